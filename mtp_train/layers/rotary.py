"""Rotary position embeddings (RoPE) with the scaling schemes of the Llama family.

cos/sin are computed once per forward for the step's positions (not per layer, and not as a table
sized by `max_position_embeddings`, which is 128k for Llama-3.1) in float32, as `transformers` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class RopeConfig:
    """What the rotary embedding needs from a model config."""

    head_dim: int  # rotated dimension (the full head dim for the Llama family)
    theta: float = 10000.0  # base of the frequencies
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    scaling: dict[str, Any] = field(default_factory=dict)  # the checkpoint's rope_scaling entries

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
                "check `rope_scaling`/`rope_parameters` in the model's config.json"
            )


def rope_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """Inverse frequencies, shape (head_dim // 2,), float32."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / float(cfg.scaling["factor"])
    elif cfg.rope_type == "llama3":
        s = cfg.scaling
        try:
            factor = float(s["factor"])
            low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
            old_ctx = float(s["original_max_position_embeddings"])
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling needs the key {e.args[0]!r} in rope_scaling") from None
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) for given positions and applies them to q and k."""

    def __init__(self, cfg: RopeConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int → cos, sin: (T, 1, head_dim) in `dtype`, broadcastable over heads."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D); cos/sin: (T, 1, D) → rotated x (T, heads, D) (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
