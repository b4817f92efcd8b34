"""P-EAGLE's own settings (`head.<key>` beside the shared ones). Imports only the config floor (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from mtp_train.config.head import HeadSettings


@dataclass
class PEagleSettings(HeadSettings):
    """The placeholder token of the slots a P-EAGLE forward drafts past the accepted rows, and how training thins the
    deeper depths (COD sampling, `head.py` `PEagleHead.loss_rows`)."""

    # The token id the slots read (with the learned mask_hidden); null = the target's last vocabulary id.
    mask_token_id: int | None = None
    # COD sampling (speculators' P-EAGLE, arXiv:2602.01469): depth d >= 1 trains floor((n - d) · max(r^d, r_min))
    # anchors of a micro-batch's n loss positions, drawn among those trained at depth d - 1 (r = down_sample_ratio,
    # r_min = down_sample_ratio_min; speculators' defaults 0.7 and 0.2). down_sample_ratio=1: every anchor trains
    # at every depth (no draw).
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2

    def __post_init__(self) -> None:
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"head.mask_token_id must be a token id >= 0 (or null), got {self.mask_token_id}")
        if not 0.0 < self.down_sample_ratio <= 1.0:
            raise ValueError(f"head.down_sample_ratio must lie in (0, 1] (the share of anchors depth 1 keeps; 1 = "
                             f"every anchor at every depth), got {self.down_sample_ratio}")
        if not 0.0 <= self.down_sample_ratio_min <= 1.0:
            raise ValueError(f"head.down_sample_ratio_min must lie in [0, 1] (the least share of anchors a depth "
                             f"keeps), got {self.down_sample_ratio_min}")

    @property
    def samples(self) -> bool:
        """Whether training draws the deeper depths' anchors (down_sample_ratio < 1)."""
        return self.down_sample_ratio < 1.0
