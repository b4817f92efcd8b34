"""vLLM's DSpark layout (`format=dspark`): what `method=dspark` loads (`qwen3_dspark.py`, `Qwen3DSparkForCausalLM`).

Tensors: our dspark head's state dict as it is, the names being vLLM's already (it prefixes `model.`): DFlash's
(`dflash/export.py`), `markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r] and, with a
confidence head, `confidence_head.proj.{weight,bias}` [1, H (+ r)], [1] (vLLM keeps them in float32). No
embedding and no lm_head: vLLM shares the target's.

config.json: DFlash's Qwen3 config of the draft layers with `architectures: ["Qwen3DSparkModel"]`, `block_size` (vLLM's
num_speculative_tokens defaults to it), `dflash_config: {block_size, mask_token_id, target_layer_ids}` (the aux
layer numbering of `dflash/export.py`: target_layer_ids = aux_layers − 1, read by vLLM from dflash_config first),
`markov_rank`, `markov_head_type: "vanilla"`, `enable_confidence_head`, `confidence_head_with_markov`,
`sample_from_anchor: true` (B queries, each slot predicting the token after it) and `dspark_bonus_anchor: false`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mtp_train.head_types.dflash import export as dflash

if TYPE_CHECKING:
    from mtp_train.heads.base import DraftHead

ARCH = "Qwen3DSparkModel"  # vLLM's registry name of Qwen3DSparkForCausalLM


def problems(head: DraftHead) -> list[str]:
    """What keeps a dspark head out of vLLM's layout (empty = it fits): DFlash's conditions."""
    return [p.replace("DFlash", "DSpark") for p in dflash.problems(head)]


def to_layout(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    """Our names are vLLM's: the tensors as they are (vLLM casts the confidence head into its float32 copy)."""
    return dict(state)


def from_layout(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    return dict(tensors)


def config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    """config.json of `format=dspark` (the fields vLLM's `qwen3_dspark.py` and its DSpark speculator read)."""
    s = head.cfg.settings
    cfg = dflash.config(head, target)
    cfg.update({"architectures": [ARCH], "markov_rank": s.markov_rank, "markov_head_type": "vanilla",
                "enable_confidence_head": s.confidence_head, "confidence_head_with_markov": s.confidence_with_markov,
                "sample_from_anchor": True, "dspark_bonus_anchor": False, "use_aux_hidden_state": True})
    return cfg
