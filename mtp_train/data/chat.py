"""Chat template rendering and the assistant-only loss mask, derived from the template itself.

`loss_mask` is 1 on the tokens of every assistant turn's content and on that turn's end-of-turn marker as the
template renders it (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...), and 0 everywhere else: system and user turns, role
headers (`<|im_start|>assistant\\n`), text a template inserts before the content (an empty `<think></think>`), and
whitespace after the end marker. No marker string is known to this module; every boundary comes from renderings:

* Where the content sits: the conversation is rendered again with this turn's content replaced by a probe
  character; the text that differs from the real rendering is the rendered content. (When the template rewrote the
  start of the content, e.g. re-formatted a `<think>` block, the raw content is matched where it ends.)
* Where the turn ends (prefix method): `messages[:i+1]` rendered alone ends where turn i ends in the full rendering.
  Templates that re-render history (Qwen3 drops the reasoning of earlier turns and adds an empty `<think>` block
  to the last one) give prefixes that are not prefixes of the full rendering; for those the turn's closing text
  is taken per turn (diff method) as the common ending of `messages[:i+1]` rendered with the real and with a
  probe content, and matched after the content in the full rendering.

Both are taken from short renderings where the template renders every turn by itself (`_local_spans`: the
conversation with each assistant content probed, and each turn as the last of a window of a few messages), so the
work grows linearly with the conversation; the prefix renderings above, whose cost grows with the square of the
turns, remain for templates that fail its checks (history re-rendered, content rewritten).

Tokens are mapped to characters with the fast tokenizer's offsets; a token is masked when its characters overlap
an assistant span and do not run past its end. (A token that straddles a header and the content, e.g. `\\n\\n` when
the content itself starts with a newline after a header ending in one, is therefore masked: the text is
tokenized as a whole, as at inference.)
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtp_train.data.fingerprints import load_tokenizer as load_tokenizer
from mtp_train.data.fingerprints import tokenizer_fingerprint as tokenizer_fingerprint
from mtp_train.data.formats import DataError
from mtp_train.data.readers import Conversation

Messages = Sequence[Mapping[str, str]]
# Private-use characters: no template special-cases them and real text rarely contains them. A probe must not occur
# in the content it stands in for, or the diff could run into the content; the first absent one is used, so text
# holding U+E000-U+E002 (icon fonts put glyphs there) takes another from the rest of the private-use area.
PROBES = ("\ue000", "\ue001", "\ue002", *(chr(c) for c in range(0xE003, 0xF900)))
TEMPLATE_ERROR = "template_error"  # the bad-row reason of a conversation that the chat template cannot render
EXAMPLES_KEPT = 3  # file:line examples kept for the drop summary


class ChatTemplateError(ValueError):
    """The tokenizer has no usable chat template, or a rendering could not be mapped back to its turns."""


@dataclass
class TokenizedSample:
    """One tokenized conversation; `loss_mask[t]` is 1 where token t belongs to an assistant turn."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False  # cut to `max_seq_len`
    id: str | None = None  # the conversation's id, when tokenized from a `Conversation`

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TokenizeStats:
    """Counts of a `tokenize_conversations` run."""

    conversations: int = 0
    kept: int = 0
    truncated: int = 0  # kept, but cut to max_seq_len
    dropped_no_assistant: int = 0  # no assistant token at all (e.g. a prompt-only conversation)
    dropped_truncated: int = 0  # every assistant token was beyond max_seq_len
    dropped_template_error: int = 0  # the chat template failed on it (on_bad_row="skip")
    template_error_examples: list[str] = field(default_factory=list)  # the first few "file:line: error"
    diff_method: int = 0  # conversations whose turn ends came from the per-turn diff (history re-rendering)
    tokens: int = 0  # tokens of kept samples
    loss_tokens: int = 0  # masked tokens of kept samples

    @property
    def dropped(self) -> int:
        return self.dropped_no_assistant + self.dropped_truncated + self.dropped_template_error


# ------------------------------------------------------------------------------------------------- rendering


def _require_template(tokenizer: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(f"tokenizer {name!r} has no chat template; set `tokenizer.chat_template` to one")


def render(tokenizer: Any, messages: Messages, add_generation_prompt: bool = False,
           template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The template's text for `messages` (what the model sees), without tokenizing."""
    _require_template(tokenizer)
    try:
        text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except Exception as exc:  # jinja raises several types; all mean the same thing here
        roles = [m.get("role") for m in messages]
        raise ChatTemplateError(f"chat template failed on roles {roles}: {exc}") from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))  # invariant: a[:lo] == b[:lo]
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common_suffix(a: str, b: str) -> int:
    """Length of the longest common suffix."""
    return _common_prefix(a[::-1], b[::-1])


