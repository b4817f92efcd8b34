"""The learning curve's report: fits, the Markdown table, the plot (bench.curve.run writes them from curve.json).

A point is {tokens, step, tau, pos, ...}; `results` is curve.json (heads → points by step, prompt lookup, the
recipe and evaluation settings); docs/curve.json is bench.curve.record's.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from bench.curve.record import write_points_json
from bench.curve.seeds import last_requests, seeds_markdown
from bench.curve.variants import ordered_rows

TAU_GOAL = 2.0  # the τ the fits extrapolate to


def log_fit(points: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Least squares τ = a + b·log2(tokens) over the points; (a, b) (b: τ gained per doubling), None if < 2."""
    xs = [math.log2(p["tokens"]) for p in points]
    ys = [p["tau"] for p in points]
    if len(xs) < 2 or max(xs) == min(xs):
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def tokens_for_tau(fit: tuple[float, float] | None, tau: float = TAU_GOAL) -> float | None:
    """Where the log-linear fit reaches τ (an extrapolation); None when it does not rise."""
    if fit is None or fit[1] <= 0:
        return None
    return 2.0 ** ((tau - fit[0]) / fit[1])


def fmt_tokens(n: float) -> str:
    """A token count in binary units: 16k, 1.5M, ...; scientific beyond 1000T."""
    if n >= 1000 * (1 << 50):
        return f"{n:.2g}"
    for unit, scale in (("T", 1 << 50), ("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def head_order(results: dict[str, Any]) -> list[str]:
    """The measured heads in the config's order (curve.json's keys are sorted)."""
    heads = results["heads"]
    first = [h for h in results.get("head_order", []) if h in heads]
    return first + sorted(h for h in heads if h not in first)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per head: the last point, the slope per doubling (all points and the upper half), the crossing count."""
    heads = {h: sorted(results["heads"][h]["points"].values(), key=lambda p: p["tokens"]) for h in head_order(results)}
    out: dict[str, Any] = {}
    for h, pts in heads.items():
        if not pts:
            continue
        upper = pts[len(pts) // 2:] if len(pts) >= 4 else pts
        fit_all, fit_upper = log_fit(pts), log_fit(upper)
        out[h] = {"last_tokens": pts[-1]["tokens"], "last_tau": pts[-1]["tau"],
                  "slope_per_doubling": fit_all[1] if fit_all else None,
                  "slope_per_doubling_upper": fit_upper[1] if fit_upper else None,
                  "upper_from_tokens": upper[0]["tokens"],
                  "tokens_for_tau_goal": tokens_for_tau(fit_upper)}
    names = [h for h in heads if heads[h]]
    if len(names) >= 2:
        a, b = names[:2]
        by_step = {p["step"]: p["tau"] for p in heads[b]}
        diffs = [p["tau"] - by_step[p["step"]] for p in heads[a] if p["step"] in by_step]
        signs = [d > 0 for d in diffs if d != 0]
        out["pair"] = {"heads": [a, b], "crossings": sum(x != y for x, y in zip(signs, signs[1:])),
                       "last_diff": diffs[-1] if diffs else None, "diffs": diffs}
    return out


def markdown_table(results: dict[str, Any]) -> str:
    """tokens × head → τ and per-position acceptance; prompt lookup as the last row."""
    heads = [h for h in head_order(results) if results["heads"][h]["points"]]
    k = int(results["eval"]["k"])
    pos = " / ".join(f"pos{j}" for j in range(k))
    header = "| training tokens | step | " + " | ".join(f"τ `{h}` | {pos} `{h}`" for h in heads) + " |"
    lines = [header, "|---:|---:|" + "---:|---:|" * len(heads)]
    steps = sorted({p["step"] for h in heads for p in results["heads"][h]["points"].values()})
    for step in steps:
        cells, tokens = [], None
        for h in heads:
            p = results["heads"][h]["points"].get(str(step))
            if p is None:
                cells += ["–", "–"]
                continue
            tokens = p["tokens"]
            cells += [f"{p['tau']:.3f}", " / ".join(f"{a:.3f}" for a in p["pos"])]
        lines.append(f"| {fmt_tokens(tokens or 0)} ({tokens}) | {step} | " + " | ".join(cells) + " |")
    ng = results.get("ngram")
    if ng:
        cells = [f"{ng['tau']:.3f}", " / ".join(f"{a:.3f}" for a in ng["pos"])] + [""] * (2 * len(heads) - 2)
        lines.append(f"| prompt lookup (n = {ng['n_min']}..{ng['n_max']}, no training) | – | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def fits_text(summary: dict[str, Any]) -> str:
    lines = []
    for h, s in summary.items():
        if h == "pair":
            continue
        slope = s["slope_per_doubling"]
        upper = s["slope_per_doubling_upper"]
        need = s["tokens_for_tau_goal"]
        lines.append(
            f"- `{h}`: τ {s['last_tau']:.3f} at {fmt_tokens(s['last_tokens'])} tokens; τ per doubling of the tokens "
            f"{'–' if slope is None else f'{slope:+.3f}'} over all points, "
            f"{'–' if upper is None else f'{upper:+.3f}'} from {fmt_tokens(s['upper_from_tokens'])} on; "
            + (f"extrapolated (log-linear from {fmt_tokens(s['upper_from_tokens'])} on) to τ {TAU_GOAL}: "
               f"~{fmt_tokens(need)} tokens" if need else f"no rising trend to extrapolate to τ {TAU_GOAL}") + ".")
    pair = summary.get("pair")
    if pair and pair["last_diff"] is not None:
        a, b = pair["heads"]
        lines.append(f"- `{a}` − `{b}` at the last point: {pair['last_diff']:+.3f} τ; the curves cross "
                     f"{pair['crossings']} time(s) over the points.")
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    summary = summarize(results)
    ev = results["eval"]
    skipped = "".join(f"\n- `{h}` skipped: {why}" for h, why in results.get("skipped", {}).items())
    return (f"# Learning curve: τ against training tokens\n\n"
            f"Command: `{results['command']}`\n\n"
            f"- Data: {results['data']} (`{results['data_dir']}`)"
            + (f"; {results['data_dirs_note']}" if results.get("data_dirs_note") else "") + "\n"
            f"- Recipe (every head, one run each to {fmt_tokens(results['budget_tokens'])} tokens = "
            f"{results['max_steps']} steps): `{' '.join(results['recipe'])}`\n"
            f"- Evaluation at each point: greedy speculative decoding through the engine, k = {ev['k']}, "
            f"{ev['limit']} conversations of {', '.join(ev['prompts'])}, at most {ev['max_new_tokens']} new tokens "
            f"per turn, batch {ev['batch_size']}; τ = mean tokens per verify step, posj = acceptance at draft "
            f"position j.\n"
            f"- Training tokens = packed rows (prompt and answer tokens) the head has trained on; the smaller "
            f"points are exports of the same run mid-way through its schedule.{skipped}\n\n"
            + (f"{markdown_table(results)}\n\n## Fits (computed)\n\n{fits_text(summary)}\n"
               if any(rec.get("points") for rec in results["heads"].values()) else
               "No head trained on the shared recipe alone: the curve's rows are its variants (below).\n"))


def plot(results: dict[str, Any], path: Path) -> None:
    """τ (left) and per-position acceptance (right) against training tokens, log x axis, of the heads and the
    variants measured at several points; prompt lookup dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    # the curve's heads, then the variants measured at several points (--full-curve), each with its own colour
    curves = [(h, results["heads"][h]["points"]) for h in head_order(results)]
    curves += [(r["variant"], r["points"]) for r in ordered_rows(results) if len(r.get("points") or {}) > 1]
    for i, (h, points) in enumerate(curves):
        pts = sorted(points.values(), key=lambda p: p["tokens"])
        if not pts:
            continue
        xs = [p["tokens"] for p in pts]
        ax.plot(xs, [p["tau"] for p in pts], "o-", color=colors[i % len(colors)], label=h)
        for j in range(len(pts[0]["pos"])):
            ax2.plot(xs, [p["pos"][j] for p in pts], marker="o", ms=3, ls=styles[j % len(styles)],
                     color=colors[i % len(colors)], label=f"{h} pos{j}")
    ng = results.get("ngram")
    if ng:
        ax.axhline(ng["tau"], color="gray", ls="--", label=f"prompt lookup (n ≤ {ng['n_max']})")
        for j, a in enumerate(ng["pos"]):
            ax2.axhline(a, color="gray", ls=styles[j % len(styles)], lw=0.8,
                        label="prompt lookup pos0..2" if j == 0 else None)
    k = results["eval"]["k"]
    ax.set(xscale="log", xlabel="training tokens", ylabel=f"τ (tokens per verify step, k = {k})",
           title=f"τ on {', '.join(results['eval']['prompts'])}, greedy")
    ax2.set(xscale="log", xlabel="training tokens", ylabel="acceptance at draft position j",
            title="per-position acceptance")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.grid(True, which="both", alpha=0.3)
        a.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: fmt_tokens(x)))
    if ax.get_legend_handles_labels()[0]:  # nothing measured yet: no legend
        ax.legend(loc="upper left")
        ax2.legend(loc="upper left", fontsize=7, ncol=2, handlelength=3.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the variants' table -------------------------------------------------------------------------------------


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


def _tau(tau: float, se: float | None) -> str:
    return f"{tau:.3f}" + ("" if se is None else f" ± {se:.3f}")


def variants_markdown(results: dict[str, Any]) -> str:
    """The variants table (empty string when none is measured): one row per variant at its last point, its τ with
    its standard error over requests, and its difference to the best row with the paired standard error; with
    "best k" columns (the k of highest τ at the last point, and that τ ± SE) when a row holds a k grid."""
    rows = ordered_rows(results)
    if not rows:
        return ""
    k = int(results["eval"]["k"])
    pos = " / ".join(f"pos{j}" for j in range(k))
    best = best_row(rows)
    grids = any(r.get("k_grid") for r in rows)
    lines = ["| variant | head | overrides (after the recipe) | training tokens | step | τ ± SE | τ − best (paired SE) "
             f"| acceptance rate | {pos} | measured (s) |" + (" best k | τ at best k ± SE |" if grids else ""),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if grids else "")]
    for r in rows:
        g = r.get("k_grid") or {}
        best_k = "" if not grids else (f" {g['best_k']} | {_tau(g['best_tau'], g.get('best_tau_se'))} |" if g
                                       else " – | – |")
        lines.append(f"| `{r['variant']}` | `{r['head']}` | `{' '.join(r['overrides'])}` | {r['tokens']} | "
                     f"{r['step']} | {_tau(r['tau'], r.get('tau_se'))} | {versus(r, best)} | "
                     f"{r['acceptance_rate']:.3f} | {' / '.join(f'{a:.3f}' for a in r['pos'])} | "
                     f"{_seconds(r.get('seconds'))} |" + best_k)
    return ("\n## Variants (the recipe at the budget)\n\n"
            "Each variant trains one head on the same folder, batches, seed and budget as the heads above, with the "
            "recipe's overrides followed by its own (`python -m bench.curve --variants NAME,...`), and is measured at "
            "the last point; SE is over the prompts' requests, the paired SE of a difference over the requests both "
            "answered (greedy: the same tokens).\n\n" + "\n".join(lines) + "\n" + variant_points_markdown(rows)
            + k_grid_markdown(results) + seeds_markdown(rows))


