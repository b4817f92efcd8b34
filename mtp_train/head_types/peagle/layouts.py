"""The peagle head type's layout and its reader: speculators' P-EAGLE layout (`export.py`), which vLLM serves as
`method=eagle3` with `parallel_drafting`, read back by `mtp-export import_from=speculators-peagle`.

Reading: the folder says `speculators_model_type: "peagle"`; its lm_head is the head's own (trained), its
placeholder token (`mask_token_id`) becomes the head's (head.mask_token_id), and a trained `embed_tokens.weight` is
refused by name, since the head reads the target's embedding frozen.
"""

from __future__ import annotations

from typing import Any

import torch

from mtp_train.config.head import HeadConfig
from mtp_train.export.layouts import Layout, Reader
from mtp_train.head_types.eagle3 import export as eagle3
from mtp_train.head_types.eagle3.layouts import on_spec
from mtp_train.head_types.peagle import export as peagle
from mtp_train.heads.base import DraftHead
from mtp_train.models.config import ModelConfigError


def peagle_head_config(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> HeadConfig:
    """A speculators P-EAGLE config.json (and its d2t) → our HeadConfig (`export.py`)."""
    try:
        return HeadConfig.of(type="peagle", **peagle.head_fields(cfg, tensors))
    except ValueError as e:
        raise ModelConfigError(str(e)) from None


def peagle_fit(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], head: DraftHead) -> list[str]:
    """What the peagle head built for a speculators P-EAGLE folder would silently change (`peagle.fit_problems`)."""
    return peagle.fit_problems(tensors, head.require_frozen().embed)


READER = Reader("P-EAGLE", "speculators", lambda cfg: cfg.get("speculators_model_type") == peagle.MODEL_TYPE,
                f"speculators_model_type {peagle.MODEL_TYPE!r}", peagle_head_config,
                layer_key="transformer_layer_config", keep=("lm_head.weight", "embed_tokens.weight"),
                trained_lm_head=True, fit=peagle_fit)

TYPE_LAYOUTS = (
    # speculators' P-EAGLE layout: EAGLE-3's, the placeholder's hidden state and token.
    Layout("speculators-peagle", lambda head: peagle.problems(eagle3.Eagle3Spec.of(head)),
           on_spec(peagle.to_layout), on_spec(peagle.from_layout),
           lambda head, target: peagle.config(eagle3.Eagle3Spec.of(head), target, head.mask_token_id),
           keeps_draft_vocab=True, serves={"vllm": {"method": "eagle3", "parallel_drafting": True}},
           reader=READER),
)
