"""The samples of stage one before any hidden state: conversations → chat template + loss masks → validated rows,
and the split of them a training run reads.

One code path from conversation to batch: `mtp-precompute` writes shards of exactly these rows (`build_samples`,
then `plan.to_rows`), and `mtp-train data.source=online|hybrid` batches the same rows (`load_rows`, `TokenDataset`),
selected by the same split rule (`manifest.in_split`) and batched by the same `LengthBucketedBatchSampler`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mtp_train.config import PrecomputeConfig
from mtp_train.data import read_conversations, tokenize_conversations
from mtp_train.precompute.manifest import SPLITS, in_split
from mtp_train.precompute.plan import Row, Sample, to_rows

log = logging.getLogger(__name__)


def _unique_ids(ids: list[str]) -> tuple[list[str], list[str]]:
    """Make conversation ids unique (two sources may both have an id "1"): repeats get "#2", "#3", ...

    Returns the ids and the ones that were repeated (each once, in order of first repeat).
    """
    seen: Counter[str] = Counter()
    out, repeated = [], []
    for i in ids:
        seen[i] += 1
        out.append(i if seen[i] == 1 else f"{i}#{seen[i]}")
        if seen[i] == 2:
            repeated.append(i)
    return out, repeated


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
        parts.append(f"{dups} duplicate id(s) kept under new ids id#2, id#3, ... (e.g. {shown})")
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
    ids, repeated = _unique_ids([t.id or f"sample-{i}" for i, t in enumerate(tokenized)])
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
        "duplicate_id_examples": repeated[:5],
    }
    return samples, info



def load_rows(tokenizer: Any, cfg: PrecomputeConfig, vocab_size: int) -> tuple[list[Row], dict[str, Any]]:
    """`build_samples`, validated against a vocabulary of `vocab_size` (`plan.to_rows`, as `precompute` does):
    every sample of the data in its order, and what happened to the rows (the manifest's `data`)."""
    samples, info = build_samples(tokenizer, cfg)
    return to_rows(samples, vocab_size), info


def row_item(r: Row) -> dict[str, Any]:
    """A row as a dataset item: {"id", "input_ids" LongTensor (L,), "loss_mask" uint8 (L,)}."""
    return {"id": r.id, "input_ids": torch.from_numpy(r.ids).long(), "loss_mask": torch.from_numpy(r.mask)}


class TokenDataset(torch.utils.data.Dataset):
    """The samples of one split of `rows`, without hidden states: what online training batches.

    `ds[i]` → {"id": str, "input_ids": LongTensor (L,), "loss_mask": uint8 (L,)}: `PrecomputedDataset`'s items
    without "hidden". split: "train", "val" or "all", by the rule a precompute folder records (`in_split` with
    `seed`, `val_fraction`). The order is that of `rows`, which is the order a one-rank precompute lists its
    samples in, so `lengths` (and with them the length-bucketed batch plan) are those of such a folder.
    """

    def __init__(self, rows: Sequence[Row], split: str, seed: int, val_fraction: float) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be train|val|all, got {split!r}")
        self.split = split
        self.where = "data.paths"  # named in errors, as PrecomputedDataset names its folder
        self.rows = [r for r in rows if in_split(r.id, split, seed, val_fraction)]
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
