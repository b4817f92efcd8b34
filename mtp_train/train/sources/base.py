"""A training data source: the base every `data.source` (offline | online | hybrid | fleet) is a subclass of.

A source is one class added to `DATA_SOURCES` (declared on the settings floor, `mtp_train.config.data`) where it is
defined, `@DATA_SOURCES.add`, under its `name` (one module of this package each, found by the registry's scan of the
package; the package's `build_source` builds the configured one). It owns what differs between them: the checks of
its settings (`check_config`), the locks it takes besides the run's own (`lock`), how a resumed checkpoint's source
is judged (`check_resume`), what a head export records about the data (`record`) and how a micro-batch gets its
hidden states (`fill`, with `begin` / `flush` / `close` around the run). Nothing outside the sources compares the
name.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mtp_train.config import TrainConfig
from mtp_train.config.data import DATA_SOURCES
from mtp_train.data.sampler import LengthBucketedBatchSampler
from mtp_train.train.data import MicroBatchStream, PackedBatch, SampleDataset

log = logging.getLogger(__name__)


def make_sampler(lengths: Sequence[int] | np.ndarray, cfg: TrainConfig, rank: int,
                 world: int) -> LengthBucketedBatchSampler:
    """The training batch plan of every source (and of the hybrid shard layout): batches of at most
    `train.micro_batch_tokens` padded tokens, shuffled from `train.seed`."""
    return LengthBucketedBatchSampler(lengths, cfg.train.micro_batch_tokens, shuffle=True, seed=cfg.train.seed,
                                      rank=rank, world=world)


def val_or_none(val: SampleDataset | None, where: str) -> SampleDataset | None:
    """`val`, or None (no evaluation) when that split is empty."""
    if val is not None and len(val) == 0:
        log.warning("%s has no val samples (val_fraction=0?): no evaluation", where)
        return None
    return val


class DataSource:
    """What the trainer reads: the train / val datasets, the micro-batch stream, the target's fingerprint, and how
    a batch gets its hidden states (`fill`). Subclasses set `name` and add themselves (`@DATA_SOURCES.add`)."""

    name: ClassVar[str] = ""  # the `data.source` value
    writes_folder: ClassVar[bool] = False  # writes `data.dir` as a precompute folder (so it is locked, `lock`)
    # Whose order the batch plan follows: the conversations' (online, hybrid) or a folder's (offline). A resume
    # across the two sees other batches.
    plans_from_conversations: ClassVar[bool] = False
    # Runs the target in our engine (computes hidden states): refused for a target no family here implements.
    runs_target: ClassVar[bool] = False

    def __init__(self, cfg: TrainConfig, train_set: SampleDataset, val_set: SampleDataset | None,
                 stream: MicroBatchStream, target_fingerprint: str, stored_aux_layers: list[int],
                 where: str) -> None:
        self.cfg = cfg
        self.train_set, self.val_set, self.stream = train_set, val_set, stream
        self.target_fingerprint = target_fingerprint  # recorded in every checkpoint and head export
        self.stored_aux_layers = stored_aux_layers  # the target layers in the batches' aux_hidden, in order
        self.where = where  # the data in messages and exports: data.dir or data.paths

    # -- before the run (class-level: no data is read) --

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        """Refuse settings this source cannot work with, naming the key (before any process group or model)."""

    @classmethod
    def lock(cls, cfg: TrainConfig, out: Path, stack: ExitStack, command: str) -> None:
        """On rank 0, after the run's own lock on `out`: take the locks this source needs on `stack`."""

    # -- the run --

    def check_resume(self, client: dict[str, Any]) -> None:
        """Judge a checkpoint's data source (`client["data_source"]`, as `save` wrote it) before resuming from it:
        a source with another batch plan is allowed, with a warning."""
        was = str(client.get("data_source", "offline"))
        other = DATA_SOURCES.get(was) if was in DATA_SOURCES else None
        if other is None or other.plans_from_conversations != self.plans_from_conversations:
            log.warning("resuming with data.source=%s (checkpoint: %s): the batch order differs from the "
                        "interrupted run's", self.name, was)

    def record(self) -> dict[str, Any]:
        """What a head export records about its training data."""
        return {"data_source": self.name}

    def fill(self, batch: PackedBatch) -> PackedBatch:
        """`batch` with its hidden states (and aux_hidden): (T, H) / (T, k·H) in the storage dtype."""
        return batch

    def read_ahead(self) -> None:
        """Called on every rank of a run that starts afresh (epoch 0, batch 0), before the engine is built: may
        start, in the background, reading what the first batch needs. Changes nothing the run sees."""

    def begin(self, epoch: int, position: int) -> None:
        """Called on every rank once the run's start (or resume) position is known, after the run's config is
        saved and before the first step."""

    def flush(self) -> None:
        """Called before every checkpoint: what the source wrote so far is on disk."""

    def close(self) -> None:
        """Called when the run ends, however it ends."""


def online_record(cfg: TrainConfig) -> dict[str, Any]:
    """The conversations and sample settings of an online or hybrid run, as a head export records them."""
    return {"data_paths": [str(p) for p in cfg.data.paths], "data_online": dataclasses.asdict(cfg.data.online)}

