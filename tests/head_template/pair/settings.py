"""The pair head's own settings (`head.<key>` beside the shared ones). Imports only the config floor (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtp_train.config.head import HeadSettings

DRAFTS = 2  # drafts per forward: what the head is


@dataclass
class PairSettings(HeadSettings):
    """The width of the head's MLP; the number of training steps follows from the type (two drafts per forward)."""

    mlp_ratio: int = 2  # the MLP's hidden width as a multiple of the target's H

    def __post_init__(self) -> None:
        if self.mlp_ratio < 1:
            raise ValueError(f"head.mlp_ratio must be >= 1 (the MLP's width in multiples of H), got {self.mlp_ratio}")

    def derived(self) -> dict[str, Any]:
        return {"loss.steps": DRAFTS}

    def derived_from(self, key: str) -> str:
        return f"the pair head's {DRAFTS} drafts per forward"
