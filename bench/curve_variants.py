"""Recipe variants on the learning curve: one head type with extra mtp-train overrides, measured at the budget.

A variant is a name, a conf/head name and overrides, e.g. `mtp-lk_hybrid-s1: {head: mtp, overrides:
[loss.kind=lk_hybrid, loss.steps=1]}` (conf/experiment/curve.yaml's `variants:` block, or a `--variants-file`
holding one). `bench/curve.py --variants NAME[,NAME...]|all` trains each on the curve's precompute folder,
batches, seed and token budget (the curve's `train:` overrides, the command line's, then the variant's, so a
variant's `loss.steps` wins over the shared `loss.steps=1`) into `<out>/variants/<name>`, and measures it at the
last point only (every log-spaced point with `--full-curve`). Its row lands in curve.json under `variants`; a
re-run skips the variants whose points are all there, and a killed one resumes its training (`resume=auto`).

This module holds the config, the selection, the resume rule, the loop and the report; bench/curve.py hands it
the training and the measurement (`train(head, run_dir, overrides, point_steps)`, `measure(head_dir)`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from curve_seeds import comparisons, last_requests, seeds_markdown

VARIANTS_DIR = "variants"
LAST_FIELDS = ("tokens", "step", "tau", "tau_se", "acceptance_rate", "pos", "seconds")  # a row repeats its last point's


@dataclass
class VariantSpec:
    """One entry of a `variants:` block (its name is the key)."""

    head: str = "mtp"  # a conf/head name
    overrides: list[str] = field(default_factory=list)  # mtp-train key=value, applied after the curve's own


@dataclass(frozen=True)
class Variant:
    name: str
    head: str
    overrides: tuple[str, ...]


def parse_variants(block: Any) -> list[Variant]:
    """A `variants:` mapping (name → {head, overrides}), in its written order, as Variants.

    A name must be usable as a folder name; an override must be key=value (Hydra syntax is checked when the
    variant's config is composed).
    """
    out = []
    for name, spec in (block or {}).items():
        name = str(name)
        if not name or "/" in name or name.startswith("."):
            raise SystemExit(f"curve: variant name {name!r} is not a folder name")
        head = spec.head if isinstance(spec, VariantSpec) else str(spec.get("head", "mtp"))
        overrides = spec.overrides if isinstance(spec, VariantSpec) else list(spec.get("overrides", []))
        bad = [o for o in overrides if "=" not in str(o)]
        if bad:
            raise SystemExit(f"curve: variant {name}: overrides must be key=value, got {bad}")
        out.append(Variant(name, str(head), tuple(str(o) for o in overrides)))
    return out


def load_variants_file(path: str | Path) -> list[Variant]:
    """The variants of a YAML file: a `variants:` block, or the mapping itself at the top level."""
    from omegaconf import OmegaConf

    conf = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(conf, dict)
    return parse_variants(conf.get("variants", conf))


def select(variants: list[Variant], names: str | None) -> list[Variant]:
    """`names`: comma-separated variant names (run in the given order) or `all` (the config's order)."""
    if names is None or names.strip() in ("", "all"):
        return list(variants)
    by_name = {v.name: v for v in variants}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"curve: unknown variant(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in dict.fromkeys(wanted)]


def variant_overrides(shared: list[str], variant: Variant, run_dir: Path) -> list[str]:
    """The mtp-train overrides of a variant: the curve's (head, data, shared recipe, budget, command line), then
    the variant's own (later ones win in Hydra), then its run folder."""
    return [*shared, *variant.overrides, f"out={run_dir}"]


def point_steps(plan: list[tuple[int, int]], full_curve: bool) -> list[int]:
    """The steps a variant is exported and measured at: the last (the budget), or every point of the plan."""
    return [s for s, _ in plan] if full_curve else [plan[-1][0]]


def is_done(row: dict[str, Any] | None, variant: Variant, recipe: list[str], steps: list[int]) -> bool:
    """Whether curve.json's row already holds this variant, with the same head, overrides, shared recipe and
    points (a changed definition is measured again)."""
    if not row:
        return False
    same = (row.get("head") == variant.head and row.get("overrides") == list(variant.overrides)
            and row.get("recipe") == recipe)
    return same and all(str(s) in row.get("points", {}) for s in steps)


def run_variants(results: dict[str, Any], variants: list[Variant], plan: list[tuple[int, int]], recipe: list[str],
                 full_curve: bool, train: Callable[[Variant, list[int]], dict[str, Any]],
                 measure: Callable[[Variant, int], dict[str, Any]], save: Callable[[], None],
                 trained: Callable[[Variant, int], bool],
                 plan_of: Callable[[Variant], list[tuple[int, int]]] | None = None) -> dict[str, Any]:
    """Train (unless `trained(variant, last_step)`) and measure each variant not yet in results["variants"].

    train(variant, point_steps) → the trainer's final metrics; measure(variant, step) → a point (step, tokens,
    tau, acceptance_rate, pos, seconds); save() writes curve.json (after each training and each point).
    plan_of(variant): the variant's own batch plan where its overrides change the batches (micro-batch tokens,
    accumulation), so that it reaches the same token points at other steps; default: `plan` for every variant.
    """
    import time

    rows = results.setdefault("variants", {})
    results["variant_order"] = list(dict.fromkeys([*results.get("variant_order", []), *(v.name for v in variants)]))
    for v in variants:
        steps = point_steps(plan_of(v) if plan_of else plan, full_curve)
        if is_done(rows.get(v.name), v, recipe, steps):
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
        missing = [s for s in steps if not trained(v, s)]
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
    return results


# --- the report ---------------------------------------------------------------------------------------------------


def ordered_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured variant rows, in the order they were asked for (curve.json's keys are sorted)."""
    rows = results.get("variants") or {}
    names = [n for n in results.get("variant_order", []) if n in rows] + sorted(
        n for n in rows if n not in results.get("variant_order", []))
    return [rows[n] for n in names if "tau" in rows[n]]


def _seconds(s: float | None) -> str:
    return "–" if s is None else f"{s:.0f}"


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of highest τ (the first of equals)."""
    return max(rows, key=lambda r: r["tau"], default=None)


def versus(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """`row`'s τ minus `ref`'s with its paired standard error over the prompts' requests ("–" without counts)."""
    from mtp_train.speculative.metrics import paired_tau_difference

    a, b = last_requests(row), last_requests(ref or {})
    if ref is None or row is ref or not a or not b:
        return "–"
    diff, se = paired_tau_difference(a, b)
    return f"{diff:+.3f}" + ("" if se is None else f" ± {se:.3f}")


def variants_markdown(results: dict[str, Any]) -> str:
    """The variants table (empty string when none is measured): one row per variant at its last point, its τ with
    its standard error over requests, and its difference to the best row with the paired standard error."""
    rows = ordered_rows(results)
    if not rows:
        return ""
    k = int(results["eval"]["k"])
    pos = " / ".join(f"pos{j}" for j in range(k))
    best = best_row(rows)
    lines = ["| variant | head | overrides (after the recipe) | training tokens | step | τ ± SE | τ − best (paired SE) "
             f"| acceptance rate | {pos} | measured (s) |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tau = f"{r['tau']:.3f}" + (f" ± {r['tau_se']:.3f}" if r.get("tau_se") is not None else "")
        lines.append(f"| `{r['variant']}` | `{r['head']}` | `{' '.join(r['overrides'])}` | {r['tokens']} | "
                     f"{r['step']} | {tau} | {versus(r, best)} | {r['acceptance_rate']:.3f} | "
                     f"{' / '.join(f'{a:.3f}' for a in r['pos'])} | "
                     f"{_seconds(r.get('seconds'))} |")
    return ("\n## Variants (the recipe at the budget)\n\n"
            "Each variant trains one head on the same folder, batches, seed and budget as the heads above, with the "
            "recipe's overrides followed by its own (`bench/curve.py --variants NAME,...`), and is measured at the "
            "last point; SE is over the prompts' requests, the paired SE of a difference over the requests both "
            "answered (greedy: the same tokens).\n\n" + "\n".join(lines) + "\n" + seeds_markdown(rows))


def points_json(results: dict[str, Any]) -> dict[str, Any]:
    """docs/curve.json: per head, the curve's points (`curve`) and each variant's; the best τ at the budget.

    A point is {tokens, step, tau, pos}; `best_tau_512k` is the highest τ at the budget's step over the curve's
    heads (variant `curve`) and every variant, with the variant and head that reached it.
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
            # the measured rows in full, so that another checkout's run resumes from this file (see `seed`)
            "variant_order": results.get("variant_order", []),
            "variants": {r["variant"]: r for r in rows}}


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
