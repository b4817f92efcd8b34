"""The samples of stage one before any hidden state: conversations → chat template + loss masks → validated rows,
and a split of them that a training run batches.

One code path from conversation to batch: `mtp-precompute` writes shards of exactly these rows (`SampleStream`,
then `checked_rows`, a window of conversations at a time), and `mtp-train data.source=online|hybrid` batches the
same rows (`load_rows`, `TokenDataset`: `build_samples` is the stream collected), selected by the split rule a
folder records (`precompute.in_split`) and batched by the same `LengthBucketedBatchSampler`
(`mtp_train.data.sampler`).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mtp_train.config import PrecomputeConfig
from mtp_train.data.chat import TokenizeStats, tokenize_conversations
from mtp_train.data.ids import IdSet
from mtp_train.data.readers import ReadStats, iter_conversations

log = logging.getLogger(__name__)

EXAMPLES = 5  # renamed ids named in the manifest and the summary
WINDOW = 1024  # conversations read and tokenized at a time, when the caller does not say
# The ids a repeat can be renamed to: "x#2", "x#3", ... (what `_unique_ids` must know of the whole data).
RENAMED_FORM = re.compile(r"#[0-9]+\Z")


class ContextError(ValueError):
    """A sample longer than the target's context, refused (`data.over_context=error`); the message names its
    file:line, id, length, the context and the settings that change what happens."""


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


def to_row(s: Sample, vocab_size: int) -> Row:
    """Validate one sample (equal lengths, ids in vocab, 0/1 mask) and convert it to arrays."""
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
    return Row(s.id, ids.astype(np.int32), mask.astype(np.uint8))


def checked_rows(samples: Iterable[Sample], vocab_size: int) -> Iterator[Row]:
    """`to_row` of each sample as it comes, refusing a repeated id (held as an `IdSet`, not the ids)."""
    seen = IdSet()
    for s in samples:
        if not seen.add(s.id):
            raise ValueError(f"duplicate sample id {s.id!r}: ids must be unique (they decide resume and the split)")
        yield to_row(s, vocab_size)


def within_context(rows: Iterable[Row], context: int) -> Iterator[Row]:
    """The rows as they come, refusing (ContextError) one longer than `context`, the target's positions: samples
    that did not come through `SampleStream`'s check (`data.over_context`) still never run past them."""
    for r in rows:
        if r.ids.size > context:
            raise ContextError(f"sample {r.id!r}: {r.ids.size} tokens, longer than the target's context of {context} "
                               "positions (its max_position_embeddings); cut it to the context (data.over_context="
                               "split or truncate, or max_seq_len) before precomputing it")
        yield r


def to_rows(samples: Sequence[Sample], vocab_size: int) -> list[Row]:
    """Validate samples (unique ids, equal lengths, ids in vocab, 0/1 mask) and convert them to arrays."""
    return list(checked_rows(samples, vocab_size))


def _unique_ids(ids: list[str], wheres: Sequence[str | None]) -> tuple[list[str], list[str], list[str]]:
    """Make conversation ids unique (two sources may both have an id "1"): a repeat gets the first of "#2", "#3",
    ... that no conversation of the data has as its id and no earlier repeat took (ids `x`, `x`, `x#2` become `x`,
    `x#3`, `x#2`).

    Returns the ids, the ones that were repeated (each once, in order of first repeat), and for each renamed
    conversation "file:line: 'x' kept as 'x#3'" (`wheres` are the conversations' file:line, or None).
    `UniqueIds` applies the same rule one id at a time.
    """
    unique = UniqueIds(lambda: {i for i in ids if RENAMED_FORM.search(i)}, examples=len(ids))
    out = [unique(i, where) for i, where in zip(ids, wheres)]
    return out, unique.repeated, unique.renamed


