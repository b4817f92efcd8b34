"""Draft heads over a frozen target: one module each, used by training (packed, autograd) and inference (paged KV).

Heads sit on the same floor as `models/`: they import `layers/` and `models/` only.
"""

from mtp_train.heads.base import (
    HEAD_TYPES,
    DraftHead,
    HeadOutput,
    build_head,
    load_head,
    packed_shift,
    packed_valid,
    read_head_config,
    resolve_seq_lens,
    save_head,
)
from mtp_train.heads.eagle1 import Eagle1Head
from mtp_train.heads.frozen import FrozenTargetParts, read_decoder_layer
from mtp_train.heads.mtp import MTPHead

__all__ = [
    "HEAD_TYPES",
    "DraftHead",
    "Eagle1Head",
    "FrozenTargetParts",
    "HeadOutput",
    "MTPHead",
    "build_head",
    "load_head",
    "packed_shift",
    "packed_valid",
    "read_decoder_layer",
    "read_head_config",
    "resolve_seq_lens",
    "save_head",
]
