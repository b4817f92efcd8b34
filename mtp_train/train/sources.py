"""Where training's target hidden states come from (`data.source`): a precompute folder, the target itself, or both.

Every source yields the same kind of micro-batches through the same path (`mtp_train.train.data`): a dataset of
samples, the length-bucketed batch plan of `make_sampler`, a resumable `MicroBatchStream`. They differ only in
where a batch's hidden states come from, which `TrainData.fill` settles just before the head's step:

* offline: `PrecomputedDataset` over `data.dir`; the batches carry their hidden states already.
* online: `TokenDataset` over the conversations of `data.paths`, made into samples by precompute's own code
  (`precompute.samples`) with `data.online.*` as its settings, and the target (`OnlineTarget`) computes each
  batch's hidden states. The samples, their split and order are those of a one-rank `mtp-precompute` with the same
  settings, so the batches (and the resume position) are exactly those of an offline run on its folder.
* hybrid: online in epoch 0, recording every batch's hidden states into `data.dir` as a precompute folder
  (`HybridWriter`); from epoch 1 on, each batch's rows are read from that folder by sample id. The batch plan is
  the online one throughout, so a hybrid run trains on the batches an online run would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

import mtp_train
from mtp_train import dist
from mtp_train.config import ConfigError, TrainConfig
from mtp_train.dist import DistInfo
from mtp_train.fileio import atomic_write_text
from mtp_train.models.config import ModelArgs
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute import LengthBucketedBatchSampler, PrecomputedDataset, ShardError
from mtp_train.precompute.manifest import MANIFEST_NAME, Manifest, ManifestError
from mtp_train.precompute.samples import TokenDataset, load_rows
from mtp_train.precompute.shards import finished_shard
from mtp_train.precompute.writer import check_settings, folder_spec
from mtp_train.train.data import MicroBatchStream, PackedBatch, SampleDataset
from mtp_train.train.online import HYBRID_ASSIGNMENT, HybridLayout, HybridWriter, OnlineTarget

log = logging.getLogger(__name__)

HYBRID_MARKER = "hybrid.json"  # in a folder a hybrid run writes: which run, so that no other folder is overwritten


def make_sampler(lengths: list[int], cfg: TrainConfig, rank: int, world: int) -> LengthBucketedBatchSampler:
    """The training batch plan of every source (and of the hybrid shard layout): batches of at most
    `train.micro_batch_tokens` padded tokens, shuffled from `train.seed`."""
    return LengthBucketedBatchSampler(lengths, cfg.train.micro_batch_tokens, shuffle=True, seed=cfg.train.seed,
                                      rank=rank, world=world)


class TrainData:
    """What the trainer reads: the train / val datasets, the micro-batch stream, the target's fingerprint, and how
    a batch gets its hidden states (`fill`). This base is the offline source, whose batches already have them."""

    source = "offline"

    def __init__(self, train_set: SampleDataset, val_set: SampleDataset | None, stream: MicroBatchStream,
                 target_fingerprint: str, stored_aux_layers: list[int], where: str) -> None:
        self.train_set, self.val_set, self.stream = train_set, val_set, stream
        self.target_fingerprint = target_fingerprint  # recorded in every checkpoint and head export
        self.stored_aux_layers = stored_aux_layers  # the target layers in the batches' aux_hidden, in order
        self.where = where  # the data in messages and exports: data.dir or data.paths

    def fill(self, batch: PackedBatch) -> PackedBatch:
        """`batch` with its hidden states (and aux_hidden): (T, H) / (T, k·H) in the storage dtype."""
        return batch

    def begin(self, epoch: int, position: int) -> None:
        """Called on every rank once the run's start (or resume) position is known, after the run's config is
        saved and before the first step."""

    def flush(self) -> None:
        """Called before every checkpoint: what the source wrote so far is on disk."""

    def close(self) -> None:
        """Called when the run ends, however it ends."""


def _val_or_none(val: SampleDataset | None, where: str) -> SampleDataset | None:
    if val is not None and len(val) == 0:
        log.warning("%s has no val samples (val_fraction=0?): no evaluation", where)
        return None
    return val


def offline_data(cfg: TrainConfig, info: DistInfo, device: torch.device) -> TrainData:
    """Batches of the precompute folder `data.dir` (checked against the target's weights)."""
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
                              num_workers=c.data.num_workers, pin_memory=device.type == "cuda")
    return TrainData(train_set, _val_or_none(val_set, c.data.dir), stream, manifest.target.fingerprint,
                     list(manifest.hidden.aux_layers), c.data.dir)


