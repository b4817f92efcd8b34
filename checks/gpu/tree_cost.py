"""The target's verify time by rows with the tree mask against a chain of the same rows (the seed system's claim (c):
tree-mask attention cost is what limits tree size on GPU).

For each row count r (1..64) one target forward over r new rows on top of a cached prefix, batch B, through our
runner (eager, the engine's attention backend: FlashInfer's custom mask on CUDA), three ways:

    chain       the r rows causal (what a chain of r − 1 drafts verifies; FlashInfer's causal kernel)
    chain_mask  the same chain passed as a tree (parents 0, 1, .., r − 2): the custom-mask path with a causal
                mask, so chain_mask / chain is the price of the mask path alone
    tree        an EAGLE-2-like tree of r rows (breadth first, `topk` children a node, `tree_parents`): the mask
                path with a tree's mask

A time is the whole step as the engine pays it: its planning (for a tree, the mask built on the host and copied
over) and the forward. A row r = 1 is the decode step every ratio is taken to (`*_vs_decode`). The rounds
interleave every (r, kind), and the medians are kept, so drift on the machine hits all of them alike. Used by
checks.gpu.tree_mask; runs on the CPU too (the torch backend's tree mask), which only the tests do.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from mtp_train.config.device import on_cuda
from mtp_train.engine import ModelRunner
from mtp_train.engine import Sequence as EngineSeq
from mtp_train.engine.timing import verify_seconds

ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # verify rows per sequence, the root included
KINDS = ("chain", "chain_mask", "tree")


def chain_parents(rows: int) -> list[int]:
    """(rows,) parents of a chain as `AttentionMetadata.set_tree` takes them: -1, 0, 1, .., rows − 2."""
    return list(range(-1, rows - 1))


def tree_parents(rows: int, topk: int = 4) -> list[int]:
    """(rows,) parents of a tree of `rows` rows laid breadth first, each node with up to `topk` children (row 0 the
    root, -1): the shape of EAGLE-2's trees at topk, every parent before its children."""
    if rows < 1 or topk < 1:
        raise ValueError(f"a tree needs rows >= 1 and topk >= 1, got rows={rows}, topk={topk}")
    return [-1] + [(i - 1) // topk for i in range(1, rows)]


def tree_depth(parents: Sequence[int]) -> int:
    """The deepest row's depth (the root's is 0)."""
    depth: list[int] = []
    for p in parents:
        depth.append(depth[p] + 1 if p >= 0 else 0)
    return max(depth)


@torch.inference_mode()
def verify_times(model, rows: Sequence[int] = ROWS, *, topk: int = 4, batch: int = 1, prefix: int = 512,
                 rounds: int = 20, warmup: int = 3) -> dict[int, dict[str, float]]:
    """Median seconds of one forward of r new rows per sequence (batch sequences over `prefix` cached tokens) for
    each kind of KINDS → {r: {"chain": s, "chain_mask": s, "tree": s}}."""
    if max(rows) > 64:
        raise ValueError(f"a tree step takes at most 64 rows per sequence, got {max(rows)}")
    runner = ModelRunner.create(model, kv_cache_gb=0.5)
    vocab = model.args.vocab_size
    seqs = [EngineSeq.new(b, [(7 * i + 13 * b) % vocab for i in range(prefix)], device=model.device)
            for b in range(batch)]
    runner.run(seqs, logits="last")
    cuda = on_cuda(model.device)
    trees = {"chain": lambda r: None, "chain_mask": chain_parents, "tree": lambda r: tree_parents(r, topk)}
    times: dict[int, dict[str, list[float]]] = {r: {k: [] for k in KINDS} for r in rows}
    for i in range(warmup + rounds):
        for r in rows:
            for kind in KINDS:
                parents = trees[kind](r)
                seconds = verify_seconds(runner, seqs, [(500 + j) % vocab for j in range(r)], prefix,
                                         tree=None if parents is None else [parents] * batch, sync=cuda)
                if i >= warmup:
                    times[r][kind].append(seconds)
    return {r: {k: statistics.median(v) for k, v in by.items()} for r, by in times.items()}


def cost_table(times: dict[int, dict[str, float]], topk: int = 4) -> list[dict[str, float]]:
    """The medians → one row per r: milliseconds of each kind, tree / chain, chain_mask / chain, and each kind
    over the 1-row step (the decode step; the smallest r measured when 1 is not)."""
    one = times[min(times)]["chain"]
    out = []
    for r, t in sorted(times.items()):
        row: dict[str, float] = {"rows": r, "tree_depth": tree_depth(tree_parents(r, topk))}
        row.update({f"{k}_ms": round(1e3 * t[k], 3) for k in KINDS})
        row["tree_vs_chain"] = round(t["tree"] / t["chain"], 3)
        row["mask_vs_chain"] = round(t["chain_mask"] / t["chain"], 3)
        row.update({f"{k}_vs_decode": round(t[k] / one, 3) for k in KINDS})
        out.append(row)
    return out


def format_table(table: Sequence[dict[str, float]]) -> str:
    """The rows as one aligned text table (a header line, then one line per r)."""
    cols = ["rows", "tree_depth", "chain_ms", "chain_mask_ms", "tree_ms", "tree_vs_chain", "mask_vs_chain",
            "chain_vs_decode", "tree_vs_decode"]
    lines = ["  ".join(f"{c:>15}" for c in cols)]
    lines += ["  ".join(f"{row[c]:>15}" for c in cols) for row in table]
    return "\n".join(lines)
