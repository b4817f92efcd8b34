"""The offline data source: the batches of a precompute folder (`data.dir`), hidden states included."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from mtp_train.config import DATA_SOURCES, TrainConfig
from mtp_train.config.device import on_cuda
from mtp_train.dist import DistInfo
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute import PrecomputedDataset
from mtp_train.train.data import MicroBatchStream
from mtp_train.train.sources.base import DataSource, make_sampler, val_or_none

log = logging.getLogger(__name__)


@DATA_SOURCES.add
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
        # The val split reads the train split's index: the manifest and shard headers are parsed once.
        val_set = PrecomputedDataset(c.data.dir, split="val", verify=c.data.verify,
                                     index=train_set.index) if c.train.eval_batches > 0 else None
        stream = MicroBatchStream(train_set, make_sampler(train_set.lengths, c, info.rank, info.world),
                                  num_workers=c.data.num_workers, pin_memory=on_cuda(device))
        super().__init__(c, train_set, val_or_none(val_set, c.data.dir), stream, manifest.target.fingerprint,
                         list(manifest.hidden.aux_layers), c.data.dir)

    def read_ahead(self) -> None:
        # The first batch reads every shard its samples lie in, and each is hashed in full first
        # (data.verify=first_open): on a big folder that is most of the time to the first step, and it can run
        # while the engine is built. Workers (data.num_workers > 0) hash what they read themselves.
        if self.cfg.data.num_workers == 0 and len(self.stream.sampler):
            self.train_set.verify_ahead(self.stream.sampler.batch_at(0))

    def close(self) -> None:
        self.train_set.index.close()

    def record(self) -> dict[str, Any]:
        return {**super().record(), "data_dir": str(self.cfg.data.dir)}
