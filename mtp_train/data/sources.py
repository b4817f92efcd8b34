"""Where records come from: files, folders, globs and saved datasets → (source, line, record) rows.

`.jsonl` / `.json` are streamed by our own code so that every error names its line (a line that is not JSON, or
not UTF-8, is a row holding a `BadRecord`, and so is a record Python cannot hold: arrays and objects nested past
`MAX_NESTING` levels, an integer of more digits than `int` converts); `.parquet` / `.csv` go through
`datasets.load_dataset`; a folder written by `Dataset.save_to_disk` through `datasets.load_from_disk` (rows are
numbered from 1 like lines). A plain folder stands for the data files directly inside it.
"""

from __future__ import annotations

import glob
import json
import re
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mtp_train.data.formats import INTEGER_TOO_LONG, INVALID_JSON, NESTED_TOO_DEEP, BadRecord, DataError

JSON_SUFFIXES = (".jsonl", ".json")
DATASETS_SUFFIXES = {".parquet": "parquet", ".csv": "csv"}
PathLike = str | Path
# Arrays and objects inside each other: a conversation needs 4 levels; Python's parser (recursive, ~1000 frames of
# stack) would fail with a RecursionError somewhere past the limit, and code that walks a record again later too.
MAX_NESTING = 100
_JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_STRING_OR_BRACKET = re.compile(_JSON_STRING + r"|[\[\]{}]")  # brackets inside strings do not nest


class _LongInteger(str):
    """The digits of a JSON integer too long for `int` (`sys.get_int_max_str_digits`), kept as text so that the
    reader can name its field."""


def _nesting(text: str, start: int = 0) -> tuple[int, int]:
    """(levels, end): how deep arrays and objects nest in the JSON value at `start` of `text`, and where it ends
    (the end of `text` when the value is not an array or object, or does not close)."""
    depth = deepest = 0
    for m in _STRING_OR_BRACKET.finditer(text, start):
        c = m.group()
        if c[0] == '"':
            if depth == 0:
                break
            continue
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
        if depth == 0:
            return deepest, m.end()
    return deepest, len(text)


