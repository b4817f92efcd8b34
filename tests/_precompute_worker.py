"""One rank of a multi-rank precompute, started by torchrun from tests/test_precompute.py.

    torchrun --standalone --nproc_per_node 2 tests/_precompute_worker.py MODEL_DIR OUT_DIR N SEED \
        SHARD_TOKENS BATCH_TOKENS AUX_LAYERS VAL_FRACTION [TP]

TP > 1 runs the target tensor-parallel in groups of TP ranks (each group one data-parallel rank).

Every rank builds the same samples from the seed (`make_samples`, shared with the test).
"""

from __future__ import annotations

import sys

import torch

from mtp_train.cli.common import configure_from_env
from mtp_train.precompute import Sample


def make_samples(n: int, seed: int, max_len: int = 40, vocab: int = 256) -> list[Sample]:
    """n random samples with lengths 1..max_len, random tokens and random 0/1 loss masks."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        mask = torch.randint(0, 2, (length,), generator=g).tolist()
        out.append(Sample(id=f"conv-{seed}-{i:04d}", input_ids=ids, loss_mask=mask))
    return out


def main(argv: list[str]) -> None:
    configure_from_env()  # the kernel settings the test process runs with (MTP_TRAIN_KERNEL_CHOICE, tests/conftest.py)
    from mtp_train import dist
    from mtp_train.config import PrecomputeConfig
    from mtp_train.models import load_model
    from mtp_train.precompute import precompute

    model_dir, out_dir, n, seed, shard_tokens, batch_tokens, aux, val_fraction, *rest = argv
    tp_size = int(rest[0]) if rest else 1
    torch.set_num_threads(1)  # two ranks on a small CPU: avoid oversubscription
    from mtp_train.cli.common import launch_env

    info = dist.init_distributed(device="cpu", launch=launch_env())
    try:
        if tp_size > 1:
            from mtp_train.models.tensor_parallel import load_model_tp, tp_groups

            tp, rank, world = tp_groups(tp_size)
            model = load_model_tp(model_dir, tp, dtype="float32", backend="torch")
            tp_rank = tp.rank
        else:
            model = load_model(model_dir, dtype="float32", backend="torch")
            rank, world, tp_rank = info.rank, info.world, 0
        cfg = PrecomputeConfig(out=out_dir, shard_tokens=int(shard_tokens), batch_tokens=int(batch_tokens),
                               aux_layers=[int(j) for j in aux.split(",") if j], val_fraction=float(val_fraction),
                               seed=0, progress=False)
        precompute(
            model, make_samples(int(n), int(seed)), cfg,
            tokenizer_fingerprint="tok-fp", chat_template_fingerprint="tmpl-fp", model_dir=model_dir,
            data_info={"source": "random"}, rank=rank, world=world, tp_rank=tp_rank, tp_size=tp_size,
        )
    finally:
        dist.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
