"""The cost of one verify forward: new rows of every sequence over its cached prefix, the unit the speculative
step's price is counted in (the engine, tree and GPU benchmarks and the GPU check measure it alike)."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from mtp_train.engine.runner import ModelRunner, StepRows
from mtp_train.engine.sequence import Sequence


def verify_seconds(runner: ModelRunner, seqs: Seq[Sequence], tokens: Seq[int], prefix: int,
                   tree: list[list[int]] | None = None, sync: bool = False) -> float:
    """Seconds of one target forward over `tokens` as new rows of every sequence after its `prefix` cached tokens
    (`StepRows`: the sequences are read, never changed, so the next call starts from the same prefix).

    Args:
        runner: the `ModelRunner` whose cache holds the prefixes.
        seqs: engine `Sequence`s of `prefix` cached tokens each, with pages for `prefix + len(tokens)` slots.
        tokens: (r,) the new rows' token ids, the same for every sequence.
        prefix: the cached length the rows follow.
        tree: per sequence the rows' parents (a tree step) or None (the rows causal, a chain).
        sync: synchronise CUDA around the forward (asynchronous devices), so the time is the step's.
    """
    for s in seqs:
        runner.kv.ensure(s.pages, prefix + len(tokens))
    rows = StepRows([list(tokens) for _ in seqs], [prefix] * len(seqs), [list(s.pages) for s in seqs], tree)
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.forward(rows, logits="all")
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - t0