class OnlineData(TrainData):
    """Batches of the conversations of `data.paths`, their hidden states computed by the target held here."""

    source = "online"

    def __init__(self, cfg: TrainConfig, info: DistInfo, device: torch.device) -> None:
        from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint
        from mtp_train.data.chat import load_tokenizer

        c, src = cfg, cfg.data.source
        check_online(c)
        target_dir = Path(c.model.path)
        args = ModelArgs.from_dir(target_dir)
        head = c.head.resolved(args.num_layers)  # the layers an aux head reads are the ones computed
        aux_layers = list(head.aux_layers) if head.features == "aux" else []
        self.settings = c.precompute_config(aux_layers)  # precompute's settings for these samples
        check_settings(self.settings, prefix="data.online.")
        tokenizer = load_tokenizer(target_dir)
        rows, self.data_info = load_rows(tokenizer, self.settings, args.vocab_size)
        o = c.data.online
        train_set = TokenDataset(rows, "train", o.seed, o.val_fraction)
        if len(train_set) == 0:
            raise ValueError(f"data.source={src}: every sample of data.paths is in the val split; lower "
                             f"data.online.val_fraction (now {o.val_fraction})")
        val_set = TokenDataset(rows, "val", o.seed, o.val_fraction) if c.train.eval_batches > 0 else None
        stream = MicroBatchStream(train_set, make_sampler(train_set.lengths, c, info.rank, info.world),
                                  num_workers=c.data.num_workers, pin_memory=device.type == "cuda")
        super().__init__(train_set, _val_or_none(val_set, "data.paths"), stream, weights_fingerprint(target_dir),
                         aux_layers, f"data.paths={list(c.data.paths)}")
        self.cfg, self.info, self.args, self.rows = c, info, args, rows
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        self.chat_template_fingerprint = chat_template_fingerprint(tokenizer)
        self.target = OnlineTarget(c.model, device, aux_layers, o.hidden_dtype)
        if info.is_main:
            log.info("data.source=%s: %d samples (%d train), %d tokens from %s; the target computes their hidden "
                     "states (%s, aux layers %s)", src, len(rows), len(train_set), sum(r.ids.size for r in rows),
                     list(c.data.paths), self.target.dtype, aux_layers)

    def fill(self, batch: PackedBatch) -> PackedBatch:
        return self.target.stored(batch, *self.target.forward(batch))


