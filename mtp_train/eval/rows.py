"""The report rows of an evaluation: one per run against its baseline, one per grid point over all prompt sets,
prompt lookup's figures on every drafter's row, and the best row."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from mtp_train.eval.acceptance import RunResult
from mtp_train.eval.methods import LOOKUP
from mtp_train.eval.options import EvalPoint
from mtp_train.speculative.metrics import SpecMetrics


def exact_match(a: RunResult, b: RunResult) -> float:
    """Share of conversations whose every turn's tokens are identical in both runs."""
    same = [[o.output_ids for o in x] == [o.output_ids for o in y] for x, y in zip(a.answers, b.answers)]
    return sum(same) / len(same) if same else 1.0


def result_row(run: RunResult, base: RunResult) -> dict[str, Any]:
    """The report row of one run against its baseline."""
    m = run.metrics
    row: dict[str, Any] = {
        "dataset": run.dataset, **run.point.row_fields(),
        "prompts": len(run.answers), "generated_tokens": run.generated_tokens, "seconds": run.seconds,
        "tokens_per_s": run.tokens_per_s, "baseline_tokens_per_s": base.tokens_per_s,
        "speedup": run.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else 0.0,
        **speedup_interval([(run, base)]), **run.split,
    }
    if m is not None:
        row.update(metric_fields(m))
        row["step_cost"] = step_cost(row)
    if run.temperature == 0:
        row["exact_match"] = exact_match(run, base)
    return row


def metric_fields(m: SpecMetrics) -> dict[str, Any]:
    """A report row's speculative columns (τ, acceptance, per-position, counts, drafts verified per step)."""
    return {"tau": m.mean_acceptance_length, "acceptance_rate": m.acceptance_rate, "per_position": m.per_position,
            "num_drafts": m.num_drafts, "num_accepted": m.num_accepted, "mean_draft_len": m.mean_draft_length,
            "num_empty": m.num_empty, "num_alt_accepted": m.num_alt_accepted}


def step_cost(row: Mapping[str, Any]) -> float | None:
    """What one speculative step (draft → verify → catch-up) cost, in plain decode steps: τ / speed-up.

    Speed-up = τ / step cost, so this is also the break-even τ on this machine, and τ_x / step_cost predicts the
    speed-up of a head reaching τ_x with the same k (the step's cost barely depends on what gets accepted).
    """
    tau, speedup = row.get("tau"), row.get("speedup")
    return tau / speedup if tau is not None and speedup else None


def speedup_interval(pairs: Sequence[tuple[RunResult, RunResult]], resamples: int = 1000,
                     seed: int = 0) -> dict[str, float]:
    """`speedup_lo`, `speedup_hi`: the 95% bootstrap interval of the speed-up over the runs' paired chunks.

    Chunk i of a run and of its baseline answered the same conversations minutes apart (`evaluate` interleaves
    them), so resampling the chunk pairs (with replacement, seeded: the same report gives the same interval) and
    taking each resample's ratio of summed throughputs measures how much the speed-up depends on which prompts
    ran and on the machine's noise between them. {} when there are fewer than two chunk pairs.
    """
    chunks = [(r, b) for run, base in pairs for r, b in zip(run.chunks, base.chunks)]
    if len(chunks) < 2:
        return {}
    gen = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        pick = [chunks[gen.randrange(len(chunks))] for _ in chunks]
        secs, bsecs = sum(r[1] for r, _ in pick), sum(b[1] for _, b in pick)
        toks, btoks = sum(r[0] for r, _ in pick), sum(b[0] for _, b in pick)
        if secs > 0 and bsecs > 0 and btoks > 0:
            ratios.append((toks / secs) / (btoks / bsecs))
    if not ratios:
        return {}
    ratios.sort()
    return {"speedup_lo": ratios[int(0.025 * (len(ratios) - 1))], "speedup_hi": ratios[int(0.975 * (len(ratios) - 1))]}


def overall_rows(pairs: Sequence[tuple[RunResult, RunResult]]) -> list[dict[str, Any]]:
    """Per grid point, all prompt sets together: counts summed, tokens/s over the summed time."""
    groups: dict[EvalPoint, list[tuple[RunResult, RunResult]]] = {}
    for run, base in pairs:
        groups.setdefault(run.point, []).append((run, base))
    rows = []
    for point, items in groups.items():
        temp = point.temperature
        m = SpecMetrics(point.k)
        for run, _ in items:
            if run.metrics is not None:
                m.merge(run.metrics)
        tokens = sum(r.generated_tokens for r, _ in items)
        secs = sum(r.seconds for r, _ in items)
        btokens = sum(b.generated_tokens for _, b in items)
        bsecs = sum(b.seconds for _, b in items)
        tps, btps = tokens / secs if secs else 0.0, btokens / bsecs if bsecs else 0.0
        row: dict[str, Any] = {
            "dataset": "overall", **point.row_fields(),
            "prompts": sum(len(r.answers) for r, _ in items), "generated_tokens": tokens, "seconds": secs,
            "tokens_per_s": tps, "baseline_tokens_per_s": btps, "speedup": tps / btps if btps else 0.0,
            **speedup_interval(items), **metric_fields(m),
        }
        row["step_cost"] = step_cost(row)
        for key in ("prefill_seconds", "draft_seconds", "verify_seconds", "update_seconds"):
            row[key] = sum(r.split.get(key, 0.0) for r, _ in items)
        if temp == 0:
            n = sum(len(r.answers) for r, _ in items)
            row["exact_match"] = sum(exact_match(r, b) * len(r.answers) for r, b in items) / max(n, 1)
        rows.append(row)
    return rows


def attach_ngram(rows: Sequence[dict[str, Any]]) -> None:
    """Give every row of another method `tau_ngram` and `speedup_ngram`: prompt lookup's on the same prompt set, k
    and temperature of the same run (when it ran), the floor a trained drafter has to clear."""
    floor = {(r["dataset"], r["k"], r["temperature"]): r for r in rows if r["method"] == LOOKUP}
    for r in rows:
        ng = floor.get((r["dataset"], r["k"], r["temperature"]))
        if r["method"] != LOOKUP and ng is not None:
            r["tau_ngram"], r["speedup_ngram"] = ng.get("tau"), ng["speedup"]


def best_row(rows: Sequence[Mapping[str, Any]], temperature: float = 0.0) -> Mapping[str, Any] | None:
    """The overall row with the highest speed-up at `temperature` (None when there is none); prompt lookup's rows
    only when no other method ran (it is the comparison, not the candidate)."""
    cands = [r for r in rows if r["dataset"] == "overall" and r["temperature"] == temperature]
    drafters = [r for r in cands if r["method"] != LOOKUP]
    cands = drafters or cands
    return max(cands, key=lambda r: r["speedup"]) if cands else None