class UniqueIds:
    """`_unique_ids`'s rule as a stream: call it with each conversation's id, in order, for the id it is kept under.

    Whether "x#k" is some conversation's id must be known of the whole data, but only ids of that form can be: so
    `renamed_form_ids()` (every kept id of the data matching `RENAMED_FORM`) is asked for at the first repeat, and
    never when the data has none. The ids seen are held as an `IdSet` (16 to 32 bytes each); the repeated ones and the
    new names in full.

    Args:
        renamed_form_ids: every kept conversation id of the data of the form "x#<digits>".
        examples: how many repeated ids and renamed rows to keep for the summary.
    """

    def __init__(self, renamed_form_ids: Callable[[], set[str]], examples: int = EXAMPLES) -> None:
        self._renamed_form_ids, self._examples = renamed_form_ids, examples
        self._taken: set[str] | None = None  # kept ids of the form x#k, over the whole data (at the first repeat)
        self._seen = IdSet()  # every id met
        self._last: dict[str, int] = {}  # a repeated id → the k its last repeat took
        self._new: set[str] = set()  # names given to repeats
        self.count = 0  # ids met
        self.duplicates = 0  # ids met more than once
        self.repeated: list[str] = []  # the first `examples` of them, in order of first repeat
        self.renamed: list[str] = []  # "file:line: 'x' kept as 'x#3'" of the first `examples` renamed rows

    def __call__(self, i: str, where: str | None) -> str:
        self.count += 1
        if i not in self._last and self._seen.add(i):
            return i
        if i not in self._last:
            self.duplicates += 1
            if len(self.repeated) < self._examples:
                self.repeated.append(i)
        if self._taken is None:
            self._taken = self._renamed_form_ids()
        k = self._last.get(i, 1) + 1
        while f"{i}#{k}" in self._taken or f"{i}#{k}" in self._new:
            k += 1
        self._last[i] = k  # the next repeat of i starts after the number this one took
        new = f"{i}#{k}"
        self._new.add(new)
        if len(self.renamed) < self._examples:
            self.renamed.append(f"{where or 'row ' + str(self.count)}: {i!r} kept as {new!r}")
        return new


def fit_context(sample: Sample, where: str | None, context: int, over: str, max_seq_len: str) -> list[Sample]:
    """`sample` as the target's context takes it: itself when it fits, else as `over` says (`data.over_context`).

    error raises ContextError; truncate keeps its first `context` tokens; split cuts it into consecutive windows
    of at most `context` tokens (ids "<id>@0", "<id>@1", ...), each a sample of its own whose positions start at 0,
    and leaves out the windows without an assistant token (their masks add up to the sample's). A cut that leaves
    no assistant token gives [].

    Args:
        sample: (L,) ids and loss mask.
        where: its "file:line", named in the error (None: its id alone).
        context: the target's positions (its max_position_embeddings).
        over: error | split | truncate.
        max_seq_len: the name and value of the length setting, for the error ("max_seq_len=32768").
    """
    n = len(sample.input_ids)
    if n <= context:
        return [sample]
    if over == "truncate":
        cut = Sample(sample.id, sample.input_ids[:context], sample.loss_mask[:context])
        return [cut] if any(cut.loss_mask) else []
    if over == "split":
        windows = [Sample(f"{sample.id}@{k}", sample.input_ids[a:a + context], sample.loss_mask[a:a + context])
                   for k, a in enumerate(range(0, n, context))]
        return [w for w in windows if any(w.loss_mask)]
    raise ContextError(
        f"{where + ' ' if where else ''}conversation {sample.id!r}: {n} tokens, longer than the target's context "
        f"of {context} positions (its max_position_embeddings): the target was never trained on positions past "
        f"it. Set data.over_context=split (consecutive windows of at most {context} tokens, each its own sample) "
        f"or data.over_context=truncate (its first {context} tokens), or lower {max_seq_len} to {context} or less")


def dropped_summary(info: Mapping[str, Any]) -> str:
    """One line on what `build_samples` left out or renamed (its `info`), or "" when nothing was."""
    parts = []
    bad = info.get("bad_rows") or {}
    if bad:
        parts.append(f"{sum(bad.values())} bad row(s) skipped ("
                     + ", ".join(f"{r}={n}" for r, n in sorted(bad.items())) + ")")
    for key, what in (("dropped_no_assistant", "conversation(s) without an assistant turn dropped"),
                      ("dropped_truncated", "conversation(s) dropped: every assistant token was past max_seq_len"),
                      ("dropped_template_error", "conversation(s) the chat template failed on dropped"),
                      ("longer_than_context", "sample(s) longer than the target's context cut as "
                       "data.over_context says"),
                      ("history_turns_unsupervised", "assistant turn(s) left out of the loss: the template "
                       "renders them otherwise in later history (data.history_turns=split learns them: "
                       "docs/stages.md)")):
        if info.get(key):
            parts.append(f"{info[key]} {what}")
    dups = int(info.get("duplicate_ids") or 0)
    if dups:
        shown = ", ".join(repr(d) for d in info.get("duplicate_id_examples") or [])
        rows = "; ".join(info.get("duplicate_id_rows") or [])
        parts.append(f"{dups} duplicate id(s) kept under new ids id#2, id#3, ... that no other row has (e.g. {shown}"
                     + (f": {rows}" if rows else "") + ")")
    return "; ".join(parts)


