"""Token ids and the assistant-only loss mask of conversations, rendered with the tokenizer's chat template.

`loss_mask` is 1 on the tokens of every assistant turn's content and on that turn's end-of-turn marker as the
template renders it (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...), and 0 everywhere else: system and user turns, role
headers (`<|im_start|>assistant\\n`), text a template inserts before the content (an empty `<think></think>`), and
whitespace after the end marker. A turn's reasoning (`thinking` / `reasoning_content`, or a `<think>` block at the
start of its content), where the template renders it, is 1 too, with the text that closes it before the next
header (harmony's `<|end|>`, Qwen3's `</think>`). A turn that the template renders otherwise in the conversation
than as its last message (Qwen3 and harmony drop the reasoning of turns before the last user message) is 0
throughout: those tokens follow a context the target never answered from (`TokenizeStats.history_turns_unsupervised`
counts them; docs/stages.md). Where each assistant turn sits in the rendering comes from the template itself
(`mtp_train.data.spans`, in time linear in the conversation's length; no marker string is known here).

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
from dataclasses import dataclass, field, fields
from typing import Any

from mtp_train.config.data import HISTORY_TURNS
from mtp_train.data.fingerprints import load_tokenizer as load_tokenizer
from mtp_train.data.fingerprints import tokenizer_fingerprint as tokenizer_fingerprint
from mtp_train.data.formats import DataError
from mtp_train.data.readers import Conversation
from mtp_train.data.spans import PROBES as PROBES
from mtp_train.data.spans import ChatTemplateError as ChatTemplateError
from mtp_train.data.spans import Messages as Messages
from mtp_train.data.spans import assistant_char_spans as assistant_char_spans
from mtp_train.data.spans import check_template, require_template
from mtp_train.data.spans import render as render

TEMPLATE_ERROR = "template_error"  # the bad-row reason of a conversation that the chat template cannot render
EXAMPLES_KEPT = 3  # file:line examples kept for the drop summary


@dataclass
class TokenizedSample:
    """One tokenized conversation; `loss_mask[t]` is 1 where token t belongs to an assistant turn."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False  # cut to `max_seq_len`
    id: str | None = None  # the conversation's id, when tokenized from a `Conversation`
    where: str | None = None  # "file:line" of that conversation, named when its id is a repeat

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
    # assistant turns left out of the loss: the template renders them otherwise in the conversation than when the
    # target produced them (their reasoning dropped from later history)
    history_turns_unsupervised: int = 0
    history_turn_samples: int = 0  # history_turns="split": samples of such a turn (the conversation up to it)
    tokens: int = 0  # tokens of kept samples
    loss_tokens: int = 0  # masked tokens of kept samples

    @property
    def dropped(self) -> int:
        return self.dropped_no_assistant + self.dropped_truncated + self.dropped_template_error

    def add(self, other: TokenizeStats) -> None:
        """Count `other`'s conversations too (a stream tokenized window by window): the sums of the two runs,
        and the first few template-error examples of both, in order."""
        for f in fields(self):
            if f.name == "template_error_examples":
                room = EXAMPLES_KEPT - len(self.template_error_examples)
                self.template_error_examples.extend(other.template_error_examples[:max(room, 0)])
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


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
            ) -> list[tuple[list[int], list[int], str, list[int]] | ChatTemplateError]:
    """(input_ids, loss_mask, method, the message indices of the turns left out of the loss) of each whole
    conversation, untruncated, or the ChatTemplateError that one conversation's rendering raised; one tokenizer
    call for all."""
    rendered: list[tuple[str, list[tuple[int, int]], str, list[int]] | ChatTemplateError] = []
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
    out: list[tuple[list[int], list[int], str, list[int]] | ChatTemplateError] = []
    for r in rendered:
        if isinstance(r, ChatTemplateError):
            out.append(r)
            continue
        _, spans, method, rerendered = r
        ids, offsets = next(encoded)
        out.append((list(ids), _mask_from_offsets([tuple(o) for o in offsets], spans), method, rerendered))
    return out


def _as_messages(conv: Messages | Conversation) -> tuple[Messages, str | None]:
    if isinstance(conv, Conversation):
        return conv.messages, conv.id
    return conv, None


