"""Getting a process ready for DeepSpeed: a world of one when torchrun made none, and no CPU shm-op build."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from mtp_train.train.deepspeed_setup import prepare_deepspeed, release_deepspeed, skip_cpu_shm_comm_build


def test_world_of_one_is_made_and_released_on_cpu():
    assert not tdist.is_initialized()
    assert prepare_deepspeed(torch.device("cpu")) is True
    try:
        assert tdist.is_initialized() and tdist.get_world_size() == 1 and tdist.get_backend() == "gloo"
        assert prepare_deepspeed(torch.device("cpu")) is False  # an existing group is used, not replaced
    finally:
        release_deepspeed()
    assert not tdist.is_initialized()
    release_deepspeed()  # nothing left to release: a no-op


def test_the_shm_comm_op_is_marked_unavailable():
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    skip_cpu_shm_comm_build()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    assert build_shm_op() is None  # what DeepSpeed's TorchBackend calls: no probe, no JIT build
