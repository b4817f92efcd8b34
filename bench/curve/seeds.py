"""Seeds on the learning curve: one recipe trained with several `train.seed` values, and two head types compared
across them (the seed system's claim (a), `mtp` against `eagle1` at the best recipe).

A variant's seed is its `train.seed=N` override (0, the curve's own, when it has none); variants of one head whose
other overrides are the same are one recipe's seeds. Two heads with the same recipe over two or more seeds each
are compared by

    Δτ = τ_a − τ_b on each head's requests pooled over its seeds (accepted tokens and steps summed per request),
    SE = sqrt(SE_prompts² + s²/n): SE_prompts the paired standard error over the requests both answered (the
         prompts are a sample), s the standard deviation of the per-seed differences over the n seeds paired by
         seed (the training's own randomness: initialisation and batch order),

with the 95% interval Δτ ± t(0.975, n − 1)·SE (Student's t over the few seeds: wide on purpose). Seed s of two
heads shares the batch order (both read the same folder), so the per-seed differences pair the seed numbers both
heads have; two heads are compared when they share two or more.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

SEED = re.compile(r"^train\.seed=(\d+)$")
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # df → t


def last_requests(row: dict[str, Any]) -> dict[str, list[int]] | None:
    """The per-request counts of a variant row's last point (None when it was measured without them)."""
    return (row.get("points") or {}).get(str(row.get("step")), {}).get("requests")


def recipe_and_seed(overrides: list[str]) -> tuple[tuple[str, ...], int]:
    """A variant's overrides without its `train.seed=` (sorted: the recipe) and that seed (0 without one)."""
    seeds = [int(m.group(1)) for o in overrides if (m := SEED.match(o))]
    return tuple(sorted(o for o in overrides if not SEED.match(o))), (seeds[-1] if seeds else 0)


def seed_groups(rows: list[dict[str, Any]]) -> dict[tuple[str, tuple[str, ...]], dict[int, dict[str, Any]]]:
    """(head, recipe) → {seed: row} over the measured rows that carry per-request counts; a later row of the same
    head, recipe and seed replaces an earlier one."""
    groups: dict[tuple[str, tuple[str, ...]], dict[int, dict[str, Any]]] = {}
    for r in rows:
        if last_requests(r):
            recipe, s = recipe_and_seed(list(r["overrides"]))
            groups.setdefault((r["head"], recipe), {})[s] = r
    return groups


def pooled(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per-request (steps, accepted) summed over the rows (a recipe's seeds), for the requests all of them have."""
    reqs = [last_requests(r) or {} for r in rows]
    keys = set(reqs[0]).intersection(*reqs[1:])
    return {k: [sum(int(q[k][0]) for q in reqs), sum(int(q[k][1]) for q in reqs)] for k in sorted(keys)}


def compare(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Head a's seeds against head b's (each {seed: row}, two or more seed numbers in common): Δτ, its SE and 95%
    interval as the module's docstring defines them, the per-seed τ and differences."""
    from mtp_train.speculative.metrics import paired_tau_difference

    diff, se_prompts = paired_tau_difference(pooled(list(a.values())), pooled(list(b.values())))
    per_seed = [a[s]["tau"] - b[s]["tau"] for s in sorted(set(a) & set(b))]
    n = len(per_seed)
    spread = statistics.stdev(per_seed)
    se = math.sqrt((se_prompts or 0.0) ** 2 + spread ** 2 / n)
    half = T975.get(n - 1, 1.96) * se
    return {"seeds_a": sorted(a), "seeds_b": sorted(b), "tau_a": [a[s]["tau"] for s in sorted(a)],
            "tau_b": [b[s]["tau"] for s in sorted(b)], "diff": diff, "se_prompts": se_prompts,
            "seed_sd": spread, "per_seed_diff": per_seed, "se": se, "ci95": [diff - half, diff + half]}


def multi_seed_groups(rows: list[dict[str, Any]]) -> dict[tuple[str, tuple[str, ...]], dict[int, dict[str, Any]]]:
    """`seed_groups` of the recipes measured with two or more seeds."""
    return {key: g for key, g in seed_groups(rows).items() if len(g) >= 2}


def comparisons(rows: list[dict[str, Any]],
                groups: dict[tuple[str, tuple[str, ...]], dict[int, dict[str, Any]]] | None = None,
                ) -> list[dict[str, Any]]:
    """Every pair of heads trained with one recipe over two or more common seeds, `mtp` first where present
    (groups: `multi_seed_groups(rows)` when the caller has them)."""
    groups = multi_seed_groups(rows) if groups is None else groups
    out = []
    keys = sorted(groups, key=lambda k: (k[1], k[0] != "mtp", k[0]))
    for i, (ha, recipe) in enumerate(keys):
        for hb, rb in keys[i + 1:]:
            if rb == recipe and hb != ha and len(set(groups[(ha, recipe)]) & set(groups[(hb, rb)])) >= 2:
                out.append({"head_a": ha, "head_b": hb, "recipe": list(recipe),
                            **compare(groups[(ha, recipe)], groups[(hb, rb)])})
    return out


def seeds_markdown(rows: list[dict[str, Any]]) -> str:
    """The seeds section of the report: each recipe's τ per seed, and every head pair's Δτ with its interval
    (empty string when no recipe has two seeds)."""
    groups = multi_seed_groups(rows)
    if not groups:
        return ""
    lines = ["| head | recipe | seeds | τ per seed | mean ± sd |", "|---|---|---|---|---:|"]
    for (head, recipe), g in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        taus = [g[s]["tau"] for s in sorted(g)]
        lines.append(f"| `{head}` | `{' '.join(recipe)}` | {', '.join(map(str, sorted(g)))} | "
                     f"{' / '.join(f'{t:.3f}' for t in taus)} | {statistics.mean(taus):.3f} ± "
                     f"{statistics.stdev(taus):.3f} |")
    pairs = comparisons(rows, groups)
    if pairs:
        lines += ["", "| heads | recipe | Δτ (pooled) | SE (prompts, seeds) | 95% interval | per-seed Δτ |",
                  "|---|---|---:|---|---|---|"]
        for c in pairs:
            sp = "–" if c["se_prompts"] is None else f"{c['se_prompts']:.3f}"
            lines.append(f"| `{c['head_a']}` − `{c['head_b']}` | `{' '.join(c['recipe'])}` | {c['diff']:+.3f} | "
                         f"{c['se']:.3f} ({sp}, {c['seed_sd']:.3f}/√{len(c['per_seed_diff'])}) | "
                         f"{c['ci95'][0]:+.3f} … {c['ci95'][1]:+.3f} | "
                         f"{' / '.join(f'{d:+.3f}' for d in c['per_seed_diff'])} |")
    return ("\n## Seeds (one recipe, several `train.seed`)\n\n"
            "A recipe's variants that differ only in `train.seed` (initialisation and batch order; none = seed 0). "
            "Two heads are compared on their requests pooled over seeds; the SE adds the prompts' paired SE and "
            "the spread of the per-seed differences, the interval uses Student's t over the seeds "
            "(bench/curve/seeds.py).\n\n" + "\n".join(lines) + "\n")
