"""Helpers shared by the benchmarks: robust timing and the one-JSON-line report."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable


def timeit(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(ours: Callable[[], object], baseline: Callable[[], object], repeat: int = 5,
            warmup: int = 1) -> tuple[float, float, float]:
    """Time ours and the baseline alternately; returns (median ours s, median baseline s, median ratio).

    The ratio (baseline / ours, > 1 = ours faster) is taken per round, so load that comes and goes on a
    shared machine hits both sides of a round alike instead of skewing one side's median.
    """
    for _ in range(warmup):
        ours()
        baseline()
    t_ours, t_base, ratios = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ours()
        t1 = time.perf_counter()
        baseline()
        t2 = time.perf_counter()
        t_ours.append(t1 - t0)
        t_base.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(t_ours), statistics.median(t_base), statistics.median(ratios)


def report(results: dict) -> None:
    """Print the results as the benchmark's last line: one JSON object."""
    print(json.dumps(results, sort_keys=True))
