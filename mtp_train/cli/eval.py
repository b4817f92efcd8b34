"""`mtp-eval`: speculative decoding through our engine on held-out prompts, measured against plain decoding.

    mtp-eval model=smollm2-135m head_ckpt=runs/train/heads/step-1000 prompts=[demo-heldout,mt-bench] k=4
    mtp-eval head_ckpt=DIR k=[1,2,3,4,5,6] temperature=[0,1] limit=20 max_new_tokens=128 out=runs/eval/grid
    mtp-eval method=draft draft_model=models/draft k=3 prompts=[data/demo_heldout.jsonl]
    mtp-eval backend=vllm model.path=models/granite head_ckpt=runs/train/heads/step-200 k=3   # measured in vLLM

Writes into `out`: report.json (one row per prompt set and grid point, plus "overall" rows and the best k at
temperature 0), report.md (the same as a table), outputs.jsonl (per prompt: each turn's token ids and text),
acceptance_per_position.png and tau_speedup_vs_k.png, and config.yaml. The methods are registered in
`mtp_train.eval.methods` (method=head, the default, runs a trained head of any type with its type's drafter, the
grid's axes those the drafter takes; method=mtp is its deprecated name), the grid is laid out (and every run
labelled) by `mtp_train.eval.options`; see `mtp_train.eval.acceptance` (the runs) and `mtp_train.eval.rows` (the
report's rows).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mtp_train.cli.common import (
    ensure_model,
    hydra_entry,
    load_target,
    save_config,
    to_dict,
)
from mtp_train.cli.outputs import claims_output
from mtp_train.config import EvalConfig, rank_device, typed
from mtp_train.data.prompts import PromptSet, load_prompt_sets
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import stop_token_ids
from mtp_train.eval.acceptance import RunResult, evaluate
from mtp_train.eval.methods import MethodSet
from mtp_train.eval.options import expand_grid
from mtp_train.eval.report import (
    check_earlier_report,
    markdown_table,
    output_records,
    plot,
    remove_stale_plots,
    write_jsonl,
)
from mtp_train.eval.rows import attach_ngram, best_row, overall_rows, result_row
from mtp_train.eval.vllm import evaluate_vllm
from mtp_train.fileio import atomic_write_text
from mtp_train.models.config import ModelConfigError
from mtp_train.models.foreign import foreign_dir, refusal

log = logging.getLogger(__name__)
PROG = "mtp-eval"


@claims_output(PROG)  # refuses a foreign `out`, then holds its lock
def eval_main(cfg: DictConfig) -> dict[str, Any]:
    """Run `mtp-eval` with a composed config; returns the report (also written to `<out>/report.json`)."""
    ec = typed(cfg, EvalConfig)  # the grid's values are checked here, before anything loads
    points = expand_grid(ec)  # an unknown method too
    for temperature in ec.grid("temperature"):  # the decoding values, as every run will take them
        SamplingParams(temperature=temperature, top_k=ec.top_k, top_p=ec.top_p, max_new_tokens=ec.max_new_tokens)
    prompt_sets = load_prompt_sets(list(ec.prompts), ec.limit)  # data errors before the model loads
    ensure_model(ec.model)
    if ec.backend == "vllm":
        return vllm_main(cfg, ec, prompt_sets)
    if foreign_dir(ec.model.path):
        raise ModelConfigError(refusal(ec.model.path, "backend=engine (our engine runs the target)"))
    target, tokenizer, target_dir = load_target(ec.model, rank_device(ec.model.device))
    methods = MethodSet.load(ec, target, tokenizer, target_dir, points)  # a bad option value fails here
    out = Path(ec.out)
    # Once every setting has passed (a bad value is named as such), before anything is written.
    check_earlier_report(out, to_dict(cfg), ec.overwrite)
    out.mkdir(parents=True, exist_ok=True)
    stop_ids = stop_token_ids(tokenizer, target.args.eos_token_ids, ec.chat_template_kwargs)
    ids = {ps.name: [c.id for c in ps.convs] for ps in prompt_sets}

    def on_result(run: RunResult, base: RunResult) -> None:
        r = result_row(run, base)
        log.info("%s %s: tau %.2f, acceptance %.2f, drafted %.2f/step, %.1f vs %.1f tok/s, speed-up %.2f",
                 r["dataset"], r["label"], r.get("tau", 1.0), r.get("acceptance_rate", 0.0),
                 r.get("mean_draft_len", 0.0), r["tokens_per_s"], r["baseline_tokens_per_s"], r["speedup"])

    pairs, baselines = evaluate(target, tokenizer, prompt_sets, points, methods, ec, stop_ids=stop_ids,
                                on_result=on_result)
    if pairs:
        rows = [result_row(run, base) for run, base in pairs]
        rows += overall_rows(pairs)
        attach_ngram(rows)
        outputs = [rec for run, _ in pairs for rec in output_records(run, tokenizer, ids[run.dataset])]
    else:  # method none: the plain runs themselves
        rows = [result_row(b, b) for b in baselines] + overall_rows([(b, b) for b in baselines])
        outputs = []
    outputs += [rec for b in baselines for rec in output_records(b, tokenizer, ids[b.dataset])]
    best = best_row(rows, 0.0) if pairs else None
    report = {"config": to_dict(cfg), "rows": rows, "best": best, "target": str(target_dir),
              "device": str(target.device), "dtype": str(target.dtype).replace("torch.", "")}
    # Saved with the report it describes: a run that fails before (a value refused mid-way) leaves both as they were.
    save_config(cfg, out / "config.yaml")
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    write_jsonl(out / "outputs.jsonl", outputs)
    table = markdown_table(rows)
    atomic_write_text(out / "report.md", f"# mtp-eval: {ec.method}\n\n{table}\n")
    files = plot(rows, out) if ec.plots and pairs else []
    remove_stale_plots(out, files)
    print(table, flush=True)
    if best is not None:
        floor = (f" (prompt lookup: tau {best['tau_ngram']:.2f}, speed-up {best['speedup_ngram']:.2f})"
                 if "tau_ngram" in best else "")
        print(f"{PROG}: best at T=0: {best['label']} (k={best['k']}) tau {best['tau']:.2f} speed-up "
              f"{best['speedup']:.2f}{floor} → {out}/report.json", flush=True)
    log.info("wrote %s", ", ".join(str(p) for p in [out / "report.json", out / "outputs.jsonl", *files]))
    return report


def vllm_main(cfg: DictConfig, ec: EvalConfig, prompt_sets: list[PromptSet]) -> dict[str, Any]:
    """`backend=vllm`: the head exported and measured inside vLLM (`mtp_train.eval.vllm`); the same files."""
    out = Path(ec.out)
    check_earlier_report(out, to_dict(cfg), ec.overwrite)  # before the export is written into it
    out.mkdir(parents=True, exist_ok=True)
    rows, outputs = evaluate_vllm(ec, prompt_sets, environ=dict(os.environ))
    report = {"config": to_dict(cfg), "rows": rows, "best": None, "target": str(ec.model.path), "backend": "vllm",
              "export": str(out / "export")}
    save_config(cfg, out / "config.yaml")
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    write_jsonl(out / "outputs.jsonl", outputs)
    table = markdown_table(rows)
    atomic_write_text(out / "report.md", f"# mtp-eval: {ec.method} in vLLM\n\n{table}\n")
    remove_stale_plots(out, [])  # vLLM's one point has no plots
    print(table, flush=True)
    last = rows[-1]
    print(f"{PROG}: vLLM {last.get('vllm_version')}: {last['label']} (k={last['k']}) tau {last.get('tau', 1.0):.2f}, "
          f"acceptance {last.get('acceptance_rate', 0.0):.2f} over {last.get('num_drafts', 0)} drafts → "
          f"{out}/report.json", flush=True)
    return report


main = hydra_entry(PROG, "eval", eval_main)

if __name__ == "__main__":
    main()
