"""The samples of stage one before any hidden state: conversations → chat template + loss masks → validated rows,
and a split of them that a training run batches.

One code path from conversation to batch: `mtp-precompute` writes shards of exactly these rows (`build_samples`,
then `to_rows`), and `mtp-train data.source=online|hybrid` batches the same rows (`load_rows`, `TokenDataset`),
selected by the split rule a folder records (`precompute.in_split`) and batched by the same
`LengthBucketedBatchSampler` (`mtp_train.data.sampler`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mtp_train.config import PrecomputeConfig
from mtp_train.data.chat import tokenize_conversations
from mtp_train.data.readers import read_conversations

log = logging.getLogger(__name__)

EXAMPLES = 5  # renamed ids named in the manifest and the summary


@dataclass(frozen=True)
class Sample:
    """One tokenized conversation: loss_mask is 1 on the tokens the head learns (assistant tokens)."""

    id: str  # unique across the whole data set; decides the train/val split
    input_ids: list[int]  # (L,)
    loss_mask: list[int]  # (L,) 0/1


@dataclass
class Row:
    """A validated sample as compact arrays."""

    id: str
    ids: np.ndarray  # (L,) int32
    mask: np.ndarray  # (L,) uint8


def to_rows(samples: Sequence[Sample], vocab_size: int) -> list[Row]:
    """Validate samples (unique ids, equal lengths, ids in vocab, 0/1 mask) and convert them to arrays."""
    rows, seen = [], set()
    for s in samples:
        if s.id in seen:
            raise ValueError(f"duplicate sample id {s.id!r}: ids must be unique (they decide resume and the split)")
        seen.add(s.id)
        ids = np.asarray(s.input_ids, dtype=np.int64)
        mask = np.asarray(s.loss_mask, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"sample {s.id!r}: input_ids must be a non-empty list of ints")
        if mask.shape != ids.shape:
            raise ValueError(f"sample {s.id!r}: {ids.size} input_ids but {mask.size} loss_mask entries")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"sample {s.id!r}: token ids must be in 0..{vocab_size - 1}")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(f"sample {s.id!r}: loss_mask must hold only 0 and 1")
        rows.append(Row(s.id, ids.astype(np.int32), mask.astype(np.uint8)))
    return rows


def _unique_ids(ids: list[str], wheres: Sequence[str | None]) -> tuple[list[str], list[str], list[str]]:
    """Make conversation ids unique (two sources may both have an id "1"): a repeat gets the first of "#2", "#3",
    ... that no conversation of the data has as its id and no earlier repeat took (ids `x`, `x`, `x#2` become `x`,
    `x#3`, `x#2`).

    Returns the ids, the ones that were repeated (each once, in order of first repeat), and for each renamed
    conversation "file:line: 'x' kept as 'x#3'" (`wheres` are the conversations' file:line, or None).
    """
    taken = set(ids)
    seen: Counter[str] = Counter()
    out, repeated, renamed = [], [], []
    for i, where in zip(ids, wheres):
        seen[i] += 1
        if seen[i] == 1:
            out.append(i)
            continue
        if seen[i] == 2:
            repeated.append(i)
        k = seen[i]
        while f"{i}#{k}" in taken:
            k += 1
        seen[i] = k  # the next repeat of i starts after the number this one took
        new = f"{i}#{k}"
        taken.add(new)
        out.append(new)
        renamed.append(f"{where or 'row ' + str(len(out))}: {i!r} kept as {new!r}")
    return out, repeated, renamed


def dropped_summary(info: Mapping[str, Any]) -> str:
    """One line on what `build_samples` left out or renamed (its `info`), or "" when nothing was."""
    parts = []
    bad = info.get("bad_rows") or {}
    if bad:
        parts.append(f"{sum(bad.values())} bad row(s) skipped ("
                     + ", ".join(f"{r}={n}" for r, n in sorted(bad.items())) + ")")
    for key, what in (("dropped_no_assistant", "conversation(s) without an assistant turn dropped"),
                      ("dropped_truncated", "conversation(s) dropped: every assistant token was past max_seq_len"),
                      ("dropped_template_error", "conversation(s) the chat template failed on dropped")):
        if info.get(key):
            parts.append(f"{info[key]} {what}")
    dups = int(info.get("duplicate_ids") or 0)
    if dups:
        shown = ", ".join(repr(d) for d in info.get("duplicate_id_examples") or [])
        rows = "; ".join(info.get("duplicate_id_rows") or [])
        parts.append(f"{dups} duplicate id(s) kept under new ids id#2, id#3, ... that no other row has (e.g. {shown}"
                     + (f": {rows}" if rows else "") + ")")
    return "; ".join(parts)


def build_samples(tokenizer: Any, cfg: PrecomputeConfig) -> tuple[list[Sample], dict[str, Any]]:
    """Read and tokenize the conversations `cfg.data` names (the first `cfg.limit`, cut to `cfg.max_seq_len`
    tokens, rendered with `cfg.chat_template_kwargs`); returns samples and what happened to the rows."""
    data = cfg.data
    if not data.paths:
        raise ValueError("data.paths is empty: give the conversation files, e.g. data.paths=[convs.jsonl]")
    convs, read_stats = read_conversations(data, limit=cfg.limit)
    tokenized, tok_stats = tokenize_conversations(tokenizer, convs, cfg.max_seq_len,
                                                  template_kwargs=dict(cfg.chat_template_kwargs),
                                                  on_bad_row=data.on_bad_row)
    if tok_stats.dropped_template_error:
        log.warning("skipped %d conversation(s) the chat template failed on: %s", tok_stats.dropped_template_error,
                    "; ".join(tok_stats.template_error_examples))
    ids, repeated, renamed = _unique_ids([t.id or f"sample-{i}" for i, t in enumerate(tokenized)],
                                         [t.where for t in tokenized])
    samples = [Sample(i, t.input_ids, t.loss_mask) for i, t in zip(ids, tokenized)]
    if not samples:
        raise ValueError(
            f"no usable sample in {list(data.paths)}: {read_stats.summary()}; "
            f"{tok_stats.dropped_no_assistant} conversations had no assistant turn (regenerate prompt-only data "
            f"with mtp-regenerate first), {tok_stats.dropped_truncated} lost every assistant token to max_seq_len, "
            f"{tok_stats.dropped_template_error} failed in the chat template"
        )
    info = {
        "name": data.name,
        "sources": [str(p) for p in data.paths],
        "format": data.format,
        "max_seq_len": cfg.max_seq_len,
        "limit": cfg.limit,
        "rows": read_stats.rows,
        "bad_rows": dict(read_stats.bad),
        "bad_row_examples": {r: list(e) for r, e in read_stats.examples.items()},  # reason → first few file:line
        "conversations": tok_stats.conversations,
        "samples": tok_stats.kept,
        "truncated": tok_stats.truncated,
        "dropped_no_assistant": tok_stats.dropped_no_assistant,
        "dropped_truncated": tok_stats.dropped_truncated,
        "dropped_template_error": tok_stats.dropped_template_error,
        "duplicate_ids": len(repeated),  # ids met more than once (renamed id#2, id#3, ...)
        "duplicate_id_examples": repeated[:EXAMPLES],
        "duplicate_id_rows": renamed[:EXAMPLES],  # "file:line: 'x' kept as 'x#2'" of the first renamed rows
    }
    return samples, info


def load_rows(tokenizer: Any, cfg: PrecomputeConfig, vocab_size: int) -> tuple[list[Row], dict[str, Any]]:
    """`build_samples`, validated against a vocabulary of `vocab_size` (`to_rows`, as `precompute` does):
    every sample of the data in its order, and what happened to the rows (the manifest's `data`)."""
    samples, info = build_samples(tokenizer, cfg)
    return to_rows(samples, vocab_size), info


def row_item(r: Row) -> dict[str, Any]:
    """A row as a dataset item: {"id", "input_ids" LongTensor (L,), "loss_mask" uint8 (L,)}."""
    return {"id": r.id, "input_ids": torch.from_numpy(r.ids).long(), "loss_mask": torch.from_numpy(r.mask)}


class TokenDataset(torch.utils.data.Dataset):
    """Rows of one split, without hidden states: what online training batches.

    `ds[i]` → {"id": str, "input_ids": LongTensor (L,), "loss_mask": uint8 (L,)}: `PrecomputedDataset`'s items
    without "hidden". `rows` are the split's rows already selected (by the rule a precompute folder records,
    `precompute.in_split`), in the order a one-rank precompute lists them, so `lengths` (and with them the
    length-bucketed batch plan) are those of such a folder; `split` names them in errors.
    """

    def __init__(self, rows: Sequence[Row], split: str) -> None:
        self.split = split
        self.where = "data.paths"  # named in errors, as PrecomputedDataset names its folder
        self.rows = list(rows)
        self.lengths: list[int] = [int(r.ids.size) for r in self.rows]
        self.ids: list[str] = [r.id for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return row_item(self.rows[i])

    def token_counts(self, vocab_size: int, masked_only: bool = True) -> torch.Tensor:
        """(vocab_size,) int64 occurrences of each token id over the split (`PrecomputedDataset.token_counts`)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for r in self.rows:
            ids = torch.from_numpy(r.ids).long()
            if masked_only:
                ids = ids[torch.from_numpy(r.mask).bool()]
            counts += torch.bincount(ids, minlength=vocab_size)
        return counts
