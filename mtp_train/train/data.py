"""Packed micro-batches of precomputed samples, and an endless, resumable stream of them.

A micro-batch is one `LengthBucketedBatchSampler` batch (at most `max_tokens` padded tokens) packed without
padding: the samples' rows are concatenated into (T, ...) buffers with their lengths alongside, the layout the
heads' training forward takes. The samples come from a precompute folder (`PrecomputedDataset`, with their hidden
states) or, for online training, from the conversations themselves (`TokenDataset`, tokens only: the target fills
the hidden states in just before the head's step, `mtp_train.train.sources`). Both go through this one path.

Ranks: the dataset is NOT split by rank; the batch sampler splits the *batches* (rank r takes batches r, r+world,
...). Every rank then yields the same number of batches (the sampler pads the list to a multiple of world), and
the global batch of a step (world · grad_accum micro-batches) is the same run of batches whatever world and
grad_accum are, so a run on 2 ranks sees exactly what 1 rank with twice the accumulation sees. Under sequence
parallelism the rank and world here are the data-parallel ones (rank // N of world / N): the N ranks of a group
read the same batches and split each one's rows (`mtp_train.train.sequence_parallel`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from mtp_train.data.sampler import LengthBucketedBatchSampler
from mtp_train.data.samples import TokenDataset
from mtp_train.precompute import PrecomputedDataset

SampleDataset = PrecomputedDataset | TokenDataset  # what batches are made of: folder samples, or tokens only


@dataclass
class PackedBatch:
    """Samples packed row after row (T = Σ seq_lens rows, H = hidden size)."""

    input_ids: torch.Tensor  # (T,) int64 tokens t_i
    loss_mask: torch.Tensor  # (T,) uint8, 1 on tokens to learn
    hidden: torch.Tensor | None  # (T, H) target hidden h_i, storage dtype (bf16); None until an online target fills it
    seq_lens: list[int]  # (B,) rows per sample, in order
    ids: list[str]  # (B,) sample ids
    aux_hidden: torch.Tensor | None = None  # (T, k·H) the folder's aux layers, concatenated, or None
    epoch: int = 0  # the epoch of the batch plan it came from (`MicroBatchStream`)

    def _map(self, fn) -> PackedBatch:
        return PackedBatch(fn(self.input_ids), fn(self.loss_mask), None if self.hidden is None else fn(self.hidden),
                           self.seq_lens, self.ids, None if self.aux_hidden is None else fn(self.aux_hidden),
                           self.epoch)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The same batch on `device` (tensors only; lengths and ids stay Python lists)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """Page-locked copies, so that the copy to the GPU can overlap compute (DataLoader pin_memory)."""
        return self._map(lambda t: t.pin_memory())

    def head_aux(self, columns: torch.Tensor | None) -> torch.Tensor | None:
        """(T, k'·H) the head's aux features: the folder's `aux_hidden` (columns None) or those columns of it."""
        if self.aux_hidden is None or columns is None:
            return self.aux_hidden
        return self.aux_hidden.index_select(1, columns.to(self.aux_hidden.device))


def collate_packed(items: Sequence[dict[str, Any]]) -> PackedBatch:
    """PrecomputedDataset (or TokenDataset: no hidden) items → one PackedBatch (concatenated in the given order,
    no padding)."""
    if not items:
        raise ValueError("cannot pack an empty batch")
    return PackedBatch(
        input_ids=torch.cat([it["input_ids"].long() for it in items]),
        loss_mask=torch.cat([it["loss_mask"] for it in items]),
        hidden=torch.cat([it["hidden"] for it in items]) if "hidden" in items[0] else None,
        seq_lens=[int(it["input_ids"].shape[0]) for it in items],
        ids=[str(it["id"]) for it in items],
        aux_hidden=torch.cat([it["aux_hidden"] for it in items]) if "aux_hidden" in items[0] else None,
    )


def make_loader(dataset: SampleDataset, sampler: LengthBucketedBatchSampler, num_workers: int = 0,
                pin_memory: bool = False) -> DataLoader:
    """A DataLoader yielding PackedBatch in the sampler's order (workers read and pack ahead of the loop)."""
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_packed, num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=False)


