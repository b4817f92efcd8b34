"""Which draft head to train, with which norms and input features (`conf/head/*.yaml`); saved with every head."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

INITS = ("scratch", "last_layer")
FEATURES = ("final", "aux")  # what step 0 reads: the target's last hidden, or its aux layers concatenated
# The norms each head type has unless a flag of HeadConfig says otherwise; its keys are the head types.
# eagle3's norms are fixed by its layout (enorm = the layer's input_layernorm on the embedding, hnorm = its
# hidden_norm, final_norm = `norm`): they cannot be switched off.
NORM_DEFAULTS: dict[str, dict[str, bool]] = {
    "mtp": {"enorm": True, "hnorm": True, "input_norm": True, "final_norm": True},
    "eagle1": {"enorm": False, "hnorm": False, "input_norm": False, "final_norm": False},
    "eagle3": {"enorm": True, "hnorm": True, "input_norm": True, "final_norm": True},
}
FEATURE_DEFAULTS = {"mtp": "final", "eagle1": "final", "eagle3": "aux"}
FIXED_NORMS = ("eagle3",)  # head types whose norm flags must stay at their defaults
DRAFT_VOCAB_REQUIRED = ("eagle3",)  # head types with their own lm_head over a draft vocabulary


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high target layers in `hidden_states[j]` numbering: [2, L//2, L-3] (vLLM's default)."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class HeadConfig:
    """Which head, with which norms. A norm left as None takes the default of the type (mtp: on, eagle1: off)."""

    type: str = "mtp"  # mtp (RMSNorm-restored, DeepSeek-V3 MTP shape) | eagle1 (original EAGLE) | eagle3 (EAGLE-3)
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
    # eagle3 needs N > 0 (capped at the target's vocabulary) and trains its own lm_head rows.
    draft_vocab_size: int = 0
    # Step 0's input: final (the target's last hidden after the final norm) | aux (the aux layers' hidden states,
    # concatenated, through an fc k·H → H); null = the type's default (mtp, eagle1: final; eagle3: aux, only).
    features: str | None = None
    # Target layers of the aux features, in transformers' hidden_states[j] numbering (0 = the embeddings, j = the
    # output of decoder layer j-1); [] = EAGLE-3's default [2, L//2, L-3]. Only with features=aux.
    aux_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = the full vocabulary), got {self.draft_vocab_size}")
        if self.type not in NORM_DEFAULTS:
            raise ValueError(f"unknown head type {self.type!r}; choose one of {', '.join(NORM_DEFAULTS)}")
        if self.init not in INITS:
            raise ValueError(f"unknown head init {self.init!r}; choose one of {', '.join(INITS)}")
        if self.features is not None and self.features not in FEATURES:
            raise ValueError(f"unknown head features {self.features!r}; choose one of {', '.join(FEATURES)}")
        if self.type in FIXED_NORMS:
            off = [k for k in NORM_DEFAULTS[self.type] if getattr(self, k) is False]
            if off:
                raise ValueError(f"{self.type} heads have fixed norms; {', '.join(off)} cannot be switched off")
            if self.features == "final":
                raise ValueError(f"{self.type} heads read the aux layers (head.features=aux)")
        if self.type in DRAFT_VOCAB_REQUIRED and self.draft_vocab_size == 0:
            raise ValueError(f"{self.type} heads draft over their own draft vocabulary: set head.draft_vocab_size "
                             "> 0 (conf/head/eagle3.yaml: 32000, capped at the target's vocabulary)")
        if self.aux_layers and self.resolved_features != "aux":
            raise ValueError(f"head.aux_layers={list(self.aux_layers)} needs head.features=aux")
        if len(set(self.aux_layers)) != len(self.aux_layers) or any(int(j) < 0 for j in self.aux_layers):
            raise ValueError(f"head.aux_layers {list(self.aux_layers)} must be distinct layer indices >= 0")

    @property
    def resolved_features(self) -> str:
        return FEATURE_DEFAULTS[self.type] if self.features is None else self.features

    def resolved(self, num_layers: int | None = None) -> HeadConfig:
        """A copy with every norm flag and `features` set (None → the type's default); given the target's layer
        count, empty aux_layers of an aux head become the default ones (checked against the count)."""
        defaults = NORM_DEFAULTS[self.type]
        out = dataclasses.replace(self, features=self.resolved_features, aux_layers=[int(j) for j in self.aux_layers],
                                  **{k: v if getattr(self, k) is None else getattr(self, k)
                                     for k, v in defaults.items()})
        if num_layers is not None and out.features == "aux":
            layers = out.aux_layers or default_aux_layers(num_layers)
            bad = [j for j in layers if not 0 <= j <= num_layers]
            if bad or len(set(layers)) != len(layers):
                raise ValueError(f"aux layers {layers} do not fit a target of {num_layers} layers (distinct, in "
                                 f"0..{num_layers}, hidden_states numbering): set head.aux_layers")
            out.aux_layers = layers
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.resolved())
