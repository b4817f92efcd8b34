"""Training memory measured against the memory plan: peak RSS of real `mtp-train` processes on the CPU.

For each head type and sample length, a synthetic precompute folder of samples of exactly that length for the target
(`mtp_train.precompute.synthetic.make_folder`, the aux layers the head reads) is trained on for a few steps by an
`mtp-train` subprocess (one micro-batch = one sample: `train.micro_batch_tokens` = the length; evaluation, W&B and
periodic saves off), and the same command with `plan=true` prints its plan. The measured peak is the process's
VmHWM (the peak resident set of its image after exec, which it writes at exit); with `--sp N` the run is N CPU ranks
under torchrun (`train.sequence_parallel=N`) and the peak is the largest rank's (a chain head's N
must divide the target's attention heads: 3 for SmolLM2-135M's 9; a block drafter takes any N).

Every measured process runs with glibc's `MALLOC_MMAP_THRESHOLD_` at 1 MiB (`MMAP_THRESHOLD`): a tensor of a MiB or
more then lives in its own mapping, returned to the system when it is freed, so the resident set follows the live
tensors (what the plan counts, and what a CUDA device holds). Without it glibc serves blocks up to 32 MiB from its
heap and keeps what is freed resident: a run's peak then carried several hundred MiB of freed activations, varying
from run to run (0.3 GiB between two runs of one SP 2 configuration).

Prints measured, planned and planned / measured per (head, length); the last line is one JSON object.

Usage: python -m bench.train_memory [--model DIR] [--heads mtp,eagle3,dflash] [--lengths 1024,2048,4096,8192]
       [--steps 2] [--sp 1] [--activation-checkpointing] [--work DIR] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import DEFAULT_MODEL, ints, parser, report

GIB = 2**30
# glibc: allocations of this many bytes or more are mapped on their own and unmapped when freed (module docstring)
MMAP_THRESHOLD = 2**20
TOTAL_LINE = re.compile(r"^peak per rank\s+([0-9.]+) GiB \((\d+) bytes\)", re.M)
# a process's own peak, written at exit to $TRAIN_MEMORY_HWM/rank-<RANK> by the `sitecustomize` of every measured run
# (torchrun's launcher, which has no RANK, writes nothing)
HWM_HOOK = """import atexit, os
def _hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            with open(os.path.join(os.environ['TRAIN_MEMORY_HWM'], 'rank-' + os.environ['RANK']), 'w') as f:
                f.write(str(int(line.split()[1]) * 1024))
if os.environ.get('TRAIN_MEMORY_HWM') and os.environ.get('RANK') is not None:
    atexit.register(_hwm)
