"""Where training's target hidden states come from (`data.source`): a precompute folder, the target itself, or both.

Every source is a `DataSource` (`base.py`) added under its name to `DATA_SOURCES` (`mtp_train.config.data`) where
it is defined, one module of this package each, found by the registry's scan of this package (a new source is one
new module; nothing lists them). Each yields the same kind of micro-batches through the same path
(`mtp_train.train.data`): a dataset of samples, the length-bucketed batch plan of `make_sampler`, a resumable
`MicroBatchStream`. They differ in where a batch's hidden
states come from, which `DataSource.fill` settles just before the head's step, and in their own checks, locks and
state:

* offline (`offline.OfflineSource`): `PrecomputedDataset` over `data.dir`; the batches carry their hidden states.
* online (`online.OnlineSource`): the conversations of `data.paths`, and the target computes each
  batch's hidden states.
* hybrid (`hybrid.HybridSource`): online in epoch 0, recording every batch's hidden states into
  `data.dir` as a precompute folder (precompute's `FolderWriter`); from epoch 1 on, each batch's rows are read
  from that folder by sample id.
* fleet (`fleet.FleetSource`): the conversations of `data.paths` as online, their hidden states captured by
  running vLLM servers (`data.fleet.endpoints`) into a spool folder kept under `data.fleet.max_spool_bytes`, each
  capture consumed as it lands and deleted once a checkpoint covers it.

`source_class(name)` is the one look-up of a name; `build_source` builds the configured one once.
"""

from __future__ import annotations

import torch

from mtp_train import dist
from mtp_train.config import DATA_SOURCES, ConfigError, TrainConfig
from mtp_train.config.data import unknown_source
from mtp_train.dist import DistInfo
from mtp_train.train.sources.base import DataSource


def source_class(name: str) -> type[DataSource]:
    """The class of `data.source=name`; ConfigError naming the key and the registered sources otherwise."""
    if name not in DATA_SOURCES:
        raise ConfigError(unknown_source(name))
    return DATA_SOURCES.get(name)


def build_source(cfg: TrainConfig, info: DistInfo, device: torch.device) -> DataSource:
    """The source `data.source` names, set up and checked (on every rank at once)."""
    source = source_class(cfg.data.source)(cfg, info, device)
    # Every rank has read the data (and, hybrid, checked data.dir) before anything is written.
    dist.barrier()
    return source


__all__ = ["DataSource", "build_source", "source_class"]
