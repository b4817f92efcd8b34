"""Scale: seconds to the first sample and peak memory of each stage, run as the real command, against the number of
conversations (or samples) it is given.

Each stage runs as its command in a process of its own (`python -m mtp_train.cli.<stage>`, what the `mtp-*` scripts
run) on synthetic inputs of `--sizes` conversations, and is stopped once its first sample is on disk:

    regenerate   mtp-regenerate on N one-turn conversations, `--max-new-tokens` per answer (the default model);
                 the first sample is the first whole record line in its output (`<out>.rank0`)
    precompute   mtp-precompute of the same N conversations (the default model, `--batch-tokens` per forward and
                 `--shard-tokens` per shard); the first sample is the first finished shard (its sidecar)
    train        mtp-train of `--heads` (eagle3: a draft vocabulary, from the folder's token counts; mtp) on a
                 precompute folder of N samples holding eagle3's aux layers, `--micro-batch-tokens` per micro-batch;
                 the first sample is the first step's line in metrics.jsonl (train.log_every=1)

The train stage's folders come from `mtp_train.precompute.synthetic.make_folder`: real shards and manifest written
through the package's writer for the default model, samples of 4-12 random tokens with random hidden states
(`--folder-dtype`), eagle3's three aux layers stored (the mtp head reads the final hidden beside them). At 10^6
samples such a folder is ~8·10^6 tokens, ~34 GiB in bf16 (5 + 2H(1 + k) bytes a token, `bench.memory_plan`): a
size whose folder does not fit in the work folder's free space is skipped, saying so.

Time counts from the process's start to the first sample (the imports, the model load and the first sample's own
forward or step are the same at every size, the last kept small by the 1024-token batches: what grows with N is
reading, tokenizing, planning and indexing everything before the first sample). Memory is
the resident set of the whole process tree, sampled every `--poll` seconds until the process is stopped, and never
below the root process's own high-water mark (VmHWM) at the last sample, which catches spikes between samples.
The process group is then stopped (SIGTERM, then SIGKILL) and what it wrote is removed.

Printed: per stage and size, seconds and peak RSS, each as a ratio to / difference from the smallest size; the
growth exponent of each (the least-squares slope of log value over log N: 0 = flat, 1 = linear); the goals (first
sample within 30 s at the largest size, peak within 1 GiB of the smallest size's); a plot (`--png`) and the
figures (`--json`) beside it. Input generation is not timed. `--warmup` runs every stage once untimed on a tiny
input first, so the first timed run does not pay for cold file caches alone.

Usage: python -m bench.scale [--sizes 10000,100000,1000000] [--stages regenerate,precompute,train]
       [--heads eagle3,mtp] [--timeout 600] [--repeat 1] [--max-new-tokens 8] [--shard-tokens 1024]
       [--batch-tokens 1024] [--micro-batch-tokens 1024] [--folder-dtype bfloat16] [--png docs/scale.png]
       [--json docs/scale.json] [--work DIR] [--keep]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_MODEL, ROOT, ints, parser, report
from mtp_train import processes

STAGES = ("regenerate", "precompute", "train")
GIB = 2**30
GOAL_SECONDS = 30.0  # first sample at the largest size
GOAL_PEAK_GROWTH_GIB = 1.0  # peak at the largest size over the smallest size's
WARMUP_SIZE = 64
DATA_NAME = "scale"

# Small vocabularies of the synthetic turns: short, varied, plain text any tokenizer takes in a few tokens.
SUBJECTS = ("the moon", "bread", "rivers", "chess", "owls", "glass", "tea", "maps", "rain", "clocks", "salt", "bees")
ASKS = ("Name one fact about", "Say a word about", "Describe", "What colour is", "Give a tip about", "Define")
ANSWERS = ("It is old.", "It is common.", "People like it.", "It changes.", "It is small.", "It has a shape.")


# --- synthetic inputs ---------------------------------------------------------------------------------------------


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """Write n one-turn conversations (`messages` JSONL: a user question of a few words, a one-sentence answer).

    Args:
        path: the file to write (its folder is made).
        n: conversations.
        seed: the draw of subjects and phrasings; the same seed gives the same file.

    Ids are unique (`scale-<i>`) and the question carries its index, so no two prompts are the same text.
    """
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            user = f"{rng.choice(ASKS)} {rng.choice(SUBJECTS)}, item {i}?"
            answer = rng.choice(ANSWERS)
            fh.write(json.dumps({"id": f"scale-{i:07d}", "messages": [{"role": "user", "content": user},
                                                                       {"role": "assistant", "content": answer}]},
                                separators=(",", ":")) + "\n")
    return path


class SkipSize(RuntimeError):
    """An input this bench cannot make at this size here; the message says why."""


# make_folder's samples are 4..12 tokens long: 8 on average, what its disk estimate counts.
FOLDER_MEAN_TOKENS = 8


def make_train_folder(out: Path, samples: int, model: Path, aux_layers: Sequence[int], storage: str) -> str:
    """A precompute folder of `samples` short random samples for the train stage, written through the package's
    own writer (`mtp_train.precompute.synthetic.make_folder`) for the target `model`; returns its size as text.

    Args:
        out: the folder to write.
        samples: samples in it.
        model: the target (its config and weights' fingerprint go into the manifest, so mtp-train takes it).
        aux_layers: the aux layers it holds (eagle3's, so that every head of `--heads` trains on it).
        storage: its hidden_dtype.

    Raises SkipSize when the folder would not fit in the free space of `out`'s file system.
    """
    from bench.memory_plan import disk_bytes_per_token
    from mtp_train.models.families import args_from_dir
    from mtp_train.precompute.synthetic import make_folder

    hidden = args_from_dir(model).hidden_size
    need = samples * FOLDER_MEAN_TOKENS * disk_bytes_per_token(hidden, len(aux_layers), storage)
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path(tempfile.gettempdir())).free
    if need > 0.9 * free:
        raise SkipSize(f"its folder needs about {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free under {out.parent} "
                       f"(--work elsewhere, or --folder-dtype float8_e4m3 for half)")
    manifest = make_folder(out, samples, target=model, aux_layers=list(aux_layers), storage=storage)
    return f"{manifest.totals.tokens:,} tokens, {manifest.totals.bytes / GIB:.2f} GiB"


def data_overrides(conversations: Path) -> list[str]:
    """The data settings that make a command read `conversations` (the synthetic messages file)."""
    return [f"data.name={DATA_NAME}", f"data.paths=[{conversations}]", "data.format=messages"]


def folder_data_name(folder: Path) -> str:
    """The data name a precompute folder's manifest records (mtp-train is given it as `data.name`)."""
    return str(json.loads((folder / "manifest.json").read_text())["data"]["name"])


# --- watching a run -----------------------------------------------------------------------------------------------


def has_line(path: Path) -> bool:
    """Whether `path` holds at least one whole line (its writers flush a record line by line)."""
    try:
        with path.open("rb") as fh:
            return b"\n" in fh.read(1 << 16)
    except OSError:
        return False


def first_record(out: Path) -> Callable[[], bool]:
    """mtp-regenerate's first sample: a whole line in the rank's part file or in the output itself."""
    part = out.with_name(f"{out.name}.rank0")
    return lambda: has_line(part) or has_line(out)


def first_shard(out: Path) -> Callable[[], bool]:
    """mtp-precompute's first sample: a shard's sidecar, written once the shard is whole."""
    return lambda: out.is_dir() and any(out.glob("shard-r*-*.json"))


def first_step(out: Path) -> Callable[[], bool]:
    """mtp-train's first sample: the first step's line in metrics.jsonl."""
    return lambda: has_line(out / "metrics.jsonl")


def process_tree_rss(pid: int) -> tuple[int, int]:
    """(resident bytes of the process and all its descendants, the process's own VmHWM in bytes); (0, 0) once it
    is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # a child that ended between the listing and the read
            total += p.memory_info().rss
    return total, vm_hwm(pid)


def vm_hwm(pid: int) -> int:
    """The process's peak resident set (Linux /proc VmHWM) in bytes; 0 where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass
class Run:
    """One timed run of a stage at one size."""

    label: str  # regenerate | precompute | train:<head>
    size: int
    seconds: float | None  # to the first sample; None when it never came
    peak_rss: int  # bytes
    rc: int | None  # the exit status when it ended by itself before the first sample (else None: stopped)
    note: str = ""


def run_until_first(label: str, size: int, cmd: list[str], ready: Callable[[], bool], timeout: float, log: Path,
                    env: dict[str, str], poll: float = 0.05) -> Run:
    """Run `cmd` in its own process group until `ready()` or `timeout` seconds, sampling the tree's memory.

    Args:
        label, size: what the run is, for its record.
        cmd: the command.
        ready: says whether the first sample is on disk.
        timeout: seconds before the run is stopped without one.
        log: the command's output (stdout and stderr).
        env: its environment.
        poll: seconds between checks and memory samples.
    """
    t0 = time.perf_counter()
    proc = processes.start(cmd, env, log, cwd=ROOT)  # its own process group: stopped with its children
    peak, seconds, rc = 0, None, None
    try:
        while True:
            rss, hwm = process_tree_rss(proc.pid)
            peak = max(peak, rss, hwm)
            if ready():
                seconds = time.perf_counter() - t0
                break
            if proc.poll() is not None:
                rc = proc.returncode
                break
            if time.perf_counter() - t0 > timeout:
                break
            time.sleep(poll)
    finally:
        processes.stop(proc, grace=10.0)  # the run and every process it spawned
    note = ""
    if seconds is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        note = (f"exited {rc} before its first sample" if rc is not None else f"no first sample in {timeout:g} s")
        note += (": " + " | ".join(tail)) if tail else ""
    return Run(label, size, seconds, peak, rc, note)


# --- the stages ---------------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """The synthetic inputs of one size: the conversations file and the train folder (or why there is none)."""

    size: int
    conversations: Path
    folder: Path | None = None
    folder_how: str = ""
    skip_train: str = ""


@dataclass
class Setup:
    """What every run shares."""

    model: Path
    work: Path
    python: str
    timeout: float
    max_new_tokens: int
    shard_tokens: int
    batch_tokens: int
    micro_batch_tokens: int
    poll: float
    folder_dtype: str
    env: dict[str, str] = field(default_factory=dict)


def stage_command(label: str, inputs: Inputs, setup: Setup, out: Path) -> tuple[list[str], Callable[[], bool]]:
    """The command of stage `label` on `inputs` writing under `out`, and its first-sample check."""
    py, model = setup.python, f"model.path={setup.model}"
    if label == "regenerate":
        target = out / "out.jsonl"
        return ([py, "-m", "mtp_train.cli.regenerate", model, *data_overrides(inputs.conversations),
                 f"out={target}", f"max_new_tokens={setup.max_new_tokens}", "progress=false"], first_record(target))
    if label == "precompute":
        return ([py, "-m", "mtp_train.cli.precompute", model, *data_overrides(inputs.conversations), f"out={out}",
                 f"shard_tokens={setup.shard_tokens}", f"batch_tokens={setup.batch_tokens}", "progress=false"],
                first_shard(out))
    head = label.split(":", 1)[1]
    assert inputs.folder is not None
    return ([py, "-m", "mtp_train.cli.train", model, f"head={head}", f"data.dir={inputs.folder}",
             f"data.name={folder_data_name(inputs.folder)}", f"out={out}", "train.log_every=1", "train.eval_every=0",
             f"train.micro_batch_tokens={setup.micro_batch_tokens}",
             "train.progress=false", "wandb.mode=disabled", "spec_eval.prompts=[]"], first_step(out))


def run_stage(label: str, inputs: Inputs, setup: Setup) -> Run:
    """One run of stage `label` at `inputs.size`, what it wrote removed after."""
    if label.startswith("train:") and inputs.folder is None:
        return Run(label, inputs.size, None, 0, None, f"skipped: {inputs.skip_train}")
    out = setup.work / "runs" / f"{label.replace(':', '-')}-{inputs.size}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log = setup.work / "logs" / f"{label.replace(':', '-')}-{inputs.size}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd, ready = stage_command(label, inputs, setup, out)
    try:
        return run_until_first(label, inputs.size, cmd, ready, setup.timeout, log, setup.env, setup.poll)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def make_inputs(size: int, labels: Sequence[str], setup: Setup, aux_layers: Sequence[int]) -> Inputs:
    """The conversations file of `size` and, when a train stage runs, its precompute folder."""
    base = setup.work / "inputs" / str(size)
    inputs = Inputs(size, write_conversations(base / "conversations.jsonl", size))
    if any(label.startswith("train:") for label in labels):
        try:
            t0 = time.perf_counter()
            inputs.folder_how = make_train_folder(base / "folder", size, setup.model, aux_layers, setup.folder_dtype)
            inputs.folder = base / "folder"
            print(f"  folder of {size:,} samples ({inputs.folder_how}) in {time.perf_counter() - t0:.0f} s",
                  flush=True)
        except SkipSize as exc:
            inputs.skip_train = str(exc)
            print(f"  train at {size}: skipped ({exc})", flush=True)
    return inputs


# --- the figures --------------------------------------------------------------------------------------------------


def growth_exponent(sizes: Sequence[float], values: Sequence[float]) -> float | None:
    """The least-squares slope of log(value) over log(size): 0 = flat, 1 = linear in the size; None with fewer than
    two points of positive value and distinct size."""
    pts = [(math.log(s), math.log(v)) for s, v in zip(sizes, values) if s > 0 and v is not None and v > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def summarize(runs: Sequence[Run], labels: Sequence[str], sizes: Sequence[int]) -> dict[str, dict]:
    """Per stage label: per size the median seconds and peak over its runs, the growth exponents and the goals."""
    out: dict[str, dict] = {}
    for label in labels:
        points = []
        for size in sizes:
            mine = [r for r in runs if r.label == label and r.size == size]
            done = [r for r in mine if r.seconds is not None]
            points.append({
                "size": size,
                "seconds": statistics.median(r.seconds for r in done) if done else None,
                "peak_rss_gib": statistics.median(r.peak_rss for r in done) / GIB if done else None,
                "runs": len(mine), "notes": sorted({r.note for r in mine if r.note}),
            })
        ok = [p for p in points if p["seconds"] is not None]
        entry: dict[str, Any] = {"points": points}
        entry["time_exponent"] = growth_exponent([p["size"] for p in ok], [p["seconds"] for p in ok])
        entry["memory_exponent"] = growth_exponent([p["size"] for p in ok], [p["peak_rss_gib"] for p in ok])
        if ok:
            first, last = ok[0], ok[-1]
            growth = last["peak_rss_gib"] - first["peak_rss_gib"]
            entry["goals"] = {
                "at_size": last["size"], "against_size": first["size"],
                "first_sample_s": round(last["seconds"], 2), "first_sample_ok": last["seconds"] <= GOAL_SECONDS,
                "peak_growth_gib": round(growth, 3), "peak_ok": growth <= GOAL_PEAK_GROWTH_GIB,
                "complete": len(ok) == len(points),
            }
        out[label] = entry
    return out


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def print_table(summary: dict[str, dict]) -> None:
    """The runs as a table, then each stage's growth exponents and goals."""
    print("\n| stage | N | s to first sample | × smallest N | peak RSS GiB | − smallest N GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, entry in summary.items():
        base = next((p for p in entry["points"] if p["seconds"] is not None), None)
        for p in entry["points"]:
            ratio = p["seconds"] / base["seconds"] if base and p["seconds"] is not None else None
            diff = p["peak_rss_gib"] - base["peak_rss_gib"] if base and p["peak_rss_gib"] is not None else None
            notes = f" ({'; '.join(p['notes'])})" if p["notes"] and p["seconds"] is None else ""
            print(f"| {label} | {p['size']:,} | {fmt(p['seconds'], '.1f')}{notes} | {fmt(ratio, '.2f')} | "
                  f"{fmt(p['peak_rss_gib'], '.2f')} | {fmt(diff, '+.2f')} |")
    print(f"\ngoals: first sample within {GOAL_SECONDS:g} s at the largest N (10^6 in the full run), peak within "
          f"{GOAL_PEAK_GROWTH_GIB:g} GiB of the smallest N's (10^4)")
    for label, entry in summary.items():
        g = entry.get("goals")
        line = (f"  {label}: growth exponent time {fmt(entry['time_exponent'], '.2f')}, memory "
                f"{fmt(entry['memory_exponent'], '.2f')}")
        if g:
            met = {True: "met", False: "MISSED"}
            line += (f"; at N {g['at_size']:,}: {g['first_sample_s']} s ({met[g['first_sample_ok']]}),"
                     f" peak {g['peak_growth_gib']:+.2f} GiB over N {g['against_size']:,} "
                     f"({met[g['peak_ok']]})" + ("" if g["complete"] else "; some sizes missing"))
        print(line)


def plot(summary: dict[str, dict], png: Path) -> None:
    """Seconds to the first sample and peak RSS against N, log-log, one line per stage, the goals dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, entry in summary.items():
        pts = [p for p in entry["points"] if p["seconds"] is not None]
        if not pts:
            continue
        xs = [p["size"] for p in pts]
        ax_t.plot(xs, [p["seconds"] for p in pts], marker="o",
                  label=f"{label} (slope {fmt(entry['time_exponent'], '.2f')})")
        ax_m.plot(xs, [p["peak_rss_gib"] for p in pts], marker="o",
                  label=f"{label} (slope {fmt(entry['memory_exponent'], '.2f')})")
    ax_t.axhline(GOAL_SECONDS, ls="--", c="grey", lw=1, label=f"goal {GOAL_SECONDS:g} s")
    ax_t.set(xscale="log", yscale="log", xlabel="conversations / samples N", ylabel="seconds to first sample",
             title="time to first sample")
    ax_m.set(xscale="log", yscale="log", xlabel="conversations / samples N", ylabel="peak RSS (GiB, process tree)",
             title=f"peak memory (goal: within {GOAL_PEAK_GROWTH_GIB:g} GiB of the smallest N)")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def commit() -> str:
    """The checkout's commit (short), with `+` when its tracked files differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+" if dirty else "")


# --- the entry ----------------------------------------------------------------------------------------------------


def labels_of(stages: Sequence[str], heads: Sequence[str]) -> list[str]:
    """The run labels of `stages`: train once per head (`train:<head>`)."""
    out = []
    for stage in stages:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}: choose among {', '.join(STAGES)}")
        out += [f"train:{h}" for h in heads] if stage == "train" else [stage]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--sizes", type=ints, default=[10**4, 10**5, 10**6],
                    help="conversations / samples, e.g. 10000,100000")
    ap.add_argument("--stages", default=",".join(STAGES), help="any of regenerate,precompute,train")
    ap.add_argument("--heads", default="eagle3,mtp", help="the train stage's head types")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take to its first sample")
    ap.add_argument("--repeat", type=int, default=1, help="runs per stage and size (median), sizes alternating order")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="regenerate: tokens per answer")
    # The first sample's own work (a forward, a step) does not depend on N; small batches keep it from hiding the
    # part that does (reading, tokenizing, planning, indexing everything first).
    ap.add_argument("--shard-tokens", type=int, default=1024, help="precompute: tokens per shard")
    ap.add_argument("--batch-tokens", type=int, default=1024, help="precompute: tokens per forward")
    ap.add_argument("--micro-batch-tokens", type=int, default=1024, help="train: tokens per micro-batch")
    ap.add_argument("--folder-dtype", default="bfloat16",
                    help="train: the synthetic folders' hidden_dtype (float8_e4m3 halves their disk)")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between memory samples")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help=f"one untimed run of every stage on {WARMUP_SIZE} conversations first")
    ap.add_argument("--png", default=str(ROOT / "docs" / "scale.png"))
    ap.add_argument("--json", default=str(ROOT / "docs" / "scale.json"))
    ap.add_argument("--work", default=None, help="folder of the inputs and runs (default: a temporary one, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (inputs, logs)")
    args = ap.parse_args(argv)
    model = Path(args.model).resolve()
    if not (model / "config.json").is_file():
        ap.error(f"{model}: no config.json (run `make model`)")
    try:
        labels = labels_of([s for s in args.stages.split(",") if s], [h for h in args.heads.split(",") if h])
    except ValueError as exc:
        ap.error(str(exc))
    sizes = sorted(set(args.sizes))
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="mtp-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    # The native-or-torch choice of the CPU kernels is measured at a model's first load and cached, or not cached on
    # a loaded machine: seconds in some runs that do not depend on N. Every run takes the native kernels instead.
    env = {**os.environ, "MTP_TRAIN_KERNEL_CHOICE": os.environ.get("MTP_TRAIN_KERNEL_CHOICE", "native")}
    setup = Setup(model, work, sys.executable, args.timeout, args.max_new_tokens, args.shard_tokens,
                  args.batch_tokens, args.micro_batch_tokens, args.poll, args.folder_dtype, env)

    from mtp_train.config.head import default_aux_layers
    from mtp_train.models.families import args_from_dir

    aux = default_aux_layers(args_from_dir(model).num_layers)  # eagle3's, which every head of --heads can train on
    runs: list[Run] = []
    try:
        print(f"inputs under {work}", flush=True)
        inputs = {}
        for size in sizes:
            inputs[size] = make_inputs(size, labels, setup, aux)
        if args.warmup:
            print(f"warm-up: every stage once on {WARMUP_SIZE} conversations, untimed", flush=True)
            warm = make_inputs(WARMUP_SIZE, labels, setup, aux)
            for label in labels:
                r = run_stage(label, warm, setup)
                if r.seconds is None:
                    print(f"  warm-up {label}: {r.note}", flush=True)
        for rnd in range(args.repeat):
            # Sizes alternate their order round by round, so a load that drifts over the run hits both ends alike.
            for size in sizes if rnd % 2 == 0 else sizes[::-1]:
                for label in labels:
                    r = run_stage(label, inputs[size], setup)
                    runs.append(r)
                    print(f"  {label} N={size:,}: " + (f"{r.seconds:.1f} s, peak {r.peak_rss / GIB:.2f} GiB"
                                                       if r.seconds is not None else r.note), flush=True)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs, labels, sizes)
    print_table(summary)
    result = {
        "date": datetime.date.today().isoformat(), "commit": commit(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "command": "python -m bench.scale " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": str(model), "sizes": sizes, "timeout": args.timeout, "repeat": args.repeat,
        "max_new_tokens": args.max_new_tokens, "shard_tokens": args.shard_tokens, "batch_tokens": args.batch_tokens,
        "micro_batch_tokens": args.micro_batch_tokens, "folder_dtype": args.folder_dtype,
        "folders": {str(s): inputs[s].folder_how or inputs[s].skip_train for s in sizes} if runs else {},
        "goals": {"first_sample_s": GOAL_SECONDS, "peak_growth_gib": GOAL_PEAK_GROWTH_GIB},
        "stages": summary, "runs": [asdict(r) for r in runs],
    }
    if args.png:
        plot(summary, Path(args.png))
        print(f"plot: {args.png}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"figures: {args.json}")
    report(result)
    return result


if __name__ == "__main__":
    main()
