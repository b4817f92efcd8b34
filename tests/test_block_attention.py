"""The block drafter's attention (`packed_block_attention`): the explicit formula's attention (`block_attend`,
forward and gradients) as a mask-free SDPA over each chunk's common prefix plus an explicit group (the ragged
context and the own blocks) folded in as its sink, so that nothing of anchors × context exists, forward or
backward, and its memory grows with the context alone."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import profile

import mtp_train.heads.block_attention as ba
from bench.attention_memory import D, block_layout, block_memory
from mtp_train.heads.block_attention import (
    BlockLayout,
    anchor_chunks,
    explicit_block_attention,
    packed_block_attention,
)

NAMES = ("q", "k_blk", "v_blk", "k_ctx", "v_ctx")


def _several_sequences() -> tuple[tuple[tuple[int, int, int, int], ...], list[int], int]:
    """Three packed sequences (context rows 6, 0, 9) and a drafting-style group with no context: anchors 0..1 read
    sequence 0, anchor 2 reads none (an empty context), anchors 3..6 sequence 2 (its first at position 0)."""
    return ((0, 2, 0, 6), (2, 3, 6, 6), (3, 7, 6, 15)), [1, 6, 0, 0, 4, 8, 9], 15


def _spread() -> tuple[tuple[tuple[int, int, int, int], ...], list[int], int]:
    """One long sequence (200 rows), 12 anchors spread over it, the first at position 0."""
    return ((0, 12, 0, 200),), [0, 3, 17, 40, 41, 75, 90, 120, 150, 151, 180, 200], 200


def _clustered() -> tuple[tuple[tuple[int, int, int, int], ...], list[int], int]:
    """Two sequences: a cluster of consecutive anchors deep in the first, then lone far ones; the second's anchors
    side by side at its start."""
    return (((0, 9, 0, 120), (9, 12, 120, 130)),
            [60, 61, 62, 63, 64, 65, 66, 110, 119, 1, 2, 3], 130)


def _unordered() -> tuple[tuple[tuple[int, int, int, int], ...], list[int], int]:
    """Anchors out of order and repeated (a batch packs them ascending; a chunk reads from its shortest)."""
    return ((0, 6, 0, 50),), [30, 5, 49, 0, 12, 12], 50


LAYOUTS = {"several_sequences": _several_sequences, "spread": _spread, "clustered": _clustered,
           "unordered": _unordered}


def _inputs(heads: tuple[int, int], layout: str = "several_sequences", b: int = 3, d: int = 8,
            dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], BlockLayout]:
    groups, ctx_len, n = LAYOUTS[layout]()
    g = torch.Generator().manual_seed(0)
    a = len(ctx_len)
    shapes = ((a, b, heads[0], d), (a, b, heads[1], d), (a, b, heads[1], d), (n, heads[1], d), (n, heads[1], d))
    xs = [(torch.randn(*s, generator=g) * 2).to(dtype).requires_grad_() for s in shapes]
    return xs, BlockLayout(groups, torch.tensor(ctx_len))


def _grads(out: torch.Tensor, xs: list[torch.Tensor], w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out.float() * w).sum(), xs)


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Equal up to float32 rounding at the tensor's own scale (both sides score in float32, in another order)."""
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_ours_is_the_explicit_formula_forward_and_backward(heads, layout, monkeypatch):
    xs, lay = _inputs(heads, layout)
    ref = explicit_block_attention(*xs, lay)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = _grads(ref, xs, w)
    # all anchors of a sequence in one chunk; chunks of a few anchors with ragged parts; one anchor per chunk
    for budget in (ba.SCORE_BUDGET, 3 * heads[0] * 3 * 40, 1):
        monkeypatch.setattr(ba, "SCORE_BUDGET", budget)
        got = packed_block_attention(*xs, lay)
        _close(got, ref, f"output under budget {budget}")
        for name, a, b in zip(NAMES, _grads(got, xs, w), ref_grads, strict=True):
            _close(a, b, f"grad of {name} under budget {budget}")


def test_chunks_cover_the_anchors_in_order_within_the_budget():
    ctx = [0, 3, 17, 40, 41, 75, 90, 120, 150, 151, 180, 200]
    for budget in (1, 2000, 10_000, 10**9):
        chunks = anchor_chunks(ctx, 4, 3, budget)
        assert [s for s, _ in chunks] == [0] + [e for _, e in chunks[:-1]] and chunks[-1][1] == len(ctx)
        for s, e in chunks:
            assert e - s == 1 or (e - s) * 4 * 3 * (ctx[e - 1] - ctx[s] + 4) <= budget
    assert anchor_chunks(ctx, 4, 3, 10**9) == [(0, len(ctx))] and len(anchor_chunks(ctx, 4, 3, 1)) == len(ctx)


