"""Which draft head to train, with which norms (`conf/head/*.yaml`); saved with every head checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

INITS = ("scratch", "last_layer")
# The norms each head type has unless a flag of HeadConfig says otherwise; its keys are the head types.
NORM_DEFAULTS: dict[str, dict[str, bool]] = {
    "mtp": {"enorm": True, "hnorm": True, "input_norm": True, "final_norm": True},
    "eagle1": {"enorm": False, "hnorm": False, "input_norm": False, "final_norm": False},
}


@dataclass
class HeadConfig:
    """Which head, with which norms. A norm left as None takes the default of the type (mtp: on, eagle1: off)."""

    type: str = "mtp"  # mtp (RMSNorm-restored, DeepSeek-V3 MTP shape) | eagle1 (original EAGLE)
    enorm: bool | None = None  # RMSNorm on the token embedding before the fc; null = the type's default
    hnorm: bool | None = None  # RMSNorm on the input hidden state before the fc; null = the type's default
    input_norm: bool | None = None  # the decoder layer's input_layernorm; null = the type's default
    final_norm: bool | None = None  # RMSNorm after the layer (its output is the predicted feature); null = default
    fc_bias: bool = False  # bias on the 2H→H fc (vLLM's EAGLE layout has none, SGLang's has one)
    moe: bool = False  # DeepSeek-V2 targets: an MoE block (the target's experts' shapes) instead of a dense MLP
    init: str = "scratch"  # scratch (random) | last_layer (copy the target's last decoder layer)
    # Draft over the N most frequent target tokens only (EAGLE-3's draft vocabulary, FR-Spec): the head's logits
    # are lm_head rows of those tokens, so each draft step and the training loss cost N/V of the full lm_head.
    # 0 = the target's whole vocabulary. The token ids are a buffer of the head (`draft_vocab`), saved with it.
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = the full vocabulary), got {self.draft_vocab_size}")
        if self.type not in NORM_DEFAULTS:
            raise ValueError(f"unknown head type {self.type!r}; choose one of {', '.join(NORM_DEFAULTS)}")
        if self.init not in INITS:
            raise ValueError(f"unknown head init {self.init!r}; choose one of {', '.join(INITS)}")

    def resolved(self) -> HeadConfig:
        """A copy with every norm flag set (None → the type's default)."""
        defaults = NORM_DEFAULTS[self.type]
        return dataclasses.replace(self, **{k: v if getattr(self, k) is None else getattr(self, k)
                                            for k, v in defaults.items()})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.resolved())
