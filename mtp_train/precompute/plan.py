"""Which samples go into which shard and which prefill batch: a pure function of the sample list and the settings.

A re-run with the same samples and settings plans the same shards under the same names, so it finds the ones
already written and skips them (resume, see `mtp_train.precompute.shards.finished_shard`):

* ranks: rank r takes samples r, r+world, r+2*world, ... of the given order (strided, so every rank
  gets a similar mix of lengths whatever order the caller uses);
* shards: a rank's samples, in order, are cut into consecutive runs of at most `shard_tokens` tokens
  (a longer sample gets a shard of its own);
* batches: a shard's samples, in order, are cut the same way by `batch_tokens` into packed prefills.

Both cuts are greedy in order, so a rank plans its shards as the samples stream in (`plan_stream`): the same plans
as `plan_rank` over the whole list, with one shard's rows in memory at a time.

`plan_shards` is the one cut of rows into shards: precompute cuts single samples, hybrid training cuts its
epoch-0 micro-batches (a batch is never split).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mtp_train.data.samples import Row

RANK_ASSIGNMENT = "strided: rank r takes samples r, r+world, r+2*world, ... of the given order"


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


def plan_shards(rank: int, groups: Sequence[Sequence[Row]], shard_tokens: int, settings: dict[str, Any],
                first_index: int = 0) -> list[ShardPlan]:
    """Shards `first_index`, `first_index` + 1, ... of rank `rank`: consecutive `groups` of rows, in order, cut
    into runs of at most `shard_tokens` tokens (a group is never split; one over budget runs alone)."""
    runs = plan_runs([sum(int(r.ids.size) for r in g) for g in groups], shard_tokens)
    return [shard_plan(rank, first_index + n, [r for k in run for r in groups[k]], settings)
            for n, run in enumerate(runs)]


def plan_rank(rows: Sequence[Row], rank: int, world: int, shard_tokens: int, settings: dict[str, Any]) -> list[
        ShardPlan]:
    """The shards rank `rank` of `mtp-precompute` writes, in order (`RANK_ASSIGNMENT`, cut by `shard_tokens`)."""
    return plan_shards(rank, [[rows[i]] for i in rank_slice(len(rows), rank, world)], shard_tokens, settings)


def plan_stream(rows: Iterable[Row], rank: int, world: int, shard_tokens: int, settings: dict[str, Any]) -> Iterator[
        ShardPlan]:
    """`plan_rank` as the rows come: each of rank `rank`'s shards as soon as its last sample is known (the next
    one would not fit, or the rows ended). `rows` is every rank's, in order; the others' are passed over."""
    shard: list[Row] = []
    total = index = 0
    for g, r in enumerate(rows):
        if g % world != rank:  # RANK_ASSIGNMENT
            continue
        n = int(r.ids.size)
        if shard and total + n > shard_tokens:  # as `plan_runs`: a sample over budget runs alone
            yield shard_plan(rank, index, shard, settings)
            shard, total, index = [], 0, index + 1
        shard.append(r)
        total += n
    if shard:
        yield shard_plan(rank, index, shard, settings)