def _field_of(value: Any, kind: type) -> str:
    """The path (`messages[0].score`) of the first node of `kind` in a decoded record, depth first."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, kind):
            return path or "the record"
        if isinstance(node, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(node))))
    return "the record"


def _decode(text: str, start: int | None = None) -> tuple[Any, int]:
    """(record, end): the JSON value of a whole line (`start` None) or the one at `start` of `text`, and where it
    ends. A record Python cannot hold comes back as a `BadRecord` in its place: nested past `MAX_NESTING` levels
    (the parser's RecursionError) or holding an integer too long to convert (Python's limit on digits), either of
    which would otherwise stop the whole read naming no line. Text that is not JSON raises `json.JSONDecodeError`.
    """
    too_long: list[str] = []

    def parse_int(digits: str) -> int | str:
        try:
            return int(digits)
        except ValueError:  # past sys.get_int_max_str_digits()
            too_long.append(digits)
            return _LongInteger(digits)

    decoder = json.JSONDecoder(parse_int=parse_int)
    begin = 0 if start is None else start
    try:
        value, end = (decoder.decode(text), len(text)) if start is None else decoder.raw_decode(text, start)
        overflowed = False
    except RecursionError:
        value, end, overflowed = None, len(text), True
    piece = text[begin:end]
    # Counting the brackets first spares ordinary records the scan.
    if overflowed or piece.count("[") + piece.count("{") > MAX_NESTING:
        levels, value_end = _nesting(text, begin + len(piece) - len(piece.lstrip()))
        if levels > MAX_NESTING:
            return BadRecord(NESTED_TOO_DEEP, f"nested deeper than {MAX_NESTING} levels (arrays and objects "
                                              f"{levels} deep); flatten the record or leave the row out"), \
                value_end if overflowed else end
        if overflowed:  # within the limit, yet the stack ran out: not the record's doing
            raise RecursionError(f"decoding a record of {levels} levels")
    if too_long:
        digits = len(too_long[0].lstrip("-"))
        return BadRecord(INTEGER_TOO_LONG, f"field {_field_of(value, _LongInteger)} is an integer of {digits} "
                                           f"digits, more than the {sys.get_int_max_str_digits()} Python converts; "
                                           f"write it as a string (in quotes) or leave the row out"), end
    return value, end


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line, decoded record) for a JSON Lines file or a `.json` array; undecodable lines yield a `BadRecord`."""
    with path.open("r", encoding="utf-8-sig", errors="replace") as fh:
        head = fh.read(4096).lstrip()
    if path.suffix == ".json" and head.startswith("["):
        yield from _json_array_rows(path)
        return
    # Bytes, decoded line by line, so that one line of broken UTF-8 is one bad row and not the end of the file.
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield lineno, BadRecord(INVALID_JSON, f"not UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                # Without its line break: a line cut short would otherwise fail "at column 1" of the next line.
                yield lineno, _decode(line.rstrip("\r\n"))[0]
            except json.JSONDecodeError as exc:
                yield lineno, BadRecord(INVALID_JSON, f"{exc.msg} at column {exc.colno}")


def _json_array_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array, each with the line it starts on. A syntax error ends the file."""
    text = path.read_text(encoding="utf-8-sig")
    pos, line, counted = text.index("[") + 1, 1, 0

    def skip(p: int, chars: str) -> int:
        while p < len(text) and text[p] in chars:
            p += 1
        return p

    def end_of_array(close: int) -> None:
        """The array closes at `close`: anything but whitespace after it (a second array, more records) is
        refused, never dropped."""
        rest = skip(close + 1, " \t\r\n")
        if rest < len(text):
            raise DataError(str(path), line + text.count("\n", counted, rest), INVALID_JSON,
                            "text after the closing ] of the file's array; a .json file holds one array of "
                            "records (write one record per line as .jsonl instead)")

    pos = skip(pos, " \t\r\n")
    if pos < len(text) and text[pos] == "]":
        end_of_array(pos)
        return
    while pos < len(text):
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            value, end = _decode(text, pos)
        except json.JSONDecodeError as exc:
            yield exc.lineno, BadRecord(INVALID_JSON, f"{exc.msg} at column {exc.colno} (rest of file not read)")
            return
        yield line, value
        pos = skip(end, " \t\r\n")
        if pos < len(text) and text[pos] == "]":
            end_of_array(pos)
            return
        if pos >= len(text) or text[pos] != ",":
            bad_line = line + text.count("\n", counted, pos)
            yield bad_line, BadRecord(INVALID_JSON, "expected ',' or ']' after an element (rest of file not read)")
            return
        pos = skip(pos + 1, " \t\r\n")


def _dataset_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(source, row, record) from a saved dataset folder or a parquet/csv file, through `datasets`."""
    import datasets  # slow to import; only needed for these sources

    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    else:
        builder = DATASETS_SUFFIXES[path.suffix]
        try:
            splits = [(None, datasets.load_dataset(builder, data_files=str(path), split="train"))]
        except Exception as exc:  # pyarrow's and datasets' many error types all mean: not a readable file
            cause = exc.__cause__ or exc
            detail = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else type(cause).__name__
            raise DataError(str(path), None, f"not a readable {path.suffix[1:]} file",
                            f"{detail.rstrip('.')}; check or re-export the file") from exc
    for split, ds in splits:
        source = str(path) if split is None else f"{path}[{split}]"
        for row, record in enumerate(ds, start=1):
            yield source, row, record


def _is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _check_kind(path: Path) -> None:
    """Refuse what is neither a regular file nor a folder (a FIFO, a device such as /dev/null, a socket), naming
    it: data is read more than once (a re-run, the split), which a stream cannot give."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise DataError(str(path), None, "not a regular file",
                    f"it is {kind}; data.paths takes files ({', '.join((*JSON_SUFFIXES, *DATASETS_SUFFIXES))}), "
                    f"folders of them, globs or saved datasets: write the data to a file and pass that")


def resolve_paths(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    """Files and saved-dataset folders to read, in order; a plain folder or glob expands to its data files."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: list[Path] = []
    for item in items:
        path = Path(item)
        if not path.exists() and glob.has_magic(str(item)):
            matches = sorted(Path(p) for p in glob.glob(str(item)))
            if not matches:
                raise FileNotFoundError(f"no data files match {item}")
            out.extend(matches)
        elif not path.exists():
            raise FileNotFoundError(f"data file not found: {path}")
        elif path.is_dir() and not _is_saved_dataset(path):
            found = sorted(p for p in path.iterdir() if p.suffix in (*JSON_SUFFIXES, *DATASETS_SUFFIXES))
            if not found:
                raise FileNotFoundError(f"{path} is neither a saved dataset nor a folder of data files")
            out.extend(found)
        else:
            out.append(path)
    for path in out:
        _check_kind(path)
        if path.is_file() and path.suffix not in (*JSON_SUFFIXES, *DATASETS_SUFFIXES):
            raise DataError(str(path), None, "unsupported file type",
                            f"expected one of {', '.join((*JSON_SUFFIXES, *DATASETS_SUFFIXES))}")
    return out


def path_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(source, line, record-or-BadRecord) of one path from `resolve_paths`."""
    if path.is_file() and path.suffix in JSON_SUFFIXES:
        for line, record in _json_rows(path):
            yield str(path), line, record
    else:
        yield from _dataset_rows(path)
