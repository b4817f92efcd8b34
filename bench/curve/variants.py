"""Recipe variants on the learning curve: trained on the curve's precompute folder, batches, seed and token budget,
measured at the last point only (every log-spaced point with `--full-curve`).

`python -m bench.curve --variants NAME[,NAME...]|all` runs them; each row lands in curve.json under `variants`; a
re-run skips the variants whose points are all there, and a killed one resumes its training (`resume=auto`). This
module holds the resume rule and the loop; bench.curve.run hands it the training and the measurement
(`train(variant, point_steps)`, `measure(variant, step)`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.curve.config import VARIANTS_DIR, Variant
from bench.curve.kgrid import has_grid

LAST_FIELDS = ("tokens", "step", "tau", "tau_se", "acceptance_rate", "pos", "seconds")  # a row repeats its last point's


def point_steps(plan: list[tuple[int, int]], full_curve: bool) -> list[int]:
    """The steps a variant is exported and measured at: the last (the budget), or every point of the plan."""
    return [s for s, _ in plan] if full_curve else [plan[-1][0]]


def is_done(row: dict[str, Any] | None, variant: Variant, recipe: list[str], steps: list[int],
            grid: bool = False) -> bool:
    """Whether curve.json's row already holds this variant, with the same head, overrides, shared recipe and
    points (a changed definition is measured again), and its k grid at the last point when `grid`."""
    if not row:
        return False
    same = (row.get("head") == variant.head and row.get("overrides") == list(variant.overrides)
            and row.get("recipe") == recipe)
    return (same and all(str(s) in row.get("points", {}) for s in steps)
            and (not grid or has_grid(row, steps[-1])))


def run_variants(results: dict[str, Any], variants: list[Variant], plan: list[tuple[int, int]], recipe: list[str],
                 full_curve: bool, train: Callable[[Variant, list[int]], dict[str, Any]],
                 measure: Callable[[Variant, int], dict[str, Any]], save: Callable[[], None],
                 trained: Callable[[Variant, int], bool],
                 plan_of: Callable[[Variant], list[tuple[int, int]]] | None = None,
                 measure_grid: Callable[[Variant, int, dict[str, Any]], dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    """Train (unless `trained(variant, last_step)`) and measure each variant not yet in results["variants"].

    train(variant, point_steps) → the trainer's final metrics; measure(variant, step) → a point (step, tokens,
    tau, acceptance_rate, pos, seconds); save() writes curve.json (after each training and each point).
    plan_of(variant): the variant's own batch plan where its overrides change the batches (micro-batch tokens,
    accumulation), so that it reaches the same token points at other steps; default: `plan` for every variant.
    measure_grid(variant, last_step, last_point) → the row's `k_grid` (bench.curve.kgrid), measured once the last
    point is; None: no k grid.
    """
    rows = results.setdefault("variants", {})
    results["variant_order"] = list(dict.fromkeys([*results.get("variant_order", []), *(v.name for v in variants)]))
    for v in variants:
        steps = point_steps(plan_of(v) if plan_of else plan, full_curve)
        if is_done(rows.get(v.name), v, recipe, steps, grid=measure_grid is not None):
            print(f"curve: variant {v.name} already measured (curve.json): skipped", flush=True)
            continue
        row = rows.get(v.name) or {}
        if row and (row.get("head"), row.get("overrides"), row.get("recipe")) != (v.head, list(v.overrides), recipe):
            # Its folder holds heads (and a checkpoint resume=auto would continue) of the old definition.
            raise SystemExit(f"curve: variant {v.name} is not what curve.json measured (head {row.get('head')}, "
                             f"overrides {row.get('overrides')}, recipe {row.get('recipe')}): give it a new name, or "
                             f"delete its row in curve.json and its folder under {VARIANTS_DIR}/")
        row.update({"variant": v.name, "head": v.head, "overrides": list(v.overrides), "recipe": recipe,
                    "command": results.get("command")})
        row.setdefault("points", {})
        rows[v.name] = row
        # Every point measured, only the k grid missing: measured on the last head where it is here; a row taken
        # from a record (its heads elsewhere) is not retrained for it.
        measured = all(str(s) in row["points"] for s in steps)
        if measured and not trained(v, steps[-1]):
            print(f"curve: variant {v.name}: measured, but its head at step {steps[-1]} is not under "
                  f"{VARIANTS_DIR}/ (a row taken from a record): its k grid is not measured", flush=True)
            continue
        missing = [] if measured else [s for s in steps if not trained(v, s)]
        if missing and trained(v, steps[-1]):
            raise SystemExit(f"curve: variant {v.name} was trained to the budget without exports at steps {missing} "
                             f"(a run without --full-curve): delete its folder under {VARIANTS_DIR}/ to retrain")
        if missing:
            print(f"curve: variant {v.name}: training {v.head} with {' '.join(v.overrides)}", flush=True)
            t0 = time.perf_counter()
            final = train(v, steps)
            row["train_wall_s"] = row.get("train_wall_s", 0.0) + time.perf_counter() - t0
            row["final"] = {k: x for k, x in final.items() if k.startswith(("eval/", "train/"))}
            save()
        for s in steps:
            if str(s) in row["points"]:
                continue
            p = measure(v, s)
            row["points"][str(s)] = p
            print(f"curve: variant {v.name} step {s} ({p['tokens']} tokens): τ {p['tau']:.3f}, pos "
                  f"{' / '.join(f'{a:.3f}' for a in p['pos'])} ({p['seconds']:.0f}s)", flush=True)
            save()
        last = row["points"][str(steps[-1])]
        row.update({k: last[k] for k in LAST_FIELDS if k in last})
        save()
        if measure_grid is not None and not has_grid(row, steps[-1]):
            row["k_grid"] = measure_grid(v, steps[-1], last)
            print(f"curve: variant {v.name}: best k {row['k_grid']['best_k']} (τ {row['k_grid']['best_tau']:.3f}) "
                  f"of k = {row['k_grid']['ks']}", flush=True)
            save()
    return results


def ordered_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured variant rows, in the order they were asked for (curve.json's keys are sorted)."""
    rows = results.get("variants") or {}
    names = [n for n in results.get("variant_order", []) if n in rows] + sorted(
        n for n in rows if n not in results.get("variant_order", []))
    return [rows[n] for n in names if "tau" in rows[n]]
