"""The output file of a regeneration run: record ids, per-rank part files, the merge, and what a killed run left.

Rank r appends each finished record to its part file `<out>.rank<r>` (`RecordWriter`: flushed per record, fsynced
every few records). `consolidate` merges `<out>` and every part into `<out>` (temporary file + rename), in
conversation order when given the order (`ids.RecordOrder`), else in the order met, and removes the parts;
`iter_records` reads a file's complete records one at a time, dropping a torn last line with a warning and refusing
records made with other settings. Nothing here holds more than a few numbers per record: outputs of millions of
records are merged and resumed in tens of megabytes.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mtp_train.data.ids import IdSet
from mtp_train.data.readers import Conversation
from mtp_train.regenerate.ids import RecordOrder
from mtp_train.regenerate.provenance import provenance_differences

log = logging.getLogger(__name__)

AFTER_ALL = 1 << 62  # sort position of records that are not in the current selection: after every conversation


class RegenerateError(ValueError):
    """No conversations to answer, or an output file that cannot be resumed; the message says why."""


class Order(Protocol):
    """What the merge asks of an order: record id → (conversation position, sample index), or None."""

    def get(self, rid: str, default: None = None, /) -> tuple[int, int] | None: ...


def plan_order(conversations: Iterable[Conversation], n: int) -> RecordOrder:
    """Record id → (conversation position, sample index): the order of the merged output (first id wins)."""
    order = RecordOrder(n)
    seen = IdSet()
    for i, conv in enumerate(conversations):
        if seen.add(conv.id):
            order.add(conv.id, i)
    return order


def part_path(out: str | Path, rank: int) -> Path:
    """The file rank `rank` appends its records to, beside `out`."""
    out = Path(out)
    return out.with_name(f"{out.name}.rank{rank}")


def find_parts(out: str | Path) -> list[Path]:
    """Part files of `out` (`<out>.rank<r>`) left by any rank of any run, by rank."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    prefix = f"{out.name}.rank"
    found = [(int(p.name[len(prefix):]), p) for p in out.parent.iterdir()
             if p.name.startswith(prefix) and p.name[len(prefix):].isdigit() and p.is_file()]
    return [p for _, p in sorted(found)]


@dataclass
class RecordLine:
    """Where one complete record sits in a file."""

    id: str
    path: Path
    offset: int
    length: int  # bytes, newline included


class RecordWriter:
    """Appends records as JSON lines: each line flushed as written, fsynced every `fsync_every` lines and at close.

    The file is opened on the first record, so a rank with nothing to write leaves no file.
    """

    def __init__(self, path: str | Path, fsync_every: int = 64) -> None:
        self.path = Path(path)
        self.fsync_every = max(1, fsync_every)
        self.count = 0
        self._fh = None

    def write(self, record: Mapping[str, Any]) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("ab")
        # One write call per line: a kill leaves at most the last line torn, never two lines interleaved.
        self._fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._fh.flush()
        self.count += 1
        if self.count % self.fsync_every == 0:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scan_records(path: str | Path, expect: Mapping[str, Any] | None = None, *, part: bool = False,
                 ) -> list[RecordLine]:
    """The complete records of a JSONL output file in a list (`iter_records`, for small files)."""
    return list(iter_records(path, expect, part=part))


