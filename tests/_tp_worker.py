"""One rank of a tensor-parallel run, started by torchrun from tests/test_tensor_parallel.py.

    torchrun --standalone --nproc_per_node 2 tests/_tp_worker.py MODEL_DIR OUT_FILE

Each rank loads only its slices; rank 0 saves the prefill hidden states / logits and greedy generations.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as tdist

from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.models.tensor_parallel import load_model_tp, tp_groups

PROMPTS = [[3, 17, 42, 9, 100], list(range(20, 41)), [250, 7, 1]]


def run(model) -> dict:
    out = prefill_hidden(model, PROMPTS)
    logits = model.compute_logits(out.hidden)
    gen = LLMEngine(model, page_size=4, num_pages=64).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return {"hidden": out.hidden, "logits": logits, "tokens": [g.output_ids for g in gen]}


def main(argv: list[str]) -> None:
    model_dir, out_file = argv
    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    tp, _, _ = tp_groups(tdist.get_world_size())
    model = load_model_tp(model_dir, tp, dtype="float32", backend="torch")
    res = run(model)
    if tdist.get_rank() == 0:
        torch.save(res, out_file)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
