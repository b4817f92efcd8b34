"""The norm ablation: the RMSNorm-restored `mtp` head against the original `eagle1` head, same everything else.

Both heads train with the `+experiment=ablation_norms` recipe (conf/experiment/ablation_norms.yaml: budget,
schedule, loss.steps=2, seed, evaluation) on the same precompute folder, one after the other in this process,
into `<out>/mtp` and `<out>/eagle1`. The folder is `--data-dir` when given, else a small one made in a temp dir
as bench/train.py makes it (regenerated SmolLM2 conversations when present, random tokens otherwise).

Then each run's `metrics.jsonl` (one JSON object per logged step; the evaluation rows carry
eval/step{j}/{loss,top1,...}) is read back and a side-by-side Markdown table is printed: per eval step and
unrolled draft step j, the val loss and top-1 of both heads. It is also written to `<out>/ablation.md`, with a
JSON summary in `<out>/ablation.json`.

Usage: python -m bench.ablation_norms [--data-dir DIR] [--out runs/ablation_norms] [--steps N] [key=value ...]
--steps N sets train.max_steps=N and scales train.eval_every to keep the recipe's number of evaluations.
The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_MODEL, REGEN_DATA, ROOT, compose_train, make_precompute, parser, report

EXPERIMENT = "ablation_norms"
HEADS = ("mtp", "eagle1")


def read_evals(run_dir: Path) -> dict[int, dict[str, float]]:
    """The eval/... values of a run's metrics.jsonl, by optimizer step (steps without evaluation left out)."""
    evals: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        values = {k: v for k, v in row.items() if k.startswith(("eval/", "spec/"))}
        if values:
            evals.setdefault(int(row["step"]), {}).update(values)
    return evals


def _fmt(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_table(evals: dict[str, dict[int, dict[str, float]]], draft_steps: int) -> str:
    """Per eval step and draft step j: val loss and top-1 of each head side by side, the top-1 difference, and
    (on the j = 0 line) τ of greedy speculative decoding on held-out prompts (spec_eval, k as configured)."""
    a, b = HEADS
    header = (f"| step | j | val loss {a} | val loss {b} | top-1 {a} | top-1 {b} | Δ top-1 ({a} − {b}) | τ {a} | "
              f"τ {b} |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [header]
    for step in sorted(set(evals[a]) | set(evals[b])):
        for j in range(draft_steps):
            la, lb = (evals[h].get(step, {}).get(f"eval/step{j}/loss") for h in HEADS)
            ta, tb = (evals[h].get(step, {}).get(f"eval/step{j}/top1") for h in HEADS)
            delta = None if ta is None or tb is None else ta - tb
            tau = [evals[h].get(step, {}).get("spec/tau") if j == 0 else None for h in HEADS]
            lines.append(f"| {step} | {j} | {_fmt(la, 4)} | {_fmt(lb, 4)} | {_fmt(ta, 3)} | {_fmt(tb, 3)} | "
                         f"{'–' if delta is None else f'{delta:+.3f}'} | {_fmt(tau[0], 2)} | {_fmt(tau[1], 2)} |")
    return "\n".join(lines)


def scaled_budget(steps: int | None) -> list[str]:
    """Overrides for `--steps`: max_steps=steps, eval_every scaled to keep the recipe's number of evaluations."""
    if steps is None:
        return []
    recipe = compose_train([], experiment=EXPERIMENT).train
    evals = max(1, int(recipe.max_steps) // max(1, int(recipe.eval_every)))
    return [f"train.max_steps={steps}", f"train.eval_every={max(1, steps // evals)}"]


def run_ablation(data_dir: Path, data_name: str | None, out: Path, model: str, extra: list[str]) -> dict[str, Any]:
    """Train every head of HEADS with the recipe into out/<head>; returns {head: (final metrics, wall seconds)}."""
    from mtp_train.cli.train import train_main

    runs: dict[str, Any] = {}
    for head in HEADS:
        overrides = [f"model.path={model}", f"head={head}", f"data.dir={data_dir}", f"out={out / head}",
                     *([f"data.name={data_name}"] if data_name else []), *extra]
        t0 = time.perf_counter()
        result = train_main(compose_train(overrides, experiment=EXPERIMENT))
        runs[head] = {"result": result, "wall_s": time.perf_counter() - t0, "overrides": overrides}
        print(f"{head}: {runs[head]['wall_s']:.0f}s", flush=True)
    return runs


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--data-dir", default=None, help="precompute folder of the target (made here when omitted)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--data", default=str(REGEN_DATA), help="conversations for the folder made here")
    ap.add_argument("--limit", type=int, default=16, help="conversations for the folder made here")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "runs" / "ablation_norms"))
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the recipe's)")
    ap.add_argument("overrides", nargs="*", help="more mtp-train overrides for both runs, key=value")
    args = ap.parse_args(argv)
    from mtp_train.cli.common import configure_from_env

    configure_from_env()  # MTP_TRAIN_CPU_KERNELS, MTP_TRAIN_KERNEL_DIR, CC, as the commands read them
    out = Path(args.out)
    extra = scaled_budget(args.steps) + list(args.overrides)

    with tempfile.TemporaryDirectory() as tmp:
        if args.data_dir:
            data_dir, kind, name = Path(args.data_dir), f"folder:{args.data_dir}", None
        else:
            data_dir = Path(tmp) / "pc"
            t0 = time.perf_counter()
            kind, name = make_precompute(args.model, data_dir, args.data, args.limit, args.max_seq_len)
            print(f"precompute ({kind}): {time.perf_counter() - t0:.1f}s", flush=True)
        runs = run_ablation(data_dir, name, out, args.model, extra)

    cfg = compose_train([], experiment=EXPERIMENT)
    draft_steps = int(cfg.loss.steps)
    for item in extra:  # a loss.steps override changes the table's width
        if item.startswith("loss.steps="):
            draft_steps = int(item.split("=", 1)[1])
    evals = {head: read_evals(out / head) for head in HEADS}
    table = markdown_table(evals, draft_steps)
    (out / "ablation.md").write_text(f"# Norm ablation ({', '.join(HEADS)}), data: {kind}\n\n{table}\n")
    print(table, flush=True)
    final_step = max(max(evals[h], default=0) for h in HEADS)
    summary: dict[str, Any] = {
        "experiment": EXPERIMENT, "data": kind, "out": str(out), "extra_overrides": extra, "draft_steps": draft_steps,
        "final_step": final_step,
        "heads": {h: {"wall_s": runs[h]["wall_s"], "head_dir": runs[h]["result"].get("head_dir"),
                      "evals": {str(s): v for s, v in sorted(evals[h].items())}} for h in HEADS},
    }
    for h in HEADS:
        last = evals[h].get(final_step, {})
        for j in range(draft_steps):
            summary[f"{h}_step{j}_val_loss"] = last.get(f"eval/step{j}/loss")
            summary[f"{h}_step{j}_top1"] = last.get(f"eval/step{j}/top1")
        summary[f"{h}_tau"] = last.get("spec/tau")
    (out / "ablation.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    report({k: v for k, v in summary.items() if k != "heads"})
    return summary


if __name__ == "__main__":
    main()
