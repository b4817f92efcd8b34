"""With two or more GPUs: tensor parallelism over 2 GPUs (torchrun, NCCL; checks.gpu.tp_worker is each rank) against
one GPU (hidden states, logits)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from checks.gpu.common import DT, TOL, Checks, rel_err
from mtp_train.engine import prefill_hidden
from mtp_train.models import load_model

ROOT = Path(__file__).resolve().parents[2]


def tensor_parallel_check(check: Checks, tmp: Path, path: Path) -> None:
    """TP over 2 GPUs (torchrun, NCCL) against one GPU."""
    out = tmp / "tp.pt"
    # the worker runs as a module of this checkout, so its root is the workers' working directory
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "checks.gpu.tp_worker", str(path), str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        check("tensor parallel tp=2 (NCCL)", False, proc.stderr[-800:])
        return
    got = torch.load(out)
    one = load_model(path, dtype=DT, device="cuda", backend="torch")
    ref = prefill_hidden(one, got["prompts"])
    e = rel_err(got["hidden"].cuda(), ref.hidden)
    el = rel_err(got["logits"].cuda(), one.compute_logits(ref.hidden))
    check("tensor parallel tp=2 (NCCL) vs one GPU", e < TOL and el < TOL,
          f"hidden max rel err {e:.2e}, logits {el:.2e}")
