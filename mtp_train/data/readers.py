"""Read conversations from the shapes public chat and prompt sets come in, into one `Conversation` type.

Formats (detected per record with `format="auto"`, or forced):

* `sharegpt`: `conversations: [{from, value}]`, `from` in human/user, gpt/assistant/chatgpt/bard/model, system.
* `messages`: `messages: [{role, content}]` (OpenAI / HF chat shape).
* `prompt`: one of `prompt` (+ optional `completion`/`response`/`output`); `instruction` + optional `input`
  (joined with a blank line) + optional `output`/`response` (Alpaca, GPTeacher; Self-Instruct's first
  `instances` entry stands in for `input`/`output`); `question` + optional `answer` (GSM8K); `turns: [str, ...]`
  (MT-bench: several user turns, kept unanswered so that a regenerator can answer them one by one).

Files: `.jsonl` / `.json` are streamed by our own code so that every error names its line; `.parquet` / `.csv`
go through `datasets.load_dataset`; a folder written by `Dataset.save_to_disk` through `datasets.load_from_disk`
(rows are numbered from 1 like lines). A plain folder stands for the data files directly inside it.

A bad record either raises `DataError` (file, line, reason) or, with `on_bad_row="skip"`, is counted per reason
in `ReadStats` and reported once, with a few file:line examples, when reading ends.
"""

from __future__ import annotations

import glob
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

Format = Literal["auto", "sharegpt", "messages", "prompt"]
OnBadRow = Literal["error", "skip"]
PathLike = str | Path

FORMATS = ("auto", "sharegpt", "messages", "prompt")
JSON_SUFFIXES = (".jsonl", ".json")
DATASETS_SUFFIXES = {".parquet": "parquet", ".csv": "csv"}
ROLES = ("system", "user", "assistant")
# Speaker names of ShareGPT dumps and other chat exports, mapped to our three roles.
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
ID_FIELDS = ("id", "question_id", "source_id")
ANSWER_FIELDS = {"prompt": ("completion", "response", "output"), "instruction": ("output", "response"),
                 "question": ("answer",)}
EXAMPLES_PER_REASON = 3  # file:line examples kept per bad-row reason for the warning

# Reasons a record is rejected; the keys of `ReadStats.bad`.
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
UNRECOGNISED = "unrecognised_fields"
NO_MESSAGES = "no_messages"
UNKNOWN_ROLE = "unknown_role"
NON_STRING = "non_string_content"
EMPTY_CONTENT = "empty_content"
ROLE_ORDER = "role_order"
INVALID_TEXT = "invalid_text"  # a string that is not valid Unicode (a lone surrogate such as "\ud800" in JSON)


class DataError(ValueError):
    """A record (or file) that cannot be read; the message names the file, the line and the reason."""

    def __init__(self, source: str, line: int | None, reason: str, detail: str = ""):
        self.source, self.line, self.reason, self.detail = source, line, reason, detail
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {reason}" + (f": {detail}" if detail else ""))


class BadRecord(ValueError):
    """One record that cannot be used; `reason` is one of the reason constants. Readers add file and line."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass
class Conversation:
    """One conversation: `messages` alternate user/assistant after an optional leading system message."""

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


# --------------------------------------------------------------------------------------------------- records


def _unicode(value: str, what: str) -> str:
    """`value` if it is valid Unicode text, else a bad row.

    JSON's `\\ud800` escapes decode to lone surrogates, which no tokenizer or UTF-8 file can take: caught here,
    with the row's file and line, rather than as a crash wherever the text is first encoded.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRecord(INVALID_TEXT, f"{what} holds a lone surrogate {value[exc.start]!r} at character "
                                      f"{exc.start} (not valid Unicode text)") from None
    return value


def _text(value: Any, what: str) -> str:
    """`value` as message content: a non-empty string of valid Unicode, else a bad row."""
    if not isinstance(value, str):
        raise BadRecord(NON_STRING, f"{what} is {type(value).__name__}, not a string")
    if not value.strip():
        raise BadRecord(EMPTY_CONTENT, f"{what} is empty")
    return _unicode(value, what)


def _optional(record: Mapping[str, Any], key: str) -> Any:
    """A field's value, with None (a missing column in parquet/csv) and "" counted as absent."""
    value = record.get(key)
    return None if value is None or value == "" else value


