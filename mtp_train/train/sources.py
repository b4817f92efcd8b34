"""Where training's target hidden states come from (`data.source`): a precompute folder, the target itself, or both.

Every source is a `DataSource` (`mtp_train.train.source`) registered under its name in `SOURCES`, and yields the
same kind of micro-batches through the same path (`mtp_train.train.data`): a dataset of samples, the
length-bucketed batch plan of `make_sampler`, a resumable `MicroBatchStream`. They differ in where a batch's
hidden states come from, which `DataSource.fill` settles just before the head's step, and in their own checks,
locks and state:

* offline (`OfflineSource`, here): `PrecomputedDataset` over `data.dir`; the batches carry their hidden states.
* online (`mtp_train.train.online.OnlineSource`): the conversations of `data.paths`, and the target computes each
  batch's hidden states.
* hybrid (`mtp_train.train.hybrid.HybridSource`): online in epoch 0, recording every batch's hidden states into
  `data.dir` as a precompute folder (precompute's `FolderWriter`); from epoch 1 on, each batch's rows are read
  from that folder by sample id.

`source_class(name)` is the one look-up of a name; `build_source` builds the configured one once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from mtp_train import dist
from mtp_train.config import ConfigError, TrainConfig
from mtp_train.config.data import SOURCES as SOURCE_NAMES
from mtp_train.config.device import on_cuda
from mtp_train.dist import DistInfo
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute import PrecomputedDataset
from mtp_train.train.data import MicroBatchStream
from mtp_train.train.hybrid import HybridSource
from mtp_train.train.online import OnlineSource
from mtp_train.train.source import SOURCES, DataSource, make_sampler, register_source, val_or_none

log = logging.getLogger(__name__)


@register_source
class OfflineSource(DataSource):
    """Batches of the precompute folder `data.dir` (checked against the target's weights)."""

    name = "offline"

    def __init__(self, cfg: TrainConfig, info: DistInfo, device: torch.device) -> None:
        c = cfg
        fingerprint = weights_fingerprint(Path(c.model.path))
        # Not split by rank here: the batch sampler splits batches (see mtp_train.train.data).
        train_set = PrecomputedDataset(c.data.dir, expect_target_fingerprint=fingerprint, split="train",
                                       verify=c.data.verify)
        manifest = train_set.manifest
        if manifest.hidden.kind != "final_norm":
            raise ValueError(f"{c.data.dir} holds hidden states of kind {manifest.hidden.kind!r}; heads train on "
                             "the target's last hidden state after the final norm (kind 'final_norm')")
        made_from = manifest.data.get("name")
        if made_from and made_from != c.data.name:
            log.warning("data=%s, but %s was precomputed from data %r; training reads data.dir", c.data.name,
                        c.data.dir, made_from)
        if len(train_set) == 0:
            raise ValueError(f"{c.data.dir} has no training samples (every sample is in the val split?)")
        val_set = PrecomputedDataset(c.data.dir, expect_target_fingerprint=fingerprint, split="val",
                                     verify=c.data.verify) if c.train.eval_batches > 0 else None
        stream = MicroBatchStream(train_set, make_sampler(train_set.lengths, c, info.rank, info.world),
                                  num_workers=c.data.num_workers, pin_memory=on_cuda(device))
        super().__init__(c, train_set, val_or_none(val_set, c.data.dir), stream, manifest.target.fingerprint,
                         list(manifest.hidden.aux_layers), c.data.dir)

    def record(self) -> dict[str, Any]:
        return {**super().record(), "data_dir": str(self.cfg.data.dir)}


def source_class(name: str) -> type[DataSource]:
    """The class of `data.source=name`; ConfigError naming the key and the registered sources otherwise."""
    cls = SOURCES.get(name)
    if cls is None:
        names = [n for n in SOURCE_NAMES if n in SOURCES] + [n for n in SOURCES if n not in SOURCE_NAMES]
        raise ConfigError(f"data.source={name!r}: choose one of {' | '.join(names)}")
    return cls


def build_source(cfg: TrainConfig, info: DistInfo, device: torch.device) -> DataSource:
    """The source `data.source` names, set up and checked (on every rank at once)."""
    source = source_class(cfg.data.source)(cfg, info, device)
    # Every rank has read the data (and, hybrid, checked data.dir) before anything is written.
    dist.barrier()
    return source


__all__ = ["SOURCES", "DataSource", "HybridSource", "OfflineSource", "OnlineSource", "build_source",
           "source_class"]
