"""The CPU fast paths of Linear equal F.linear; training takes the plain path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp_train.layers.linear import (
    GEMV_M_MAX,
    ROW_MULTIPLE,
    WIDE_BLOCK,
    Linear,
    _takes_copy,
    _takes_gemv,
    gemv_weight,
    linear,
    prepack_linears,
    stream_linears,
    takes_small_m,
    weight_copy,
)


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


def _rounded(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 weight a copy of `kind` stands for."""
    from mtp_train.layers import cpu_kernels

    copy = weight_copy(w, kind)
    return copy.float() if kind == "bf16" else cpu_kernels.int8_weight(copy)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("m", [1, 2, 5, GEMV_M_MAX, GEMV_M_MAX + 1, 64])
def test_a_copy_stream_computes_over_the_rounded_weight_and_switches_back(m, kind):
    """Under `stream(kind)` few-row products read the bfloat16 or int8 copy (F.linear over the rounded weight, where
    the kernels take it); more rows, autograd and switching off read the float32 weight; the state dict is
    unchanged."""
    torch.manual_seed(m)
    mlp = torch.nn.Sequential(Linear(64, 96), torch.nn.ReLU(), Linear(96, 32, bias=False))
    x = torch.randn(m, 64)
    exact = mlp(x).detach()
    assert stream_linears(mlp, kind) == 2
    rounded = F.linear(torch.relu(F.linear(x, _rounded(mlp[0].weight, kind), mlp[0].bias)),
                       _rounded(mlp[2].weight, kind))
    with torch.inference_mode():
        out = mlp(x)
    streams = _streams(m, kind)
    if streams:  # the MLP-style transposed chain must not take such rows
        assert not takes_small_m(x, mlp[0].weight, mlp[0].w16)
    torch.testing.assert_close(out, rounded if streams else exact, rtol=1e-5, atol=1e-5)
    assert set(mlp.state_dict()) == {"0.weight", "0.bias", "2.weight"}
    torch.testing.assert_close(mlp(x), exact, rtol=1e-5, atol=1e-5)  # autograd on: the float32 weight
    assert stream_linears(mlp, None) == 0 and mlp[0].w16 is None
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), exact, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="int4"):
        mlp[0].stream("int4")


def _streams(m: int, kind: str = "bf16") -> bool:
    """Whether m rows take a copy of `kind` on this machine (kernels available and measured faster)."""
    return _takes_copy(m, torch.empty(0, dtype=torch.bfloat16 if kind == "bf16" else torch.int8))


def test_gemv_weight_names_what_linear_streams_for_m_rows():
    """The weight a fused caller streams is the one `Linear.forward` would: the bfloat16 copy under `stream("bf16")`
    (made again after an in-place change), the float32 weight otherwise, nothing for another module, a training
    weight or a row count the gemv does not serve."""
    lin = Linear(16, 8, bias=True)
    with torch.inference_mode():
        assert gemv_weight(lin, 1) is (lin.weight if _takes_gemv(1, lin.weight) else None)
        assert gemv_weight(lin, GEMV_M_MAX + 1) is None
        assert gemv_weight(torch.nn.Linear(16, 8), 1) is None
    assert gemv_weight(lin, 1) is None  # autograd differentiates the weight: F.linear's path
    lin.stream("bf16")
    with torch.no_grad():
        lin.weight.mul_(2)
    with torch.inference_mode():
        w = gemv_weight(lin, 1)
        if _streams(1):
            assert w is lin.w16 and torch.equal(w, lin.weight.detach().bfloat16())  # the fresh copy
        else:
            assert w is (lin.weight if _takes_gemv(1, lin.weight) else None)


def test_a_stale_bf16_copy_is_made_again_when_the_weight_changes():
    lin = Linear(16, 8, bias=False)
    lin.stream("bf16")
    with torch.no_grad():
        lin.weight.mul_(2)
    x = torch.randn(1, 16)
    with torch.inference_mode():
        out = lin(x)
    want = F.linear(x, lin.weight.bfloat16().float()) if _streams(1) else F.linear(x, lin.weight)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
