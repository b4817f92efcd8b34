"""The block drafter's attention (`packed_block_attention`): the explicit formula's attention (`block_attend`,
forward and gradients) through one fused SDPA per chunk of anchors, the block folded in as its sink, so that
nothing (anchors × heads × B × context) is kept for the backward."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

import mtp_train.heads.block_attention as ba
from bench.attention_memory import block_layout, block_saved
from mtp_train.heads.block_attention import BlockLayout, explicit_block_attention, packed_block_attention

NAMES = ("q", "k_blk", "v_blk", "k_ctx", "v_ctx")


def _inputs(heads: tuple[int, int], b: int = 3, d: int = 8, dtype: torch.dtype = torch.float32
            ) -> tuple[list[torch.Tensor], BlockLayout]:
    """Three packed sequences (context rows 6, 0, 9) and a drafting-style group with no context: anchors 0..1 read
    sequence 0, anchor 2 reads none (an empty context), anchors 3..6 sequence 2."""
    g = torch.Generator().manual_seed(0)
    a, n = 7, 15
    shapes = ((a, b, heads[0], d), (a, b, heads[1], d), (a, b, heads[1], d), (n, heads[1], d), (n, heads[1], d))
    xs = [(torch.randn(*s, generator=g) * 2).to(dtype).requires_grad_() for s in shapes]
    layout = BlockLayout(((0, 2, 0, 6), (2, 3, 6, 6), (3, 7, 6, 15)), torch.tensor([1, 6, 0, 1, 4, 8, 9]))
    return xs, layout


def _grads(out: torch.Tensor, xs: list[torch.Tensor], w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out.float() * w).sum(), xs)


@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_ours_is_the_explicit_formula_forward_and_backward(heads, monkeypatch):
    xs, layout = _inputs(heads)
    ref = explicit_block_attention(*xs, layout)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = _grads(ref, xs, w)
    for budget in (ba.SCORE_BUDGET, 1):  # all anchors of a sequence at once, then one anchor per chunk
        monkeypatch.setattr(ba, "SCORE_BUDGET", budget)
        got = packed_block_attention(*xs, layout)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for name, a, b in zip(NAMES, _grads(got, xs, w), ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_bf16_is_as_close_to_float32_as_the_explicit_formula():
    """In bf16 the block's logsumexp rides in two columns (high and low part): ours errs against the float32
    attention as little as the explicit formula (float32 scores over bf16 inputs) does."""
    xs, layout = _inputs((6, 2), b=4, d=16)
    exact = explicit_block_attention(*xs, layout)
    w = torch.randn(exact.shape, generator=torch.Generator().manual_seed(1))
    exact_grads = _grads(exact, xs, w)
    low = [x.detach().bfloat16().requires_grad_() for x in xs]
    errs = {}
    for name, fn in (("explicit", explicit_block_attention), ("ours", packed_block_attention)):
        out = fn(*low, layout)
        assert out.dtype == torch.bfloat16
        errs[name] = ((out.float() - exact).abs().max().item(),
                      max((a.float() - e).abs().max().item() / e.abs().max().item()
                          for a, e in zip(_grads(out, low, w), exact_grads)))
    assert errs["ours"][0] <= 2 * errs["explicit"][0] + 1e-3, errs
    assert errs["ours"][1] <= 2 * errs["explicit"][1] + 1e-3, errs


def test_the_drafting_path_runs_under_inference_mode():
    xs, layout = _inputs((6, 2))
    with torch.inference_mode():
        got = packed_block_attention(*(x.detach() for x in xs), layout)
    torch.testing.assert_close(got, explicit_block_attention(*xs, layout).detach(), rtol=1e-5, atol=1e-5)


def test_a_layout_that_misses_blocks_is_refused():
    xs, layout = _inputs((6, 2))
    with pytest.raises(ValueError, match="the layout's groups cover 6 of 7 blocks"):
        packed_block_attention(*xs, BlockLayout(layout.groups[:2] + ((3, 6, 6, 15),), layout.ctx_len))


def test_cpu_runs_the_flash_kernel_never_the_math_one():
    xs, layout = _inputs((9, 3), b=16, d=64)
    with profile() as prof:
        packed_block_attention(*xs, layout).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= names
    assert "aten::_scaled_dot_product_attention_math" not in names


def test_memory_grows_with_the_context_alone_and_keeps_no_probabilities():
    """64 blocks of 16 over 2048 and 4096 context rows: the bytes autograd saves grow by the context (< 2.3x) and
    no saved storage is as large as the blocks' rows × the context, while the explicit formula keeps its
    (A, Hq, B, N) probabilities."""
    a, b = 64, 16
    (small, big_small), (large, big_large) = (block_saved(block_layout(n, a), b, explicit=False) for n in (2048, 4096))
    assert large / small < 2.3, (small, large)
    assert big_small < a * b * 2048 and big_large < a * b * 4096
    explicit, biggest = block_saved(block_layout(2048, a), b, explicit=True)
    assert biggest >= a * b * 2048 and explicit > 4 * small  # (its chunks of) heads × rows × context
