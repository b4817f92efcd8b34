"""`data.source=hybrid`: epoch 0 online, written into `data.dir` as a precompute folder on the way; later epochs read
that folder.

The folder is written by precompute's own `FolderWriter`. Rank r's shards `shard-r{r}-{n}` hold, in order, the
samples of its epoch-0 training batches (each batch's first appearance only: the copies that even the ranks out
belong to another rank's shards), cut into runs of at most `shard_tokens` tokens (a batch is never split), then
its share of the val split (val samples r, r+world, ...), cut the same way (`HybridLayout`, over
`precompute.plan_shards`). The plan is a pure function of the data, the batch plan and the settings, so a resumed
run plans the same shards, the writer keeps those whose sidecars match, and the source recomputes, by replaying
the same micro-batches, the samples of the shard that was being filled when the run stopped. Shards are written
by the writer's thread while training goes on; after epoch 0 rank 0 writes `manifest.json`, last, and the folder
is an ordinary precompute folder. The batch plan is the online one throughout, so a hybrid run trains on the
batches an online run would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

import mtp_train
from mtp_train import dist
from mtp_train.config import DATA_SOURCES, ConfigError, TrainConfig
from mtp_train.data.sampler import LengthBucketedBatchSampler
from mtp_train.data.samples import Row, TokenDataset, row_item
from mtp_train.dist import DistInfo
from mtp_train.fileio import atomic_write_text, output_lock
from mtp_train.models.loader import resolve_dtype
from mtp_train.precompute import (
    MANIFEST_NAME,
    FolderWriter,
    PrecomputedDataset,
    ShardError,
    ShardPlan,
    folder_complete,
    folder_spec,
    plan_runs,
    plan_shards,
)
from mtp_train.train.data import PackedBatch, collate_packed
from mtp_train.train.sources.base import make_sampler
from mtp_train.train.sources.online import OnlineSource, split_rows, token_lists

log = logging.getLogger(__name__)

HYBRID_MARKER = "hybrid.json"  # in a folder a hybrid run writes: which run, so that no other folder is overwritten
HYBRID_ASSIGNMENT = ("hybrid: rank r's shards hold its epoch-0 training batches in order (first appearances), "
                     "then val samples r, r+world, ...")


class HybridLayout:
    """Which shards a hybrid run writes (see the module docstring), for any rank: a pure function of the train /
    val samples, the batch plan's settings (`make_sampler(rank)`) and `shard_tokens`; `settings` enter the plan
    hashes (`FolderSpec.settings`)."""

    def __init__(self, train_set: TokenDataset, val_rows: Sequence[Row], make_sampler: Callable[[int],
                 LengthBucketedBatchSampler], world: int, shard_tokens: int, settings: dict[str, Any]) -> None:
        self.train_set, self.val_rows, self.make_sampler = train_set, list(val_rows), make_sampler
        self.world, self.shard_tokens, self.settings = world, shard_tokens, settings

    def epoch0(self, rank: int) -> list[tuple[list[int], bool]]:
        """Rank `rank`'s epoch-0 batches (dataset indices) with their first-appearance flags."""
        sampler = self.make_sampler(rank)
        sampler.set_epoch(0)
        return sampler.rank_batches()

    def plans(self, rank: int) -> tuple[list[ShardPlan], list[ShardPlan]]:
        """(train shards, val shards) of rank `rank`, in the order they are listed in the manifest."""
        rows = self.train_set.rows
        firsts = [[rows[i] for i in b] for b, first in self.epoch0(rank) if first]
        train = plan_shards(rank, firsts, self.shard_tokens, self.settings)
        val = plan_shards(rank, [[r] for r in self.val_rows[rank::self.world]], self.shard_tokens, self.settings,
                          first_index=len(train))
        return train, val

    def every_plan(self) -> list[ShardPlan]:
        """Every rank's shards, in manifest order."""
        return [p for r in range(self.world) for part in self.plans(r) for p in part]


def check_hybrid_dir(folder: Path, out: Path) -> None:
    """Refuse a `data.dir` hybrid must not write: the run's own `out`, or a folder another tool made."""
    if folder.resolve() == out.resolve():
        raise ConfigError(f"data.source=hybrid writes its precompute folder to data.dir, which is the run folder "
                          f"out={out}: choose another data.dir (e.g. data.dir={out}/precompute)")
    if not folder.is_dir() or (folder / HYBRID_MARKER).is_file():
        return
    if (folder / MANIFEST_NAME).is_file() or any(folder.glob("shard-r*.safetensors")):
        raise ConfigError(f"data.dir={folder} holds a precompute folder that no hybrid run wrote (no "
                          f"{HYBRID_MARKER}); data.source=hybrid would overwrite its shards: point data.dir at a new "
                          "folder, or train on this one with data.source=offline")


