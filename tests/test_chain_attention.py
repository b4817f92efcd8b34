"""The chained training attention's two modes: `diagonal` (one causal attention per step, the own keys folded in as
one extra key) gives `masked`'s attention over all (j+1)·n keys, forward and backward."""

from __future__ import annotations

import pytest
import torch

from mtp_train.heads.chain_attention import ChainTrainAttention
from mtp_train.layers import AttentionMetadata


def _unroll(mode: str, qkv: list[tuple[torch.Tensor, ...]], lens: list[int], window: int | None) -> list[torch.Tensor]:
    q0, k0, _ = qkv[0]
    attn = ChainTrainAttention(q0.shape[1], k0.shape[1], q0.shape[2], window, mode)
    outs = []
    for j, (q, k, v) in enumerate(qkv):
        meta = AttentionMetadata.build(lens)
        meta.positions = meta.positions + j
        attn.prepare(meta)
        outs.append(attn.forward(q, k, v, None, meta))
    return outs


@pytest.mark.parametrize(("heads", "dv", "window"), [((6, 2), 16, None), ((4, 4), 16, 3), ((4, 1), 8, None)],
                         ids=["gqa", "window", "latent-values"])
def test_diagonal_mode_is_the_masked_attention_forward_and_backward(heads, dv, window):
    g = torch.Generator().manual_seed(0)
    lens, steps, d = [7, 5, 1], 5, 16
    t = sum(lens)
    qkv = [tuple((torch.randn(t, h, w, generator=g) * 2).requires_grad_() for h, w in
                 ((heads[0], d), (heads[1], d), (heads[1], dv))) for _ in range(steps)]
    leaves = [x for step in qkv for x in step]
    weights = [torch.randn(t, heads[0], dv, generator=g) for _ in range(steps)]
    results = {}
    for mode in ("masked", "diagonal"):
        outs = _unroll(mode, qkv, lens, window)
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        results[mode] = (outs, torch.autograd.grad(loss, leaves))
    for a, b in zip(results["masked"][0], results["diagonal"][0], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for a, b in zip(results["masked"][1], results["diagonal"][1], strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown chain attention mode 'dense'.*diagonal, masked"):
        ChainTrainAttention(4, 2, 8, mode="dense")
