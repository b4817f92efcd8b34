"""Head types: the class of each `HEAD_SPECS` entry, and building a new head for a target.

A head type is one spec in `mtp_train.config.head.HEAD_SPECS` (its settings: norm defaults, fixed norms, features,
draft-vocabulary rule, export formats) plus one class here, registered under the spec's name with
`@register_head`. `build_head` makes a head from a `HeadConfig` whose `type` names it (the frozen embedding /
lm_head read from the target folder); `head_class` is the one look-up of a type's class.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtp_train.config.head import HEAD_SPECS, HeadConfig
from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.models.config import ModelArgs
from mtp_train.models.loader import resolve_dtype

HEAD_TYPES: dict[str, type[DraftHead]] = {}  # spec name → class, filled by the head modules' @register_head


def register_head(cls: type[DraftHead]) -> type[DraftHead]:
    """Class decorator: make `cls` the class of the head type `cls.type_name`, which must have a spec."""
    if cls.type_name not in HEAD_SPECS:
        raise TypeError(f"{cls.__name__}.type_name {cls.type_name!r} has no HeadTypeSpec in "
                        f"mtp_train.config.head.HEAD_SPECS (known: {', '.join(HEAD_SPECS)})")
    if cls.type_name in HEAD_TYPES:
        raise TypeError(f"head type {cls.type_name!r} is registered twice ({HEAD_TYPES[cls.type_name].__name__}, "
                        f"{cls.__name__})")
    HEAD_TYPES[cls.type_name] = cls
    return cls


def head_class(head_type: str) -> type[DraftHead]:
    """The class of head type `head_type`; ValueError naming the implemented types otherwise."""
    cls = HEAD_TYPES.get(head_type)
    if cls is None:
        raise ValueError(f"head type {head_type!r} has no implementation; known: {', '.join(HEAD_TYPES)}")
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
