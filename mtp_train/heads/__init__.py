"""Draft heads over a frozen target: one module each, used by training (packed, autograd) and inference (paged KV).

Heads sit above `models/`: they import `layers/`, `models/` and `config/` only. `base.py` is the interface,
`registry.py` builds a head of a registered type (the plug-ins are `mtp_train.head_types`), `checkpoint.py` the
head folders, `packing.py` the packed-batch alignment, `chain_attention.py` the chained training attention,
`frozen.py` the target tensors a head reads, `sequence.py` a batch's rows split over a sequence-parallel group.
"""

from mtp_train.heads.base import ChainHead, DraftHead, HeadOutput
from mtp_train.heads.checkpoint import load_head, read_head_config, save_head
from mtp_train.heads.frozen import FrozenTargetParts, read_decoder_layer
from mtp_train.heads.packing import packed_shift, packed_valid, resolve_seq_lens
from mtp_train.heads.registry import build_head, head_class, new_head
from mtp_train.heads.sequence import SequenceShard

__all__ = [
    "ChainHead",
    "DraftHead",
    "FrozenTargetParts",
    "HeadOutput",
    "SequenceShard",
    "build_head",
    "head_class",
    "load_head",
    "new_head",
    "packed_shift",
    "packed_valid",
    "read_decoder_layer",
    "read_head_config",
    "resolve_seq_lens",
    "save_head",
]
