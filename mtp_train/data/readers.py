"""Read conversations from the shapes public chat and prompt sets come in, into one `Conversation` type.

What to read and how comes from a `DataConfig` (`conf/data/*.yaml`): `paths` (files, folders, globs, saved
datasets: see `mtp_train.data.sources`), `format` and `field_map` (the record shapes: see
`mtp_train.data.formats`), `system_prompt`, and `on_bad_row`.

A bad record either raises `DataError` (file, line, reason) or, with `on_bad_row="skip"`, is counted per reason
in `ReadStats` and reported once, with a few file:line examples, when reading ends.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtp_train.config import DataConfig
from mtp_train.data.formats import FORMATS, BadRecord, DataError, parse_record
from mtp_train.data.sources import path_rows, resolve_paths

log = logging.getLogger(__name__)

ON_BAD_ROW = ("error", "skip")
EXAMPLES_PER_REASON = 3  # file:line examples kept per bad-row reason for the warning


@dataclass
class Conversation:
    """One conversation: `messages` alternate user/assistant after an optional leading system message; an
    assistant message may carry its reasoning (`REASONING_FIELDS` of `mtp_train.data.spans`, all one text)."""

    id: str
    messages: list[dict[str, str]]
    source: str  # file (or dataset folder) it came from
    line: int  # 1-based line (row for `datasets` sources) within `source`
    metadata: dict[str, Any] = field(default_factory=dict)  # the record's other fields

    @property
    def has_answer(self) -> bool:
        """True when at least one assistant turn is present (False for prompt-only records)."""
        return any(m["role"] == "assistant" for m in self.messages)


@dataclass
class ReadStats:
    """What a read saw: rows read, conversations kept, and rejected rows per reason with a few examples."""

    rows: int = 0
    kept: int = 0
    bad: Counter = field(default_factory=Counter)  # reason → count
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason → first few "file:line"

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    def add_bad(self, reason: str, where: str) -> None:
        self.bad[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(where)

    def summary(self) -> str:
        """One line: counts and examples per reason."""
        parts = [f"{r}={n} ({', '.join(self.examples.get(r, []))})" for r, n in sorted(self.bad.items())]
        return f"read {self.rows} rows, kept {self.kept}, skipped {self.num_bad}: " + "; ".join(parts)


def iter_conversations(data: DataConfig, limit: int | None = None, stats: ReadStats | None = None, *,
                       warn: bool = True) -> Iterator[Conversation]:
    """Stream the conversations `data` names, read as it says (see the module docstring).

    `stats`, when given, is updated as rows are read; skipped rows are logged once, when the stream ends (unless
    `warn` is False: a second read of the same data, which the first already reported).
    `limit` stops after that many conversations. Settings and paths are checked at once (`ValueError`,
    `FileNotFoundError` naming the path); a bad row raises `DataError` while streaming unless
    `data.on_bad_row="skip"`.
    """
    if data.format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {data.format!r}")
    if data.on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {data.on_bad_row!r}")
    resolved = resolve_paths(data.paths)
    return _stream(resolved, data, limit, stats if stats is not None else ReadStats(), warn)


def _stream(resolved: list[Path], data: DataConfig, limit: int | None, stats: ReadStats,
            warn: bool = True) -> Iterator[Conversation]:
    """The generator behind `iter_conversations`."""
    for path in resolved:
        if limit is not None and stats.kept >= limit:
            break
        with closing(path_rows(path)) as rows:
            for source, line, record in rows:
                if limit is not None and stats.kept >= limit:
                    break
                stats.rows += 1
                try:
                    if isinstance(record, BadRecord):
                        raise record
                    messages, metadata, conv_id = parse_record(record, data)
                except BadRecord as bad:
                    if data.on_bad_row == "error":
                        raise DataError(source, line, bad.reason, bad.detail) from None
                    stats.add_bad(bad.reason, f"{source}:{line}")
                    continue
                stats.kept += 1
                yield Conversation(id=conv_id or f"{Path(source).name}:{line}", messages=messages,
                                   source=source, line=line, metadata=metadata)
    if stats.num_bad and warn:
        log.warning("skipped bad rows: %s", stats.summary())


def read_conversations(data: DataConfig, limit: int | None = None) -> tuple[list[Conversation], ReadStats]:
    """All conversations `data` names in a list, with the `ReadStats` of the read (see `iter_conversations`)."""
    stats = ReadStats()
    convs = list(iter_conversations(data, limit, stats))
    return convs, stats
