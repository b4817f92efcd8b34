"""The attention backend interface, the layout of one layer's KV pool, and the backend names (`auto` resolved here;
the backends themselves are made by name in `selection.py`, which imports them: this module imports none).

A backend computes attention for one layer over the packed new tokens of a step, reading and
writing that layer's slice of the paged KV cache. The KV cache of one layer is a tensor of shape
(num_pages, 2, page_size, num_kv_heads, head_dim) — FlashInfer's NHD layout, index 0 = K, 1 = V —
so that both backends read the same pool. Multi-head latent attention (DeepSeek-V2) caches one
latent row per token instead (`KVLayout(latent=True)`, read by the backends in `mla.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from mtp_train.config.device import on_cuda
from mtp_train.layers.attention.metadata import AttentionMetadata

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")  # what model.attention_backend (and `backend=`) may say

@dataclass(frozen=True)
class KVLayout:
    """What one layer's paged pool holds per token, hence the shape of one page.

    K/V (latent False): a page is (2, page_size, num_kv_heads, head_dim), FlashInfer's NHD layout (0 = K, 1 = V).
    MLA latent (latent True): a page is (page_size, head_dim), one [c ; k_pe] row per token and nothing else —
    FlashInfer MLA's ckv / kpe page layout, the two being the leading and trailing columns; num_kv_heads is 1.
    """

    num_kv_heads: int  # Hkv (1 for the latent layout)
    head_dim: int  # D, or kv_lora_rank + qk_rope_head_dim for the latent layout
    latent: bool = False  # MLA: one latent row per token, no separate V

    def __post_init__(self) -> None:
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"the latent (MLA) layout has one row per token, got num_kv_heads={self.num_kv_heads}")

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        """The shape of one page: (2, page_size, Hkv, D), or (page_size, D) for the latent layout."""
        if self.latent:
            return (page_size, self.head_dim)
        return (2, page_size, self.num_kv_heads, self.head_dim)

    @property
    def values_per_token(self) -> int:
        """Cached values per token in one layer: 2·Hkv·D (K and V), or D (the latent row)."""
        return self.head_dim if self.latent else 2 * self.num_kv_heads * self.head_dim


class AttentionBackend(ABC):
    """Attention for one model shape; one instance serves all layers of a model."""

    name: str = "base"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_q_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5

    @property
    def tree_steps(self) -> bool:
        """Whether a step may verify a tree of new tokens per sequence (`AttentionMetadata.set_tree`); a sliding
        window then counts the tokens' tree positions (`AttentionMetadata.rope_positions`), not their slots."""
        return True

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Do the per-step work shared by all layers (masks, kernel plans); writes meta.backend_state."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of one layer.

        q: (T, Hq, D); k, v: (T, Hkv, D) for the step's new tokens (already rotated).
        kv_cache: this layer's (num_pages, 2, page_size, Hkv, D) pool or None when the step uses no
        cache; when given, the new K/V are written into it at meta.slot_pages/slot_offsets first.
        Returns (T, Hq, D). A backend that runs attention sinks (GPT-OSS; the torch backend) also takes
        `sinks=` (Hq,) logits that join each head's softmax denominator; the others are never passed them.
        """


def check_backend_name(name: str) -> None:
    """ValueError naming the choices unless `name` is one of ATTENTION_BACKENDS."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """`auto` → flashinfer on CUDA when it imports, else torch. Validates explicit names (no backend is imported:
    `selection.make_attention_backend` creates one)."""
    check_backend_name(name)
    cuda = on_cuda(torch.device(device))
    if name == "auto":
        if not cuda:
            return "torch"
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return "torch"
        return "flashinfer"
    if name == "flashinfer" and not cuda:
        raise ValueError("the flashinfer attention backend needs a CUDA device; use backend=torch on CPU")
    return name
