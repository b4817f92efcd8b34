"""Helpers shared by the benchmarks: robust timing and the one-JSON-line report."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any


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


def compose(config_name: str, overrides: list[str]) -> Any:
    """The Hydra config `config_name` (conf/<config_name>.yaml) composed with `overrides`, as the CLIs see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name, overrides=overrides)
