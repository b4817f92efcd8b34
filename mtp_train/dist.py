"""torch.distributed set-up from torchrun's environment, and the few helpers every stage needs.

Entry points read torchrun's environment (`mtp_train.cli.common.launch_env`) and call `init_distributed()` once;
library code takes `rank` / `world` as arguments and never reads the environment itself. Without torchrun
(WORLD_SIZE unset, or 1) everything is a no-op and the process is rank 0 of 1. `sequence_groups` splits the job
into sequence-parallel groups (training's `train.sequence_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mtp_train.config.device import device_kind
from mtp_train.config.errors import ConfigError


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


@dataclass(frozen=True)
class Launch:
    """What the launcher (torchrun) says about this process: RANK, WORLD_SIZE, LOCAL_RANK (read by the CLI)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0


def init_distributed(device: str = "auto", launch: Launch | None = None,
                     timeout: timedelta = timedelta(minutes=30)) -> DistInfo:
    """Initialise the default process group for the process `launch` describes (default: rank 0 of 1).

    device: a device name (`auto`, `cpu`, `cuda`, `cuda:N`; see `mtp_train.config.device`). On CUDA each rank gets
    `cuda:<local_rank>` and the NCCL backend; on CPU, gloo. timeout bounds every collective (a rank that waits
    longer at a barrier fails instead of hanging). Calling it again returns the same info.
    """
    launch = launch or Launch()
    kind = device_kind(device)
    if kind == "cuda":
        torch.cuda.set_device(launch.local_rank)
    dev = torch.device("cuda", launch.local_rank) if kind == "cuda" else torch.device("cpu")
    if launch.world > 1 and not dist.is_initialized():
        backend = "nccl" if kind == "cuda" else "gloo"
        kwargs = {"device_id": dev} if kind == "cuda" else {}
        dist.init_process_group(backend=backend, rank=launch.rank, world_size=launch.world, timeout=timeout,
                                **kwargs)
    return DistInfo(rank=launch.rank, world=launch.world, local_rank=launch.local_rank, device=dev)


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


@dataclass(frozen=True)
class SequenceGroups:
    """This rank's place in sequence parallelism (`train.sequence_parallel`): groups of `size` consecutive ranks
    share each sample's positions; the groups are data parallel among themselves."""

    size: int  # N, ranks per sequence-parallel group
    index: int  # this rank's index inside its group, 0..N-1 (its rows of every batch)
    dp_rank: int  # which group: the data-parallel rank (rank // N), whose batches the group reads
    dp_world: int  # number of groups: the data-parallel degree (world / N)
    group: dist.ProcessGroup | None  # the group's ranks [dp_rank·N, (dp_rank+1)·N); None when N = 1


def sequence_groups(size: int, rank: int, world: int) -> SequenceGroups:
    """The sequence-parallel groups of a job of `world` ranks: ranks [g·size, (g+1)·size) form group g.

    Every rank creates every group, in the same order (`new_group` is collective); size 1 creates none.
    """
    if size < 1 or world % size:
        raise ConfigError(f"train.sequence_parallel={size} does not divide the world size {world}: give a divisor "
                          f"of {world} (the ranks of a sequence-parallel group share one sample), or launch a "
                          "multiple of it with torchrun --nproc_per_node")
    if size == 1:
        return SequenceGroups(1, 0, rank, world, None)
    mine = None
    for g in range(world // size):
        group = dist.new_group(list(range(g * size, (g + 1) * size)))
        if g == rank // size:
            mine = group
    return SequenceGroups(size, rank % size, rank // size, world // size, mine)
