"""The head's own best k on the learning curve: τ at each k of a grid, measured at the last point only.

A point is measured at the curve's k (eval.k, e.g. 3) all along; at the last point the head is measured again at
every k of `eval.k_grid` (a chain drafter drafts as deep as it is asked) or, for a drafter that drafts at most m
tokens whatever k is asked (a block drafter: B-1 slots), at `eval.block_k_grid` cut at m (every k from 1 to m
when that is empty). The record, `k_grid` on a head's or variant's row of curve.json:

    {"step": 1024, "tokens": 2097152, "bound": 15 | null, "ks": [1, 2, ...],
     "by_k": {"1": {"tau", "tau_se", "acceptance_rate", "pos", "requests", "seconds"}, ...},
     "best_k": 4, "best_tau": 1.71, "best_tau_se": 0.02}

The best k is the one of highest τ (the smallest of equals: fewer verified tokens for the same τ).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PROBE_K = 1024  # a depth no drafter's block reaches: a drafter that drafts fewer at this k is bounded


def drafter_bound(max_nodes: Callable[[int], int]) -> int | None:
    """m when the drafter (its `Proposer.max_nodes`) drafts at most m tokens whatever k is asked, else None."""
    m = int(max_nodes(PROBE_K))
    return m if m < PROBE_K else None


def grid_for(bound: int | None, k_grid: list[int], block_k_grid: list[int]) -> list[int]:
    """The k a head is measured at: `k_grid` for an unbounded drafter; for one bounded at m, `block_k_grid` cut
    at m, or 1..m when it is empty. Sorted, each once, every k ≥ 1."""
    if bound is None:
        ks = list(k_grid)
    else:
        ks = [k for k in block_k_grid if k <= bound] if block_k_grid else list(range(1, bound + 1))
    bad = [k for k in ks if int(k) < 1]
    if bad:
        raise SystemExit(f"curve: eval.k_grid / eval.block_k_grid hold k < 1: {bad}")
    return sorted({int(k) for k in ks})


def best_k(by_k: dict[str, dict[str, Any]]) -> int:
    """The k of highest τ among the measured ones (the smallest k of equal τ)."""
    if not by_k:
        raise ValueError("no k measured")
    return int(min(by_k, key=lambda k: (-float(by_k[k]["tau"]), int(k))))


def k_grid_record(step: int, tokens: int, bound: int | None, by_k: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The `k_grid` record of one head at one step from its measurements per k (each a point's fields)."""
    table = {str(k): by_k[k] for k in sorted(by_k)}
    k = best_k(table)
    best = table[str(k)]
    return {"step": int(step), "tokens": int(tokens), "bound": bound, "ks": sorted(by_k), "by_k": table,
            "best_k": k, "best_tau": best["tau"], "best_tau_se": best.get("tau_se")}


def has_grid(rec: dict[str, Any] | None, step: int) -> bool:
    """Whether a row already holds its k grid at `step` (a re-run skips it)."""
    grid = (rec or {}).get("k_grid") or {}
    return grid.get("step") == int(step) and bool(grid.get("by_k"))