def _where(conv: Messages | Conversation) -> str | None:
    return f"{conv.source}:{conv.line}" if isinstance(conv, Conversation) else None


def _finish(ids: list[int], mask: list[int], conv_id: str | None, max_seq_len: int | None,
            where: str | None = None) -> tuple[TokenizedSample | None, str]:
    """Truncate; (sample or None, outcome) with outcome "kept", "no_assistant" or "truncated_away"."""
    if not any(mask):
        return None, "no_assistant"
    truncated = max_seq_len is not None and len(ids) > max_seq_len
    if truncated:
        # Keep the start: the context a turn is conditioned on must stay whole.
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not any(mask):
            return None, "truncated_away"
    return TokenizedSample(ids, mask, truncated, conv_id, where), "kept"


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
    ids, mask, _, _ = encoded
    return _finish(ids, mask, conv_id, max_seq_len, _where(messages))[0]


def tokenize_conversations(tokenizer: Any, convs: Iterable[Messages | Conversation], max_seq_len: int | None = None,
                           *, template_kwargs: Mapping[str, Any] | None = None, batch_size: int = 64,
                           on_bad_row: str = "error", history_turns: str = "mask",
                           ) -> tuple[list[TokenizedSample], TokenizeStats]:
    """`tokenize_conversation` over many conversations; counts what was truncated and dropped, and why.

    Conversations are tokenized `batch_size` at a time (one tokenizer call each), in order. A conversation the
    chat template fails on is a bad row: a `Conversation` raises DataError naming its file and line, or, with
    on_bad_row="skip", is dropped and counted (`dropped_template_error`); plain message lists raise
    ChatTemplateError.

    An assistant turn the conversation renders otherwise than as its last message (its reasoning dropped from
    later history) is out of the conversation's loss; with history_turns="split" it is also a sample of its own
    right after the conversation's: the conversation up to that turn (id "<id>@turn<i>", i its message index),
    where it renders as the target produced it and is learnt (turns before it that render otherwise there are
    left out: they have samples of their own). Each turn is then learnt once; the tokens grow with the square of
    such turns.
    """
    _check_max_seq_len(max_seq_len)
    if history_turns not in HISTORY_TURNS:
        raise ValueError(f"data.history_turns={history_turns!r}: choose one of {' | '.join(HISTORY_TURNS)}")
    check_template(tokenizer)  # a template that does not parse is its file's fault, not the first row's
    stats = TokenizeStats()
    samples: list[TokenizedSample] = []

    def keep(ids: list[int], mask: list[int], sample_id: str | None, where: str | None) -> None:
        sample, outcome = _finish(ids, mask, sample_id, max_seq_len, where)
        if sample is None:
            if outcome == "no_assistant":
                stats.dropped_no_assistant += 1
            else:
                stats.dropped_truncated += 1
            return
        stats.kept += 1
        stats.truncated += sample.truncated
        stats.tokens += len(sample.input_ids)
        stats.loss_tokens += sample.num_loss_tokens
        samples.append(sample)

    it = iter(convs)
    while batch := [(c, *_as_messages(c)) for c in itertools.islice(it, batch_size)]:
        encoded = _encode(tokenizer, [msgs for _, msgs, _ in batch], template_kwargs)
        for (conv, msgs, conv_id), result in zip(batch, encoded):
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
            ids, mask, method, rerendered = result
            stats.diff_method += method == "diff"
            keep(ids, mask, conv_id, _where(conv))
            if history_turns != "split":
                stats.history_turns_unsupervised += len(rerendered)
                continue
            for i, turn in zip(rerendered, _encode(tokenizer, [msgs[:i + 1] for i in rerendered], template_kwargs)):
                if isinstance(turn, ChatTemplateError):  # its conversation rendered whole: the template's fault
                    raise turn
                stats.history_turn_samples += 1
                keep(turn[0], turn[1], None if conv_id is None else f"{conv_id}@turn{i}", _where(conv))
    return samples, stats


# ----------------------------------------------------------------------------------------------- fingerprints


def chat_template_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of the chat template text; named templates (a dict) are hashed as sorted JSON."""
    require_template(tokenizer)
    template = tokenizer.chat_template
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
