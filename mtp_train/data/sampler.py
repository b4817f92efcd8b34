"""The training batch plan: batches of samples of similar length under a token budget, in lock-step across ranks.

Only the samples' lengths enter it, so a precompute folder (`PrecomputedDataset`) and the conversations of an
online run (`mtp_train.data.samples.TokenDataset`) with the same samples get the same batches.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


class LengthBucketedBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of samples of similar length, at most `max_tokens` padded tokens each, in lock-step across ranks.

    Each epoch, samples are sorted by length (ties in an order drawn from seed + epoch when shuffling) and
    cut greedily into batches with len(batch) * longest ≤ max_tokens; a sample longer than max_tokens is a
    batch of its own. The batch order is then shuffled from seed + epoch, identically on every rank, and
    rank r takes batches r, r+world, ... . Every rank must yield the same number of batches or DDP hangs,
    so the batch list is first made a multiple of world: drop_last=True drops the last (at most world-1)
    batches, otherwise the first batches are repeated (a few samples are seen twice that epoch).

    State for resuming is (epoch, position), position = batches this rank has handed out in the epoch.
    A DataLoader asks for batches ahead of the training loop (prefetch), so save the number of steps
    the loop has taken as position, not the sampler's own count.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world: int = 1, drop_last: bool = False) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.lengths = np.asarray(lengths, dtype=np.int64)  # (N,)
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.rank, self.world, self.drop_last = rank, world, drop_last
        self.epoch = 0
        self.position = 0
        self._cache: _Plan | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first batch."""
        self.epoch, self.position = epoch, 0

    def _plan(self) -> _Plan:
        """The current epoch's plan, computed once per epoch (len() and iter() of one epoch share it)."""
        if self._cache is None or self._cache.epoch != self.epoch:
            self._cache = self._make_plan()
        return self._cache

    def _make_plan(self) -> _Plan:
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, self.epoch])
        tie = rng.permutation(n) if self.shuffle else np.arange(n)
        order = np.lexsort((tie, self.lengths))  # (N,) by length, then tie-break
        starts = _cut(self.lengths[order].tolist(), self.max_tokens)
        distinct = len(starts) - 1
        seq = rng.permutation(distinct) if self.shuffle else np.arange(distinct)  # the batches' order
        if self.drop_last:
            seq = seq[: distinct - distinct % self.world]
        elif distinct and distinct % self.world:
            want = math.ceil(distinct / self.world) * self.world
            seq = np.concatenate([seq, seq[np.arange(want - distinct) % distinct]])  # the first ones again
        return _Plan(self.epoch, order, np.asarray(starts, dtype=np.int64), seq[self.rank::self.world], distinct)

    def _batch(self, plan: _Plan, b: int) -> list[int]:
        return plan.order[plan.starts[b]:plan.starts[b + 1]].tolist()

    def rank_batches(self) -> list[tuple[list[int], bool]]:
        """This rank's batches of the current epoch, in order, each with whether it is the batch's first
        appearance in the epoch (False for the copies added to even the ranks out; each sample is in exactly
        one first appearance over all ranks)."""
        plan = self._plan()
        return [(self._batch(plan, int(b)), self.rank + p * self.world < plan.distinct)
                for p, b in enumerate(plan.mine)]

    def batch_at(self, position: int) -> list[int]:
        """This rank's batch `position` of the current epoch (what iterating from that position yields first)."""
        plan = self._plan()
        return self._batch(plan, int(plan.mine[position]))

    def __len__(self) -> int:
        return len(self._plan().mine)

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._plan()
        while self.position < len(plan.mine):
            b = self._batch(plan, int(plan.mine[self.position]))
            self.position += 1
            yield b
        # A finished epoch restarts from its beginning if iterated again without set_epoch.
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        """Two integers whatever the number of samples: the plan is recomputed from the seed and the epoch."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at batch `position` of epoch `epoch` (same lengths, max_tokens, seed, rank and world)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


@dataclass
class _Plan:
    """One epoch's batches as arrays: batch b is samples order[starts[b]:starts[b+1]]."""

    epoch: int
    order: np.ndarray  # (N,) sample indices by length, then tie-break
    starts: np.ndarray  # (B+1,) where each batch starts in `order`
    mine: np.ndarray  # this rank's batches, in order (indices into starts)
    distinct: int  # B: batches before the list was evened out over ranks


def _cut(lengths: list[int], max_tokens: int) -> list[int]:
    """Where the batches of samples sorted by length start (and N at the end): each batch is cut as late as
    len(batch) · longest <= max_tokens allows, a longer sample alone.

    Sorted ascending, a batch from s that takes sample i holds (i - s + 1) samples of at most lengths[i] tokens,
    which only grows with i: the cut is a binary search per batch, not a step per sample.
    """
    n = len(lengths)
    starts, s = [0], 0
    while s < n:
        s = s + 1 + bisect.bisect_left(range(s + 1, n), True,
                                       key=lambda i, s=s: lengths[i] * (i - s + 1) > max_tokens)
        starts.append(s)
    return starts
