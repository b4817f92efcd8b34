"""`mtp-eval`: speculative decoding through our engine on held-out prompts, measured against plain decoding.

    mtp-eval model=smollm2-135m head_ckpt=runs/train/heads/step-1000 prompts=[demo-heldout,mt-bench] k=4
    mtp-eval head_ckpt=DIR k=[1,2,3,4,5,6] temperature=[0,1] limit=20 max_new_tokens=128 out=runs/eval/grid
    mtp-eval method=draft draft_model=models/draft k=3 prompts=[data/demo_heldout.jsonl]

Writes into `out`: report.json (one row per prompt set and grid point, plus "overall" rows and the best k at
temperature 0), report.md (the same as a table), outputs.jsonl (per prompt: each turn's token ids and text),
acceptance_per_position.png and tau_speedup_vs_k.png, and config.yaml. See `mtp_train.eval.acceptance` (the runs)
and `mtp_train.eval.rows` (the report's rows).
"""

from __future__ import annotations

import json
import logging
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
from mtp_train.config import EvalConfig, rank_device, typed
from mtp_train.data.chat import load_tokenizer, tokenizer_fingerprint
from mtp_train.data.prompts import load_prompt_sets
from mtp_train.engine.turns import stop_token_ids
from mtp_train.eval.acceptance import Method, evaluate
from mtp_train.eval.report import markdown_table, output_records, plot, write_jsonl
from mtp_train.eval.rows import attach_ngram, best_row, overall_rows, result_row
from mtp_train.fileio import atomic_write_text
from mtp_train.models.config import ModelConfigError
from mtp_train.speculative.engine import METHODS
from mtp_train.speculative.proposers import DraftModelProposer, HeadProposer, NgramProposer

log = logging.getLogger(__name__)
PROG = "mtp-eval"


def make_proposers(cfg: EvalConfig, target: Any, tokenizer: Any, target_dir: Path) -> list[Method]:
    """The methods of the grid (each a factory of fresh proposers); [] for method none.

    method=mtp: one per (draft_threshold, catch_up, draft_width) of the grid; prompt lookup joins every method but none
    when `ngram.compare` is on.
    """
    method = cfg.method
    if method not in METHODS:
        raise ValueError(f"method {method!r} is unknown; choose one of {', '.join(METHODS)}")
    if method == "none":
        return []
    ng = cfg.ngram
    ngram = Method("ngram", lambda: NgramProposer(n_max=ng.n_max, n_min=ng.n_min))
    ngram.make()  # n_min / n_max errors now, before any run
    if method == "ngram":
        return [ngram]
    return [*_drafters(cfg, target, tokenizer, target_dir), *([ngram] if ng.compare else [])]


def _drafters(cfg: EvalConfig, target: Any, tokenizer: Any, target_dir: Path) -> list[Method]:
    method = cfg.method
    if method == "mtp":
        if not cfg.head_ckpt:
            raise ValueError("method=mtp needs head_ckpt=DIR (a folder written by mtp-train or mtp-export)")
        from mtp_train.heads import load_head

        head = load_head(cfg.head_ckpt, target_dir, device=target.device, dtype=target.dtype,
                         backend=cfg.model.backend, verify_fingerprint=cfg.verify_fingerprint)
        log.info("head %s: %s, %.2fM parameters, draft vocabulary %d", cfg.head_ckpt, head.cfg.type,
                 head.num_params() / 1e6, head.vocab_size)
        methods = []
        for thr in cfg.grid("draft_threshold"):
            for cu in cfg.grid("catch_up"):
                for w in cfg.grid("draft_width"):
                    opts = {"draft_threshold": thr, "catch_up": cu, "draft_width": w}
                    HeadProposer(head, **opts)  # a bad value fails before any run
                    methods.append(Method("mtp", lambda o=opts: HeadProposer(head, **o), opts))
        return methods
    if not cfg.draft_model:
        raise ValueError("method=draft needs draft_model=DIR (a Hugging Face folder with the target's tokenizer)")
    from mtp_train.models.loader import load_model

    draft_dir = Path(cfg.draft_model)
    if tokenizer_fingerprint(load_tokenizer(draft_dir)) != tokenizer_fingerprint(tokenizer):
        raise ModelConfigError(f"draft model {draft_dir} has another tokenizer than the target {target_dir}; "
                               "speculative decoding needs the same one")
    draft = load_model(draft_dir, dtype=str(target.dtype).replace("torch.", ""), device=target.device,
                       backend=cfg.model.backend)
    if draft.args.vocab_size != target.args.vocab_size:
        raise ModelConfigError(f"draft model {draft_dir} has vocab_size {draft.args.vocab_size}, the target "
                               f"{target.args.vocab_size}")
    return [Method("draft", lambda: DraftModelProposer(draft))]