class MicroBatchStream:
    """Endless micro-batches over epochs, with a resumable position.

    Epoch e plays the sampler's batch plan for e (shuffled from seed + e); when it ends, epoch e + 1 starts.
    The position is (epoch, batches this rank has taken in the epoch), counted here as batches are handed
    to the loop, not by the sampler, which the DataLoader runs ahead of the loop.
    """

    def __init__(self, dataset: SampleDataset, sampler: LengthBucketedBatchSampler, num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.epoch, self.position = 0, 0
        self._it: Iterator[PackedBatch] | None = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at batch `position` of epoch `epoch` (same data, sampler settings, rank and world)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._it = None

    def _start(self) -> Iterator[PackedBatch]:
        self.sampler.set_epoch(self.epoch)
        self.sampler.load_state_dict({"epoch": self.epoch, "position": self.position})
        return iter(make_loader(self.dataset, self.sampler, self.num_workers, self.pin_memory))

    def next(self) -> PackedBatch:
        """The next micro-batch of this rank (a new epoch starts when one ends)."""
        for _ in range(2):  # at most one epoch change per call
            if self._it is None:
                self._it = self._start()
            batch = next(self._it, None)
            if batch is not None:
                self.position += 1
                batch.epoch = self.epoch
                return batch
            self.epoch, self.position, self._it = self.epoch + 1, 0, None
        raise ValueError(f"{self.dataset.where}: the {self.dataset.split} split yields no batch")


def eval_batches(dataset: SampleDataset, max_tokens: int, n: int, rank: int = 0, world: int = 1,
                 seed: int = 0) -> Iterator[PackedBatch]:
    """This rank's share of the first n·world batches of epoch 0 of a split (evaluation).

    The batch plan is shuffled from a fixed seed, so every evaluation of a run reads the same batches, of all
    lengths (an unshuffled plan would start with the shortest samples only).
    """
    if n <= 0 or len(dataset) == 0:
        return
    sampler = LengthBucketedBatchSampler(dataset.lengths, max_tokens, shuffle=True, seed=seed, rank=rank,
                                         world=world)
    for k, batch in enumerate(make_loader(dataset, sampler)):
        if k == n:
            break
        yield batch


def draft_vocab_from_data(dataset: SampleDataset, size: int, vocab_size: int,
                          always: Sequence[int] = ()) -> torch.Tensor:
    """(size,) ascending ids of the `size` most frequent assistant tokens of `dataset`, plus the `always` ids (EOS).

    Ties go to the lower id, and every rank reads the same (whole) split, so every rank picks the same set. A
    precompute folder's counts come from its `token_counts.safetensors` (no shard is read); an older folder's are
    counted from its shards (`PrecomputedDataset.token_counts`).
    """
    counts = dataset.token_counts(vocab_size)
    keep = [int(t) for t in always if 0 <= int(t) < vocab_size]
    counts[keep] = torch.iinfo(torch.long).max  # always in
    order = torch.sort(-counts, stable=True).indices  # stable: ties stay in id order
    return order[:size].sort().values


def aux_columns(stored: Sequence[int], wanted: Sequence[int], hidden_size: int,
                data_dir: object) -> torch.Tensor | None:
    """Columns of a folder's `aux_hidden` (layers `stored`, concatenated) that give the head's layers `wanted`.

    None when the head reads no aux layers or the folder holds exactly them; a clear error when it lacks some.
    """
    stored, wanted = [int(j) for j in stored], [int(j) for j in wanted]
    if not wanted or stored == wanted:
        return None
    missing = [j for j in wanted if j not in stored]
    if missing:
        layers = ",".join(map(str, wanted))
        raise ValueError(f"{data_dir} holds aux layers {stored} but the head reads {wanted} (head.aux_layers, "
                         f"hidden_states numbering; lacking {missing}): run mtp-precompute with aux_layers=[{layers}] "
                         "or set head.aux_layers to layers the folder holds")
    return torch.cat([torch.arange(stored.index(j) * hidden_size, (stored.index(j) + 1) * hidden_size)
                      for j in wanted])