def iter_records(path: str | Path, expect: Mapping[str, Any] | None = None, *, part: bool = False,
                 ) -> Iterator[RecordLine]:
    """The complete records of a JSONL output file (`part`: a rank's part file), one at a time.

    A last line without its newline, or a last line that is not a JSON record, is a write cut short by a kill: it
    is left out with a warning. A bad line anywhere else means the file is damaged (RegenerateError, file:line,
    raised when the line after it is read). A file that is not ours is refused before anything of it is dropped:
    `out` (not a part) whose first line is not a whole record, or any file whose first record has no provenance
    (data, or another tool's output). With `expect` (a provenance), every record must have been made with matching
    settings.
    """
    path = Path(path)
    if path.is_dir():
        raise RegenerateError(f"out={path} is a folder; mtp-regenerate writes a JSONL file: choose a file name, "
                              f"e.g. out={path / 'regenerated.jsonl'}")
    count = 0
    bad: tuple[int, str] | None = None  # a bad line is only forgivable if nothing follows it
    offset = 0
    foreign = ("is not a record of mtp-regenerate ({}): the file holds something else, which would be lost; "
               "choose another `out`")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            start, offset = offset, offset + len(raw)
            if bad is not None:
                raise RegenerateError(f"{path}:{bad[0]}: {bad[1]}; the file is damaged (only a torn last line is "
                                      "repaired); remove the line or choose another `out`")
            if not raw.endswith(b"\n"):
                bad = (lineno, "line without a newline")
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                rid = record["id"]
                if not isinstance(rid, str):
                    raise TypeError(f"id is {type(rid).__name__}")
            except (ValueError, KeyError, TypeError) as exc:
                bad = (lineno, f"not a record ({type(exc).__name__}: {exc})")
                continue
            if not count and not isinstance(record.get("provenance"), dict):
                raise RegenerateError(f"{path}:{lineno} " + foreign.format("no provenance"))
            if expect is not None:
                diff = provenance_differences(record.get("provenance") or {}, expect)
                if diff:
                    raise RegenerateError(
                        f"{path}:{lineno} (record {rid!r}) was made with other settings: {'; '.join(diff[:4])}. "
                        "Resuming needs the same target, tokenizer, chat template and sampling; choose another "
                        "`out` or remove the file")
            count += 1
            yield RecordLine(rid, path, start, len(raw))
    if bad is not None and not count and not part:  # `out` is written whole by the merge: never torn alone
        raise RegenerateError(f"{path}:{bad[0]} " + foreign.format(bad[1]))
    if bad is not None:
        log.warning("%s:%d: dropping a torn last line (%s), left by an interrupted write; its record is "
                    "generated again", path, bad[0], bad[1])


def consolidate(out: str | Path, order: Order | None = None, expect: Mapping[str, Any] | None = None) -> int:
    """Merge `out` and its part files into `out`, in the order given by `order` (record id → sort key).

    Records whose id is not in `order` (other data, a smaller `limit`) are kept after the others, in their previous
    order; without an order (start-up, before the data is read) every record keeps the order met: `out`'s, then
    each part's. A record present twice is kept once (the copy met first: `out`'s). `out` is rewritten through a
    temporary file and a rename, then the parts are removed; when there are no parts and nothing to repair, `out` is
    left as it is. Returns the number of records in `out`. Holds a few numbers per record, never the records.
    """
    out = Path(out)
    parts = find_parts(out)
    files = [out, *parts] if out.exists() else list(parts)
    size = out.stat().st_size if out.exists() else 0
    # One row per record kept: its file, offset and length, and its sort key (position, sample index, met).
    where, offsets, lengths = array("q"), array("q"), array("q")
    pos, sample = array("q"), array("q")
    seen = IdSet()
    unknown = 0
    end_of_out = 0
    for f, path in enumerate(files):
        for line in iter_records(path, expect, part=path != out):
            if path == out:
                end_of_out = line.offset + line.length
            if not seen.add(line.id):
                continue
            key = order.get(line.id) if order is not None else None
            if key is None:
                unknown += order is not None
                key = (AFTER_ALL, len(seen))  # after every known record, in the order met
            where.append(f)
            offsets.append(line.offset)
            lengths.append(line.length)
            pos.append(key[0])
            sample.append(key[1])
    total = len(where)
    if not parts and end_of_out == size:  # nothing cut off at the end
        return total
    if unknown:
        log.warning("%d record(s) in %s are not in the current data selection; they are kept at the end", unknown, out)
    rows = np.lexsort((np.asarray(sample, dtype=np.int64), np.asarray(pos, dtype=np.int64))) if total else []

    # A unique sibling opened normally (mkstemp's 0600 mode would survive the rename); same file system as `out`.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.merge")
    handles: dict[int, Any] = {}
    try:
        with tmp.open("xb") as dst:
            for r in rows:
                f = where[r]
                src = handles.get(f) or handles.setdefault(f, files[f].open("rb"))
                src.seek(offsets[r])
                dst.write(src.read(lengths[r]))  # byte for byte: a resumed record never changes
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for h in handles.values():
            h.close()
    # Only once the merged file is in place: a kill before this leaves parts that the next merge de-duplicates.
    for p in parts:
        p.unlink(missing_ok=True)
    return total
