"""The CPU fast paths of Linear equal F.linear; training takes the plain path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp_train.layers.linear import Linear, prepack_linears


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


def test_training_uses_autograd_path_and_state_dict_is_plain():
    lin = Linear(8, 4)
    lin.prepack()
    x = torch.randn(2, 8, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert set(lin.state_dict()) == {"weight", "bias"}
