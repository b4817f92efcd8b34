"""Rotary position embeddings (RoPE) with the scaling schemes of the Llama family.

Each scaling kind (config.json's `rope_type`) is one `RopeScaling` entry of `ROPE_SCALINGS`: its inverse
frequencies, its cos/sin magnitude, and the score correction a model may take from it.

cos/sin are computed once per forward for the step's positions (not per layer, and not as a table
sized by `max_position_embeddings`, which is 128k for Llama-3.1) in float32, as `transformers` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class RopeConfig:
    """What the rotary embedding needs from a model config."""

    head_dim: int  # rotated dimension (the full head dim for the Llama family)
    theta: float = 10000.0  # base of the frequencies
    rope_type: str = "default"  # a ROPE_SCALINGS name: default | linear | llama3 | yarn
    scaling: dict[str, Any] = field(default_factory=dict)  # the checkpoint's rope_scaling entries

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
                "check `rope_scaling`/`rope_parameters` in the model's config.json"
            )

    @property
    def scaling_kind(self) -> RopeScaling:
        """The registered scaling of `rope_type`."""
        return ROPE_SCALINGS[self.rope_type]


def _base_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, float32."""
    d = cfg.head_dim
    return 1.0 / (cfg.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def _linear_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """Position interpolation: every frequency slowed by `factor`."""
    return _base_inv_freq(cfg) / float(cfg.scaling["factor"])


def _llama3_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between interpolated."""
    inv_freq = _base_inv_freq(cfg)
    s = cfg.scaling
    try:
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling needs the key {e.args[0]!r} in rope_scaling") from None
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(cfg: RopeConfig) -> float:
    """YaRN's cos/sin magnitude: `attention_factor`, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    s = cfg.scaling
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _yarn_mscale(factor, float(s["mscale"])) / _yarn_mscale(factor, float(s["mscale_all_dim"]))
    return _yarn_mscale(factor)


def _yarn_score_mscale(cfg: RopeConfig) -> float:
    """mscale(factor, mscale_all_dim) when the config sets `mscale_all_dim`, else 1."""
    m = cfg.scaling.get("mscale_all_dim")
    return _yarn_mscale(float(cfg.scaling["factor"]), float(m)) if m else 1.0


def _yarn_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023): interpolate low frequencies by `factor`, keep high ones, ramp in between."""
    s, d, base = cfg.scaling, cfg.head_dim, cfg.theta
    try:
        factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"yarn rope scaling needs the key {e.args[0]!r} in rope_scaling") from None
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def _one(cfg: RopeConfig) -> float:
    return 1.0


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling kind (config.json's `rope_type`): how it sets the frequencies and magnitudes."""

    inv_freq: Callable[[RopeConfig], torch.Tensor]  # cfg → (head_dim // 2,) float32 inverse frequencies
    attention_factor: Callable[[RopeConfig], float] = _one  # cos/sin are scaled by it (YaRN)
    # The softmax-scale correction squared into the scores by a model that asks for it (DeepSeek-V2's YaRN
    # `mscale_all_dim`; transformers' yarn_get_mscale); 1 for kinds without one.
    score_mscale: Callable[[RopeConfig], float] = _one


ROPE_SCALINGS: dict[str, RopeScaling] = {
    "default": RopeScaling(_base_inv_freq),
    "linear": RopeScaling(_linear_inv_freq),
    "llama3": RopeScaling(_llama3_inv_freq),
    "yarn": RopeScaling(_yarn_inv_freq, yarn_attention_factor, _yarn_score_mscale),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_SCALINGS)


def rope_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """Inverse frequencies, shape (head_dim // 2,), float32."""
    return cfg.scaling_kind.inv_freq(cfg)


# CPU inference steps at positions below this read RoPE's cos and sin from a table (RotaryEmbedding._cpu_table):
# 2 MiB at head_dim 64, 4 MiB at 128.
ROPE_TABLE_POSITIONS = 4096


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) for given positions and applies them to q and k."""

    def __init__(self, cfg: RopeConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        # YaRN scales cos and sin (hence every rotated q·k term) by its attention factor.
        self.attention_scaling = cfg.scaling_kind.attention_factor(cfg)
        self._table: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None  # see _cpu_table

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int → cos, sin: (T, 1, head_dim) in `dtype`, broadcastable over heads.

        CPU inference reads positions below ROPE_TABLE_POSITIONS from a table of the same values (`_cpu_table`): a
        decode step's few rows cost two lookups there instead of seven small ops, each slowed by the caches the
        weights just flushed."""
        if positions.device.type == "cpu" and not torch.is_grad_enabled() and positions.numel():
            table = self._cpu_table(int(positions.max()))
            if table is not None:
                return table[0][positions].to(dtype), table[1][positions].to(dtype)
        return self._compute(positions, dtype)

    def _cpu_table(self, top: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) of positions 0 .. ROPE_TABLE_POSITIONS - 1, (P, 1, D) float32, made once per inv_freq; None
        when `top` lies beyond them or inv_freq is not on the CPU."""
        if top >= ROPE_TABLE_POSITIONS or self.inv_freq.device.type != "cpu":
            return None
        f = self.inv_freq  # an inference tensor (made in inference mode) has no version: it cannot change
        key = (f.data_ptr(), -1 if f.is_inference() else f._version)
        if self._table is None or self._table[0] != key:
            pos = torch.arange(ROPE_TABLE_POSITIONS)
            self._table = (key, self._compute(pos, torch.float32))
        return self._table[1]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, D)
        if self.attention_scaling != 1.0:
            return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D); cos/sin: (T, 1, D) → rotated x (T, heads, D) (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
