"""Weights and knobs of the draft-head loss (`loss.*` of `mtp-train`; see `mtp_train.train.losses`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtp_train.config.registry import Registry

CE_IMPLS = ("checkpoint", "fused")  # how the soft cross-entropy's backward is computed (see train/losses.py)
# The token losses between the head's and the target's distributions (`loss.kind`): `TokenLoss`es, each added
# where train/divergences.py defines it, which the first read imports (by computed name: this floor imports
# nothing of the project at import time).
TOKEN_LOSSES: Registry[Any] = Registry("loss kind", "mtp_train.train.divergences")
POSITION_WEIGHTS = ("decay", "dpace")  # how the unrolled steps' rows are weighted (see train/position_weights.py)
UNROLL_ATTENTION = ("chain", "causal")  # how unrolled steps j > 0 attend (see heads/chain_attention.py)


@dataclass
class LossConfig:
    """Weights and knobs of the head loss."""

    w_feat: float = 1.0  # weight of the SmoothL1 feature loss
    w_tok: float = 0.1  # weight of the token loss against the target's distribution
    kind: str = "soft_ce"  # token loss: soft_ce | rkl | jsd | tv (1 − α) | nla (−log α) | lk_hybrid | argmax_ce
    smooth_l1_beta: float = 1.0  # SmoothL1 switch point between quadratic and linear
    # Chained draft steps unrolled per batch; null = what the head type derives from its settings (a block drafter:
    # one step per drafted slot of its block, `HeadSettings.derived`; applied by TrainConfig), else 1.
    steps: int | None = None
    step_decay: float = 0.8  # step j weighs step_decay ** j, unless step_weights is given
    step_weights: list[float] | None = None  # explicit per-step weights (length = steps)
    # decay: step j weighs step_weights[j] (or step_decay ** j); dpace: each row of each step weighs the expected
    # accepted drafts that depend on it, from the head's own detached confidence (D-PACE), and the step weights
    # are not used
    position_weights: str = "decay"
    dpace_alpha: float = 0.5  # D-PACE's confidence smoothing: (1 − a)·q + a, in (0, 1]
    unroll_attention: str = "chain"  # chain (as the inference chain sees it) | causal (DeepSeek-V3 MTP style)
    chunk_size: int = 1024  # rows per lm_head chunk: bounds memory at ~3 · chunk_size · V floats
    # fused (the gradient in the forward: no recomputation, half the loss chunk's memory) | checkpoint
    ce_impl: str = "fused"
    noise_std: float = 0.0  # uniform noise U(-std, std) on the input features in training mode (EAGLE); 0 = off
    # With a draft vocabulary: drop positions whose target argmax lies outside it (EAGLE-3 trains so). Costs one
    # no-grad full-vocabulary lm_head pass per batch (argmax only, shared by all steps); false = no such pass.
    mask_out_of_draft: bool = False

    def __post_init__(self) -> None:
        # Left null: 1 until TrainConfig gives the value the head type derives (`steps_unset` tells it apart).
        self.steps_unset = self.steps is None
        if self.steps is None:
            self.steps = len(self.step_weights) if self.step_weights is not None else 1
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.step_weights is not None and len(self.step_weights) != self.steps:
            raise ValueError(f"{len(self.step_weights)} step_weights for {self.steps} steps")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.unroll_attention not in UNROLL_ATTENTION:
            raise ValueError(f"unknown unroll_attention {self.unroll_attention!r}; "
                             f"choose one of {', '.join(UNROLL_ATTENTION)}")
        if self.position_weights not in POSITION_WEIGHTS:
            raise ValueError(f"unknown position_weights {self.position_weights!r}; choose one of "
                             f"{', '.join(POSITION_WEIGHTS)}")
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}")
        TOKEN_LOSSES.get(self.kind)  # unknown → a ValueError naming the registered kinds
        if self.ce_impl not in CE_IMPLS:
            raise ValueError(f"unknown ce_impl {self.ce_impl!r}; choose one of {', '.join(CE_IMPLS)}")

    def weights(self) -> list[float]:
        """Per-step loss weights (all 1 under dpace, whose weights are per row)."""
        if self.position_weights == "dpace":
            return [1.0] * self.steps
        if self.step_weights is not None:
            return [float(w) for w in self.step_weights]
        return [self.step_decay**j for j in range(self.steps)]
