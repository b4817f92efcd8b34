"""Getting a process ready for `deepspeed.initialize`, and tearing down what was made for it.

DeepSpeed needs torch.distributed even on one process, and reads LOCAL_RANK from the environment (DeepSpeed
0.19, `runtime/engine.py` `_set_distributed_vars`): the entry point sets that (`mtp_train.cli.train`), never this
library. Models and heads never import deepspeed; only the training floor does, lazily.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as tdist

from mtp_train.config.device import on_cpu, on_cuda


def skip_cpu_shm_comm_build() -> None:
    """Tell DeepSpeed its CPU shared-memory allreduce op is unavailable, so it is neither probed nor JIT-built.

    Works around DeepSpeed's `TorchBackend.__init__` (0.19, `deepspeed/comm/torch.py` `build_shm_op`): on a CPU
    accelerator it consults `deepspeed.ops.__compatible_ops__`, whose first access probes every op builder's
    compiler, and then JIT-builds `deepspeed_shm_comm`, which takes minutes on a small machine and fails where the
    extension does not compile (deepspeedai/DeepSpeed#7108: the same build breaking at start-up on a CPU
    accelerator). CPU runs are tests and development, where gloo's collectives are enough. The table is only read
    for that op; filling the entry first skips both the probes and the build. Call it for CPU runs only.
    """
    import deepspeed.ops

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


def prepare_deepspeed(device: torch.device) -> bool:
    """Make a world of one when torchrun did not (DeepSpeed needs a process group), and quiet DeepSpeed's logger.

    Returns True when this call created the group: the caller then calls `release_deepspeed` at the end.
    """
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step INFO lines drown ours
    if on_cpu(device):
        skip_cpu_shm_comm_build()
    if tdist.is_initialized():
        return False
    if on_cuda(device):
        # Naming the device spares NCCL guessing it (and warning at every barrier).
        dev = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        tdist.init_process_group(backend="nccl", store=tdist.HashStore(), rank=0, world_size=1, device_id=dev)
    else:
        tdist.init_process_group(backend="gloo", store=tdist.HashStore(), rank=0, world_size=1)
    return True


def release_deepspeed() -> None:
    """Destroy the world of one `prepare_deepspeed` made, through DeepSpeed when it took it over.

    DeepSpeed then forgets the groups it derived from it, so a later run in the same process (a resume) builds
    a new world.
    """
    if not tdist.is_initialized():
        return
    import deepspeed.comm

    if deepspeed.comm.is_initialized():
        deepspeed.comm.destroy_process_group()
    else:  # the run failed before DeepSpeed set up its communication
        tdist.destroy_process_group()
