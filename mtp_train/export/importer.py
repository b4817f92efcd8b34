"""Reading a DFlash drafter trained elsewhere (z-lab's layout, or speculators', as vLLM loads them) into one of our
heads, so that it can be evaluated (`mtp-eval`), exported again or fine-tuned (`mtp-train` from the saved head).

The folder holds `config.json` and `model.safetensors` (or shards listed by `model.safetensors.index.json`) with
the tensors `export/dflash.py` names. z-lab's config: `architectures: ["DFlashDraftModel"]`, `dflash_config:
{block_size, mask_token_id, target_layer_ids}` and the draft layers' Qwen3 fields. speculators':
`speculators_model_type: "dflash"`, the layers' fields in `transformer_layer_config` and, for a draft vocabulary,
`lm_head.weight` (the target's rows of those tokens: checked, since our head drafts through the target's frozen
lm_head), `d2t` and `t2d` (`export/speculators_dflash.py`). An `embed_tokens` in either is not read (the head
shares the target's, as vLLM does when it is absent). Its shapes are checked against the target's: a draft for
another target is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mtp_train.config.head import HeadConfig
from mtp_train.export import dflash, speculators_dflash
from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.registry import new_head
from mtp_train.models.config import ModelConfigError
from mtp_train.models.families import args_from_dir

_SHARED = ("embed_tokens.", "lm_head.", "model.embed_tokens.")  # the target's, never the draft's own here
LAYOUTS = ("dflash", "speculators-dflash")  # the layouts `import_dflash` reads


def _tensors(folder: Path, keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise ModelConfigError(f"{folder}: no {', '.join(missing)}: a DFlash drafter's folder holds its weights "
                               "(model.safetensors, or the shards model.safetensors.index.json names)")
    for name in files:
        with safe_open(str(folder / name), framework="pt", device="cpu") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()  # noqa: SIM118
                        if k in keep or not k.startswith(_SHARED)})
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


def _speculators_head_config(cfg: dict[str, Any], folder: Path, tensors: dict[str, torch.Tensor]) -> HeadConfig:
    """A speculators DFlash config.json (and its d2t, for the draft vocabulary's size) → our HeadConfig."""
    try:
        fields = speculators_dflash.head_fields(cfg)
    except ValueError as e:
        raise ModelConfigError(f"{folder}/config.json: {e}") from None
    vocab = {k for k in ("lm_head.weight", "d2t", "t2d") if k in tensors}
    if vocab and vocab != {"lm_head.weight", "d2t", "t2d"}:
        raise ModelConfigError(f"{folder}: a draft vocabulary needs lm_head.weight, d2t and t2d together; it holds "
                               f"only {sorted(vocab)}")
    return HeadConfig(type="dflash", draft_vocab_size=int(tensors["d2t"].numel()) if vocab else 0, **fields)


def import_dflash(folder: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None, layout: str = "dflash") -> DraftHead:
    """The DFlash drafter in `folder` (module docstring), in `layout` (one of LAYOUTS), as our dflash head for the
    target in `target_dir`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: a DFlash drafter is read from one of {', '.join(LAYOUTS)}")
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelConfigError(f"{cfg_file} does not exist: head_ckpt is a DFlash drafter's folder here ({layout} "
                               "layout: config.json and model.safetensors)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{cfg_file}: not valid JSON ({e}); restore it from where the drafter came "
                               "from") from None
    speculators = layout == "speculators-dflash"
    if speculators and cfg.get("speculators_model_type") != speculators_dflash.MODEL_TYPE:
        raise ModelConfigError(f"{cfg_file}: speculators_model_type {cfg.get('speculators_model_type')!r} is not "
                               f"{speculators_dflash.MODEL_TYPE!r} (speculators' DFlash layout)"
                               + ("; a z-lab DFlash folder is read with import_from=dflash"
                                  if dflash.ARCH in (cfg.get("architectures") or []) else ""))
    if not speculators and dflash.ARCH not in (cfg.get("architectures") or []):
        raise ModelConfigError(f"{folder}/config.json: architectures {cfg.get('architectures')} is not "
                               f"[{dflash.ARCH!r}] (z-lab's DFlash layout)"
                               + ("; a speculators folder is read with import_from=speculators-dflash"
                                  if cfg.get("speculators_model_type") else ""))
    layer = (cfg.get("transformer_layer_config") or {}) if speculators else cfg
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
        raise ModelConfigError(f"{folder}: a DFlash drafter of other shapes than the target {target_dir} "
                               f"(draft, target): {off}")
    tensors = _tensors(folder, keep=("lm_head.weight",) if speculators else ())
    head_cfg = _speculators_head_config(cfg, folder, tensors) if speculators else dflash_head_config(cfg)
    frozen = FrozenTargetParts.from_pretrained(target_dir, device=device)
    head = new_head(head_cfg, args, frozen)
    try:
        state = (speculators_dflash.from_layout if speculators else dflash.from_layout)(tensors, head)
    except ValueError as e:  # d2t / t2d that do not describe one draft vocabulary
        raise ModelConfigError(f"{folder}: {e}") from None
    own = head.state_dict()
    problems = [f"{k}: missing" for k in sorted(own.keys() - state.keys())]
    problems += [f"{k}: not a tensor of the layout" for k in sorted(state.keys() - own.keys())]
    problems += [f"{k}: shape {tuple(state[k].shape)}, expected {tuple(own[k].shape)}"
                 for k in sorted(own.keys() & state.keys()) if state[k].shape != own[k].shape]
    if problems:
        raise ModelConfigError(f"{folder} is not a DFlash drafter for this target:\n  " + "\n  ".join(problems))
    dt = dtype or next(v for v in state.values() if v.is_floating_point()).dtype
    head.load_state_dict({k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()})
    head.attach(frozen.to(device=device, dtype=dt))
    if "lm_head.weight" in tensors:
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
