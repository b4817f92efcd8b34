"""Attention backends behind one interface, the per-step metadata they read, and the KV pool layout.

Multi-head latent attention (DeepSeek-V2) has its own interface over a latent-only cache (`mla.py`); `selection.py`
makes a backend of either kind by name; `masks.py` holds what several backends build from a step's metadata;
`windows.py` runs layers of different windows in one model.
"""

from mtp_train.layers.attention.base import ATTENTION_BACKENDS, AttentionBackend, KVLayout, resolve_backend_name
from mtp_train.layers.attention.metadata import AttentionMetadata, ForwardMode
from mtp_train.layers.attention.mla import LatentAsOneHead, MLABackend, TorchMLA
from mtp_train.layers.attention.selection import make_attention_backend, make_mla_backend, resolve_mla_backend_name
from mtp_train.layers.attention.windows import LayerWindowAttention

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardMode",
    "KVLayout",
    "LatentAsOneHead",
    "LayerWindowAttention",
    "MLABackend",
    "TorchMLA",
    "make_attention_backend",
    "make_mla_backend",
    "resolve_backend_name",
    "resolve_mla_backend_name",
]
