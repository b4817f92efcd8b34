"""Reading a DFlash, DSpark or P-EAGLE drafter trained elsewhere (z-lab's DFlash layout, speculators' DFlash layout,
vLLM's DSpark layout, speculators' P-EAGLE layout, as vLLM loads them) into one of our heads, so that it can be
evaluated (`mtp-eval`), exported again or fine-tuned (`mtp-train` from the saved head).

The folder holds `config.json` (`architectures: ["DFlashDraftModel"]` or `["Qwen3DSparkModel"]`, `dflash_config:
{block_size, mask_token_id, target_layer_ids}`, the draft layers' Qwen3 fields; DSpark adds `markov_rank` and
`enable_confidence_head`) and `model.safetensors` (or shards listed by `model.safetensors.index.json`) with the
tensors `export/dflash.py` / `export/dspark.py` name; an `embed_tokens` or `lm_head` in it is not read (the head
shares the target's, as vLLM does when they are absent). speculators' DFlash folder
(`import_from=speculators-dflash`, `export/speculators_dflash.py`) says `speculators_model_type: "dflash"`, keeps
the layers' fields in `transformer_layer_config` and, for a draft vocabulary, `lm_head.weight` (which must be the
target's rows of those tokens, since our head drafts through the target's frozen lm_head: a trained one is refused),
`d2t` and `t2d`. speculators' P-EAGLE folder (`import_from=speculators-peagle`, `export/peagle.py`) says
`speculators_model_type: "peagle"`: its lm_head is the head's own (trained), and a placeholder token other than
the head's (`mask_token_id`) or a trained `embed_tokens.weight` is refused by name, since the head would change
them. Its shapes are checked against the target's: a draft for another target is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mtp_train.config.head import HeadConfig
from mtp_train.export import dflash, dspark, eagle3, peagle, speculators_dflash
from mtp_train.fileio import file_problem, safetensors_problem
from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.registry import new_head
from mtp_train.models.config import ModelConfigError
from mtp_train.models.families import args_from_dir

_SHARED = ("embed_tokens.", "lm_head.", "model.embed_tokens.")  # the target's, never the draft's own here


def _read_json(path: Path, what: str, todo: str) -> Any:
    """The JSON in `path`, checked to be a regular file first (a FIFO would block the read); ModelConfigError naming
    the file, what it should be (`what`) and what to do (`todo`) otherwise."""
    problem = file_problem(path)
    if problem:
        raise ModelConfigError(f"{path} {problem}: {what}; {todo}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); {todo}") from None
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}); {todo}") from None


def _tensors(folder: Path, noun: str = "DFlash", keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    todo = "copy the drafter's folder again from where it came from"
    index = folder / "model.safetensors.index.json"
    if file_problem(index) == "does not exist":
        files = ["model.safetensors"]
    else:
        weight_map = _read_json(index, "the shards' index of the drafter's weights", todo)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelConfigError(f"{index}: weight_map is not an object of file names; {todo}")
        files = sorted(set(weight_map.values()))
    out: dict[str, torch.Tensor] = {}
    missing = [name for name in files if file_problem(folder / name) == "does not exist"]
    if missing:
        raise ModelConfigError(f"{folder}: no {', '.join(missing)}: a {noun} drafter's folder holds its weights "
                               "(model.safetensors, or the shards model.safetensors.index.json names)")
    for name in files:
        problem = safetensors_problem(folder / name)  # the library's own errors name no file; a FIFO would block
        if problem:
            raise ModelConfigError(f"{folder / name} {problem}: the {noun} drafter's weights are not readable; "
                                   f"{todo}")
        with safe_open(str(folder / name), framework="pt", device="cpu") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()  # noqa: SIM118
                        if k in keep or not k.startswith(_SHARED)})
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(value: Any, key: str) -> int:
    """`value` of config.json's `key` as an int; ModelConfigError naming the key when JSON holds no integer there
    (`"16"` is text: int() would take it, and `"1,8"` would fail with a message that names nothing)."""
    if not _is_int(value):
        raise ModelConfigError(f"{key} is {json.dumps(value)}, not an integer; write an integer there")
    return value


def integers(value: Any, key: str) -> list[int]:
    """`value` of config.json's `key` as a list of ints; ModelConfigError naming the key otherwise."""
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        shown = f"[{value.replace(',', ', ')}]" if isinstance(value, str) else "[1, 8]"
        raise ModelConfigError(f"{key} is {json.dumps(value)}, not a list of integers; write a JSON list there, "
                               f"e.g. {shown}")
    return list(value)


