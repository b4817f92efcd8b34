"""The settings of a block drafter (`head.<key>` beside the shared ones): dflash's, and the base of dspark's.

The block [last token, mask_token_id × (B-1)] runs through `layers` Qwen3-shaped draft layers in ONE forward;
training drafts `max_anchors` such blocks per packed micro-batch. Imports only the config floor (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtp_train.config.head import HeadSettings

# The largest head.block_size: far past where drafts are still accepted (the chance that all of a block's B - 1 drafts
# are right falls geometrically with B), and small enough that a block's rows and its attention over itself stay a
# small part of a micro-batch. The target's max_position_embeddings bounds it too (`fit_problem`).
MAX_BLOCK_SIZE = 256


@dataclass
class BlockSettings(HeadSettings):
    """A block drafter's own settings (dflash)."""

    layers: int = 1  # draft decoder layers of the block drafter (1 or more, Qwen3-shaped)
    # B: the block [last token, mask × (B-1)] drafted in one forward (dflash: B-1 drafts; dspark: B, every slot)
    block_size: int = 8
    # The token id of the block's mask slots (its frozen target embedding); null = the target's last vocabulary id
    # (a padding or reserved row of Qwen3 / Llama-3, never emitted in text; docs/training.md names it per target).
    mask_token_id: int | None = None
    max_anchors: int = 512  # training: most blocks (anchors, sampled among loss positions) per packed micro-batch

    def __post_init__(self) -> None:
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"head.block_size={self.block_size} is over {MAX_BLOCK_SIZE}, the most a block drafter "
                             f"takes: a block drafts block_size - 1 tokens in one forward, and every block of a "
                             f"training micro-batch holds block_size rows per layer; choose at most {MAX_BLOCK_SIZE} "
                             "(DFlash drafters use 8 to 16)")
        if self.layers < 1 or self.block_size < 2 or self.max_anchors < 1:
            raise ValueError(f"a block drafter needs head.layers >= 1, head.block_size >= 2 (one draft per mask "
                             f"slot) and head.max_anchors >= 1; got {self.layers}, {self.block_size}, "
                             f"{self.max_anchors}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"head.mask_token_id must be a token id >= 0 (or null), got {self.mask_token_id}")

    @property
    def drafts(self) -> int:
        """Tokens one block drafts: B - 1 (the mask slots; the block's first position holds the last token)."""
        return self.block_size - 1

    def derived(self) -> dict[str, Any]:
        """One unrolled loss step per drafted slot."""
        return {"loss.steps": self.drafts}

    def derived_from(self, key: str) -> str:
        return f"head.block_size={self.block_size} - 1"

    def block_bytes(self, hidden_size: int, bytes_per_value: int = 4) -> int:
        """A lower bound of the memory the blocks of one training micro-batch take: max_anchors blocks of block_size
        rows of `hidden_size` values, kept once per draft layer for the backward pass (attention scores, the MLP and
        the logits come on top). bytes_per_value: 4 for the fp32 activations of mixed-precision training."""
        return self.max_anchors * self.block_size * hidden_size * self.layers * bytes_per_value

    def fit_problem(self, max_positions: int, hidden_size: int, free_bytes: Callable[[], int | None],
                    human: Callable[[int], str], target: str, device: str) -> str | None:
        """A block past the target's positions (a block's positions run from its anchor to anchor + block_size - 1,
        all of them positions the target's RoPE knows), or blocks whose memory alone is over what is free."""
        if self.block_size > max_positions:
            return (f"head.block_size={self.block_size} is over the target's max_position_embeddings "
                    f"({max_positions}, {target}): a block's positions run from its anchor to anchor + block_size - 1, "
                    f"and the target knows no position past that; choose at most {max_positions}")
        need, free = self.block_bytes(hidden_size), free_bytes()
        if free is not None and need > free:
            return (f"head.block_size={self.block_size} with head.max_anchors={self.max_anchors}: the blocks of one "
                    f"micro-batch alone take at least {human(need)}: {self.max_anchors} blocks of {self.block_size} "
                    f"rows of {hidden_size} values per draft layer, more than the {human(free)} free on {device}; "
                    "lower head.block_size or head.max_anchors")
        return None
