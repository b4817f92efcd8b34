"""The CPU fast paths of Linear equal F.linear; training takes the plain path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp_train.layers.linear import ROW_MULTIPLE, WIDE_BLOCK, Linear, linear, prepack_linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 2, 7, 128, 300])
def test_fast_paths_equal_f_linear(bias, m):
    torch.manual_seed(m)
    lin = Linear(64, 96, bias=bias)
    assert prepack_linears(lin) in (0, 1)  # 0 where this torch has no MKL packing
    x = torch.randn(m, 64)
    with torch.inference_mode():
        out = lin(x)
    assert out.shape == (m, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [96, 2 * WIDE_BLOCK + 37])  # one product, and a wide output made block by block
@pytest.mark.parametrize("m", [17, ROW_MULTIPLE * 5 + 3, 64, 127])  # rows padded up to ROW_MULTIPLE, or not
def test_small_m_padding_and_wide_blocks_equal_f_linear(bias, n, m):
    g = torch.Generator().manual_seed(n + m)
    w, x = torch.randn(n, 64, generator=g), torch.randn(m, 64, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    with torch.inference_mode():
        out = linear(x, w, b)
    assert out.shape == (m, n) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_training_uses_autograd_path_and_state_dict_is_plain():
    lin = Linear(8, 4)
    lin.prepack()
    x = torch.randn(2, 8, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert set(lin.state_dict()) == {"weight", "bias"}
