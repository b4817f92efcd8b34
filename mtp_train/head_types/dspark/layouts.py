"""The dspark head type's layout and its reader: vLLM's Qwen3 DSpark layout (`export.py`, `method=dspark`), read
back by `mtp-export import_from=dspark`.

Reading: DFlash's fields (`head_types/dflash/layouts.py`: `dflash_config` or vLLM's top-level `block_size` /
`dspark_block_size`, `target_layer_ids` / `dspark_target_layer_ids`, `mask_token_id` / `dspark_noise_token_id`)
plus `markov_rank` and `enable_confidence_head`; a layout our block does not compute (`sample_from_anchor` false,
`dspark_bonus_anchor`, another `markov_head_type`, a reduced draft vocabulary) is refused by its key.
"""

from __future__ import annotations

from typing import Any

import torch

from mtp_train.config.head import HeadConfig
from mtp_train.export.importer import integer
from mtp_train.export.layouts import Layout, Reader
from mtp_train.head_types.dflash.layouts import dflash_fields
from mtp_train.head_types.dspark import export as dspark
from mtp_train.models.config import ModelConfigError


def dspark_head_config(cfg: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> HeadConfig:
    """A vLLM Qwen3 DSpark config.json → our HeadConfig (DFlash's fields, `export.py`, plus the Markov and
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
    return HeadConfig.of(type="dspark", **dflash_fields({**cfg, "dflash_config": sub}),
                         markov_rank=integer(cfg["markov_rank"], "markov_rank"),
                         confidence_head=bool(cfg.get("enable_confidence_head")),
                         confidence_with_markov=bool(cfg.get("confidence_head_with_markov")))


READER = Reader("DSpark", "vLLM", lambda cfg: bool({dspark.ARCH, "DSparkDraftModel"} & set(cfg.get("architectures")
                                                                                           or [])),
                f"architectures [{dspark.ARCH!r}]", dspark_head_config)

TYPE_LAYOUTS = (
    Layout("dspark", dspark.problems, dspark.to_layout, dspark.from_layout, dspark.config,
           serves={"vllm": {"method": "dspark"}}, reader=READER),
)
