"""Distributed set-up without torchrun is a single process of rank 0 (the multi-rank path is exercised by
the two-rank precompute test)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from mtp_train import dist
from mtp_train.cli.common import launch_env


def test_single_process_is_a_no_op(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert launch_env() == dist.Launch(rank=0, world=1, local_rank=0)
    info = dist.init_distributed(device="cpu", launch=launch_env())
    assert (info.rank, info.world, info.local_rank, info.device) == (0, 1, 0, torch.device("cpu"))
    assert info.is_main and dist.is_main() and dist.get_rank() == 0 and dist.get_world_size() == 1
    assert not tdist.is_initialized()
    dist.barrier()
    assert dist.cpu_group(timeout=timedelta(seconds=1)) is None
    dist.destroy()


def test_bad_device():
    with pytest.raises(ValueError, match="auto|cpu|cuda"):
        dist.init_distributed(device="tpu")


def test_launch_env_reads_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch_env() == dist.Launch(rank=3, world=4, local_rank=1)
