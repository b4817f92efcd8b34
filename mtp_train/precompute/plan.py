"""Which samples go into which shard and which prefill batch: a pure function of the sample list and the settings.

A re-run with the same samples and settings plans the same shards under the same names, so it finds the ones
already written and skips them (resume, see `mtp_train.precompute.shards.finished_shard`):

* ranks: rank r takes samples r, r+world, r+2*world, ... of the given order (strided, so every rank
  gets a similar mix of lengths whatever order the caller uses);
* shards: a rank's samples, in order, are cut into consecutive runs of at most `shard_tokens` tokens
  (a longer sample gets a shard of its own);
* batches: a shard's samples, in order, are cut the same way by `batch_tokens` into packed prefills.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

RANK_ASSIGNMENT = "strided: rank r takes samples r, r+world, r+2*world, ... of the given order"


@dataclass(frozen=True)
class Sample:
    """One tokenized conversation: loss_mask is 1 on the tokens the head learns (assistant tokens)."""

    id: str  # unique across the whole data set; decides the train/val split
    input_ids: list[int]  # (L,)
    loss_mask: list[int]  # (L,) 0/1


@dataclass
class Row:
    """A validated sample as compact arrays."""

    id: str
    ids: np.ndarray  # (L,) int32
    mask: np.ndarray  # (L,) uint8


@dataclass
class ShardPlan:
    """What one shard will hold; two runs with equal plans write byte-identical shards."""

    rank: int
    index: int
    rows: list[Row]
    tokens: int
    loss_tokens: int
    ids_sha256: str  # sha256 over the sample ids
    plan_sha256: str  # sha256 over the settings and every sample's id, tokens and mask

    @property
    def name(self) -> str:
        return shard_name(self.rank, self.index)


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank}-{index:05d}.safetensors"


def plan_runs(lengths: Sequence[int], budget: int) -> list[range]:
    """Cut consecutive items into runs of at most `budget` total length (an item over budget runs alone)."""
    runs: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > budget:
            runs.append(range(start, i))
            start, total = i, 0
        total += n
    if len(lengths) > start:
        runs.append(range(start, len(lengths)))
    return runs


def rank_slice(n: int, rank: int, world: int) -> range:
    """Indices of the samples rank `rank` precomputes (`RANK_ASSIGNMENT`)."""
    return range(rank, n, world)


def to_rows(samples: Sequence[Sample], vocab_size: int) -> list[Row]:
    """Validate samples (unique ids, equal lengths, ids in vocab, 0/1 mask) and convert them to arrays."""
    rows, seen = [], set()
    for s in samples:
        if s.id in seen:
            raise ValueError(f"duplicate sample id {s.id!r}: ids must be unique (they decide resume and the split)")
        seen.add(s.id)
        ids = np.asarray(s.input_ids, dtype=np.int64)
        mask = np.asarray(s.loss_mask, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"sample {s.id!r}: input_ids must be a non-empty list of ints")
        if mask.shape != ids.shape:
            raise ValueError(f"sample {s.id!r}: {ids.size} input_ids but {mask.size} loss_mask entries")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"sample {s.id!r}: token ids must be in 0..{vocab_size - 1}")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(f"sample {s.id!r}: loss_mask must hold only 0 and 1")
        rows.append(Row(s.id, ids.astype(np.int32), mask.astype(np.uint8)))
    return rows


def shard_plan(rank: int, index: int, rows: Sequence[Row], settings: dict[str, Any]) -> ShardPlan:
    """Shard `index` of rank `rank` holding `rows`, in order; `settings` (anything that changes shard bytes) enters
    the plan hash, which a finished shard's sidecar must match (resume)."""
    ids_h, plan_h = hashlib.sha256(), hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for r in rows:
        key = r.id.encode() + b"\0"
        ids_h.update(key)
        plan_h.update(key + r.ids.size.to_bytes(8, "little") + r.ids.tobytes() + r.mask.tobytes())
    return ShardPlan(rank, index, list(rows), sum(r.ids.size for r in rows), sum(int(r.mask.sum()) for r in rows),
                     ids_h.hexdigest(), plan_h.hexdigest())


def plan_rank(rows: Sequence[Row], rank: int, world: int, shard_tokens: int, settings: dict[str, Any]) -> list[
        ShardPlan]:
    """The shards rank `rank` writes, in order (`RANK_ASSIGNMENT`, cut by `shard_tokens`)."""
    mine = [rows[i] for i in rank_slice(len(rows), rank, world)]
    return [shard_plan(rank, index, [mine[i] for i in run], settings)
            for index, run in enumerate(plan_runs([r.ids.size for r in mine], shard_tokens))]