def eval_main(cfg: DictConfig) -> dict[str, Any]:
    """Run `mtp-eval` with a composed config; returns the report (also written to `<out>/report.json`)."""
    ec = typed(cfg, EvalConfig)  # the grid's values are checked here, before anything loads
    prompt_sets = load_prompt_sets(list(ec.prompts), ec.limit)  # data errors before the model loads
    ensure_model(ec.model)
    target, tokenizer, target_dir = load_target(ec.model, rank_device(ec.model.device))
    proposers = make_proposers(ec, target, tokenizer, target_dir)
    out = Path(ec.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    stop_ids = stop_token_ids(tokenizer, target.args.eos_token_ids, ec.chat_template_kwargs)
    ids = {ps.name: [c.id for c in ps.convs] for ps in prompt_sets}

    def on_result(run: Any, base: Any) -> None:
        r = result_row(run, base)
        opts = "".join(f" {k}={v}" for k, v in run.options.items())
        log.info("%s %s%s k=%d T=%g: tau %.2f, acceptance %.2f, drafted %.2f/step, %.1f vs %.1f tok/s, speed-up %.2f",
                 r["dataset"], r["method"], opts, r["k"], r["temperature"], r.get("tau", 1.0),
                 r.get("acceptance_rate", 0.0), r.get("mean_draft_len", 0.0), r["tokens_per_s"],
                 r["baseline_tokens_per_s"], r["speedup"])

    pairs, baselines = evaluate(target, tokenizer, prompt_sets, proposers, ec, stop_ids=stop_ids, on_result=on_result)
    if proposers:
        rows = [result_row(run, base) for run, base in pairs]
        rows += overall_rows(pairs)
        attach_ngram(rows)
        outputs = [rec for run, _ in pairs for rec in output_records(run, tokenizer, ids[run.dataset])]
    else:  # method none: the plain runs themselves
        rows = [result_row(b, b) for b in baselines] + overall_rows([(b, b) for b in baselines])
        outputs = []
    outputs += [rec for b in baselines for rec in output_records(b, tokenizer, ids[b.dataset])]
    best = best_row(rows, 0.0) if proposers else None
    report = {"config": to_dict(cfg), "rows": rows, "best": best, "target": str(target_dir),
              "device": str(target.device), "dtype": str(target.dtype).replace("torch.", "")}
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    write_jsonl(out / "outputs.jsonl", outputs)
    table = markdown_table(rows)
    atomic_write_text(out / "report.md", f"# mtp-eval: {ec.method}\n\n{table}\n")
    files = plot(rows, out) if ec.plots and proposers else []
    print(table, flush=True)
    if best is not None:
        floor = (f" (prompt lookup: tau {best['tau_ngram']:.2f}, speed-up {best['speedup_ngram']:.2f})"
                 if "tau_ngram" in best else "")
        print(f"{PROG}: best at T=0: {best['method']} k={best['k']} tau {best['tau']:.2f} speed-up "
              f"{best['speedup']:.2f}{floor} → {out}/report.json", flush=True)
    log.info("wrote %s", ", ".join(str(p) for p in [out / "report.json", out / "outputs.jsonl", *files]))
    return report


main = hydra_entry(PROG, "eval", eval_main)

if __name__ == "__main__":
    main()
