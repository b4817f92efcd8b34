"""Stage two: training draft heads on precomputed target hidden states."""

from mtp_train.train.losses import (
    chunked_soft_ce,
    chunked_token_loss,
    draft_loss,
    step_targets,
    step_token_counts,
    uniform_noise,
    unrolled_loss,
)

__all__ = [
    "chunked_soft_ce",
    "chunked_token_loss",
    "draft_loss",
    "step_targets",
    "step_token_counts",
    "uniform_noise",
    "unrolled_loss",
]