def variant_points_markdown(rows: list[dict[str, Any]]) -> str:
    """τ ± SE of the variants measured at more than one point (--full-curve), training tokens × variant; empty
    when none is. A variant batched otherwise reaches the points at other steps: the rows are the token points."""
    curves = [r for r in rows if len(r.get("points") or {}) > 1]
    if not curves:
        return ""
    # the i-th point of each run is the plan's i-th: its tokens within one batch of the others' (a variant that
    # batches otherwise reaches it at another step)
    lines = ["| training tokens | " + " | ".join(f"τ ± SE `{r['variant']}`" for r in curves) + " |",
             "|---:|" + "---:|" * len(curves)]
    order = {r["variant"]: sorted(r["points"].values(), key=lambda p: p["tokens"]) for r in curves}
    for i in range(max(len(ps) for ps in order.values())):
        cells, tokens = [], []
        for r in curves:
            ps = order[r["variant"]]
            if i < len(ps):
                tokens.append(int(ps[i]["tokens"]))
                cells.append(_tau(ps[i]["tau"], ps[i].get("tau_se")))
            else:
                cells.append("–")
        lo, hi = min(tokens), max(tokens)
        label = fmt_tokens(lo) if lo == hi else f"{fmt_tokens(lo)}–{fmt_tokens(hi)}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return ("\n### Variants at every point\n\nτ at k = the curve's k (± its SE over requests), point by point (the "
            "i-th export of each run; its training tokens within one batch of the point's).\n\n"
            + "\n".join(lines) + "\n")


