"""A Linear layer with faster CPU paths for the few-row products of decode and verify steps.

On CPU, a fp32 `F.linear` over 1–128 rows is far from the memory bandwidth it could reach (its GEMM
packs the weight on every call). Measured on a 2-core AVX2 machine (bench/bench_cpu_kernels.py: 30 layers'
worth of SmolLM2 weights per round, so that nothing stays in cache; bench/bench_engine.py shows the effect on
decode):

* 1–16 rows (decode, verify): the native kernel of `cpu_kernels` streams the weight once, ~1.9× MKL's
  pre-packed GEMM and `F.linear` for one row, 1.1–1.6× `(W @ xᵀ)ᵀ` and 2–3× `F.linear` for 2–16 rows;
* without it, 1 row: MKL's pre-packed GEMM (`torch.ops.mkl._mkl_linear` with a weight packed once
  at load time), ~1.5× `F.linear`; 2–128 rows: `(W @ xᵀ)ᵀ`, ~2× `x @ Wᵀ`;
* more rows (prefill): `F.linear` is the fastest.

The results equal `F.linear` up to floating-point summation order. These paths are used only for
inference (no autograd through them); training and GPUs always take `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.layers import cpu_kernels

SMALL_M_MAX = 128  # up to this many rows, (W @ xᵀ)ᵀ beats x @ Wᵀ on CPU
GEMV_M_MAX = 16  # up to this many rows, the native kernel beats both (it turns compute-bound beyond)


def _mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with the CPU inference fast paths above; x: (M, in) or (..., in) → (M, out) / (..., out).

    packed: MKL-packed copy of weight for 1-row products (`Linear.prepack`), if any. Autograd, GPUs and other
    dtypes take `F.linear`.
    """
    if (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
        m = x.shape[0]
        if m <= GEMV_M_MAX and weight.dtype == torch.float32 and cpu_kernels.available():
            return cpu_kernels.gemv(x, weight, bias)
        if m == 1 and packed is not None:
            return torch.ops.mkl._mkl_linear(x, packed, weight, bias, 1)
        if 1 < m <= SMALL_M_MAX:
            out = torch.mm(weight, x.t()).t()
            if bias is not None:
                out = out + bias
            return out.contiguous()
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) with the CPU inference fast paths above."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None  # MKL-packed copy of the weight for 1-row products

    def prepack(self) -> None:
        """Pack the weight for MKL's 1-row GEMM (CPU, fp32). Call again if the weight changes.

        Not needed (and not done: the packed copy doubles the weight's memory) when the native kernel
        serves 1-row products.
        """
        w = self.weight
        if (w.device.type == "cpu" and w.dtype == torch.float32 and _mkl_packing_available()
                and not cpu_kernels.available()):
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, in) or (..., in) → (M, out) / (..., out)."""
        return linear(x, self.weight, self.bias, self._packed)


def prepack_linears(module: nn.Module) -> int:
    """Pack every `Linear` of `module` for CPU 1-row products; returns how many were packed."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            m.prepack()
            n += m._packed is not None
    return n