class HybridData(OnlineData):
    """Epoch 0 online, written into `data.dir` as a precompute folder on the way; later epochs read that folder."""

    source = "hybrid"

    def __init__(self, cfg: TrainConfig, info: DistInfo, device: torch.device) -> None:
        super().__init__(cfg, info, device)
        c = self.cfg
        self.dir = Path(c.data.dir)
        check_hybrid_dir(self.dir, Path(c.out))
        spec = folder_spec(self.args, _resolved_dtype(self.target, self.args), c.model.path,
                           c.data.online.hidden_dtype, self.stored_aux_layers)
        val_rows = TokenDataset(self.rows, "val", c.data.online.seed, c.data.online.val_fraction).rows
        layout = HybridLayout(self.train_set, val_rows,
                              lambda r: make_sampler(self.train_set.lengths, c, r, info.world), info.world,
                              c.data.online.shard_tokens, spec.settings)
        o = c.data.online
        prov = {
            "package_version": mtp_train.__version__, "torch_version": torch.__version__,
            "writer": "mtp-train data.source=hybrid", "run": str(Path(c.out).resolve()),
            "settings": {"world": info.world, "tp": c.model.tp, "shard_tokens": o.shard_tokens,
                         "batch_tokens": c.train.micro_batch_tokens, "seed": c.train.seed,
                         "rank_assignment": HYBRID_ASSIGNMENT},
            "config": dataclasses.asdict(c),
        }
        fields = {"tokenizer_fingerprint": self.tokenizer_fingerprint,
                  "chat_template_fingerprint": self.chat_template_fingerprint, "data_info": self.data_info,
                  "val_fraction": o.val_fraction, "seed": o.seed, "provenance": prov}
        self.writer = HybridWriter(self.dir, layout, spec, self.target, rank=info.rank,
                                   batch_tokens=c.train.micro_batch_tokens, verify=c.data.verify != "never",
                                   manifest_fields=fields)
        self.folder: PrecomputedDataset | None = None
        self._index: dict[str, int] = {}

    def begin(self, epoch: int, position: int) -> None:
        if self.info.is_main:
            atomic_write_text(self.dir / HYBRID_MARKER, json.dumps(
                {"written_by": "mtp-train data.source=hybrid", "run": str(Path(self.cfg.out).resolve())}) + "\n")
        if epoch == 0:
            self.writer.begin(position)
        elif self._folder_complete():
            self._open()
        else:  # resumed past epoch 0 with the folder incomplete (files removed since): redo what is missing
            log.warning("hybrid: %s is not complete at epoch %d; recomputing its missing shards", self.dir, epoch)
            self.writer.begin(0)
            self._finish_epoch0()

    def _folder_complete(self) -> bool:
        """Whether `data.dir` holds this run's finished folder: its manifest lists exactly the planned shards, as
        their sidecars describe them (the same answer on every rank)."""
        try:
            manifest = Manifest.load(self.dir)
        except ManifestError:
            return False
        plans = [p for r in range(self.info.world) for part in self.writer.layout.plans(r) for p in part]
        if [s.file for s in manifest.shards] != [p.name for p in plans]:
            return False
        return all(finished_shard(self.dir, p, verify=False) == s for p, s in zip(plans, manifest.shards))

    def _finish_epoch0(self) -> None:
        self.writer.finalize()
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
        self.writer.record(batch, hidden, aux)  # evaluation's val batches are not in the train shards: ignored
        return self.target.stored(batch, hidden, aux)

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


def _resolved_dtype(target: OnlineTarget, args: ModelArgs) -> torch.dtype:
    from mtp_train.models.loader import resolve_dtype

    return resolve_dtype(target.dtype, args)


def check_online(c: TrainConfig) -> None:
    """Refuse online / hybrid settings that cannot work, naming the key and what to do."""
    src = c.data.source
    if not str(c.model.path).strip():
        raise ConfigError(f"data.source={src} computes the target's hidden states during training: set model.path "
                          "to the target's Hugging Face folder (config.json + safetensors + tokenizer)")
    if not c.data.paths:
        raise ConfigError(f"data.source={src} reads conversations from data.paths, which is empty: give them "
                          "(data.paths=[convs.jsonl] or data=<conf/data name>), or train on a precompute folder "
                          "with data.source=offline data.dir=DIR")


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


def build_train_data(cfg: TrainConfig, info: DistInfo, device: torch.device) -> TrainData:
    """The source `data.source` names (offline | online | hybrid), set up and checked."""
    if cfg.data.source == "offline":
        return offline_data(cfg, info, device)
    data = HybridData(cfg, info, device) if cfg.data.source == "hybrid" else OnlineData(cfg, info, device)
    dist.barrier()  # every rank has read the data (and, hybrid, checked data.dir) before anything is written
    return data


def data_record(data: TrainData, cfg: TrainConfig) -> dict[str, Any]:
    """What a head export records about its training data."""
    if data.source == "offline":
        return {"data_source": "offline", "data_dir": str(cfg.data.dir)}
    out: dict[str, Any] = {"data_source": data.source, "data_paths": [str(p) for p in cfg.data.paths],
                           "data_online": dataclasses.asdict(cfg.data.online)}
    if data.source == "hybrid":
        out["data_dir"] = str(cfg.data.dir)
    return out