def _chat_turns(turns: Any, role_key: str, content_key: str, what: str) -> list[dict[str, str]]:
    """`[{from, value}]` or `[{role, content}]` turns (either key style is accepted) → messages."""
    if not isinstance(turns, list):
        raise BadRecord(UNRECOGNISED, f"'{what}' is {type(turns).__name__}, not a list")
    if not turns:
        raise BadRecord(NO_MESSAGES, f"'{what}' is empty")
    messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise BadRecord(UNRECOGNISED, f"{what}[{k}] is {type(turn).__name__}, not an object")
        # Dumps mix the two key styles, so a turn may use either.
        role = turn.get(role_key, turn.get("role" if role_key == "from" else "from"))
        content = turn.get(content_key, turn.get("content" if content_key == "value" else "value"))
        mapped = ROLE_ALIASES.get(role.lower()) if isinstance(role, str) else None
        if mapped is None:
            raise BadRecord(UNKNOWN_ROLE, f"{what}[{k}] has role {role!r}")
        messages.append({"role": mapped, "content": _text(content, f"{what}[{k}] content")})
    return messages


def _prompt_messages(record: Mapping[str, Any]) -> tuple[list[dict[str, str]], set[str]]:
    """Prompt-shaped records → messages, and the fields consumed."""
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list):
            raise BadRecord(UNRECOGNISED, f"'turns' is {type(turns).__name__}, not a list")
        if not turns:
            raise BadRecord(NO_MESSAGES, "'turns' is empty")
        return [{"role": "user", "content": _text(t, f"turns[{k}]")} for k, t in enumerate(turns)], {"turns"}
    for key in ("prompt", "instruction", "question"):
        if key in record:
            break
    else:
        raise BadRecord(UNRECOGNISED, "none of prompt/instruction/question/turns")
    used = {key}
    prompt = _text(record[key], key)
    fields: Mapping[str, Any] = record
    if key == "instruction" and "input" not in record and isinstance(record.get("instances"), list):
        # Self-Instruct keeps input/output in a list of instances; the first one is the task's example.
        first = record["instances"][0] if record["instances"] else {}
        fields = first if isinstance(first, Mapping) else {}
        used.add("instances")
    if key == "instruction":
        extra = _optional(fields, "input")
        used.add("input")
        if extra is not None:
            prompt = prompt + "\n\n" + _text(extra, "input")
    messages = [{"role": "user", "content": prompt}]
    for answer_key in ANSWER_FIELDS[key]:
        answer = _optional(fields, answer_key)
        if answer is not None:
            messages.append({"role": "assistant", "content": _text(answer, answer_key)})
            used.add(answer_key)
            break
    return messages, used


def _detect(record: Mapping[str, Any]) -> str:
    """The format of one record, from the fields it has."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if any(k in record for k in ("prompt", "instruction", "question", "turns")):
        return "prompt"
    raise BadRecord(UNRECOGNISED, f"no recognisable fields among {sorted(record)[:8]}")


def _check_order(messages: list[dict[str, str]]) -> None:
    """System first if at all, never an assistant first or two assistants in a row.

    Consecutive user turns are allowed: unanswered multi-turn prompts (MT-bench) are exactly that.
    """
    prev = None
    for k, m in enumerate(messages):
        role = m["role"]
        if role == "system" and k != 0:
            raise BadRecord(ROLE_ORDER, f"system message at position {k}")
        if role == "assistant" and prev != "user":
            raise BadRecord(ROLE_ORDER, f"assistant at position {k} follows {prev or 'nothing'}")
        prev = role
    if all(m["role"] == "system" for m in messages):
        raise BadRecord(NO_MESSAGES, "only a system message")


def parse_record(record: Any, fmt: Format = "auto", field_map: Mapping[str, str] | None = None,
                 system_prompt: str | None = None) -> tuple[list[dict[str, str]], dict[str, Any], str | None]:
    """One decoded record → (messages, metadata, id or None). Raises `BadRecord` with a reason."""
    if not isinstance(record, Mapping):
        raise BadRecord(NOT_AN_OBJECT, f"record is {type(record).__name__}, not an object")
    if field_map:
        # Canonical name ← the record's own name, e.g. {"prompt": "question_text"}.
        record = dict(record)
        for canonical, own in field_map.items():
            if own in record:
                record[canonical] = record.pop(own)
    kind = _detect(record) if fmt == "auto" else fmt
    if kind == "messages":
        if "messages" not in record:
            raise BadRecord(UNRECOGNISED, "no 'messages' field")
        messages, used = _chat_turns(record["messages"], "role", "content", "messages"), {"messages"}
    elif kind == "sharegpt":
        if "conversations" not in record:
            raise BadRecord(UNRECOGNISED, "no 'conversations' field")
        messages, used = _chat_turns(record["conversations"], "from", "value", "conversations"), {"conversations"}
    else:
        messages, used = _prompt_messages(record)
    system = _optional(record, "system")
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": _text(system, "system")})
        used.add("system")
    elif system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    _check_order(messages)

    conv_id = None
    for key in ID_FIELDS:
        if _optional(record, key) is not None:
            conv_id = _unicode(str(record[key]), key)
            # `source_id` is only unique within the file a derived set took it from.
            if key == "source_id" and _optional(record, "source_file") is not None:
                conv_id = _unicode(f"{record['source_file']}:{conv_id}", "source_file")
            used.add(key)
            break
    metadata = {k: v for k, v in record.items() if k not in used}
    return messages, metadata, conv_id


# ----------------------------------------------------------------------------------------------------- files


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
                yield lineno, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                yield lineno, BadRecord(INVALID_JSON, f"{exc.msg} at column {exc.colno}")


def _json_array_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array, each with the line it starts on. A syntax error ends the file."""
    text = path.read_text(encoding="utf-8-sig")
    decoder = json.JSONDecoder()
    pos, line, counted = text.index("[") + 1, 1, 0

    def skip(p: int, chars: str) -> int:
        while p < len(text) and text[p] in chars:
            p += 1
        return p

    pos = skip(pos, " \t\r\n")
    if pos < len(text) and text[pos] == "]":
        return
    while pos < len(text):
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            yield exc.lineno, BadRecord(INVALID_JSON, f"{exc.msg} at column {exc.colno} (rest of file not read)")
            return
        yield line, value
        pos = skip(end, " \t\r\n")
        if pos < len(text) and text[pos] == "]":
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
        splits = [(None, datasets.load_dataset(builder, data_files=str(path), split="train"))]
    for split, ds in splits:
        source = str(path) if split is None else f"{path}[{split}]"
        for row, record in enumerate(ds, start=1):
            yield source, row, record


