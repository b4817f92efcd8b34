"""Training memory on CUDA: the memory plan against real runs, and the training attentions' bf16 results.

1. For `eagle3` (its 3-step training-time test) at 4k and 8k tokens, at 8k with `train.activation_checkpointing`,
   and `dflash` at 8k, on the SmolLM2 target: `mtp-train ... plan=true plan_device=cuda` prints the predicted peak per
   rank, and the same command without `plan` trains two steps on a synthetic precompute folder of samples of exactly
   that length (`precompute.synthetic.make_folder`, every token under the loss) and logs the peak it measured
   (`train/peak_memory_gib`: the allocator's peak reservation plus the device memory outside it). The check passes
   where planned / measured lies in [1 / (1 + tol), 1 + tol]: the plan's CUDA coefficients (bf16 values, the 1.5 GiB
   runtime, DeepSpeed's reduction bucket) are counted, not measured on the CPU, so this is where they are first
   checked; the figures go to a `TRAIN_MEMORY {json}` line either way.
2. The chained training attention (`diagonal`) against the quadratic reference (`masked`), and the block attention
   against its explicit formula, in bf16 on CUDA: outputs and gradients (the 8 extra sink columns and the fused
   kernels' masks are CUDA-only paths).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from checks.gpu.common import DT, TOL, Checks, rel_err
from mtp_train.config.head import default_aux_layers
from mtp_train.head_types.dflash.head import default_block_layers
from mtp_train.heads.block_attention import BlockLayout, explicit_block_attention, packed_block_attention
from mtp_train.heads.chain_attention import ChainTrainAttention, attend_chain
from mtp_train.models.families import args_from_dir
from mtp_train.precompute.synthetic import make_folder

PEAK_LINE = re.compile(r"^peak per rank\s+[0-9.]+ GiB \((\d+) bytes\)", re.M)
GIB = 2**30


def _train_args(target: Path, head: str, folder: Path, out: Path, length: int, checkpointing: bool,
                device: str) -> list[str]:
    """`mtp-train`'s overrides for two steps of one `length`-token sample each on `device`, nothing else run or
    saved."""
    return [f"model.path={target}", f"head={head}", f"data.dir={folder}", f"out={out}", f"model.device={device}",
            "train.max_steps=2", f"train.micro_batch_tokens={length}", "train.eval_batches=0", "train.save_every=0",
            "train.log_every=1", "train.progress=false", "optim.warmup_steps=1", "wandb.mode=disabled",
            "spec_eval.prompts=[]", f"train.activation_checkpointing={str(checkpointing).lower()}"]


def _mtp_train(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtp_train.cli.train", *args], capture_output=True, text=True)


CASES = (("eagle3", 4096, False), ("eagle3", 8192, False), ("eagle3", 8192, True), ("dflash", 8192, False))


def plan_against_run(check: Checks, target: Path, work: Path,
                     cases: tuple[tuple[str, int, bool], ...] = CASES, tol: float = 0.25, device: str = "cuda") -> dict:
    """Item 1 of the module docstring over `cases` (head, tokens, activation checkpointing); returns the figures
    (GiB) by `head/tokens/ckpt`. `device` and `cases` are for a dry run of the plumbing on the CPU
    (tests/test_gpu_train_memory.py)."""
    layers = args_from_dir(target).num_layers
    aux = sorted(set(default_aux_layers(layers)) | set(default_block_layers(layers)))  # what either head reads
    record: dict = {}
    for head, length, ckpt in cases:
        folder = work / f"data-{length}"
        if not (folder / "manifest.json").is_file():
            make_folder(folder, 4, target=target, aux_layers=aux, min_len=length, max_len=length, val_fraction=0.0,
                        shard_tokens=max(65536, length), loss_fraction=1.0)
        name = f"{head}/{length}/{'ckpt' if ckpt else 'plain'}"
        out = work / f"run-{head}-{length}-{int(ckpt)}"
        args = _train_args(target, head, folder, out, length, ckpt, device)
        plan = _mtp_train([*args, "plan=true"])
        run = _mtp_train([*args, "overwrite=true", "resume=none"])
        found = PEAK_LINE.search(plan.stdout)
        metrics = out / "metrics.jsonl"
        if plan.returncode or found is None or run.returncode or not metrics.is_file():
            check(f"train memory {name}: plan and run", False, (plan.stdout + plan.stderr + run.stderr)[-1500:])
            continue
        measured = max(json.loads(line).get("train/peak_memory_gib", 0.0)
                       for line in metrics.read_text().splitlines() if line.strip())
        planned = int(found.group(1)) / GIB
        ratio = planned / measured if measured else float("inf")
        record[name] = {"planned_gib": round(planned, 3), "measured_gib": round(measured, 3), "ratio": round(ratio, 3)}
        check(f"train memory {name}: the plan within {tol:.0%} of the measured peak", 1 / (1 + tol) <= ratio <= 1 + tol,
              f"planned {planned:.2f} GiB, measured {measured:.2f} GiB (planned / measured {ratio:.3f})")
    return record


def attention_bf16(check: Checks, device: str = "cuda", n: int = 4096, steps: int = 3) -> None:
    """Item 2 of the module docstring, at SmolLM2's head shape (9 query heads, 3 KV heads of 64)."""
    g = torch.Generator(device=device).manual_seed(0)
    hq, hkv, d = 9, 3, 64
    lens = [n // 2, n // 2]
    qkv = [tuple(torch.randn(n, h, d, generator=g, device=device, dtype=DT).requires_grad_() for h in (hq, hkv, hkv))
           for _ in range(steps)]
    got = {}
    for mode in ("masked", "diagonal"):
        outs = attend_chain(ChainTrainAttention(hq, hkv, d, mode=mode), qkv, lens, device)
        grads = torch.autograd.grad(sum(o.float().square().sum() for o in outs), [x for s in qkv for x in s])
        got[mode] = ([o.detach() for o in outs], grads)
    err = max(rel_err(a, b) for a, b in zip([*got["diagonal"][0], *got["diagonal"][1]],
                                            [*got["masked"][0], *got["masked"][1]]))
    check(f"chain attention bf16, {steps} steps over {lens}: diagonal = masked", err < TOL, f"max rel err {err:.2e}")

    anchors, b = 64, 16
    q, kb, vb = (torch.randn(anchors, b, h, d, generator=g, device=device, dtype=DT).requires_grad_()
                 for h in (hq, hkv, hkv))
    kc, vc = (torch.randn(n, hkv, d, generator=g, device=device, dtype=DT).requires_grad_() for _ in range(2))
    ctx_len = torch.sort(torch.randint(1, n, (anchors,), generator=g, device=device)).values
    layout = BlockLayout(((0, anchors, 0, n),), ctx_len)
    results = []
    for fn in (packed_block_attention, explicit_block_attention):
        out = fn(q, kb, vb, kc, vc, layout)
        results.append([out.detach(), *torch.autograd.grad(out.float().square().sum(), [q, kb, vb, kc, vc])])
    err = max(rel_err(a, b) for a, b in zip(*results))
    check(f"block attention bf16, {anchors} anchors of {b} over {n} rows: ours = explicit", err < TOL,
          f"max rel err {err:.2e}")


def train_memory_check(check: Checks, target: Path, work: Path) -> None:
    """Both items; the figures on one `TRAIN_MEMORY {json}` line."""
    attention_bf16(check)
    record = plan_against_run(check, target, work)
    print(f"TRAIN_MEMORY {json.dumps(record)}", flush=True)