def test_bf16_is_as_close_to_float32_as_the_explicit_formula():
    """In bf16 the explicit group's logsumexp rides in two columns (high and low part): ours errs against the
    float32 attention as little as the explicit formula (float32 scores over bf16 inputs) does."""
    for layout in ("several_sequences", "spread"):
        xs, lay = _inputs((6, 2), layout, b=4, d=16)
        exact = explicit_block_attention(*xs, lay)
        w = torch.randn(exact.shape, generator=torch.Generator().manual_seed(1))
        exact_grads = _grads(exact, xs, w)
        low = [x.detach().bfloat16().requires_grad_() for x in xs]
        errs = {}
        for name, fn in (("explicit", explicit_block_attention), ("ours", packed_block_attention)):
            out = fn(*low, lay)
            assert out.dtype == torch.bfloat16
            errs[name] = ((out.float() - exact).abs().max().item(),
                          max((a.float() - e).abs().max().item() / e.abs().max().item()
                              for a, e in zip(_grads(out, low, w), exact_grads)))
        assert errs["ours"][0] <= 2 * errs["explicit"][0] + 1e-3, (layout, errs)
        assert errs["ours"][1] <= 2 * errs["explicit"][1] + 1e-3, (layout, errs)


@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_the_drafting_path_runs_under_inference_mode(heads):
    """Drafting: one anchor per sequence over its whole context (no ragged part), and the training layouts."""
    xs, _ = _inputs(heads, "clustered")
    drafting = BlockLayout(((0, 1, 0, 120), (1, 2, 120, 130), (2, 3, 130, 130)), torch.tensor([120, 10, 0]))
    for ys, lay in (([x[:3] for x in xs[:3]] + xs[3:], drafting), _inputs(heads, "spread")):
        with torch.inference_mode():
            got = packed_block_attention(*(y.detach() for y in ys), lay)
        _close(got, explicit_block_attention(*ys, lay).detach(), "drafting output")


def test_a_layout_that_misses_blocks_or_reads_past_its_context_is_refused():
    xs, layout = _inputs((6, 2))
    with pytest.raises(ValueError, match="the layout's groups cover 6 of 7 blocks"):
        packed_block_attention(*xs, BlockLayout(layout.groups[:2] + ((3, 6, 6, 15),), layout.ctx_len))
    with pytest.raises(ValueError, match="see up to 10 context rows, but their sequence has 9"):
        packed_block_attention(*xs, BlockLayout(layout.groups, torch.tensor([1, 6, 0, 0, 4, 8, 10])))


def test_cpu_runs_the_flash_kernel_never_the_math_one():
    xs, layout = _inputs((9, 3), "spread", b=16, d=64)
    with profile() as prof:
        packed_block_attention(*xs, layout).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= names
    assert "aten::_scaled_dot_product_attention_math" not in names


def test_memory_grows_with_the_context_alone():
    """64 blocks of 16 (SmolLM2's heads) over 4096, 8192 and 16384 context rows, counted under FakeTensorMode: the
    bytes autograd saves and the largest tensor the backward allocates grow at most linearly in the context, and
    no tensor kept or allocated is as large as anchors × context × D, while the stride-0 form's backward writes
    its dK/dV at chunk × context × D."""
    a, b = 64, 16
    layouts = {n: block_layout(n, a) for n in (4096, 8192, 16384)}  # real: the chunks are cut on the host
    with FakeTensorMode(allow_non_fake_inputs=True):
        ours = {n: block_memory(layout, b, "ours") for n, layout in layouts.items()}
        stride0 = block_memory(layouts[4096], b, "stride0")
    for n, m in ((8192, 4096), (16384, 8192)):
        assert ours[n][0] < 2 * ours[m][0] and ours[n][2] < 2 * ours[m][2], ours
    for n, (_, kept, grad) in ours.items():
        assert kept < a * n * D / 4 and grad < a * n * D, (n, ours[n])  # (elements, bytes of float32)
    assert stride0[2] >= a * 4096 * D * 4  # every anchor's dK at the view's size, float32
    assert ours[16384][2] <= ba.SCORE_BUDGET * 4 + 2 * 16385 * 3 * (D + 2) * 4  # the budget, the context's dK/dV
    assert ours[4096][0] <= stride0[0]  # it keeps no probabilities either: the explicit group recomputes them