def dflash_head_config(cfg: dict[str, Any]) -> HeadConfig:
    """A z-lab DFlash config.json → our HeadConfig (aux_layers = target_layer_ids + 1, `export/dflash.py`)."""
    sub = cfg.get("dflash_config") or {}
    if not isinstance(sub, dict):
        raise ModelConfigError(f"dflash_config is {json.dumps(sub)}, not an object")
    ids = sub.get("target_layer_ids")
    block = sub.get("block_size", cfg.get("block_size"))
    if not ids or block is None or sub.get("mask_token_id") is None:
        raise ModelConfigError("not a DFlash drafter's config.json: dflash_config needs target_layer_ids, "
                               "block_size (or a top-level block_size) and mask_token_id")
    where = "dflash_config.block_size" if "block_size" in sub else "block_size"
    return HeadConfig(type="dflash", layers=integer(cfg.get("num_hidden_layers"), "num_hidden_layers"),
                      block_size=integer(block, where),
                      mask_token_id=integer(sub["mask_token_id"], "dflash_config.mask_token_id"),
                      aux_layers=dflash.aux_layers_of(integers(ids, "dflash_config.target_layer_ids")))


def dspark_head_config(cfg: dict[str, Any]) -> HeadConfig:
    """A vLLM Qwen3 DSpark config.json → our HeadConfig (DFlash's fields, `export/dspark.py`, plus the Markov and
    confidence heads); a layout our block does not compute is refused by its key."""
    sub = dict(cfg.get("dflash_config") or {})
    sub.setdefault("block_size", cfg.get("block_size", cfg.get("dspark_block_size")))
    sub.setdefault("target_layer_ids", cfg.get("dspark_target_layer_ids", cfg.get("target_layer_ids")))
    for key in ("mask_token_id", "dspark_noise_token_id"):
        if sub.get("mask_token_id") is None:
            sub["mask_token_id"] = cfg.get(key)
    off = [f"{k}={cfg.get(k)!r} (ours: {v!r})" for k, v in
           (("sample_from_anchor", True), ("dspark_bonus_anchor", False), ("markov_head_type", "vanilla"))
           if cfg.get(k, v) != v]
    vocab, draft_vocab = cfg.get("vocab_size"), cfg.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != vocab:
        off.append(f"draft_vocab_size={draft_vocab} (a reduced vocabulary with d2t; ours drafts over all {vocab})")
    if off or not cfg.get("markov_rank"):
        raise ModelConfigError("a DSpark drafter this head cannot compute: " + ("; ".join(off) or "no markov_rank"))
    base = dflash_head_config({**cfg, "dflash_config": sub})
    return HeadConfig(type="dspark", layers=base.layers, block_size=base.block_size,
                      mask_token_id=base.mask_token_id, aux_layers=base.aux_layers,
                      markov_rank=integer(cfg["markov_rank"], "markov_rank"),
                      confidence_head=bool(cfg.get("enable_confidence_head")),
                      confidence_with_markov=bool(cfg.get("confidence_head_with_markov")))


