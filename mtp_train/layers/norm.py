"""RMSNorm, computed in float32 and cast back exactly as the reference implementation does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.layers import cpu_kernels

NATIVE_ROWS_MAX = 64  # beyond a few rows torch's vectorised ops catch up; the native kernel is single-threaded


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    The statistics are taken in float32 whatever the input dtype, and the weight multiplies the
    result after it is cast back, so bf16 outputs match `transformers` bit for bit.
    """

    def __init__(self, dim: int, eps: float = 1e-6, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) → (..., dim) in x's dtype."""
        in_dtype, w = x.dtype, self.weight
        if x.dim() == 2 and x.shape[0] <= NATIVE_ROWS_MAX and cpu_kernels.serves(x, w):
            # decode / verify rows on CPU: one native pass instead of torch's composite of ~6 ops
            return cpu_kernels.rms_norm(x, w, self.eps)
        if in_dtype == torch.float32:
            # one fused kernel; identical math to the general path below when nothing needs casting
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
