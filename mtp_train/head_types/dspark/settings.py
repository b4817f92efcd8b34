"""DSpark's own settings: a block drafter's (`dflash.settings.BlockSettings`) plus its Markov head and its optional
confidence head. Imports only the config floor and the block settings (no torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mtp_train.head_types.dflash.settings import BlockSettings

DEFAULT_MARKOV_RANK = 64  # a Markov head's rank when head.markov_rank is null


@dataclass
class DSparkSettings(BlockSettings):
    """A block drafter with DSpark's Markov head: the rank r of its bias W2·W1[x_{k-1}] on each block position's
    logits (null = DEFAULT_MARKOV_RANK), and the confidence head (a per-position acceptance estimate,
    sigmoid(proj(h)) or, with confidence_with_markov, sigmoid(proj([h ; W1[x_{k-1}]])))."""

    markov_rank: int | None = None
    confidence_head: bool = False
    confidence_with_markov: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank is not None and self.markov_rank < 1:
            raise ValueError(f"a dspark head needs head.markov_rank >= 1 (the rank of its Markov bias), got "
                             f"{self.markov_rank}")
        if self.confidence_with_markov and not self.confidence_head:
            raise ValueError("head.confidence_with_markov=true needs head.confidence_head=true")

    @property
    def drafts(self) -> int:
        """Tokens one block drafts: B, every slot (slot j predicts the token after its position)."""
        return self.block_size

    def resolved(self) -> DSparkSettings:
        return dataclasses.replace(self, markov_rank=DEFAULT_MARKOV_RANK if self.markov_rank is None
                                   else self.markov_rank)

    def derived(self) -> dict[str, Any]:
        """One unrolled loss step per slot."""
        return {"loss.steps": self.drafts}

    def derived_from(self, key: str) -> str:
        return f"head.block_size={self.block_size}"
