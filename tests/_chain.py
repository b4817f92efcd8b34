"""Test helpers shared by the head tests: packed-sequence starts, a head's paged cache, and the check that an
unrolled training step equals the inference draft chain."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mtp_train.engine import KVCache
from mtp_train.heads import DraftHead
from mtp_train.layers import AttentionMetadata


def seq_starts(lens: Sequence[int]) -> list[int]:
    """Row offset of each packed sequence."""
    return [sum(lens[:b]) for b in range(len(lens))]


def new_cache(head: DraftHead, page_size: int) -> KVCache:
    """A fresh one-layer paged pool in the head's KV layout."""
    layers, layout = head.kv_shape
    return KVCache(layers, num_pages=64, page_size=page_size, layout=layout)


def assert_unroll_is_the_inference_chain(head: DraftHead, inputs: torch.Tensor, tokens: torch.Tensor,
                                         lens: Sequence[int], outs: Sequence[torch.Tensor], page_size: int,
                                         tol: dict) -> None:
    """Row i of unrolled step j (`outs[j]`) = draft step j of a chain started at i over a fresh paged cache.

    inputs: (T, W) the head's step-0 input rows (target hidden or aux features), tokens: (T,), lens: (B,). The
    cache is filled from the target's rows 0..i (tokens t_1..t_{i+1}); each later step feeds the previous output
    with the next token at the next position.
    """
    steps = len(outs)
    for b, start in enumerate(seq_starts(lens)):
        n = lens[b]
        h, t = inputs[start:start + n], tokens[start:start + n]
        for i in range(n - 1):
            kv = new_cache(head, page_size)
            pages: list[int] = []
            kv.ensure(pages, i + 1)
            meta = AttentionMetadata.build([i + 1], [i + 1], [pages], page_size)
            # catch-up on target states
            x = head(h[: i + 1], t[1: i + 2], meta, kv.layers[0], from_target=True).hidden[-1:]
            torch.testing.assert_close(x[0], outs[0][start + i], **tol)
            for j in range(1, min(steps, n - 1 - i)):
                kv.ensure(pages, i + j + 1)
                meta = AttentionMetadata.build([1], [i + j + 1], [pages], page_size)
                x = head(x, t[i + j + 1: i + j + 2], meta, kv.layers[0], from_target=False).hidden
                torch.testing.assert_close(x[0], outs[j][start + i], **tol, msg=f"seq {b} row {i} step {j}")