def _probe_for(content: str) -> str:
    """A probe character absent from `content`."""
    for probe in PROBES:
        if probe not in content:
            return probe
    raise ChatTemplateError("content contains every private-use character (U+E000-U+F8FF); cannot locate it in the "
                            "rendering")


def _with_content(messages: Messages, i: int, content: str) -> list[dict[str, str]]:
    out = [dict(m) for m in messages]
    out[i]["content"] = content
    return out


def _closing_in_full(full: str, at: int, closing: str) -> int:
    """How much of `closing` (the text after a final turn's content) follows position `at` of `full`.

    A closing may hold more than the end-of-turn marker when the turn is last (an end-of-conversation token
    after `<|end|>` and a newline, say); where only part of it matches, the match is cut back to its last
    whitespace, where the next turn's text starts.
    """
    matched = _common_prefix(full[at:at + len(closing)], closing)
    if matched == len(closing):
        return matched
    part = full[at:at + matched]
    last_space = max((k for k, ch in enumerate(part) if ch.isspace()), default=-1)
    return last_space + 1 if last_space >= 0 else matched


def _window(messages: Messages, i: int) -> list[Mapping[str, str]]:
    """Turn i with the message before it, after a leading system message: all a local template's rendering of
    turn i as the last one depends on (the window keeps a user/assistant alternation a template may demand)."""
    head = [messages[0]] if messages[0]["role"] == "system" and i > 1 else []
    return [*head, *messages[max(len(head), i - 1):i + 1]]


def _local_spans(tokenizer: Any, messages: Messages, full: str, turns: Sequence[int],
                 kw: Mapping[str, Any] | None) -> tuple[list[tuple[int, int]], str] | None:
    """The spans of `assistant_char_spans` from two renderings of the conversation and two of a short window per
    turn, so the work grows linearly with the conversation; None when the template is not local enough for it.

    The conversation is rendered once more with every assistant content replaced by its own probe; the text
    between probes is the template's. Each turn is rendered as the last turn of its window (`_window`), alone
    and with a probe content: that gives its rendered content and closing, exactly what the per-turn prefix
    renderings give when the template renders every turn by itself. The assumption is checked: the full text
    must be the probe rendering with every probe replaced by the window's rendered content, and a content the
    template rewrote (shorter than the stripped raw content) is left to the per-turn method.
    """
    probes = [p for p in PROBES if p not in full][:len(turns)]
    if len(probes) < len(turns):
        return None
    probed = [dict(m) for m in messages]
    for i, p in zip(turns, probes):
        probed[i]["content"] = p
    try:
        alt = render(tokenizer, probed, template_kwargs=kw)
    except ChatTemplateError:
        return None
    at = [alt.find(p) for p in probes]
    if any(a < 0 or alt.count(p) != 1 for a, p in zip(at, probes)) or at != sorted(at):
        return None
    pieces = [alt[a + 1:b] for a, b in zip(at, [*at[1:], len(alt)])]  # the template's text after each probe
    if not full.startswith(alt[:at[0]]):
        return None
    pos, spans, method = at[0], [], "prefix"
    for i, piece in zip(turns, pieces):
        window = _window(messages, i)
        probe = _probe_for(messages[i]["content"])
        try:
            upto = render(tokenizer, window, template_kwargs=kw)
            alt_upto = render(tokenizer, _with_content(window, len(window) - 1, probe), template_kwargs=kw)
        except ChatTemplateError:
            return None
        w0 = _common_prefix(upto, alt_upto)
        w1 = max(w0, len(upto) - _common_suffix(upto, alt_upto))
        content = upto[w0:w1]
        raw = messages[i]["content"].strip()
        if len(raw) > len(content) or not full.startswith(content, pos) \
                or not full.startswith(piece, pos + len(content)):
            return None
        c0, c1 = pos, pos + len(content)
        closing = upto[w1:]
        if full.startswith(closing, c1):
            turn_end = c1 + len(closing)
        else:
            method = "diff"
            common = _common_suffix(upto, alt_upto)
            turn_end = c1 + _closing_in_full(full, c1, upto[len(upto) - common:] if common else "")
        spans.append((c0, c1 + len(full[c1:turn_end].rstrip())))
        pos = c1 + len(piece)
    if pos != len(full) or any(b > a for (_, b), (a, _) in zip(spans, spans[1:])):
        return None
    return spans, method


