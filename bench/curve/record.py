"""docs/curve.json, the committed record of the curve: written from curve.json (`points_json`), and read back into a
fresh checkout's curve.json (`seed`) so that a run skips what is already measured and committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.curve.seeds import comparisons
from bench.curve.variants import ordered_rows


def points_json(results: dict[str, Any]) -> dict[str, Any]:
    """docs/curve.json: per head, the curve's points (`curve`) and each variant's; the best τ at the budget.

    A point is {tokens, step, tau, pos}; `best_tau_512k` is the highest τ at the budget's step over the curve's
    heads (variant `curve`) and every variant, with the variant and head that reached it. `best_k`: per head of the
    curve (`<head> (curve)`) and variant measured at a k grid (bench.curve.kgrid), its best k at the last point
    with that τ and SE; `heads_k_grid`: the curve's heads' grids in full (the variants' are on their rows).
    """
    def pts(points: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"tokens": p["tokens"], "step": p["step"], "tau": p["tau"], "pos": p["pos"],
                 **({"tau_se": p["tau_se"]} if p.get("tau_se") is not None else {})}
                for p in sorted(points.values(), key=lambda p: p["tokens"])]

    heads: dict[str, dict[str, Any]] = {}
    best: tuple[float, str, str] | None = None
    last_step = results.get("max_steps")
    budget = int(results.get("budget_tokens") or 0)
    for h, rec in (results.get("heads") or {}).items():
        if rec.get("points"):
            heads.setdefault(h, {})["curve"] = pts(rec["points"])
    rows = ordered_rows(results)
    for r in rows:
        heads.setdefault(r["head"], {})[r["variant"]] = pts(r["points"])
    for h, by_variant in heads.items():
        for name, ps in by_variant.items():
            # the point at the budget (a variant that batches otherwise reaches it at another step)
            p = ps[-1] if ps else None
            if p and p["tokens"] >= budget and (best is None or p["tau"] > best[0]):
                best = (p["tau"], name, h)
    return {"k": results["eval"]["k"], "budget_tokens": results.get("budget_tokens"), "max_steps": last_step,
            "data": results.get("data"), "data_dir": results.get("data_dir"),  # which conversations trained them
            "recipe": results.get("recipe"), "eval": results["eval"], "heads": heads,
            "best_tau_512k": best[0] if best else None, "best_variant": best[1] if best else None,
            "best_head": best[2] if best else None, "ngram": results.get("ngram"),
            "seed_comparisons": comparisons(rows),  # e.g. mtp against eagle1 over 3 seeds
            "best_k": {name: {"k": g["best_k"], "tau": g["best_tau"], "tau_se": g.get("best_tau_se"),
                              "tokens": g["tokens"], "ks": g["ks"]} for name, g in k_grids(results)},
            "heads_k_grid": {h: rec["k_grid"] for h, rec in (results.get("heads") or {}).items()
                             if rec.get("k_grid")},
            # the measured rows in full, so that another checkout's run resumes from this file (see `seed`)
            "variant_order": results.get("variant_order", []),
            "variants": {r["variant"]: r for r in rows}}


def k_grids(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, k grid) of the curve's heads (`<head> (curve)`) and the variants that hold one."""
    heads = [(f"{h} (curve)", rec["k_grid"]) for h, rec in (results.get("heads") or {}).items() if rec.get("k_grid")]
    return heads + [(r["variant"], r["k_grid"]) for r in ordered_rows(results) if r.get("k_grid")]


def seed(results: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """Fill `results` (a curve.json) with what a record (`points_json`, e.g. docs/curve.json) holds and it lacks:
    variant rows, the heads' curve points, prompt lookup. Returns what was taken, one name each.

    A run on a fresh checkout thus skips what is already measured and committed; a seeded row whose head,
    overrides or recipe differs from the config's is refused by `run_variants` as any other changed row.
    """
    taken = []
    rows = results.setdefault("variants", {})
    for name, row in (record.get("variants") or {}).items():
        if name not in rows:
            rows[name] = row
            taken.append(name)
    order = [*results.get("variant_order", []), *record.get("variant_order", [])]
    results["variant_order"] = list(dict.fromkeys(order))
    if results.get("recipe") in (None, record.get("recipe")) and results.get("max_steps") in (
            None, record.get("max_steps")):
        heads = results.setdefault("heads", {})
        for h, by_variant in (record.get("heads") or {}).items():
            if by_variant.get("curve") and not (heads.get(h) or {}).get("points"):
                heads[h] = {"points": {str(p["step"]): p for p in by_variant["curve"]}}
                if (record.get("heads_k_grid") or {}).get(h):
                    heads[h]["k_grid"] = record["heads_k_grid"][h]
                taken.append(f"{h} (curve)")
        for key in ("recipe", "max_steps", "budget_tokens", "eval"):
            results.setdefault(key, record.get(key))
    if record.get("ngram") and not results.get("ngram"):
        results["ngram"] = record["ngram"]
        taken.append("prompt lookup")
    return taken


def write_points_json(results: dict[str, Any], path: Path) -> None:
    from mtp_train.fileio import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(points_json(results), indent=2) + "\n")