def k_grid_rows(results: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, head, k grid) of every head of the curve and every variant that holds one, in the report's order."""
    out = [(f"{h} (curve)", h, results["heads"][h]["k_grid"]) for h in head_order(results)
           if (results["heads"][h] or {}).get("k_grid")] if results.get("heads") else []
    return out + [(r["variant"], r["head"], r["k_grid"]) for r in ordered_rows(results) if r.get("k_grid")]


def k_grid_markdown(results: dict[str, Any]) -> str:
    """τ ± SE at each k of the grids measured at the last point, the best k marked; empty without grids."""
    rows = k_grid_rows(results)
    if not rows:
        return ""
    ks = sorted({int(k) for _, _, g in rows for k in g["by_k"]})
    lines = ["| head / variant | head type | training tokens | " + " | ".join(f"k = {k}" for k in ks)
             + " | best k | τ at best k ± SE |", "|---|---|---:|" + "---:|" * len(ks) + "---:|---:|"]
    for name, head, g in rows:
        cells = []
        for k in ks:
            e = g["by_k"].get(str(k))
            cell = "–" if e is None else _tau(e["tau"], e.get("tau_se"))
            cells.append(f"**{cell}**" if e is not None and k == g["best_k"] else cell)
        lines.append(f"| `{name}` | `{head}` | {fmt_tokens(g['tokens'])} | " + " | ".join(cells)
                     + f" | {g['best_k']} | {_tau(g['best_tau'], g.get('best_tau_se'))} |")
    return ("\n### τ at each k (the last point): the head's own best k\n\n"
            "Greedy τ (± its SE over requests) with k drafts per verify step; a block drafter drafts at most its "
            "block's slots whatever k is, so its grid stops there (– where a k was not measured). Bold: the best "
            "k, the highest τ (the smallest k of equals).\n\n" + "\n".join(lines) + "\n")


def write_report(results: dict[str, Any], out: Path, doc: Path | None = None, png: Path | None = None) -> str:
    from mtp_train.fileio import atomic_write_text

    text = markdown(results) + variants_markdown(results)
    atomic_write_text(out / "curve.md", text)
    plot(results, out / "curve.png")
    if doc is not None:
        doc.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(doc, text)
        write_points_json(results, doc.with_suffix(".json"))
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "curve.png", png)
    return text
