"""Head types by name, and building a new head for a target.

A head module registers its class with `@register_head`; `build_head` makes one from a `HeadConfig` whose `type`
names it (the frozen embedding / lm_head read from the target folder).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtp_train.config.head import HeadConfig
from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.models.loader import resolve_dtype

HEAD_TYPES: dict[str, type[DraftHead]] = {}


def register_head(cls: type[DraftHead]) -> type[DraftHead]:
    """Class decorator: make `cls` buildable from a HeadConfig whose type is `cls.type_name`."""
    HEAD_TYPES[cls.type_name] = cls
    return cls


def build_head(cfg: HeadConfig, target_dir: str | Path, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "auto", backend: str = "torch",
               frozen: FrozenTargetParts | None = None) -> DraftHead:
    """A new head for the target in `target_dir`, with its frozen embedding / lm_head read from there.

    dtype: auto (the target's) | float32 | bfloat16 | float16, for the head and the frozen parts alike.
    `cfg.init = last_layer` copies the target's last decoder layer into the head's layer.
    """
    if cfg.type not in HEAD_TYPES:
        raise ValueError(f"head type {cfg.type!r} has no implementation; known: {', '.join(HEAD_TYPES)}")
    if frozen is None:
        frozen = FrozenTargetParts.from_pretrained(target_dir, device=device, dtype=dtype)
    head = HEAD_TYPES[cfg.type](cfg, frozen.args, frozen, backend)
    if head.cfg.init == "last_layer":
        head.init_from_target(target_dir)
    dt = resolve_dtype(dtype, frozen.args)
    return head.to(device=device, dtype=dt)
