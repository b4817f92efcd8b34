"""Attention backends by name: `auto` | `torch` | `flashinfer`, for K/V pages and for MLA's latent rows.

The one module that knows every backend: it imports them (each loads without CUDA or FlashInfer; FlashInfer itself
is imported when a FlashInfer backend is created) and the backends import only the interfaces (`base.py`,
`mla.py`) and the shared step helpers (`masks.py`), so no backend module imports this one or another backend's
internals. A new backend is one entry in `KV_BACKENDS` or `MLA_BACKENDS`, plus its rule in the resolver
(`base.resolve_backend_name` for K/V pages, `resolve_mla_backend_name` here for MLA).
"""

from __future__ import annotations

import torch

from mtp_train.config.device import on_cuda
from mtp_train.layers.attention.base import AttentionBackend, check_backend_name, resolve_backend_name
from mtp_train.layers.attention.flashinfer_backend import FlashInferBackend
from mtp_train.layers.attention.flashinfer_mla import FlashInferMLA
from mtp_train.layers.attention.mla import MLABackend, TorchMLA, flashinfer_mla_problem
from mtp_train.layers.attention.torch_backend import TorchBackend

KV_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchBackend, "flashinfer": FlashInferBackend}
MLA_BACKENDS: dict[str, type[MLABackend]] = {"torch": TorchMLA, "flashinfer": FlashInferMLA}


def make_attention_backend(name: str, num_q_heads: int, num_kv_heads: int, head_dim: int,
                           sliding_window: int | None = None,
                           device: torch.device | str = "cpu") -> AttentionBackend:
    """Create the backend `name` (auto|torch|flashinfer, `base.resolve_backend_name`) for a model of this shape."""
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":  # the reference runs anywhere and needs no device
        return TorchBackend(num_q_heads, num_kv_heads, head_dim, sliding_window)
    return KV_BACKENDS[resolved](num_q_heads, num_kv_heads, head_dim, sliding_window, device=device)


def resolve_mla_backend_name(name: str, device: torch.device | str, kv_lora_rank: int, rope_dim: int,
                             dtype: torch.dtype | None = None) -> str:
    """`auto` → flashinfer on CUDA when it imports and fits the shape and dtype, else torch.

    An explicit `flashinfer` that cannot run raises ValueError naming the constraint.
    """
    check_backend_name(name)
    cuda = on_cuda(torch.device(device))
    problem = flashinfer_mla_problem(kv_lora_rank, rope_dim, dtype)
    if name == "auto":
        if not cuda or problem:
            return "torch"
        try:
            import flashinfer.mla  # noqa: F401
        except ImportError:
            return "torch"
        return "flashinfer"
    if name == "flashinfer":
        if not cuda:
            raise ValueError("the flashinfer MLA backend needs a CUDA device; use backend=torch (or auto) on CPU")
        if problem:
            raise ValueError(f"{problem}; use backend=torch (or auto)")
    return name


def make_mla_backend(name: str, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                     device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> MLABackend:
    """Create the MLA backend `name` (auto|torch|flashinfer); dtype (the model's) takes part in `auto`'s choice."""
    resolved = resolve_mla_backend_name(name, device, kv_lora_rank, rope_dim, dtype)
    if resolved == "torch":
        return TorchMLA(num_heads, kv_lora_rank, rope_dim, scale)
    return MLA_BACKENDS[resolved](num_heads, kv_lora_rank, rope_dim, scale, device=device)
