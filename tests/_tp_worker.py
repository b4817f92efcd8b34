"""One rank of a tensor-parallel run, started by torchrun from tests/test_tensor_parallel.py.

    torchrun --standalone --nproc_per_node 2 tests/_tp_worker.py MODEL_DIR OUT_FILE [MODEL_DIR OUT_FILE ...]

Each rank loads only its slices; rank 0 saves the prefill hidden states / logits and greedy generations, and the
number of all-reduces one prefill forward makes (each pair of arguments is one model, in one process group).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as tdist

from mtp_train.cli.common import configure_from_env
from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.models.tensor_parallel import load_model_tp, tp_groups

PROMPTS = [[3, 17, 42, 9, 100], list(range(20, 41)), [250, 7, 1]]


def run(model) -> dict:
    out = prefill_hidden(model, PROMPTS)
    logits = model.compute_logits(out.hidden)
    gen = LLMEngine(model, page_size=4, num_pages=64).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return {"hidden": out.hidden, "logits": logits, "tokens": [g.output_ids for g in gen]}


def count_all_reduces(model) -> int:
    """The all-reduces of one prefill forward (torch.distributed's, counted as they are called)."""
    calls, real = [0], tdist.all_reduce

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    tdist.all_reduce = counted
    try:
        prefill_hidden(model, PROMPTS[:1])
    finally:
        tdist.all_reduce = real
    return calls[0]


def main(argv: list[str]) -> None:
    configure_from_env()  # the kernel settings the test process runs with (MTP_TRAIN_KERNEL_CHOICE, tests/conftest.py)
    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    tp, _, _ = tp_groups(tdist.get_world_size())
    for model_dir, out_file in zip(argv[::2], argv[1::2], strict=True):
        model = load_model_tp(model_dir, tp, dtype="float32", backend="torch")
        res = {**run(model), "all_reduces": count_all_reduces(model)}
        if tdist.get_rank() == 0:
            torch.save(res, out_file)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    # Every result is saved and both ranks passed the barrier: leave without the interpreter's finalisation, where
    # gloo's worker threads can still be torn down and abort a finished rank now and then ("terminate called
    # without an active exception", SIGABRT after its work is done; pytorch/pytorch#179291 describes the race).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
