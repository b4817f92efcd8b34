"""EAGLE-3's own settings (`head.<key>` beside the shared ones). Imports only the config floor (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from mtp_train.config.head import HeadSettings


@dataclass
class Eagle3Settings(HeadSettings):
    """EAGLE-3 feeds the next draft step its output BEFORE the final norm (as vLLM and SGLang run it), takes the
    layer's residual from the un-normed g, reads the aux layers as they come and trains its own lm_head rows; each
    switch below selects speculators' variant instead (its `Eagle3SpeculatorConfig` field named in the comment)."""

    # EAGLE-3.1 (speculators' `norm_output`): the next draft step reads the final-normed output instead.
    norm_output: bool = False
    # speculators' `norm_before_fc` (its trainer's eagle3 default): ONE RMSNorm over the whole (T, k·H) aux input
    # before the fc (`fc_input_norm.weight` (k·H,), speculators' and vLLM's `input_norm.weight`).
    fc_input_norm: bool = False
    # speculators' / vLLM's `norm_before_residual`: the layer's residual is hidden_norm(g), not g.
    norm_before_residual: bool = False
    # false: the lm_head rows stay the target's rows of the draft vocabulary, frozen (no gradient, not in the
    # optimiser), as speculators trains them; true: they start there and train.
    train_lm_head: bool = True
