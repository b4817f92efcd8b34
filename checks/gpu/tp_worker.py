"""One rank of the GPU tensor-parallel check (checks.gpu.tensor_parallel starts it with torchrun, 2 processes, NCCL).

Usage, from the checkout's root: torchrun --standalone --nproc_per_node 2 -m checks.gpu.tp_worker MODEL_DIR OUT_FILE
Rank 0 saves the prompts, the TP hidden states and logits to OUT_FILE.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as tdist

from mtp_train.engine import prefill_hidden
from mtp_train.models.tensor_parallel import load_model_tp, tp_groups


def main(model_dir: str, out_file: str) -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    tdist.init_process_group("nccl")
    tp, _, _ = tp_groups(tdist.get_world_size())
    model = load_model_tp(model_dir, tp, dtype=torch.bfloat16, device=f"cuda:{local}", backend="torch")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist() for n in (33, 7, 120)]
    out = prefill_hidden(model, prompts)
    logits = model.compute_logits(out.hidden)
    if tdist.get_rank() == 0:
        torch.save({"prompts": prompts, "hidden": out.hidden.cpu(), "logits": logits.cpu()}, out_file)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
