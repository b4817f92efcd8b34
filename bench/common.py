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


def report(results: dict) -> None:
    """Print the results as the benchmark's last line: one JSON object."""
    print(json.dumps(results, sort_keys=True))
