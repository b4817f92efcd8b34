"""Attention backends behind one interface, the per-step metadata they read, and the KV pool layout.

Multi-head latent attention (DeepSeek-V2) has its own interface over a latent-only cache (`mla.py`).
"""

from mtp_train.layers.attention.base import AttentionBackend, KVLayout, make_attention_backend, resolve_backend_name
from mtp_train.layers.attention.metadata import AttentionMetadata, ForwardMode
from mtp_train.layers.attention.mla import (
    LatentAsOneHead,
    MLABackend,
    TorchMLA,
    make_mla_backend,
    resolve_mla_backend_name,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardMode",
    "KVLayout",
    "LatentAsOneHead",
    "MLABackend",
    "TorchMLA",
    "make_attention_backend",
    "make_mla_backend",
    "resolve_backend_name",
    "resolve_mla_backend_name",
]