def assistant_char_spans(tokenizer: Any, messages: Messages, template_kwargs: Mapping[str, Any] | None = None,
                         ) -> tuple[str, list[tuple[int, int]], str]:
    """Render `messages`; return (text, [start, end) of every assistant span in it, method).

    A span runs from the first character of the rendered content to the end of the turn's end-of-turn marker
    (trailing whitespace after the marker excluded). `method` is "prefix", or "diff" when any turn needed the
    per-turn diff because the template re-renders history or closes the last turn differently.

    Templates that render each turn by itself take `_local_spans` (renderings of the conversation and of a few
    messages per turn: linear in the conversation's length); others the per-turn renderings of every prefix
    below, whose cost grows with the square of the number of turns.
    """
    kw = template_kwargs
    full = render(tokenizer, messages, template_kwargs=kw)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    local = _local_spans(tokenizer, messages, full, turns, kw) if turns else None
    if local is not None:
        return full, local[0], local[1]
    spans: list[tuple[int, int]] = []
    method = "prefix"
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        where = f"assistant turn {i}"
        # Start bound: the generation prompt for this turn (header) is rendered history, never assistant text.
        # Where the full text does not continue the generation prompt (a prompt ending in an empty <think> block
        # that the data's own reasoning replaces), only the history before the prompt bounds the turn.
        gen = render(tokenizer, messages[:i], add_generation_prompt=True, template_kwargs=kw) if i else ""
        if full.startswith(gen):
            start_bound = len(gen)
        else:
            start_bound = _common_prefix(full, render(tokenizer, messages[:i], template_kwargs=kw))

        # Content span: what changes when only this turn's content changes.
        probe = _probe_for(message["content"])
        alt = render(tokenizer, _with_content(messages, i, probe), template_kwargs=kw)
        c0 = _common_prefix(full, alt)
        c1 = max(c0, len(full) - _common_suffix(full, alt))
        raw = message["content"].strip()
        if raw and len(raw) > c1 - c0 and c1 - len(raw) >= start_bound and full[c1 - len(raw):c1] == raw:
            # The template rewrote the start (e.g. probes get an empty <think> block where the real content has
            # its own): the raw content is still there, ending where the rendered content ends.
            c0 = c1 - len(raw)
        if c0 < start_bound:
            raise ChatTemplateError(f"{where}: its content changes the rendering before the turn starts")

        # Turn end: from the prefix rendering when it is a prefix of the full text, else per-turn diff.
        upto = render(tokenizer, messages[: i + 1], template_kwargs=kw)
        if full.startswith(upto) and len(upto) >= c1:
            turn_end = len(upto)
        else:
            method = "diff"
            alt_upto = render(tokenizer, _with_content(messages[: i + 1], i, probe), template_kwargs=kw)
            closing = _common_suffix(upto, alt_upto)
            turn_end = c1 + _closing_in_full(full, c1, upto[len(upto) - closing:] if closing else "")
        end = c1 + len(full[c1:turn_end].rstrip())
        if spans and c0 < spans[-1][1]:
            raise ChatTemplateError(f"{where}: span overlaps the previous assistant turn")
        spans.append((c0, end))
    return full, spans, method


# ---------------------------------------------------------------------------------------------- tokenization


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span without running past its end; spans sorted, disjoint.

    A token that starts before a span and reaches into it carries assistant text and is masked; one that starts
    inside and runs past the end carries the next turn's text (e.g. its header) and is not.
    """
    mask = [0] * len(offsets)
    k = 0
    for t, (s, e) in enumerate(offsets):
        if e <= s:  # zero-width (e.g. tokens a post-processor adds): no characters of the text
            continue
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        if k < len(spans) and spans[k][0] < e <= spans[k][1]:
            mask[t] = 1
    return mask


def _encode(tokenizer: Any, convs: Sequence[Messages], template_kwargs: Mapping[str, Any] | None,
            ) -> list[tuple[list[int], list[int], str] | ChatTemplateError]:
    """(input_ids, loss_mask, method) of each whole conversation, untruncated, or the ChatTemplateError that one
    conversation's rendering raised; one tokenizer call for all."""
    rendered: list[tuple[str, list[tuple[int, int]], str] | ChatTemplateError] = []
    for messages in convs:
        try:
            rendered.append(assistant_char_spans(tokenizer, messages, template_kwargs))
        except ChatTemplateError as exc:  # this conversation's problem: the caller decides (see tokenize_conversations)
            rendered.append(exc)
    texts = [r[0] for r in rendered if not isinstance(r, ChatTemplateError)]
    try:
        # The template already writes BOS and friends, so the tokenizer must not add them again. A batch call
        # lets a fast tokenizer encode on all cores.
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else \
            {"input_ids": [], "offset_mapping": []}
    except NotImplementedError as exc:
        raise ChatTemplateError("loss masks need a fast tokenizer (character offsets)") from exc
    encoded = iter(zip(enc["input_ids"], enc["offset_mapping"]))
    out: list[tuple[list[int], list[int], str] | ChatTemplateError] = []
    for r in rendered:
        if isinstance(r, ChatTemplateError):
            out.append(r)
            continue
        _, spans, method = r
        ids, offsets = next(encoded)
        out.append((list(ids), _mask_from_offsets([tuple(o) for o in offsets], spans), method))
    return out


