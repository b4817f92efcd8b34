"""Write an evaluation's results: report.json, outputs.jsonl, report.md and PNG plots, each atomically; and judge
an earlier evaluation's report found in `out` before any of them is replaced (`check_earlier_report`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mtp_train.config.errors import ConfigError
from mtp_train.engine.turns import answer_text
from mtp_train.eval.acceptance import RunResult
from mtp_train.eval.methods import method_spec
from mtp_train.fileio import atomic_write, atomic_write_text

REPORT = "report.json"
PLOTS = ("acceptance_per_position.png", "tau_speedup_vs_k.png")
# Settings that change how a run shows itself, not what it measures: a re-run differing only in them replaces the
# report as one of the same settings does.
PRESENTATION = ("out", "overwrite", "progress", "plots")

# The table's columns around the methods' own option columns (each method's axes beyond k and temperature).
LEADING = ("dataset", "method", "k")
TRAILING = ("temperature", "tau", "mean_draft_len", "acceptance_rate", "tokens_per_s", "baseline_tokens_per_s",
            "speedup", "speedup_lo", "speedup_hi", "step_cost", "tau_ngram", "speedup_ngram", "exact_match")


def columns(rows: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The table's columns: the leading ones, every option axis of the rows' methods (in their order), the rest."""
    options: list[str] = []
    for r in rows:
        for a in method_spec(r["method"]).axis_names:
            if a not in ("k", "temperature") and a not in options:
                options.append(a)
    return (*LEADING, *options, *TRAILING)


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
    cols = columns(rows)
    head = "| " + " | ".join(cols) + " |\n|" + "|".join("---" if c in ("dataset", "method") else "---:"
                                                       for c in cols) + "|"
    lines = [head] + ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
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
    for fig, name in zip((per_position_figure(rows), vs_k_figure(rows)), PLOTS):
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
    """Acceptance by draft position (integer ticks), one line per grid point (its label)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in sorted(overall_rows_of(rows), key=lambda r: (r["series"], r["k"])):
        pos = r["per_position"]
        ax.plot(range(1, len(pos) + 1), pos, marker="o", label=r["label"])
    _integer_ticks(ax)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (share of steps reaching it)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def vs_k_figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Against k (integer ticks), one line per series (`plot_series`): τ with the step cost beside it (the τ a
    method needs to break even: a point above its cost pays), and the speed-up over plain decoding with its 95%
    interval as error bars (`speedup_lo` / `speedup_hi`, where the report has them)."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    for label, rs in plot_series(rows).items():
        ks = [r["k"] for r in rs]
        (line,) = a1.plot(ks, [r["tau"] for r in rs], marker="o", label=label)
        if all(r.get("step_cost") is not None for r in rs):
            a1.plot(ks, [r["step_cost"] for r in rs], marker="x", ls=":", color=line.get_color(), label="_cost")
        sp = [r["speedup"] for r in rs]
        if all(r.get("speedup_lo") is not None and r.get("speedup_hi") is not None for r in rs):
            err = [[s - r["speedup_lo"] for s, r in zip(sp, rs)], [r["speedup_hi"] - s for s, r in zip(sp, rs)]]
            a2.errorbar(ks, sp, yerr=err, marker="o", capsize=3, label=label)
        else:
            a2.plot(ks, sp, marker="o", label=label)
    a1.set_xlabel("k")
    a1.set_ylabel("τ (o) and step cost (x, dotted)")
    a2.set_xlabel("k")
    a2.set_ylabel("speed-up vs none [95%]")
    a2.axhline(1.0, color="grey", lw=0.8, ls="--")
    for a in (a1, a2):
        _integer_ticks(a)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _integer_ticks(ax: Any) -> None:
    """Ticks on whole numbers only on the x axis (k, a draft position): never k = 1.2."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return path


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys → values (`model.path`, `ngram.n_max`, ...)."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def settings_changed(earlier: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """What differs between an earlier evaluation's resolved config and this run's, in words (`k 4, this run 3`),
    PRESENTATION keys aside. A key only one of them has (a setting added or removed between versions) is not
    compared: there is nothing to compare it with.

    Args:
        earlier: the resolved config the earlier report records.
        config: this run's resolved config.
    """
    old, new = _flat(earlier), _flat(config)
    return [f"{key} {old[key]}, this run {new[key]}" for key in new
            if key in old and key.split(".")[0] not in PRESENTATION and old[key] != new[key]]


def check_earlier_report(out: Path, config: Mapping[str, Any], overwrite: bool) -> None:
    """Refuse (ConfigError) to replace the report of an evaluation of other settings that `out` holds, naming what
    differs; a re-run of the same settings measures again and replaces it, and `overwrite=true` replaces any.

    The earlier settings are read from the report itself (the resolved config it records): config.yaml is saved with
    it, but a folder whose report.json is missing holds no finished evaluation to keep.

    Args:
        out: the evaluation's output folder (`mtp_train.cli.outputs.check_output` has found it mtp-eval's or new).
        config: this run's resolved config (`mtp_train.cli.common.to_dict`).
        overwrite: the run's `overwrite`.
    """
    report = out / REPORT
    if overwrite or not (report.is_file() or report.is_symlink()):
        return
    try:
        earlier = None if report.is_symlink() else json.loads(report.read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError, AttributeError):
        earlier = None
    if not isinstance(earlier, Mapping):
        raise ConfigError(f"{report}: not a report mtp-eval can read (no `config` in it), so it cannot tell whether "
                          "this run measures the same: choose another `out`, or pass overwrite=true to replace it")
    changed = settings_changed(earlier, config)
    if changed:
        more = f"; and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ConfigError(f"out={out} holds the report of an evaluation of other settings ({'; '.join(changed[:3])}"
                          f"{more}): mtp-eval replaces only a report of the same settings; choose another `out`, or "
                          "pass overwrite=true to replace it")


def remove_stale_plots(out: Path, written: Sequence[Path]) -> None:
    """Remove the plots an earlier run left in `out` that this one did not write (`plots=false`, or no drafting
    method): they would show the replaced report's figures beside the new one.

    Args:
        out: the evaluation's output folder.
        written: the plot files this run wrote there (`plot`'s answer).
    """
    for name in PLOTS:
        if out / name not in written:
            (out / name).unlink(missing_ok=True)
