"""fp8 storage of hidden states: float8_e4m3fn values with one float32 scale per token (and per stored layer).

A token's row is scaled so that its largest magnitude lands on e4m3's largest finite value (448), stored in
fp8, and multiplied back on read. Per-token scales follow the large spread of hidden-state norms across tokens
(the first token's are often orders of magnitude above the rest), which one scale per tensor would crush. Each
element keeps e4m3's 3 mantissa bits: a relative error of at most 2^-4 for values within e4m3's normal range of
the token's maximum, and an absolute error of at most the token's max · 2^-9 below it.

Bytes per token: H (values) + 4 (scale) per stored layer, against 2·H in bf16.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_NAME = "float8_e4m3fn"
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = 1e-30  # an all-zero row keeps scale 1e-30 / 448 instead of dividing by zero


def quantize_fp8(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, groups·H) → (values (T, groups·H) float8_e4m3fn, scales (T, groups) float32).

    Each of the `groups` column blocks (one per stored layer) of each row gets its own scale.
    """
    t, width = x.shape
    if width % groups:
        raise ValueError(f"width {width} is not a multiple of {groups} groups")
    xf = x.float().reshape(t, groups, width // groups)
    scale = xf.abs().amax(dim=-1).clamp_min(_TINY) / FP8_MAX  # (T, groups)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(t, width), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of `quantize_fp8`: values (T, groups·H) and scales (T, groups) → (T, groups·H) in `dtype`."""
    t, width = q.shape
    groups = scale.shape[-1]
    x = q.float().reshape(t, groups, width // groups) * scale.float().unsqueeze(-1)
    return x.reshape(t, width).to(dtype)
