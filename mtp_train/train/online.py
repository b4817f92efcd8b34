"""The target inside training: hidden states computed per micro-batch (online), and written as a precompute folder
during epoch 0 (hybrid).

`OnlineTarget` runs the frozen target's cache-free packed prefill (`engine.prefill_hidden`, what `mtp-precompute`
runs) over a micro-batch's samples right before the head's step and hands the head exactly what a precompute
folder would have given it: the final-norm hidden state and the head's aux layers, rounded through the storage
dtype (`precompute.writer.as_stored`).

`HybridWriter` keeps the hidden states of epoch 0 in precompute's format. Rank r's shards `shard-r{r}-{n}` hold,
in order, the samples of its epoch-0 training batches (each batch's first appearance only: the copies that even
the ranks out belong to another rank's shards), cut into runs of at most `shard_tokens` tokens (a batch is never
split), then its share of the val split (val samples r, r+world, ...), cut the same way. The plan is a pure
function of the data, the batch plan and the settings, so a resumed run plans the same shards, skips those whose
sidecars match (`precompute.shards.finished_shard`) and recomputes, by replaying the same micro-batches, the
samples of the shard that was being filled when the run stopped. Shards are written atomically by a writer thread
while training goes on; after epoch 0 rank 0 writes `manifest.json`, last, and the folder is an ordinary precompute
folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from mtp_train import dist
from mtp_train.config import ModelConfig
from mtp_train.engine.runner import prefill_hidden
from mtp_train.fileio import TMP_PREFIX
from mtp_train.models.base import CausalLM
from mtp_train.models.loader import load_model
from mtp_train.models.tensor_parallel import TPGroup, load_model_tp, tp_groups
from mtp_train.precompute import LengthBucketedBatchSampler
from mtp_train.precompute.manifest import MANIFEST_NAME, Manifest
from mtp_train.precompute.plan import Row, ShardPlan, plan_runs, shard_plan
from mtp_train.precompute.samples import TokenDataset, row_item
from mtp_train.precompute.shards import finished_shard, sidecar_path, write_shard
from mtp_train.precompute.writer import FolderSpec, as_stored, assemble_manifest, new_shard_tensors, store_rows
from mtp_train.train.data import PackedBatch, collate_packed

log = logging.getLogger(__name__)

HYBRID_ASSIGNMENT = ("hybrid: rank r's shards hold its epoch-0 training batches in order (first appearances), "
                     "then val samples r, r+world, ...")


def online_dtype(model_cfg: ModelConfig, device: torch.device) -> str:
    """The dtype the online target computes in: `model.dtype` when set, else bfloat16 on CUDA (as training's own
    compute) and the checkpoint's dtype elsewhere."""
    if model_cfg.dtype != "auto":
        return model_cfg.dtype
    return "bfloat16" if device.type == "cuda" else "auto"


def token_lists(batch: PackedBatch) -> list[list[int]]:
    """A packed batch's samples as token lists (the input of a packed prefill)."""
    ids = batch.input_ids.tolist()
    out, a = [], 0
    for n in batch.seq_lens:
        out.append(ids[a:a + n])
        a += n
    return out


Forward = list[list[int]]  # the token lists of one packed prefill
Outputs = Callable[[int, torch.Tensor, torch.Tensor | None], None]  # (index, hidden (T, H), aux (T, k·H) | None)


