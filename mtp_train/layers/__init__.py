"""The ground floor: norms, rotary embeddings, attention backends and per-step attention metadata.

Nothing here imports anything of the project above this package.
"""

from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, make_attention_backend
from mtp_train.layers.norm import RMSNorm
from mtp_train.layers.rotary import RopeConfig, RotaryEmbedding

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "make_attention_backend",
]
