"""The attention-memory benchmark counts what autograd really keeps: its FakeTensorMode count (no memory, so the
quadratic sides reach 16k tokens) equals the count over real tensors, and its report has every side and length."""

from __future__ import annotations

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.attention_memory import BLOCK_SIDES, block_layout, block_memory, chain_saved, main


@pytest.mark.parametrize(("mode", "window"), [("masked", None), ("diagonal", None), ("diagonal", 100)])
def test_the_fake_count_of_the_chain_is_the_real_one(mode, window):
    real = chain_saved(300, 3, mode, window)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = chain_saved(300, 3, mode, window)
    assert fake == real and real[0] > 0


@pytest.mark.parametrize("side", BLOCK_SIDES)
def test_the_fake_count_of_the_block_attention_is_the_real_one(side):
    """What autograd keeps and the backward's largest tensor, each side."""
    layout = block_layout(300, 20)
    real = block_memory(layout, 4, side)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = block_memory(layout, 4, side)
    assert fake == real and min(real) > 0


def test_the_report_has_every_side_for_every_length(capsys):
    res = main(["--lens", "1024", "2048", "--anchors", "16", "--block", "4"])
    row = res["2048"]
    assert set(row) == {"chain_masked_mib", "chain_diagonal_mib"} | {
        f"block_{side}{what}_mib" for side in BLOCK_SIDES for what in ("", "_grad")}
    assert row["chain_masked_mib"] > row["chain_diagonal_mib"] and row["block_explicit_mib"] > row["block_ours_mib"]
    assert row["block_stride0_grad_mib"] > row["block_ours_grad_mib"]
    assert capsys.readouterr().out.count("\nn ") == 1  # one line per length, then the JSON one
