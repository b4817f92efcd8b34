"""One record of a chat or prompt set → messages: the record shapes public sets come in, and why a record is refused.

Shapes (detected per record with `format="auto"`, or forced by `DataConfig.format`):

* `sharegpt`: `conversations: [{from, value}]`, `from` in human/user, gpt/assistant/chatgpt/bard/model, system.
* `messages`: `messages: [{role, content}]` (OpenAI / HF chat shape).

An assistant turn of either chat shape keeps its reasoning, given as `thinking` (GPT-OSS's template reads it) or
`reasoning_content` (Qwen3's and DeepSeek's): the text goes into the message under both names
(`REASONING_FIELDS`), so the target's template renders it whichever name it reads; a turn without one is unchanged.
* `prompt`: one of `prompt` (+ optional `completion`/`response`/`output`); `instruction` + optional `input`
  (joined with a blank line) + optional `output`/`response` (Alpaca, GPTeacher; Self-Instruct's first
  `instances` entry stands in for `input`/`output`); `question` + optional `answer` (GSM8K); `turns: [str, ...]`
  (MT-bench: several user turns, kept unanswered so that a regenerator can answer them one by one).

A record that cannot be used raises `BadRecord` with one of the reason constants below; the readers add the file
and line (`DataError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtp_train.config import DataConfig
from mtp_train.data.spans import REASONING_FIELDS

FORMATS = ("auto", "sharegpt", "messages", "prompt")
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
CONFLICTING_REASONING = "conflicting_reasoning"  # `thinking` and `reasoning_content` holding different texts
NESTED_TOO_DEEP = "nested_too_deep"  # arrays and objects nested past `sources.MAX_NESTING` levels
INTEGER_TOO_LONG = "integer_too_long"  # more digits than Python converts (sys.get_int_max_str_digits)


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
        message = {"role": mapped, "content": _text(content, f"{what}[{k}] content")}
        reasoning = _reasoning(turn, f"{what}[{k}]") if mapped == "assistant" else None
        if reasoning is not None:
            message.update(dict.fromkeys(REASONING_FIELDS, reasoning))
        messages.append(message)
    return messages


def _reasoning(turn: Mapping[str, Any], what: str) -> str | None:
    """An assistant turn's reasoning under any of `REASONING_FIELDS`, or None when it has none (absent, null or
    blank); a non-string, invalid text or two different texts make a bad row."""
    found = {}
    for key in REASONING_FIELDS:
        value = _optional(turn, key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise BadRecord(NON_STRING, f"{what} {key} is {type(value).__name__}, not a string")
        if value.strip():
            found[key] = _unicode(value, f"{what} {key}")
    if len(set(found.values())) > 1:
        raise BadRecord(CONFLICTING_REASONING, f"{what} has different texts in {' and '.join(found)}")
    return next(iter(found.values()), None)


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


def parse_record(record: Any, data: DataConfig) -> tuple[list[dict[str, str]], dict[str, Any], str | None]:
    """One decoded record → (messages, metadata, id or None), read as `data` says (its format, field_map and
    system_prompt). Raises `BadRecord` with a reason."""
    if not isinstance(record, Mapping):
        raise BadRecord(NOT_AN_OBJECT, f"record is {type(record).__name__}, not an object")
    if data.field_map:
        # Canonical name ← the record's own name, e.g. {"prompt": "question_text"}.
        record = dict(record)
        for canonical, own in data.field_map.items():
            if own in record:
                record[canonical] = record.pop(own)
    kind = _detect(record) if data.format == "auto" else data.format
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
    elif data.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": data.system_prompt})
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
