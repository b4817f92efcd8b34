"""The pair head's export layout, `pair-flat`: every tensor of the head under `pair.`, its settings in config.json
(`pair_config`), and the reader that imports such a folder back (`mtp-export import_from=pair-flat`)."""

from __future__ import annotations

from typing import Any

import torch

from mtp_train.config.head import HeadConfig
from mtp_train.export.layouts import Layout, Reader, drop_vocab, hf_config
from mtp_train.heads import DraftHead

ARCH = "PairDraftModel"
PREFIX = "pair."


def _problems(head: DraftHead) -> list[str]:
    # the layout has no draft vocabulary: a head over a reduced one would draft over another vocabulary when served
    return ["draft_vocab_size > 0: pair-flat drafts over the target's whole vocabulary"] if (
        head.cfg.draft_vocab_size) else []


def _to(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    return {PREFIX + k: v for k, v in drop_vocab(state).items()}


def _from(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    return {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}


def _config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    return hf_config(target, architectures=[ARCH], pair_config={"mlp_ratio": head.cfg.settings.mlp_ratio})


def _head_config(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> HeadConfig:
    return HeadConfig.of(type="pair", mlp_ratio=int((cfg.get("pair_config") or {}).get("mlp_ratio", 2)))


READER = Reader("pair", "this template's", lambda cfg: ARCH in (cfg.get("architectures") or []),
                f"architectures [{ARCH!r}]", _head_config)

TYPE_LAYOUTS = (Layout("pair-flat", _problems, _to, _from, _config, reader=READER),)
