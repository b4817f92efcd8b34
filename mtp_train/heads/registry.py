"""Building a head: the class of a head type, and a new head for a target.

A head type is one plug-in registered in `mtp_train.config.head.HEAD_TYPES` (`mtp_train.head_types`); its module
class is `HeadType.module`. `build_head` makes a head from a `HeadConfig` whose `type` names it (the frozen
embedding / lm_head read from the target folder); `head_class` is the one look-up of a type's class.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtp_train.config.head import HeadConfig
from mtp_train.config.head import head_type as _head_type
from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.models.config import ModelArgs
from mtp_train.models.loader import resolve_dtype


def head_class(head_type: str) -> type[DraftHead]:
    """The module class of head type `head_type` (its plug-in's `HeadType.module`); ValueError naming the known
    types otherwise."""
    cls = _head_type(head_type).module
    if not (isinstance(cls, type) and issubclass(cls, DraftHead)):
        raise TypeError(f"head type {head_type!r}: its module {cls!r} is not a DraftHead subclass")
    return cls


def new_head(cfg: HeadConfig, args: ModelArgs, frozen: FrozenTargetParts | None = None,
             backend: str = "torch") -> DraftHead:
    """A freshly initialised head of `cfg.type` for a target of shapes `args` (no weights read)."""
    return head_class(cfg.type)(cfg, args, frozen, backend)


def build_head(cfg: HeadConfig, target_dir: str | Path, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "auto", backend: str = "torch",
               frozen: FrozenTargetParts | None = None) -> DraftHead:
    """A new head for the target in `target_dir`, with its frozen embedding / lm_head read from there.

    dtype: auto (the target's) | float32 | bfloat16 | float16, for the head and the frozen parts alike.
    `cfg.init = last_layer` copies the target's last decoder layer into the head's layer; `target_mtp` copies the
    checkpoint's own MTP layer into the whole head (mtp heads).
    """
    cls = head_class(cfg.type)
    if frozen is None:
        frozen = FrozenTargetParts.from_pretrained(target_dir, device=device, dtype=dtype)
    head = cls(cfg, frozen.args, frozen, backend)
    if head.cfg.init != "scratch":  # last_layer | target_mtp (`init_from_target` reads which)
        head.init_from_target(target_dir)
    dt = resolve_dtype(dtype, frozen.args)
    return head.to(device=device, dtype=dt)
