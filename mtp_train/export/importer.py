"""Reading a DFlash or DSpark drafter trained elsewhere (z-lab's DFlash layout, vLLM's DSpark layout, as vLLM loads
them) into one of our heads, so that it can be evaluated (`mtp-eval`), exported again or fine-tuned (`mtp-train`
from the saved head).

The folder holds `config.json` (`architectures: ["DFlashDraftModel"]` or `["Qwen3DSparkModel"]`, `dflash_config:
{block_size, mask_token_id, target_layer_ids}`, the draft layers' Qwen3 fields; DSpark adds `markov_rank` and
`enable_confidence_head`) and `model.safetensors` (or shards listed by `model.safetensors.index.json`) with the
tensors `export/dflash.py` / `export/dspark.py` name; an `embed_tokens` or `lm_head` in it is not read (the head
shares the target's, as vLLM does when they are absent). Its shapes are checked against the target's: a draft for
another target is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mtp_train.config.head import HeadConfig
from mtp_train.export import dflash, dspark
from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.registry import new_head
from mtp_train.models.config import ModelConfigError
from mtp_train.models.families import args_from_dir

_SHARED = ("embed_tokens.", "lm_head.", "model.embed_tokens.")  # the target's, never the draft's own here


def _tensors(folder: Path, noun: str = "DFlash") -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise ModelConfigError(f"{folder}: no {', '.join(missing)}: a {noun} drafter's folder holds its weights "
                               "(model.safetensors, or the shards model.safetensors.index.json names)")
    for name in files:
        with safe_open(str(folder / name), framework="pt", device="cpu") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if not k.startswith(_SHARED)})  # noqa: SIM118
    return out


def dflash_head_config(cfg: dict[str, Any]) -> HeadConfig:
    """A z-lab DFlash config.json → our HeadConfig (aux_layers = target_layer_ids + 1, `export/dflash.py`)."""
    sub = cfg.get("dflash_config") or {}
    ids = sub.get("target_layer_ids")
    block = sub.get("block_size", cfg.get("block_size"))
    if not ids or block is None or sub.get("mask_token_id") is None:
        raise ModelConfigError("not a DFlash drafter's config.json: dflash_config needs target_layer_ids, "
                               "block_size (or a top-level block_size) and mask_token_id")
    return HeadConfig(type="dflash", layers=int(cfg["num_hidden_layers"]), block_size=int(block),
                      mask_token_id=int(sub["mask_token_id"]), aux_layers=dflash.aux_layers_of(ids))


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
                      markov_rank=int(cfg["markov_rank"]), confidence_head=bool(cfg.get("enable_confidence_head")),
                      confidence_with_markov=bool(cfg.get("confidence_head_with_markov")))


# `import_from=` name → (the drafter's name in messages, its architectures, config.json → HeadConfig, tensors → state)
LAYOUTS = {
    "dflash": ("DFlash", (dflash.ARCH,), dflash_head_config, dflash.from_layout),
    "dspark": ("DSpark", (dspark.ARCH, "DSparkDraftModel"), dspark_head_config, dspark.from_layout),
}


def import_dflash(folder: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None) -> DraftHead:
    """The DFlash drafter in `folder` (module docstring) as our dflash head for the target in `target_dir`."""
    return import_drafter("dflash", folder, target_dir, device, dtype)


def import_drafter(layout: str, folder: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> DraftHead:
    """The drafter in `folder` in `layout` (a LAYOUTS name; module docstring) as our head for the target in
    `target_dir`."""
    noun, archs, head_config, from_layout = LAYOUTS[layout]
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelConfigError(f"{cfg_file} does not exist: head_ckpt is a {noun} drafter's folder here ("
                               f"{'z-lab' if layout == 'dflash' else 'vLLM'}'s layout: config.json and "
                               "model.safetensors)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{cfg_file}: not valid JSON ({e}); restore it from where the drafter came "
                               "from") from None
    if not set(archs) & set(cfg.get("architectures") or []):
        raise ModelConfigError(f"{folder}/config.json: architectures {cfg.get('architectures')} is not "
                               f"[{archs[0]!r}] ({noun}'s layout)")
    sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if sliding or (cfg.get("dflash_config") or {}).get("use_swa") or cfg.get("attention_bias"):
        raise ModelConfigError(f"{folder}: draft layers with sliding windows or attention bias; ours are full "
                               "attention without bias")
    args = args_from_dir(target_dir)
    theirs = {k: cfg.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                      "intermediate_size")}
    ours = {"hidden_size": args.hidden_size, "num_attention_heads": args.num_heads,
            "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim,
            "intermediate_size": args.intermediate_size}
    off = {k: (theirs[k], v) for k, v in ours.items() if theirs[k] is not None and theirs[k] != v}
    if off:
        raise ModelConfigError(f"{folder}: a {noun} drafter of other shapes than the target {target_dir} "
                               f"(draft, target): {off}")
    frozen = FrozenTargetParts.from_pretrained(target_dir, device=device)
    head = new_head(head_config(cfg), args, frozen)
    tensors = _tensors(folder, noun)
    state = from_layout(tensors, head)
    own = head.state_dict()
    problems = [f"{k}: missing" for k in sorted(own.keys() - state.keys())]
    problems += [f"{k}: not a tensor of the layout" for k in sorted(state.keys() - own.keys())]
    problems += [f"{k}: shape {tuple(state[k].shape)}, expected {tuple(own[k].shape)}"
                 for k in sorted(own.keys() & state.keys()) if state[k].shape != own[k].shape]
    if problems:
        raise ModelConfigError(f"{folder} is not a {noun} drafter for this target:\n  " + "\n  ".join(problems))
    dt = dtype or next(iter(state.values())).dtype
    head.load_state_dict({k: v.to(dt) for k, v in state.items()})
    head.attach(frozen.to(device=device, dtype=dt))
    return head.to(device=device, dtype=dt).eval()