def speculators_head_config(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> HeadConfig:
    """A speculators DFlash config.json (and its d2t, for the draft vocabulary's size) → our HeadConfig."""
    try:
        fields = speculators_dflash.head_fields(cfg)
    except ValueError as e:
        raise ModelConfigError(str(e)) from None
    vocab = {k for k in speculators_dflash.VOCAB_KEYS if k in tensors}
    if vocab and vocab != set(speculators_dflash.VOCAB_KEYS):
        raise ModelConfigError(f"a draft vocabulary needs lm_head.weight, d2t and t2d together; the folder holds "
                               f"only {sorted(vocab)}")
    return HeadConfig(type="dflash", draft_vocab_size=int(tensors["d2t"].numel()) if vocab else 0, **fields)


def peagle_head_config(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> HeadConfig:
    """A speculators P-EAGLE config.json (and its d2t) → our HeadConfig (`export/peagle.py`)."""
    try:
        return HeadConfig(type="peagle", **peagle.head_fields(cfg, tensors))
    except ValueError as e:
        raise ModelConfigError(str(e)) from None


def peagle_fit(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], head: DraftHead) -> list[str]:
    """What the peagle head built for a speculators P-EAGLE folder would silently change (`peagle.fit_problems`)."""
    return peagle.fit_problems(cfg, tensors, getattr(head, "mask_token_id", -1), head.require_frozen().embed)


@dataclass(frozen=True)
class Reader:
    """How `import_from=<name>` reads a folder."""

    noun: str  # the drafter's name in messages
    origin: str  # whose layout, in messages
    recognises: Callable[[dict[str, Any]], bool]  # config.json → whether it is this layout
    expected: str  # what `recognises` looks for, in messages
    head_config: Callable[[dict[str, Any], dict[str, torch.Tensor]], HeadConfig]  # (config.json, tensors) → ours
    from_layout: Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]
    layer_key: str | None = None  # where config.json keeps the draft layers' fields (None: at the top)
    keep: tuple[str, ...] = ()  # shared-looking tensors that are the layout's own (checked, not skipped)
    trained_lm_head: bool = False  # its lm_head.weight is the head's own (not the target's rows, which are checked)
    # (config.json, tensors, the head built) → what the head would silently change (refused); None: nothing
    fit: Callable[[dict[str, Any], dict[str, torch.Tensor], DraftHead], list[str]] | None = None


def _archs(*names: str) -> Callable[[dict[str, Any]], bool]:
    return lambda cfg: bool(set(names) & set(cfg.get("architectures") or []))


LAYOUTS = {
    "dflash": Reader("DFlash", "z-lab", _archs(dflash.ARCH), f"architectures [{dflash.ARCH!r}]",
                     lambda cfg, _: dflash_head_config(cfg), dflash.from_layout),
    "speculators-dflash": Reader(
        "DFlash", "speculators", lambda cfg: cfg.get("speculators_model_type") == speculators_dflash.MODEL_TYPE,
        f"speculators_model_type {speculators_dflash.MODEL_TYPE!r}", speculators_head_config,
        speculators_dflash.from_layout, layer_key="transformer_layer_config", keep=("lm_head.weight",)),
    "dspark": Reader("DSpark", "vLLM", _archs(dspark.ARCH, "DSparkDraftModel"), f"architectures [{dspark.ARCH!r}]",
                     lambda cfg, _: dspark_head_config(cfg), dspark.from_layout),
    "speculators-peagle": Reader(
        "P-EAGLE", "speculators", lambda cfg: cfg.get("speculators_model_type") == peagle.MODEL_TYPE,
        f"speculators_model_type {peagle.MODEL_TYPE!r}", peagle_head_config,
        lambda tensors, head: peagle.from_layout(tensors, eagle3.Eagle3Spec.of(head)),
        layer_key="transformer_layer_config", keep=("lm_head.weight", "embed_tokens.weight"), trained_lm_head=True,
        fit=peagle_fit),
}


def import_dflash(folder: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None) -> DraftHead:
    """The DFlash drafter in `folder` (z-lab's layout; module docstring) as our dflash head for `target_dir`."""
    return import_drafter("dflash", folder, target_dir, device, dtype)


