"""P-EAGLE's own settings (`head.<key>` beside the shared ones). Imports only the config floor (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from mtp_train.config.head import HeadSettings


@dataclass
class PEagleSettings(HeadSettings):
    """The placeholder token of the slots a P-EAGLE forward drafts past the accepted rows."""

    # The token id the slots read (with the learned mask_hidden); null = the target's last vocabulary id.
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"head.mask_token_id must be a token id >= 0 (or null), got {self.mask_token_id}")
