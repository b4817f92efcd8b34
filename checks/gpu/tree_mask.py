"""Claim (c): SmolLM2's verify time by rows 1-64 with the tree mask (FlashInfer's custom mask) against a chain of the
same rows, batch 1 and 8, one table each and a `TREE_COST {json}` line (the timing: checks.gpu.tree_cost); before
that, a chain passed as a tree mask must give the causal chain's logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from checks.gpu.common import DT, TOL, Checks, rel_err
from checks.gpu.tree_cost import ROWS, chain_parents, cost_table, format_table, verify_times
from mtp_train.engine import ModelRunner, Sequence
from mtp_train.models import load_model


def tree_mask_cost(check: Checks, tag: str, path: Path, device: str = "cuda", backend: str = "flashinfer",
                   rounds: int = 20, dtype: torch.dtype = DT) -> None:
    """Claim (c): the target's verify time by rows (1-64) with the tree mask against a chain of the same rows, on
    the FlashInfer backend (its custom mask), batch 1 and 8, one table each (`tree_cost`); before that, the chain
    passed as a tree mask must give the causal chain's logits. `device` / `backend` / `rounds` / `dtype` are
    for a dry run of the plumbing on CPU."""
    model = load_model(path, dtype=dtype, device=device, backend=backend)
    runner = ModelRunner.create(model, kv_cache_gb=1)
    prefix = [(7 * i) % model.args.vocab_size for i in range(300)]
    worst = 0.0
    for r in (16, 64):
        logits = []
        for tree in (None, [chain_parents(r)]):
            s = Sequence.new(0, prefix, device=device)
            runner.run([s])  # the prefix cached, then r new rows verified over it
            s.token_ids.extend(range(100, 100 + r))
            logits.append(runner.run([s], logits="all", tree=tree).logits)
            runner.free(s)
        worst = max(worst, rel_err(logits[1], logits[0]))
    check(f"{tag} tree mask: a chain as a tree mask = the causal chain (16 and 64 rows)", worst < TOL,
          f"max rel err {worst:.2e}")
    for batch in (1, 8):
        table = cost_table(verify_times(model, ROWS, batch=batch, rounds=rounds))
        print(f"INFO  {tag} verify time by rows, batch {batch}, 512 cached tokens (claim (c): tree mask vs chain):\n"
              f"{format_table(table)}", flush=True)
        print(f"TREE_COST {json.dumps({'model': tag, 'batch': batch, 'table': table})}", flush=True)
