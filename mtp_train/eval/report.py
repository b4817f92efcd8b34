"""Write an evaluation's results: report.json, outputs.jsonl, report.md and PNG plots, each atomically."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mtp_train.engine.turns import answer_text
from mtp_train.eval.acceptance import RunResult
from mtp_train.fileio import atomic_write, atomic_write_text

COLUMNS = ("dataset", "method", "k", "draft_threshold", "catch_up", "draft_width", "tree", "temperature", "tau",
           "mean_draft_len", "acceptance_rate", "tokens_per_s", "baseline_tokens_per_s", "speedup", "speedup_lo",
           "speedup_hi", "step_cost", "tau_ngram",
           "speedup_ngram", "exact_match")


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per row: τ, drafts verified per step, acceptance rate, tokens/s (ours, plain), speed-up, step cost,
    prompt lookup's τ and speed-up on the same prompts, exact match (temperature 0).

    step_cost: one speculative step in plain decode steps (τ / speed-up), i.e. the τ at which the method breaks even.
    """
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "|".join("---" if c in ("dataset", "method") else "---:"
                                                          for c in COLUMNS) + "|"
    lines = [head] + ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def output_records(run: RunResult, tokenizer: Any, ids: Sequence[str]) -> list[dict[str, Any]]:
    """outputs.jsonl records of one run: per conversation, the generated token ids and text of every turn (the
    text as the next turn's prompt carried it: `mtp_train.engine.turns.answer_text`)."""
    return [{"dataset": run.dataset, "id": cid, "method": run.method, "k": run.k, "temperature": run.temperature,
             **run.point.options, "label": run.point.label,
             "turns": [{"prompt_tokens": len(o.prompt_ids), "output_ids": o.output_ids,
                        "text": answer_text(tokenizer, o), "finish_reason": o.finish_reason} for o in turns]}
            for cid, turns in zip(ids, run.answers)]


def write_jsonl(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def plot(rows: Sequence[Mapping[str, Any]], out: Path) -> list[Path]:
    """acceptance_per_position.png and tau_speedup_vs_k.png from the overall rows; returns the files written."""
    plt = _pyplot()
    if not overall_rows_of(rows):
        return []
    written = []
    for fig, name in ((per_position_figure(rows), "acceptance_per_position.png"),
                      (vs_k_figure(rows), "tau_speedup_vs_k.png")):
        written.append(_save(fig, out / name))
        plt.close(fig)
    return written


def overall_rows_of(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows the plots show: all prompt sets together, of methods that draft (they have a τ)."""
    return [r for r in rows if r["dataset"] == "overall" and "tau" in r]


def plot_series(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """The lines of the τ / speed-up vs k plot: each row's `series` (its label without k, so every other axis
    that varies, draft_width and temperature included, gives a line of its own) → its rows by k."""
    series: dict[str, list[Mapping[str, Any]]] = {}
    for r in overall_rows_of(rows):
        series.setdefault(r["series"], []).append(r)
    return {name: sorted(rs, key=lambda r: r["k"]) for name, rs in sorted(series.items())}


def per_position_figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Acceptance by draft position, one line per grid point (its label)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in sorted(overall_rows_of(rows), key=lambda r: (r["series"], r["k"])):
        pos = r["per_position"]
        ax.plot(range(1, len(pos) + 1), pos, marker="o", label=r["label"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (share of steps reaching it)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def vs_k_figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """τ (left) and speed-up over plain decoding (right) against k, one line per series (`plot_series`)."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, rs in plot_series(rows).items():
        a1.plot([r["k"] for r in rs], [r["tau"] for r in rs], marker="o", label=label)
        a2.plot([r["k"] for r in rs], [r["speedup"] for r in rs], marker="o", label=label)
    a1.set_xlabel("k")
    a1.set_ylabel("mean acceptance length τ")
    a2.set_xlabel("k")
    a2.set_ylabel("speed-up vs none")
    a2.axhline(1.0, color="grey", lw=0.8, ls="--")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return path