"""


@dataclass
class Row:
    """One measurement: a head type at a sample length, its measured and planned peak per rank (bytes)."""

    head: str
    length: int
    sp: int
    measured: int
    planned: int
    checkpointing: bool = False

    @property
    def ratio(self) -> float:
        return self.planned / self.measured


def head_overrides(head: str) -> list[str]:
    """The head group and its recipe as `mtp-train` takes them (eagle3's 3-step unroll is its recipe's default)."""
    return [f"head={head}"]


def folder_for(work: Path, model: Path, head: str, length: int, samples: int) -> Path:
    """A synthetic precompute folder for `head` on `model` of `samples` samples of exactly `length` tokens, made once
    under `work` (the aux layers the head type reads at its shipped config)."""
    from bench.memory_plan import stored_aux_layers
    from mtp_train.models.families import args_from_dir
    from mtp_train.precompute.synthetic import make_folder

    aux = stored_aux_layers(head, args_from_dir(model).num_layers)
    out = work / f"data-{'-'.join(map(str, aux)) or 'final'}-{length}-all"
    if not (out / "manifest.json").is_file():
        # every token under the loss: the plan assumes every row counted (the loss's chunk is then full)
        make_folder(out, samples, target=model, aux_layers=aux, min_len=length, max_len=length, val_fraction=0.0,
                    shard_tokens=max(65536, length), loss_fraction=1.0)
    return out


def overrides(model: Path, head: str, folder: Path, out: Path, length: int, steps: int, sp: int) -> list[str]:
    """`mtp-train`'s overrides of one measurement: `steps` steps of one sample each, nothing else run or saved that
    a real run at these settings would not hold at its peak."""
    return [f"model.path={model}", *head_overrides(head), f"data.dir={folder}", f"out={out}",
            f"train.max_steps={steps}", f"train.micro_batch_tokens={length}", "train.eval_batches=0",
            "train.save_every=0", "train.progress=false", "optim.warmup_steps=1", "wandb.mode=disabled",
            "spec_eval.prompts=[]", *([f"train.sequence_parallel={sp}"] if sp > 1 else [])]


def measure(args: list[str], sp: int, work: Path) -> int:
    """The peak RSS in bytes of `mtp-train args`: the process's own (sp = 1), or the largest of its sp CPU ranks.

    Each process writes its own VmHWM at exit (`HWM_HOOK`): the resident high-water mark of its image after exec.
    The parent's `wait4` would not do: a child's ru_maxrss counts the pages it shared with its parent between fork and
    exec, so a child of a large process (a test suite's) reports the parent's size."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    hook, peaks_dir = work / "hwm_hook", work / "hwm"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HWM_HOOK)
    peaks_dir.mkdir(exist_ok=True)
    for old in peaks_dir.glob("rank-*"):
        old.unlink()
    env.update(TRAIN_MEMORY_HWM=str(peaks_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")])))
    if sp == 1:
        env["RANK"] = "0"  # rank 0 of 1, as without torchrun (the hook names its file by RANK)
        cmd = [sys.executable, "-m", "mtp_train.cli.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={sp}",
               "-m", "mtp_train.cli.train", *args, "model.device=cpu"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    peaks = [int(f.read_text()) for f in peaks_dir.glob("rank-*")]
    if len(peaks) != sp:
        raise RuntimeError(f"expected {sp} ranks' peaks in {peaks_dir}, got {len(peaks)}")
    return max(peaks)


def planned(args: list[str], sp: int) -> int:
    """The peak per rank `mtp-train args plan=true` prints, in bytes (world = sp, as the measured run's)."""
    extra = [f"plan_world={sp}"] if sp > 1 else []
    run = subprocess.run([sys.executable, "-m", "mtp_train.cli.train", *args, "plan=true", *extra],
                         capture_output=True, text=True)
    found = TOTAL_LINE.search(run.stdout)
    if run.returncode != 0 or found is None:
        raise RuntimeError(f"mtp-train plan=true failed ({run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    return int(found.group(2))


def run_one(model: Path, head: str, length: int, steps: int, sp: int, work: Path, samples: int = 4,
            checkpointing: bool = False, extra: list[str] | None = None) -> Row:
    """Measure and plan one (head, length, sp), with train.activation_checkpointing when `checkpointing` and the
    `mtp-train` overrides `extra` after the bench's own."""
    folder = folder_for(work, model, head, length, max(samples, steps * sp))
    out = work / f"run-{head}-{length}-sp{sp}"
    args = overrides(model, head, folder, out, length, steps, sp)
    if checkpointing:
        args.append("train.activation_checkpointing=true")
    args += extra or []
    row = Row(head, length, sp, measure(args + ["overwrite=true", "resume=none"], sp, work), planned(args, sp),
              checkpointing)
    for p in sorted(out.rglob("*"), reverse=True):  # a run's checkpoint is not needed once its peak is read
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    return row


def print_rows(rows: list[Row]) -> None:
    print("| head | tokens | SP | act. ckpt | measured GiB | planned GiB | planned / measured |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.head} | {r.length} | {r.sp} | {'on' if r.checkpointing else 'off'} | {r.measured / GIB:.2f} | "
              f"{r.planned / GIB:.2f} | {r.ratio:.3f} |", flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the target's folder")
    ap.add_argument("--heads", default="mtp,eagle3,dflash", help="head types, comma-separated")
    ap.add_argument("--lengths", type=ints, default=[1024, 2048, 4096, 8192], help="sample lengths in tokens")
    ap.add_argument("--steps", type=int, default=2, help="training steps per run")
    ap.add_argument("--sp", type=int, default=1, help="train.sequence_parallel (that many CPU ranks)")
    ap.add_argument("--activation-checkpointing", action="store_true", help="train.activation_checkpointing=true")
    ap.add_argument("--work", type=Path, default=None, help="where folders and runs go (default: a temporary one)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an mtp-train override for every run, e.g. --set loss.ce_impl=fused (repeatable)")
    args = ap.parse_args(argv)
    model = args.model.resolve()
    with tempfile.TemporaryDirectory(prefix="train-memory-") as tmp:
        work = (args.work or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for head in args.heads.split(","):
            for length in args.lengths:
                rows.append(run_one(model, head, length, args.steps, args.sp, work,
                                    checkpointing=args.activation_checkpointing, extra=args.set))
                print(f"{head} {length}: measured {rows[-1].measured / GIB:.2f} GiB, planned "
                      f"{rows[-1].planned / GIB:.2f} GiB ({rows[-1].ratio:.3f})", flush=True)
    print_rows(rows)
    result = {"model": str(model), "steps": args.steps, "sp": args.sp, "overrides": args.set,
              "rows": [{**asdict(r), "ratio": round(r.ratio, 4)} for r in rows]}
    report(result)
    return result


if __name__ == "__main__":
    main()