class SampleStream:
    """The conversations `cfg.data` names as samples, read and tokenized `window` conversations at a time: the
    first `cfg.limit`, cut to `cfg.max_seq_len` tokens, rendered with `cfg.chat_template_kwargs`, their ids made
    unique (`UniqueIds`). Iterate it once; `info` (what happened to the rows: the manifest's `data`) is complete
    when the iteration has ended, and `tokenized` counts the conversations tokenized so far.

    Host memory: one window of tokenized conversations (about 60 bytes a token as Python lists) and 16 to 32 bytes an id
    (`IdSet`), whatever the number of conversations. Data whose ids repeat is read once more, tokenizing only the
    conversations whose id has the form "x#<digits>" (`UniqueIds`).

    A sample longer than `context` (after the max_seq_len cut) is what `cfg.data.over_context` says (`fit_context`):
    refused (ContextError) when met, or split or truncated.

    Args:
        tokenizer: the target's (fast) tokenizer, with its chat template.
        cfg: data, limit, max_seq_len and chat_template_kwargs are read.
        window: conversations read and tokenized at a time.
        context: the target's positions (max_position_embeddings); None: not checked.
        prefix: where `max_seq_len` sits in the command's settings, for the errors ("data.online." in training).
        quiet: no warnings about skipped rows (a second read of data another read reports).
    """

    def __init__(self, tokenizer: Any, cfg: PrecomputeConfig, window: int = WINDOW, *, context: int | None = None,
                 prefix: str = "", quiet: bool = False) -> None:
        if not cfg.data.paths:
            raise ValueError("data.paths is empty: give the conversation files, e.g. data.paths=[convs.jsonl]")
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        if context is not None and context < 1:
            raise ValueError(f"context must be positive, got {context}")
        self.tokenizer, self.cfg, self.window, self.context, self.prefix = tokenizer, cfg, window, context, prefix
        self.quiet = quiet
        self.info: dict[str, Any] = {}
        self.tokenized = 0

    def _tokenize(self, convs: Iterable[Any], on_bad_row: str) -> tuple[list[Any], TokenizeStats]:
        return tokenize_conversations(self.tokenizer, convs, self.cfg.max_seq_len,
                                      template_kwargs=dict(self.cfg.chat_template_kwargs), on_bad_row=on_bad_row,
                                      history_turns=self.cfg.data.history_turns)

    def _renamed_form_ids(self) -> set[str]:
        """Every kept id of the form "x#<digits>" in the data: a second read, tokenizing only those."""
        data = self.cfg.data
        convs = (c for c in iter_conversations(data, limit=self.cfg.limit, warn=False) if RENAMED_FORM.search(c.id))
        # Skipped here whatever on_bad_row says: the main read reports a template error where it meets it.
        tokenized, _ = self._tokenize(convs, on_bad_row="skip")
        return {t.id for t in tokenized if t.id is not None}

    def _fit(self, sample: Sample, where: str | None) -> list[Sample]:
        if self.context is None:
            return [sample]
        return fit_context(sample, where, self.context, self.cfg.data.over_context,
                           f"{self.prefix}max_seq_len={self.cfg.max_seq_len}")

    def __iter__(self) -> Iterator[Sample]:
        data, cfg = self.cfg.data, self.cfg
        read_stats, tok_stats = ReadStats(), TokenizeStats()
        convs = iter_conversations(data, limit=cfg.limit, stats=read_stats, warn=not self.quiet)
        unique = UniqueIds(self._renamed_form_ids)
        n = over = 0
        while window := list(itertools.islice(convs, self.window)):
            tokenized, stats = self._tokenize(window, on_bad_row=data.on_bad_row)
            tok_stats.add(stats)
            self.tokenized += len(window)
            del window
            for t in tokenized:
                sample = Sample(unique(t.id or f"sample-{n}", t.where), t.input_ids, t.loss_mask)
                fitted = self._fit(sample, t.where)
                over += fitted != [sample]
                for s in fitted:
                    yield s
                    n += 1
        if tok_stats.dropped_template_error and not self.quiet:
            log.warning("skipped %d conversation(s) the chat template failed on: %s", tok_stats.dropped_template_error,
                        "; ".join(tok_stats.template_error_examples))
        if not n:
            raise ValueError(
                f"no usable sample in {list(data.paths)}: {read_stats.summary()}; "
                f"{tok_stats.dropped_no_assistant} conversations had no assistant turn (regenerate prompt-only data "
                f"with mtp-regenerate first), {tok_stats.dropped_truncated} lost every assistant token to "
                f"max_seq_len, {tok_stats.dropped_template_error} failed in the chat template"
            )
        self.info.update({
            "name": data.name,
            "sources": [str(p) for p in data.paths],
            "format": data.format,
            "max_seq_len": cfg.max_seq_len,
            "limit": cfg.limit,
            "rows": read_stats.rows,
            "bad_rows": dict(read_stats.bad),
            "bad_row_examples": {r: list(e) for r, e in read_stats.examples.items()},  # reason → first file:lines
            "conversations": tok_stats.conversations,
            "samples": tok_stats.kept,
            "truncated": tok_stats.truncated,
            "dropped_no_assistant": tok_stats.dropped_no_assistant,
            "dropped_truncated": tok_stats.dropped_truncated,
            "dropped_template_error": tok_stats.dropped_template_error,
            "history_turns_unsupervised": tok_stats.history_turns_unsupervised,
            "history_turn_samples": tok_stats.history_turn_samples,  # data.history_turns=split: their own samples
            "duplicate_ids": unique.duplicates,  # ids met more than once (renamed id#2, id#3, ...)
            "duplicate_id_examples": unique.repeated,
            "duplicate_id_rows": unique.renamed,  # "file:line: 'x' kept as 'x#2'" of the first renamed rows
        })
        if over:  # recorded where it changed the samples, so data that fits gives the manifest it always gave
            self.info.update({
                "context": self.context,  # the target's positions
                "over_context": self.cfg.data.over_context,  # what a longer sample became
                "longer_than_context": over,  # samples longer than it, split or truncated
            })