@DATA_SOURCES.add
class HybridSource(OnlineSource):
    """Epoch 0 online, written into `data.dir` as a precompute folder on the way; later epochs read that folder.

    Host memory in epoch 0: the shard being filled and the one being written, about
    2 · shard_tokens · (k+1) · H storage bytes, as precompute.
    """

    name = "hybrid"
    writes_folder = True

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        super().check_config(cfg)
        if cfg.train.sequence_parallel > 1:
            # Each rank writes its own shards of the folder; the ranks of a sequence-parallel group share their
            # batches, so the group would write each shard more than once.
            raise ConfigError(f"data.source=hybrid writes data.dir one rank's shards at a time, which "
                              f"train.sequence_parallel={cfg.train.sequence_parallel} (ranks sharing batches) does not "
                              "fit: write the folder first (mtp-precompute) and train with data.source=offline, or "
                              "train with data.source=online")

    @classmethod
    def lock(cls, cfg: TrainConfig, out: Path, stack: ExitStack, command: str) -> None:
        # It writes data.dir too: one run at a time there as well.
        check_hybrid_dir(Path(cfg.data.dir), out)
        stack.enter_context(output_lock(cfg.data.dir, command=f"{command} data.source=hybrid"))

    def __init__(self, cfg: TrainConfig, info: DistInfo, device: torch.device) -> None:
        super().__init__(cfg, info, device)
        c, o = self.cfg, cfg.data.online
        self.dir = Path(c.data.dir)
        check_hybrid_dir(self.dir, Path(c.out))
        spec = folder_spec(self.args, resolve_dtype(self.target.dtype, self.args), c.model.path, o.hidden_dtype,
                           self.stored_aux_layers)
        self.layout = HybridLayout(self.train_set, split_rows(self.rows, "val", c).rows,
                                   self._sampler, info.world, o.shard_tokens, spec.settings)
        train_plans, self.val_plans = self.layout.plans(info.rank)
        self.writer = FolderWriter(self.dir, spec, [*train_plans, *self.val_plans], rank=info.rank,
                                   verify=c.data.verify != "never")
        prov = {
            "package_version": mtp_train.__version__, "torch_version": torch.__version__,
            "writer": "mtp-train data.source=hybrid", "run": str(Path(c.out).resolve()),
            "settings": {"world": info.world, "tp": c.model.tp, "shard_tokens": o.shard_tokens,
                         "batch_tokens": c.train.micro_batch_tokens, "seed": c.train.seed,
                         "rank_assignment": HYBRID_ASSIGNMENT},
            "config": dataclasses.asdict(c),
        }
        self.manifest_fields = {"tokenizer_fingerprint": self.tokenizer_fingerprint,
                                "chat_template_fingerprint": self.chat_template_fingerprint,
                                "data_info": self.data_info, "val_fraction": o.val_fraction, "seed": o.seed,
                                "provenance": prov}
        self.folder: PrecomputedDataset | None = None
        self._index: dict[str, int] = {}

    def _sampler(self, rank: int) -> LengthBucketedBatchSampler:
        return make_sampler(self.train_set.lengths, self.cfg, rank, self.info.world)

    def record(self) -> dict[str, Any]:
        return {**super().record(), "data_dir": str(self.cfg.data.dir)}

    # -- epoch 0 --

    def begin(self, epoch: int, position: int) -> None:
        if self.info.is_main:
            atomic_write_text(self.dir / HYBRID_MARKER, json.dumps(
                {"written_by": "mtp-train data.source=hybrid", "run": str(Path(self.cfg.out).resolve())}) + "\n")
        if epoch == 0:
            self._begin_epoch0(position)
        elif folder_complete(self.dir, self.layout.every_plan()):
            self._open()
        else:  # resumed past epoch 0 with the folder incomplete (files removed since): redo what is missing
            log.warning("hybrid: %s is not complete at epoch %d; recomputing its missing shards", self.dir, epoch)
            self._begin_epoch0(0)
            self._finish_epoch0()

    def _begin_epoch0(self, position: int) -> None:
        """Start (or resume) epoch 0 at this rank's batch `position`: the writer keeps the shards that match the
        plan, and the shard that was open is refilled from the batches before `position`."""
        self.writer.begin(owner=self.info.is_main)
        if self.writer.done:
            log.info("hybrid: rank %d finds %d of its %d shards done in %s", self.info.rank, len(self.writer.done),
                     len(self.writer.plans), self.dir)
        self._catch_up(position)
        dist.barrier()  # no rank writes before rank 0 has removed the stale manifest

    def _catch_up(self, position: int) -> None:
        """Recompute, with the same micro-batches (so the same values), the samples of batches before
        `position` whose shards are not on disk."""
        todo = [collate_packed([self.train_set[i] for i in b]) for b, _first in self.layout.epoch0(self.info.rank)
                [:position] if any(self.writer.needs(self.train_set.ids[i]) for i in b)]
        self._compute(todo)
        if todo:
            log.info("hybrid: rank %d recomputed %d micro-batch(es) of shards the interrupted run had not written",
                     self.info.rank, len(todo))

    def _compute(self, batches: Sequence[PackedBatch]) -> None:
        # Every rank runs this, with or without work: a tensor-parallel target's forwards are collective.
        self.target.run([token_lists(b) for b in batches],
                        lambda i, hidden, aux: self.writer.record(batches[i].ids, batches[i].seq_lens, hidden, aux))

    def _finish_epoch0(self) -> None:
        """Complete the folder (every rank at once): missing train shards (replayed), this rank's val shards, then,
        after a barrier, rank 0 writes the manifest; then read it."""
        self._catch_up(len(self.layout.epoch0(self.info.rank)))
        # The val shards, in packed prefills of at most micro_batch_tokens, as precompute packs its shards.
        val = [collate_packed([row_item(p.rows[i]) for i in run]) for p in self.val_plans
               if p.index not in self.writer.done
               for run in plan_runs([r.ids.size for r in p.rows], self.cfg.train.micro_batch_tokens)]
        self._compute(val)
        self.writer.finish()
        dist.barrier()
        if self.info.is_main:
            manifest = self.writer.write_manifest(self.layout.every_plan(),
                                                  [*self.train_set.rows, *self.layout.val_rows],
                                                  redo="resume the hybrid run to redo it", **self.manifest_fields)
            log.info("hybrid: epoch 0 written: %d samples, %d shards, %.1f MiB → %s", manifest.totals.samples,
                     len(manifest.shards), manifest.totals.bytes / 2**20, self.dir / MANIFEST_NAME)
        dist.barrier()  # every rank reads the folder from here on
        self._open()

    def _open(self) -> None:
        """Read the finished folder from now on (and free the target's memory)."""
        self.folder = PrecomputedDataset(self.dir, expect_target_fingerprint=self.target_fingerprint,
                                         expect_tokenizer_fingerprint=self.tokenizer_fingerprint,
                                         expect_chat_template_fingerprint=self.chat_template_fingerprint,
                                         split="all", verify=self.cfg.data.verify)
        self._index = {sid: i for i, sid in enumerate(self.folder.ids)}
        self.target.release()

    def fill(self, batch: PackedBatch) -> PackedBatch:
        if batch.epoch >= 1 and self.folder is None:
            self._finish_epoch0()  # the first batch of epoch 1, on every rank at the same step
        if self.folder is not None:
            return self._read(batch)
        hidden, aux = self.target.forward(batch)
        # Evaluation's val batches are not in the train shards the writer expects them in: ignored until the end.
        self.writer.record(batch.ids, batch.seq_lens, hidden, aux)
        return self.target.stored(batch, hidden, aux)

    # -- later epochs --

    def _read(self, batch: PackedBatch) -> PackedBatch:
        """The batch's rows read from the folder, by sample id (the reader's own checks apply)."""
        assert self.folder is not None
        try:
            items = [self.folder[self._index[sid]] for sid in batch.ids]
        except KeyError as e:
            raise ShardError(f"{self.dir} has no sample {e.args[0]!r} of data.paths: the folder was written from "
                             "other conversations; delete it (or choose another data.dir) and resume") from None
        ids = torch.cat([it["input_ids"] for it in items])
        if not torch.equal(ids, batch.input_ids):
            raise ShardError(f"{self.dir} holds other tokens for samples of this batch than data.paths gives (other "
                             "conversations or tokenizer settings): delete it (or choose another data.dir) and resume")
        aux = torch.cat([it["aux_hidden"] for it in items]) if "aux_hidden" in items[0] else None
        return PackedBatch(batch.input_ids, batch.loss_mask, torch.cat([it["hidden"] for it in items]),
                           batch.seq_lens, batch.ids, aux, batch.epoch)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        if self.folder is None and self.info.is_main:
            log.info("hybrid: the run stopped in epoch 0, so %s has no manifest yet; resuming the run (with more "
                     "train.max_steps if it finished) completes it", self.dir)

