"""The training batch plan: batches of samples of similar length under a token budget, in lock-step across ranks.

Only the samples' lengths enter it, so a precompute folder (`PrecomputedDataset`) and the conversations of an
online run (`mtp_train.data.samples.TokenDataset`) with the same samples get the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

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

    def __init__(self, lengths: Sequence[int], max_tokens: int, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world: int = 1, drop_last: bool = False) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.rank, self.world, self.drop_last = rank, world, drop_last
        self.epoch = 0
        self.position = 0
        self._cache: tuple[int, list[list[int]], int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first batch."""
        self.epoch, self.position = epoch, 0

    def _all_batches(self) -> list[list[int]]:
        """All ranks' batches of the current epoch, in order, before the per-rank split."""
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, self.epoch])
        tie = rng.permutation(n) if self.shuffle else np.arange(n)
        order = np.lexsort((tie, self.lengths))  # by length, then tie-break
        batches: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for i in order.tolist():
            n_i = int(self.lengths[i])
            if cur and max(longest, n_i) * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n_i)
        if cur:
            batches.append(cur)
        if self.shuffle:
            batches = [batches[k] for k in rng.permutation(len(batches))]
        return batches

    def _rank_batches(self) -> list[list[int]]:
        return self._plan()[0]

    def _plan(self) -> tuple[list[list[int]], int]:
        """(this rank's batches of the epoch, the number of batches before the list was evened out over ranks)."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1], self._cache[2]
        batches = self._all_batches()
        distinct = len(batches)
        if self.drop_last:
            batches = batches[: len(batches) - len(batches) % self.world]
        elif batches and len(batches) % self.world:
            want = math.ceil(len(batches) / self.world) * self.world
            batches = batches + [batches[i % len(batches)] for i in range(want - len(batches))]
        mine = batches[self.rank::self.world]
        self._cache = (self.epoch, mine, distinct)  # len() and iter() of one epoch share one plan
        return mine, distinct

    def rank_batches(self) -> list[tuple[list[int], bool]]:
        """This rank's batches of the current epoch, in order, each with whether it is the batch's first
        appearance in the epoch (False for the copies added to even the ranks out; each sample is in exactly
        one first appearance over all ranks)."""
        mine, distinct = self._plan()
        return [(b, self.rank + p * self.world < distinct) for p, b in enumerate(mine)]

    def __len__(self) -> int:
        return len(self._rank_batches())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._rank_batches()
        while self.position < len(batches):
            b = batches[self.position]
            self.position += 1
            yield b
        # A finished epoch restarts from its beginning if iterated again without set_epoch.
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at batch `position` of epoch `epoch` (same lengths, max_tokens, seed, rank and world)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
