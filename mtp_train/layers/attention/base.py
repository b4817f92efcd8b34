"""The attention backend interface and its selection.

A backend computes attention for one layer over the packed new tokens of a step, reading and
writing that layer's slice of the paged KV cache. The KV cache of one layer is a tensor of shape
(num_pages, 2, page_size, num_kv_heads, head_dim) — FlashInfer's NHD layout, index 0 = K, 1 = V —
so that both backends read the same pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from mtp_train.layers.attention.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "flashinfer")


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
        Returns (T, Hq, D).
        """


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """`auto` → flashinfer on CUDA when it imports, else torch. Validates explicit names."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    is_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if not is_cuda:
            return "torch"
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return "torch"
        return "flashinfer"
    if name == "flashinfer" and not is_cuda:
        raise ValueError("the flashinfer attention backend needs a CUDA device; use backend=torch on CPU")
    return name


def make_attention_backend(name: str, num_q_heads: int, num_kv_heads: int, head_dim: int,
                           sliding_window: int | None = None,
                           device: torch.device | str = "cpu") -> AttentionBackend:
    """Create the backend `name` (auto|torch|flashinfer) for a model of the given shape."""
    resolved = resolve_backend_name(name, device)
    if resolved == "flashinfer":
        from mtp_train.layers.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(num_q_heads, num_kv_heads, head_dim, sliding_window, device=device)
    from mtp_train.layers.attention.torch_backend import TorchBackend

    return TorchBackend(num_q_heads, num_kv_heads, head_dim, sliding_window)
