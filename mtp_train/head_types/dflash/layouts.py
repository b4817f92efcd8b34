"""The dflash head type's layouts and their readers: z-lab's DFlash layout (`export.py`, vLLM's `method=dflash`)
and speculators' DFlash layout (`speculators.py`, the same vLLM method behind speculators' config), each read back
by `mtp-export import_from=<name>` (`mtp_train.export.importer.import_drafter`).

Reading z-lab's folder: `config.json` says `architectures: ["DFlashDraftModel"]`, `dflash_config: {block_size,
mask_token_id, target_layer_ids}` and the draft layers' Qwen3 fields, and aux_layers = target_layer_ids + 1
(`export.py`). speculators' folder says `speculators_model_type: "dflash"`, keeps the layers' fields in
`transformer_layer_config` and, for a draft vocabulary, `lm_head.weight` (which must be the target's rows of those
tokens, since our head drafts through the target's frozen lm_head: a trained one is refused), `d2t` and `t2d`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mtp_train.config.head import HeadConfig
from mtp_train.export.importer import import_drafter, integer, integers
from mtp_train.export.layouts import Layout, Reader
from mtp_train.head_types.dflash import export as dflash
from mtp_train.head_types.dflash import speculators
from mtp_train.heads.base import DraftHead
from mtp_train.models.config import ModelConfigError

TYPE = "dflash"  # the head type these layouts read into


def dflash_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """A z-lab DFlash config.json → the flat `head.<key>` settings it fixes (layers, block_size, mask_token_id,
    aux_layers = target_layer_ids + 1); a ModelConfigError naming the key otherwise."""
    sub = cfg.get("dflash_config") or {}
    if not isinstance(sub, dict):
        raise ModelConfigError(f"dflash_config is {json.dumps(sub)}, not an object")
    ids = sub.get("target_layer_ids")
    block = sub.get("block_size", cfg.get("block_size"))
    if not ids or block is None or sub.get("mask_token_id") is None:
        raise ModelConfigError("not a DFlash drafter's config.json: dflash_config needs target_layer_ids, "
                               "block_size (or a top-level block_size) and mask_token_id")
    where = "dflash_config.block_size" if "block_size" in sub else "block_size"
    return {"layers": integer(cfg.get("num_hidden_layers"), "num_hidden_layers"),
            "block_size": integer(block, where),
            "mask_token_id": integer(sub["mask_token_id"], "dflash_config.mask_token_id"),
            "aux_layers": dflash.aux_layers_of(integers(ids, "dflash_config.target_layer_ids"))}


def dflash_head_config(cfg: dict[str, Any]) -> HeadConfig:
    """A z-lab DFlash config.json → our HeadConfig (aux_layers = target_layer_ids + 1, `export.py`)."""
    return HeadConfig.of(type=TYPE, **dflash_fields(cfg))


def speculators_head_config(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> HeadConfig:
    """A speculators DFlash config.json (and its d2t, for the draft vocabulary's size) → our HeadConfig."""
    try:
        fields = speculators.head_fields(cfg)
    except ValueError as e:
        raise ModelConfigError(str(e)) from None
    vocab = {k for k in speculators.VOCAB_KEYS if k in tensors}
    if vocab and vocab != set(speculators.VOCAB_KEYS):
        raise ModelConfigError(f"a draft vocabulary needs lm_head.weight, d2t and t2d together; the folder holds "
                               f"only {sorted(vocab)}")
    return HeadConfig.of(type=TYPE, draft_vocab_size=int(tensors["d2t"].numel()) if vocab else 0, **fields)


def _archs(*names: str) -> Any:
    return lambda cfg: bool(set(names) & set(cfg.get("architectures") or []))


ZLAB_READER = Reader("DFlash", "z-lab", _archs(dflash.ARCH), f"architectures [{dflash.ARCH!r}]",
                     lambda cfg, _: dflash_head_config(cfg))
SPECULATORS_READER = Reader(
    "DFlash", "speculators", lambda cfg: cfg.get("speculators_model_type") == speculators.MODEL_TYPE,
    f"speculators_model_type {speculators.MODEL_TYPE!r}", speculators_head_config,
    layer_key="transformer_layer_config", keep=("lm_head.weight",))

TYPE_LAYOUTS = (
    Layout("dflash", dflash.problems, dflash.to_layout, dflash.from_layout, dflash.config,
           serves={"vllm": {"method": "dflash"}}, reader=ZLAB_READER),
    Layout("speculators-dflash", speculators.problems, speculators.to_layout, speculators.from_layout,
           speculators.config, keeps_draft_vocab=True, serves={"vllm": {"method": "dflash"}},
           reader=SPECULATORS_READER),
)


def import_dflash(folder: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None) -> DraftHead:
    """The DFlash drafter in `folder` (z-lab's layout) as our dflash head for `target_dir`."""
    return import_drafter("dflash", folder, target_dir, device, dtype)
