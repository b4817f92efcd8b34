"""torch.distributed set-up from torchrun's environment, and the few helpers every stage needs.

Entry points call `init_distributed()` once; library code takes `rank` / `world` as arguments and
never reads the environment itself. Without torchrun (no `WORLD_SIZE`, or 1) everything is a no-op
and the process is rank 0 of 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int  # global rank, 0..world-1
    world: int  # number of processes
    local_rank: int  # rank on this node (the GPU index on CUDA)
    device: torch.device  # the device this rank computes on

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", timeout: timedelta = timedelta(minutes=30)) -> DistInfo:
    """Initialise the default process group from torchrun's RANK / WORLD_SIZE / LOCAL_RANK.

    device: "auto" (cuda when available, else cpu), "cpu" or "cuda". On CUDA each rank gets
    `cuda:<local_rank>` and the NCCL backend; on CPU, gloo. timeout bounds every collective (a rank
    that waits longer at a barrier fails instead of hanging). Calling it again returns the same info.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto|cpu|cuda, got {device!r}")
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        kwargs = {"device_id": dev} if device == "cuda" else {}
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return DistInfo(rank=rank, world=world, local_rank=local_rank, device=dev)


def get_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """True on the rank that alone logs and writes shared files."""
    return get_rank() == 0


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank (of `group`, default all); a no-op without a process group."""
    if not dist.is_initialized():
        return
    if group is None and dist.get_backend() == "nccl":
        # Naming the device avoids NCCL guessing it (and warning) when the barrier is the first collective.
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def cpu_group(timeout: timedelta) -> dist.ProcessGroup | None:
    """A gloo group over all ranks with its own timeout; None without a process group.

    Stages whose ranks finish at very different times (a resumed rank has nothing left to do) wait on
    this group, so the default group's short timeout still guards training collectives. All ranks
    must call it at the same point, early, while they are in step.
    """
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def destroy() -> None:
    """Tear the process group down at the end of an entry point (no-op without one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