def check_context(tokenizer: Any, cfg: PrecomputeConfig, context: int, prefix: str = "") -> None:
    """Refuse (ContextError) data holding a sample longer than `context` before any work on it: a read of the
    whole data when `max_seq_len` lets such a sample through and `data.over_context` is error (otherwise nothing to
    do). Costs one more tokenization of the data; the target has not run yet."""
    if cfg.max_seq_len <= context or cfg.data.over_context != "error":
        return
    for _ in SampleStream(tokenizer, cfg, cfg.window, context=context, prefix=prefix, quiet=True):
        pass


def build_samples(tokenizer: Any, cfg: PrecomputeConfig) -> tuple[list[Sample], dict[str, Any]]:
    """Read and tokenize the conversations `cfg.data` names (the first `cfg.limit`, cut to `cfg.max_seq_len`
    tokens, rendered with `cfg.chat_template_kwargs`); returns samples and what happened to the rows. Every sample
    in memory: `SampleStream` gives them a window at a time."""
    stream = SampleStream(tokenizer, cfg)
    samples = list(stream)
    return samples, stream.info


def load_rows(tokenizer: Any, cfg: PrecomputeConfig, vocab_size: int, *, context: int | None = None,
              prefix: str = "") -> tuple[list[Row], dict[str, Any]]:
    """`build_samples`, validated against a vocabulary of `vocab_size` (`to_rows`, as `precompute` does):
    every sample of the data in its order, and what happened to the rows (the manifest's `data`). A sample longer
    than `context` is what `cfg.data.over_context` says (`SampleStream`; `prefix`: where max_seq_len is set)."""
    stream = SampleStream(tokenizer, cfg, context=context, prefix=prefix)
    rows = list(checked_rows(stream, vocab_size))
    return rows, stream.info


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
