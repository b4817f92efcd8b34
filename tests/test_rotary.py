"""RoPE's cos and sin: the CPU inference table gives the values computed per step, bit for bit."""

from __future__ import annotations

import pytest
import torch

from mtp_train.layers.rotary import ROPE_TABLE_POSITIONS, RopeConfig, RotaryEmbedding

CONFIGS = {
    "default": RopeConfig(head_dim=64, theta=100000.0),
    "llama3": RopeConfig(head_dim=32, theta=500000.0, rope_type="llama3",
                         scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 256}),
    "yarn": RopeConfig(head_dim=16, theta=10000.0, rope_type="yarn",  # cos and sin scaled by its attention factor
                       scaling={"factor": 4.0, "original_max_position_embeddings": 128}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_cpu_table_gives_the_computed_cos_and_sin(name):
    rot = RotaryEmbedding(CONFIGS[name])
    g = torch.Generator().manual_seed(0)
    for pos in (torch.tensor([0]), torch.randint(0, ROPE_TABLE_POSITIONS, (7,), generator=g),
                torch.tensor([ROPE_TABLE_POSITIONS - 1, 3]), torch.tensor([ROPE_TABLE_POSITIONS, 5])):
        for dtype in (torch.float32, torch.bfloat16):
            with torch.inference_mode():
                cos, sin = rot(pos, dtype)
            want = rot._compute(pos, dtype)
            assert cos.shape == (len(pos), 1, CONFIGS[name].head_dim) and cos.dtype == dtype
            assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert rot._table is not None  # the table served the steps within it


def test_the_table_follows_its_frequencies():
    """inv_freq changed in place (or replaced, as a loader moving the module does): the table is made again."""
    rot = RotaryEmbedding(CONFIGS["default"])
    pos = torch.tensor([5, 9])
    with torch.inference_mode():
        before = rot(pos, torch.float32)[0]
    rot.inv_freq.mul_(0.5)
    with torch.inference_mode():
        after = rot(pos, torch.float32)[0]
    assert not torch.equal(before, after) and torch.equal(after, rot._compute(pos, torch.float32)[0])


def test_a_rotary_made_in_inference_mode_serves_from_its_table():
    """A head makes its RotaryEmbedding at its first inference step: its frequencies are inference tensors."""
    with torch.inference_mode():
        rot = RotaryEmbedding(CONFIGS["default"])
        cos, sin = rot(torch.tensor([3, 4]), torch.float32)
    assert rot._table is not None and torch.equal(cos, rot._compute(torch.tensor([3, 4]), torch.float32)[0])