class OnlineTarget:
    """The frozen target, loaded on first use, computing hidden states of packed token batches.

    aux_layers: the HF `hidden_states[j]` indices the head reads (concatenated into aux_hidden, in order);
    storage: the `hidden_dtype` whose rounding the head sees (`as_stored`). tp > 1: the target is split over
    groups of `tp` consecutive ranks (`models.tensor_parallel`), each rank holding 1/tp of its weights; every
    training rank still has its own batches, so a group runs its members' forwards one after another, each member
    computing all of them (the forward is collective) and keeping its own. Create it on every rank at once.
    """

    def __init__(self, model_cfg: ModelConfig, device: torch.device, aux_layers: Sequence[int], storage: str) -> None:
        self.path, self.device = Path(model_cfg.path), device
        self.dtype, self.backend = online_dtype(model_cfg, device), model_cfg.backend
        self.aux_layers, self.storage = [int(j) for j in aux_layers], storage
        # new_group is collective: every rank creates its OnlineTarget at the same point.
        self.tp: TPGroup | None = tp_groups(model_cfg.tp)[0] if model_cfg.tp > 1 else None
        self._model: CausalLM | None = None

    @property
    def model(self) -> CausalLM:
        if self._model is None:
            # No CPU pre-packing: it only speeds up 1-row decode products and doubles the weights' memory.
            if self.tp is not None:
                self._model = load_model_tp(self.path, self.tp, dtype=self.dtype, device=self.device,
                                            backend=self.backend, cpu_prepack=False)
            else:
                self._model = load_model(self.path, dtype=self.dtype, device=self.device, backend=self.backend,
                                         cpu_prepack=False)
        return self._model

    def release(self) -> None:
        """Drop the weights (hybrid, once epoch 0 is on disk); a later use loads them again."""
        self._model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _prefill(self, lists: Forward) -> tuple[torch.Tensor, torch.Tensor | None]:
        # no_grad, not inference_mode: the head's autograd graph takes these tensors as inputs.
        with torch.no_grad():
            out = prefill_hidden(self.model, lists, hidden_layers=self.aux_layers)
        aux = torch.cat([out.layers[j] for j in self.aux_layers], dim=-1) if self.aux_layers else None
        return out.hidden, aux

    def run(self, forwards: Sequence[Forward], fn: Outputs) -> None:
        """Run this rank's `forwards` in order, calling fn(i, hidden (T, H), aux (T, k·H) or None) for the i-th,
        in the target's compute dtype on its device. With tensor parallelism every member of the group calls this
        at the same time (with its own forwards, any number): they are gathered and run round by round."""
        if self.tp is None:
            for i, lists in enumerate(forwards):
                fn(i, *self._prefill(lists))
            return
        everyone: list[Any] = [None] * self.tp.size
        tdist.all_gather_object(everyone, list(forwards), group=self.tp.group)
        for i in range(max(len(f) for f in everyone)):
            for member, theirs in enumerate(everyone):
                if i < len(theirs):
                    hidden, aux = self._prefill(theirs[i])  # collective: every member runs every forward
                    if member == self.tp.rank:
                        fn(i, hidden, aux)

    def forward(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's (hidden (T, H), aux (T, k·H) or None) for one packed batch (on every TP member at once)."""
        got: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.run([token_lists(batch)], lambda _i, hidden, aux: got.append((hidden, aux)))
        return got[0]

    def stored(self, batch: PackedBatch, hidden: torch.Tensor, aux: torch.Tensor | None) -> PackedBatch:
        """`batch` with `forward`'s outputs as a precompute folder would give them (storage rounding)."""
        k = len(self.aux_layers)
        return PackedBatch(batch.input_ids, batch.loss_mask, as_stored(hidden, self.storage), batch.seq_lens,
                           batch.ids, None if aux is None else as_stored(aux, self.storage, groups=k), batch.epoch)


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
        firsts = [b for b, first in self.epoch0(rank) if first]
        train = []
        for run in plan_runs([sum(int(rows[i].ids.size) for i in b) for b in firsts], self.shard_tokens):
            train.append(shard_plan(rank, len(train), [rows[i] for k in run for i in firsts[k]], self.settings))
        mine = self.val_rows[rank::self.world]
        val = [shard_plan(rank, len(train) + n, [mine[i] for i in run], self.settings)
               for n, run in enumerate(plan_runs([int(r.ids.size) for r in mine], self.shard_tokens))]
        return train, val


class HybridWriter:
    """Epoch 0's hidden states of this rank, written as precompute shards while training runs (module docstring).

    `record` takes each training micro-batch's target outputs; `begin` (once, before training, with the position
    resumed at) skips finished shards and replays what the interrupted run had computed but not written;
    `finalize` (at the first batch of epoch 1, on every rank at once) completes the folder: any missing train
    shard, the val shards, then rank 0's manifest. Host memory: the shard being filled and the one being written,
    about 2 · shard_tokens · (k+1) · H storage bytes, as precompute.
    """

    def __init__(self, out_dir: Path, layout: HybridLayout, spec: FolderSpec, target: OnlineTarget, *, rank: int,
                 batch_tokens: int, verify: bool, manifest_fields: dict[str, Any]) -> None:
        self.out_dir, self.layout, self.spec, self.target = out_dir, layout, spec, target
        self.rank, self.batch_tokens, self.verify = rank, batch_tokens, verify
        self.manifest_fields = manifest_fields
        self.train_plans, self.val_plans = layout.plans(rank)
        self.plans = {p.index: p for p in (*self.train_plans, *self.val_plans)}
        self._train_slots, self._val_slots = _slots(self.train_plans), _slots(self.val_plans)
        self._done: set[int] = set()  # shard indices finished on disk (or handed to the writer thread)
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}  # shard index → its tensors being filled
        self._filled: dict[int, set[str]] = {}  # shard index → ids stored so far
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-shard-writer")
        self._pending: Future | None = None

    # -- set-up --

    def begin(self, position: int) -> None:
        """Start (or resume) epoch 0 at this rank's batch `position`: forget a stale manifest, keep the shards
        that match the plan, and refill the shard that was open from the batches before `position`."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            # The manifest vouches for a finished folder; this run is about to (re)write shards of it.
            for stale in (self.out_dir / MANIFEST_NAME, self.out_dir / (TMP_PREFIX + MANIFEST_NAME)):
                stale.unlink(missing_ok=True)
        for tmp in self.out_dir.glob(f"{TMP_PREFIX}shard-r{self.rank}-*"):
            tmp.unlink(missing_ok=True)  # torn temporaries of a killed run
        for p in self.plans.values():
            if finished_shard(self.out_dir, p, verify=self.verify) is not None:
                self._done.add(p.index)
            else:
                sidecar_path(self.out_dir / p.name).unlink(missing_ok=True)  # it no longer describes the file
        if self._done:
            log.info("hybrid: rank %d finds %d of its %d shards done in %s", self.rank, len(self._done),
                     len(self.plans), self.out_dir)
        self._catch_up(position)
        dist.barrier()  # no rank writes before rank 0 has removed the stale manifest

    def _catch_up(self, position: int) -> None:
        """Recompute, with the same micro-batches (so the same values), the samples of batches before
        `position` whose shards are not on disk."""
        todo = []
        for b, _first in self.layout.epoch0(self.rank)[:position]:
            ids = [self.layout.train_set.ids[i] for i in b]
            if any(s in self._train_slots and self._train_slots[s][0] not in self._done for s in ids):
                todo.append(collate_packed([self.layout.train_set[i] for i in b]))
        # Every rank runs this, with or without work: a tensor-parallel target's forwards are collective.
        self.target.run([token_lists(b) for b in todo], lambda i, hidden, aux: self.record(todo[i], hidden, aux))
        if todo:
            log.info("hybrid: rank %d recomputed %d micro-batch(es) of shards the interrupted run had not written",
                     self.rank, len(todo))

    # -- epoch 0 --

    def record(self, batch: PackedBatch, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Store the rows of a training batch's samples that belong to this rank's unfinished train shards; hidden
        (T, H), aux (T, k·H) as the target computed them. A shard whose every sample is in goes to the writer."""
        self._store(batch, hidden, aux, self._train_slots)

    def _store(self, batch: PackedBatch, hidden: torch.Tensor, aux: torch.Tensor | None,
               slots: dict[str, tuple[int, int]]) -> None:
        a = 0
        for sid, n in zip(batch.ids, batch.seq_lens):
            slot = slots.get(sid)  # None: a val sample (evaluation), or another rank's (an evening copy)
            if slot is not None and slot[0] not in self._done:
                index, row = slot
                plan = self.plans[index]
                if index not in self._buffers:
                    self._buffers[index] = new_shard_tensors(plan, self.spec.target.hidden_size,
                                                             len(self.spec.hidden.aux_layers), self.spec.storage)
                    self._filled[index] = set()
                store_rows(self._buffers[index], row, row + n, hidden[a:a + n],
                           None if aux is None else aux[a:a + n], self.spec.storage)
                self._filled[index].add(sid)
                if len(self._filled[index]) == len(plan.rows):
                    del self._filled[index]
                    self._write(plan, self._buffers.pop(index))
            a += n

    def _write(self, plan: ShardPlan, tensors: dict[str, torch.Tensor]) -> None:
        # At most one shard waits for the disk: the next one blocks here until it is written.
        self.flush()
        self._pending = self._pool.submit(write_shard, self.out_dir, plan, tensors, self.spec.metadata)
        self._done.add(plan.index)

    def flush(self) -> None:
        """Wait for the shard being written (before a checkpoint: what it counts as done is on disk)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failed write in the training thread

    # -- the end of epoch 0 --

    def finalize(self) -> Manifest | None:
        """Complete the folder (every rank at once): missing train shards (replayed), this rank's val shards, then,
        after a barrier, rank 0 writes the manifest; returns it on rank 0."""
        self._catch_up(len(self.layout.epoch0(self.rank)))
        if self._buffers:  # cannot happen when the batch plan covers every sample; a bug if it does
            raise RuntimeError(f"hybrid: shards {sorted(self._buffers)} of rank {self.rank} are incomplete at the "
                               "end of epoch 0")
        # The val shards, in packed prefills of at most micro_batch_tokens, as precompute packs its shards.
        val = [collate_packed([row_item(p.rows[i]) for i in run]) for p in self.val_plans if p.index not in self._done
               for run in plan_runs([r.ids.size for r in p.rows], self.batch_tokens)]
        self.target.run([token_lists(b) for b in val],
                        lambda i, hidden, aux: self._store(val[i], hidden, aux, self._val_slots))
        self.flush()
        dist.barrier()
        manifest = None
        if self.rank == 0:
            plans = [p for r in range(self.layout.world) for part in self.layout.plans(r) for p in part]
            manifest = assemble_manifest(self.out_dir, plans, [*self.layout.train_set.rows, *self.layout.val_rows],
                                         self.spec, redo="resume the hybrid run to redo it", **self.manifest_fields)
            manifest.save(self.out_dir)
            log.info("hybrid: epoch 0 written: %d samples, %d shards, %.1f MiB → %s", manifest.totals.samples,
                     len(manifest.shards), manifest.totals.bytes / 2**20, self.out_dir / MANIFEST_NAME)
        dist.barrier()  # every rank reads the folder from here on
        return manifest

    def close(self) -> None:
        """Finish the write in flight and stop the writer thread."""
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)


def _slots(plans: Sequence[ShardPlan]) -> dict[str, tuple[int, int]]:
    """sample id → (shard index, the sample's first row in the shard)."""
    out = {}
    for p in plans:
        row = 0
        for r in p.rows:
            out[r.id] = (p.index, row)
            row += int(r.ids.size)
    return out
