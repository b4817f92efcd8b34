"""The block-attention benchmark's two sides compute the same attention, so its ratios compare like with like."""

from __future__ import annotations

import torch

from bench.block_attention import dense, make_inputs, ours


def test_dense_masked_sdpa_equals_ours_forward_and_backward():
    x = make_inputs([9, 1, 14], anchors=12, block=3)
    assert sum(a1 - a0 for a0, a1, _, _ in x["layout"].groups) == 12
    got, ref = ours(x), dense(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    names = ("q", "k_blk", "v_blk", "k_ctx", "v_ctx")
    grads = torch.autograd.grad(got.square().sum(), [x[n] for n in names])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x[n] for n in names])
    for n, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"grad of {n}: {m}")