def import_drafter(layout: str, folder: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> DraftHead:
    """The drafter in `folder` in `layout` (a LAYOUTS name; module docstring) as our head for the target in
    `target_dir`."""
    reader = LAYOUTS[layout]
    noun = reader.noun
    folder = Path(folder)
    cfg_file = folder / "config.json"
    cfg = _read_json(cfg_file, f"head_ckpt is a {noun} drafter's folder here ({reader.origin}'s layout: "
                     "config.json and model.safetensors as plain files)",
                     "restore it from where the drafter came from")
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{cfg_file}: a JSON {type(cfg).__name__}, not an object; restore it from where the "
                               "drafter came from")
    if not reader.recognises(cfg):
        other = [name for name, r in LAYOUTS.items() if name != layout and r.recognises(cfg)]
        raise ModelConfigError(f"{cfg_file}: no {reader.expected} ({reader.origin}'s {noun} layout)"
                               + (f"; this folder is read with import_from={other[0]}" if other else ""))
    layer = (cfg.get(reader.layer_key) or {}) if reader.layer_key else cfg
    sliding = [t for t in layer.get("layer_types") or [] if t != "full_attention"]
    if sliding or (cfg.get("dflash_config") or {}).get("use_swa") or layer.get("attention_bias"):
        raise ModelConfigError(f"{folder}: draft layers with sliding windows or attention bias; ours are full "
                               "attention without bias")
    args = args_from_dir(target_dir)
    theirs = {k: layer.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "intermediate_size")}
    ours = {"hidden_size": args.hidden_size, "num_attention_heads": args.num_heads,
            "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim,
            "intermediate_size": args.intermediate_size}
    off = {k: (theirs[k], v) for k, v in ours.items() if theirs[k] is not None and theirs[k] != v}
    if off:
        raise ModelConfigError(f"{folder}: a {noun} drafter of other shapes than the target {target_dir} "
                               f"(draft, target): {off}")
    tensors = _tensors(folder, noun, reader.keep)
    try:
        head_cfg = reader.head_config(cfg, tensors)
    except ValueError as e:  # ModelConfigError naming the key, or a value HeadConfig refuses (its bounds)
        raise ModelConfigError(f"{cfg_file}: {e}") from None
    frozen = FrozenTargetParts.from_pretrained(target_dir, device=device)
    head = new_head(head_cfg, args, frozen)
    unfit = [] if reader.fit is None else reader.fit(cfg, tensors, head)
    if unfit:
        raise ModelConfigError(f"{folder}: a {noun} drafter this head would change:\n  " + "\n  ".join(unfit))
    tensors.pop("embed_tokens.weight", None)  # checked to be the target's (above): the head reads that one
    try:
        state = reader.from_layout(tensors, head)
    except ValueError as e:  # e.g. d2t / t2d that do not describe one draft vocabulary
        raise ModelConfigError(f"{folder}: {e}") from None
    own = head.state_dict()
    problems = [f"{k}: missing" for k in sorted(own.keys() - state.keys())]
    problems += [f"{k}: not a tensor of the layout" for k in sorted(state.keys() - own.keys())]
    problems += [f"{k}: shape {tuple(state[k].shape)}, expected {tuple(own[k].shape)}"
                 for k in sorted(own.keys() & state.keys()) if state[k].shape != own[k].shape]
    if problems:
        raise ModelConfigError(f"{folder} is not a {noun} drafter for this target:\n  " + "\n  ".join(problems))
    dt = dtype or next(v for v in state.values() if v.is_floating_point()).dtype
    head.load_state_dict({k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()})
    head.attach(frozen.to(device=device, dtype=dt))
    if "lm_head.weight" in reader.keep and "lm_head.weight" in tensors and not reader.trained_lm_head:
        _check_lm_head_rows(folder, tensors["lm_head.weight"], head)
    return head.to(device=device, dtype=dt).eval()


def _check_lm_head_rows(folder: Path, lm_head: torch.Tensor, head: DraftHead) -> None:
    """Refuse a draft-vocabulary lm_head that is not the target's rows of those tokens: our head drafts through the
    target's frozen lm_head, so a trained one would silently be replaced."""
    rows = head.lm_head_weight().detach().to("cpu", torch.float32)
    theirs = lm_head.to(torch.float32)
    tol = 1e-2 if lm_head.dtype in (torch.bfloat16, torch.float16) else 1e-5  # the target's rows rounded to 16 bits
    if theirs.shape != rows.shape or not torch.allclose(theirs, rows, rtol=tol, atol=tol):
        raise ModelConfigError(f"{folder}: lm_head.weight is not the target's rows of the draft vocabulary (a "
                               "trained lm_head); our dflash head drafts through the target's frozen lm_head and "
                               "cannot hold it")
