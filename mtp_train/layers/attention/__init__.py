"""Attention backends behind one interface, and the per-step metadata they read."""

from mtp_train.layers.attention.base import AttentionBackend, make_attention_backend, resolve_backend_name
from mtp_train.layers.attention.metadata import AttentionMetadata, ForwardMode

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardMode",
    "make_attention_backend",
    "resolve_backend_name",
]
