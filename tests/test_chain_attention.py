"""The chained training attention's two modes: `diagonal` (one causal attention per step, the own keys folded in as
one extra key) gives `masked`'s attention over all (j+1)·n keys, forward and backward."""

from __future__ import annotations

import json

import pytest
import torch

from checks.gpu.chain_attention import chain_attention_check
from checks.gpu.common import Checks
from mtp_train.heads.chain_attention import ChainTrainAttention, attend_chain


def _unroll(mode: str, qkv: list[tuple[torch.Tensor, ...]], lens: list[int], window: int | None) -> list[torch.Tensor]:
    q0, k0, _ = qkv[0]
    return attend_chain(ChainTrainAttention(q0.shape[1], k0.shape[1], q0.shape[2], window, mode), qkv, lens)


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


def test_the_gpu_checks_chain_attention_section_runs_on_the_cpu(capsys):
    """checks.gpu's chain-attention group as a dry run on the CPU (float32, small shapes, one round): the modes
    agree, and its record line carries both modes' times per shape."""
    check = Checks()
    chain_attention_check(check, device="cpu", dtype=torch.float32, lens=(9, 4), steps=3,
                          shapes=(("tiny", 4, 2, 8),), rounds=1)
    assert [(name, ok) for name, ok, _ in check.results] == [
        ("chain attention tiny (4/2 heads of 8), 3 steps: diagonal = masked", True)]
    line = next(json.loads(x.split(" ", 1)[1]) for x in capsys.readouterr().out.splitlines()
                if x.startswith("CHAIN_ATTENTION "))
    assert line["steps"] == 3 and line["lens"] == [9, 4]
    assert {"masked_ms", "diagonal_ms", "masked_over_diagonal"} <= set(line["tiny"])