def _is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


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
        if path.is_file() and path.suffix not in (*JSON_SUFFIXES, *DATASETS_SUFFIXES):
            raise DataError(str(path), None, "unsupported file type",
                            f"expected one of {', '.join((*JSON_SUFFIXES, *DATASETS_SUFFIXES))}")
    return out


def _rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(source, line, record-or-BadRecord) of one resolved path."""
    if path.is_file() and path.suffix in JSON_SUFFIXES:
        for line, record in _json_rows(path):
            yield str(path), line, record
    else:
        yield from _dataset_rows(path)


# ---------------------------------------------------------------------------------------------------- public


def iter_conversations(paths: PathLike | Iterable[PathLike], format: Format = "auto",
                       field_map: Mapping[str, str] | None = None, system_prompt: str | None = None,
                       on_bad_row: OnBadRow = "error", limit: int | None = None,
                       stats: ReadStats | None = None) -> Iterator[Conversation]:
    """Stream conversations from `paths` (see the module docstring for formats and sources).

    `stats`, when given, is updated as rows are read; skipped rows are logged once, when the stream ends.
    `limit` stops after that many conversations. Arguments and paths are checked at once (`ValueError`,
    `FileNotFoundError` naming the path); a bad row raises `DataError` while streaming unless
    `on_bad_row="skip"`.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    resolved = resolve_paths(paths)
    stats = stats if stats is not None else ReadStats()
    return _stream(resolved, format, field_map, system_prompt, on_bad_row, limit, stats)


def _stream(resolved: list[Path], format: Format, field_map: Mapping[str, str] | None, system_prompt: str | None,
            on_bad_row: OnBadRow, limit: int | None, stats: ReadStats) -> Iterator[Conversation]:
    """The generator behind `iter_conversations`."""
    for path in resolved:
        if limit is not None and stats.kept >= limit:
            break
        with closing(_rows(path)) as rows:
            for source, line, record in rows:
                if limit is not None and stats.kept >= limit:
                    break
                stats.rows += 1
                try:
                    if isinstance(record, BadRecord):
                        raise record
                    messages, metadata, conv_id = parse_record(record, format, field_map, system_prompt)
                except BadRecord as bad:
                    if on_bad_row == "error":
                        raise DataError(source, line, bad.reason, bad.detail) from None
                    stats.add_bad(bad.reason, f"{source}:{line}")
                    continue
                stats.kept += 1
                yield Conversation(id=conv_id or f"{Path(source).name}:{line}", messages=messages,
                                   source=source, line=line, metadata=metadata)
    if stats.num_bad:
        log.warning("skipped bad rows: %s", stats.summary())


def read_conversations(paths: PathLike | Sequence[PathLike], format: Format = "auto",
                       field_map: Mapping[str, str] | None = None, system_prompt: str | None = None,
                       on_bad_row: OnBadRow = "error",
                       limit: int | None = None) -> tuple[list[Conversation], ReadStats]:
    """All conversations of `paths` in a list, with the `ReadStats` of the read (see `iter_conversations`)."""
    stats = ReadStats()
    convs = list(iter_conversations(paths, format, field_map, system_prompt, on_bad_row, limit, stats))
    return convs, stats