def _as_messages(conv: Messages | Conversation) -> tuple[Messages, str | None]:
    if isinstance(conv, Conversation):
        return conv.messages, conv.id
    return conv, None


def _finish(ids: list[int], mask: list[int], conv_id: str | None,
            max_seq_len: int | None) -> tuple[TokenizedSample | None, str]:
    """Truncate; (sample or None, outcome) with outcome "kept", "no_assistant" or "truncated_away"."""
    if not any(mask):
        return None, "no_assistant"
    truncated = max_seq_len is not None and len(ids) > max_seq_len
    if truncated:
        # Keep the start: the context a turn is conditioned on must stay whole.
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not any(mask):
            return None, "truncated_away"
    return TokenizedSample(ids, mask, truncated, conv_id), "kept"


def _check_max_seq_len(max_seq_len: int | None) -> None:
    if max_seq_len is not None and max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")


def tokenize_conversation(tokenizer: Any, messages: Messages | Conversation, max_seq_len: int | None = None, *,
                          template_kwargs: Mapping[str, Any] | None = None) -> TokenizedSample | None:
    """Render `messages` with the tokenizer's chat template and tokenize it with an assistant-only loss mask.

    Truncates to `max_seq_len` tokens (keeping the start). Returns None when no assistant token remains.
    `template_kwargs` go to the template (e.g. `{"enable_thinking": False}`).
    """
    _check_max_seq_len(max_seq_len)
    msgs, conv_id = _as_messages(messages)
    encoded = _encode(tokenizer, [msgs], template_kwargs)[0]
    if isinstance(encoded, ChatTemplateError):
        raise encoded
    ids, mask, _ = encoded
    return _finish(ids, mask, conv_id, max_seq_len)[0]


def tokenize_conversations(tokenizer: Any, convs: Iterable[Messages | Conversation], max_seq_len: int | None = None,
                           *, template_kwargs: Mapping[str, Any] | None = None, batch_size: int = 64,
                           on_bad_row: str = "error") -> tuple[list[TokenizedSample], TokenizeStats]:
    """`tokenize_conversation` over many conversations; counts what was truncated and dropped, and why.

    Conversations are tokenized `batch_size` at a time (one tokenizer call each), in order. A conversation the
    chat template fails on is a bad row: a `Conversation` raises DataError naming its file and line, or, with
    on_bad_row="skip", is dropped and counted (`dropped_template_error`); plain message lists raise
    ChatTemplateError.
    """
    _check_max_seq_len(max_seq_len)
    _require_template(tokenizer)
    stats = TokenizeStats()
    samples = []
    it = iter(convs)
    while batch := [(c, *_as_messages(c)) for c in itertools.islice(it, batch_size)]:
        encoded = _encode(tokenizer, [msgs for _, msgs, _ in batch], template_kwargs)
        for (conv, _, conv_id), result in zip(batch, encoded):
            stats.conversations += 1
            if isinstance(result, ChatTemplateError):
                if not isinstance(conv, Conversation):
                    raise result
                if on_bad_row != "skip":
                    raise DataError(conv.source, conv.line, TEMPLATE_ERROR, str(result)) from None
                stats.dropped_template_error += 1
                if len(stats.template_error_examples) < EXAMPLES_KEPT:
                    stats.template_error_examples.append(f"{conv.source}:{conv.line}: {result}")
                continue
            ids, mask, method = result
            stats.diff_method += method == "diff"
            sample, outcome = _finish(ids, mask, conv_id, max_seq_len)
            if sample is None:
                if outcome == "no_assistant":
                    stats.dropped_no_assistant += 1
                else:
                    stats.dropped_truncated += 1
                continue
            stats.kept += 1
            stats.truncated += sample.truncated
            stats.tokens += len(sample.input_ids)
            stats.loss_tokens += sample.num_loss_tokens
            samples.append(sample)
    return samples, stats


# ----------------------------------------------------------------------------------------------- fingerprints


def chat_template_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of the chat template text; named templates (a dict) are hashed as sorted JSON."""
    _require_template(tokenizer)
    template = tokenizer.chat_template
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
