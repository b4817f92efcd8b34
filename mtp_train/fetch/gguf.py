"""GGUF → Hugging Face folder with transformers, and the checks the saved folder must pass before it is marked.

The conversion fixes what transformers leaves wrong (the GGUF quantizer entry, end-of-turn and pad ids, the
tokenizer's length limit); the check reloads the saved folder as a user will and compares it with the converted
model, then asks it `VERIFY_PROMPT`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

from mtp_train.fetch.registry import ModelFetchError, ModelSpec

log = logging.getLogger(__name__)

VERIFY_PROMPT = "What is the capital of France?"
VERIFY_NEW_TOKENS = 16


def require_modules(modules: tuple[str, ...] = ("gguf",)) -> None:
    """Fail early and clearly when a module needed for the conversion is not installed.

    transformers only reports a missing `gguf` deep inside loading, after the download.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pkgs = " ".join(f"'{m}'" for m in missing)
        raise ModelFetchError(f"the GGUF conversion needs the Python package(s) {', '.join(missing)}, which "
                              f"are not installed; install them with "
                              f"`{sys.executable} -m pip install {pkgs}` (or `pip install -e .`) and rerun.")


def _token_id(tokenizer: Any, token: str) -> int:
    """Id of a special token, failing when the tokenizer does not know it (it would map to unk)."""
    tid = tokenizer.convert_tokens_to_ids(token)
    unknown = not isinstance(tid, int) or tid == tokenizer.unk_token_id
    if unknown or tokenizer.convert_ids_to_tokens(tid) != token:
        raise ModelFetchError(f"the converted tokenizer has no token {token!r}; "
                              f"the GGUF is not the expected model.")
    return tid


def _with_eos(current: int | list[int] | None, eos_id: int) -> int | list[int]:
    """`current` end ids, guaranteed to contain `eos_id` (other stop ids the model declares are kept)."""
    if isinstance(current, list):
        return current if eos_id in current else [eos_id, *current]
    return eos_id


def convert_gguf(gguf_path: Path, dest: Path, spec: ModelSpec) -> tuple[Any, Any]:
    """Load a GGUF with transformers, fix what the conversion leaves wrong, save it to `dest` as float32.

    Returns the in-memory (model, tokenizer), used as the reference when checking the saved copy.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, fname = str(gguf_path.parent), gguf_path.name
    log.info("converting %s (dequantizing; the tokenizer alone takes about half a minute)", gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname)
    except ImportError as e:
        raise ModelFetchError(f"transformers cannot read GGUF files here: {e}. Install a recent `gguf` "
                              f"(`{sys.executable} -m pip install 'gguf>=0.10'`) and rerun.") from e
    except Exception as e:  # a truncated download or a non-GGUF --gguf file surfaces as anything
        raise ModelFetchError(f"could not convert {gguf_path}: {type(e).__name__}: {e}. If the file is "
                              f"damaged, rerun with --force (or pass a good file with --gguf PATH).") from e
    model = model.to(torch.float32).eval()

    # save_pretrained refuses a model that still carries the GGUF quantizer, although the weights are already
    # plain dequantized tensors; with the config entry left in, loaders would look for a GGUF that is gone.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    eos_id = _token_id(tokenizer, spec.eos_token)
    if tokenizer.eos_token != spec.eos_token:
        log.info("tokenizer eos %r -> %r", tokenizer.eos_token, spec.eos_token)
        tokenizer.eos_token = spec.eos_token
    if tokenizer.pad_token is None:  # batched generation needs a pad token; the end token is the usual choice
        tokenizer.pad_token = spec.eos_token
    pad_id = tokenizer.pad_token_id
    gen = model.generation_config
    for obj, label in ((model.config, "config"), (gen, "generation config")):
        new_eos = _with_eos(obj.eos_token_id, eos_id)
        if obj.eos_token_id != new_eos:
            log.info("%s eos_token_id %r -> %r", label, obj.eos_token_id, new_eos)
            obj.eos_token_id = new_eos
        if obj.pad_token_id is None:
            log.info("%s pad_token_id None -> %d", label, pad_id)
            obj.pad_token_id = pad_id
    # The GGUF tokenizer comes out with a "no limit" sentinel length; the real limit is the context size.
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and (tokenizer.model_max_length or 0) > max_pos:
        tokenizer.model_max_length = max_pos
    if not tokenizer.chat_template:
        raise ModelFetchError(f"{gguf_path} carries no chat template; it is not the expected instruct model.")

    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return model, tokenizer


def _check_config_files(folder: Path, spec: ModelSpec, eos_id: int) -> None:
    """Check the saved config/generation config/weights against the spec without loading the model."""
    from safetensors import safe_open

    for rel in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
        if not (folder / rel).is_file():
            raise ModelFetchError(f"conversion did not produce {rel}")
    cfg = json.loads((folder / "config.json").read_text())
    problems = []
    if "quantization_config" in cfg:
        problems.append("config.json still has quantization_config")
    if cfg.get("architectures") != [spec.architecture]:
        problems.append(f"architectures is {cfg.get('architectures')}, expected [{spec.architecture!r}]")
    problems += [f"{k} is {cfg.get(k)!r}, expected {v!r}" for k, v in spec.config.items() if cfg.get(k) != v]
    for rel, data in (("config.json", cfg), ("generation_config.json",
                                             json.loads((folder / "generation_config.json").read_text()))):
        eos = data.get("eos_token_id")
        if eos != eos_id and not (isinstance(eos, list) and eos_id in eos):
            problems.append(f"{rel} eos_token_id is {eos!r}, expected {eos_id} ({spec.eos_token})")
        if data.get("pad_token_id") is None:
            problems.append(f"{rel} has no pad_token_id")
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    if not (folder / "chat_template.jinja").is_file() and not tok_cfg.get("chat_template"):
        problems.append("no chat template saved")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    if dtypes != {"F32"}:
        problems.append(f"model.safetensors has dtypes {sorted(dtypes)}, expected only F32")
    if problems:
        raise ModelFetchError(f"the converted folder {folder} is not as expected: " + "; ".join(problems))


def verify_folder(folder: Path, spec: ModelSpec, reference: tuple[Any, Any] | None = None) -> str:
    """Check a converted folder the way a user will load it; return the greedy answer to `VERIFY_PROMPT`.

    With `reference` (the in-memory model and tokenizer it was saved from), the reloaded model must give the
    same logits on the prompt, which proves that save and reload lost nothing.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    eos_id = _token_id(tokenizer, spec.eos_token)
    _check_config_files(folder, spec, eos_id)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    if type(model).__name__ != spec.architecture:
        raise ModelFetchError(f"{folder} loads as {type(model).__name__}, expected {spec.architecture}")

    messages = [{"role": "user", "content": VERIFY_PROMPT}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
        if reference is not None:
            ref_model, ref_tok = reference
            ref_enc = ref_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)
            if not torch.equal(ref_enc["input_ids"], enc["input_ids"]):
                raise ModelFetchError("the saved tokenizer encodes the chat prompt differently from the "
                                      "GGUF one")
            diff = (ref_model(**ref_enc).logits - model(**enc).logits).abs().max().item()
            if diff > 1e-4:
                raise ModelFetchError(f"the saved model's logits differ from the converted one's by "
                                      f"{diff:.3g}")
        out = model.generate(**enc, max_new_tokens=VERIFY_NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    if not answer:
        raise ModelFetchError(f"{folder} loads but answers {VERIFY_PROMPT!r} with empty text; the conversion "
                              f"is broken (rerun with --force).")
    return answer

