"""Chat template rendering and where each assistant turn sits in it, derived from the template itself.

An assistant span runs from the first character of a turn's rendered content to the end of that turn's
end-of-turn marker as the template renders it (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...); whitespace after the
marker, role headers and text a template inserts before the content (an empty `<think></think>`) are outside.
No marker string is known to this module; every boundary comes from renderings:

* Where the content sits: the conversation is rendered again with the content replaced by a probe character; the
  text that differs from the real rendering is the rendered content. (When the template rewrote the start of the
  content, e.g. re-formatted a `<think>` block, the raw content is matched where it ends.)
* Where the turn ends: the text after the content when the turn is rendered as the last message (its closing),
  matched after the content. Where it does not follow as a whole (an end-of-conversation token after the last
  turn only), the closing's common ending with a probe rendering is matched and cut at its last whitespace; where
  nothing of it follows (harmony closes the last turn with `<|return|>`, the others with `<|end|>`), the closing
  the turn gets when another follows it (rendered with a generation prompt, less the prompt).

`assistant_char_spans` takes both from a constant number of renderings of the whole conversation plus two short
renderings per turn (`_linear_spans`), so the work grows linearly with the conversation; `prefix_char_spans`, the
reference method (a probe rendering of the whole conversation and renderings of `messages[:i+1]` per turn, whose
cost grows with the square of the turns), remains for templates that fail the linear method's checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Messages = Sequence[Mapping[str, str]]
Span = tuple[int, int]  # [start, end) character offsets in the rendered text
# Private-use characters: no template special-cases them and real text rarely contains them. A probe must not occur
# in the content it stands in for, or the diff could run into the content; the first absent one is used, so text
# holding U+E000-U+E002 (icon fonts put glyphs there) takes another from the rest of the private-use area.
PROBES = ("\ue000", "\ue001", "\ue002", *(chr(c) for c in range(0xE003, 0xF900)))


class ChatTemplateError(ValueError):
    """The tokenizer has no usable chat template, or a rendering could not be mapped back to its turns."""


def require_template(tokenizer: Any) -> None:
    """Raise ChatTemplateError naming the tokenizer when it has no chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(f"tokenizer {name!r} has no chat template; set `tokenizer.chat_template` to one")


def render(tokenizer: Any, messages: Messages, add_generation_prompt: bool = False,
           template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The template's text for `messages` (what the model sees), without tokenizing."""
    require_template(tokenizer)
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


def _closing_before_next(tokenizer: Any, window: Messages, kw: Mapping[str, Any] | None) -> str:
    """The text after the last turn's content of `window` when the template renders that turn as one that another
    follows ('' when it cannot tell): the window rendered with a generation prompt, less that prompt.

    For a template that closes the last turn otherwise (harmony: `<|return|>` last, `<|end|>` before the next
    turn). The prompt is what the template adds after the user turn before (`window[:-1]` with and without it).
    """
    if len(window) < 2:
        return ""
    try:
        probe = _probe_for(window[-1]["content"])
        gen = render(tokenizer, window, add_generation_prompt=True, template_kwargs=kw)
        gen_alt = render(tokenizer, _with_content(window, len(window) - 1, probe), add_generation_prompt=True,
                         template_kwargs=kw)
        before = render(tokenizer, window[:-1], template_kwargs=kw)
        prompted = render(tokenizer, window[:-1], add_generation_prompt=True, template_kwargs=kw)
    except ChatTemplateError:
        return ""
    tail = gen[len(gen) - _common_suffix(gen, gen_alt):]  # the closing, then the prompt
    prompt = prompted[len(before):] if prompted.startswith(before) else ""
    return tail[:len(tail) - len(prompt)] if prompt and tail.endswith(prompt) else ""


def _raw_start(full: str, c0: int, c1: int, content: str, bound: int) -> int:
    """Where the rendered content [c0, c1) starts once a template's rewrite of its start is undone: probes get an
    empty <think> block where the real content has its own, so the raw content, ending at c1, starts earlier."""
    raw = content.strip()
    if raw and len(raw) > c1 - c0 and c1 - len(raw) >= bound and full[c1 - len(raw):c1] == raw:
        return c1 - len(raw)
    return c0


# ------------------------------------------------------------------------------------------- linear method


def _window(messages: Messages, i: int) -> list[Mapping[str, str]]:
    """Turn i with the message before it, after a leading system message: all a template's rendering of turn i as
    the last one depends on (the window keeps a user/assistant alternation a template may demand)."""
    head = [messages[0]] if messages[0]["role"] == "system" and i > 1 else []
    return [*head, *messages[max(len(head), i - 1):i + 1]]


def _probed(messages: Messages, turns: Sequence[int], probes: Sequence[str]) -> list[dict[str, str]]:
    out = [dict(m) for m in messages]
    for i, p in zip(turns, probes):
        out[i]["content"] = p
    return out


def _rendered_contents(tokenizer: Any, messages: Messages, full: str, turns: Sequence[int],
                       kw: Mapping[str, Any] | None) -> list[Span] | None:
    """[c0, c1) in `full` of every assistant turn's changed text, from four renderings of the conversation; None
    when the template's rendering of a turn depends on another turn's content.

    With every assistant content probed (`alt`), the probes split the template's text into pieces. A rendering with
    the turns of one parity (by their order among assistant turns) probed and the others real holds each real turn
    between two probes, so its diff against `alt` between those probes is what that turn's content changes: the
    rendered content, plus text the template derives from it (a `<think>` block). That is the whole-conversation
    probe diff of the reference method, for every turn at once, and it depends only on the template rendering
    each turn from its own content and its place in the conversation (Qwen3 keeps the reasoning of the turns
    after the last user message only); checked by rebuilding `full` from `alt` and the diffs.
    """
    used = set(full).union(*(m["content"] for m in messages))
    probes = [p for p in PROBES if p not in used][:len(turns)]
    if len(probes) < len(turns):
        return None
    alt = render(tokenizer, _probed(messages, turns, probes), template_kwargs=kw)
    by_parity = []
    for parity in (0, 1):  # parity p: turns k with k % 2 == p real, the others probed
        other = [(i, p) for k, (i, p) in enumerate(zip(turns, probes)) if k % 2 != parity]
        by_parity.append(render(tokenizer, _probed(messages, *zip(*other)), template_kwargs=kw) if other else full)
    at_alt = [alt.find(p) for p in probes]
    if any(a < 0 or alt.count(p) != 1 for a, p in zip(at_alt, probes)) or at_alt != sorted(at_alt):
        return None
    regions: list[tuple[int, int, str]] = []  # per turn: [start, end) in alt replaced by the text in the real one
    for k in range(len(turns)):
        real = by_parity[k % 2]
        lo = real.find(probes[k - 1]) + 1 if k else 0  # the neighbours are probed in `real`
        hi = real.find(probes[k + 1]) if k + 1 < len(turns) else len(real)
        if lo < (1 if k else 0) or hi < lo:
            return None
        a_lo = at_alt[k - 1] + 1 if k else 0
        a_hi = at_alt[k + 1] if k + 1 < len(turns) else len(alt)
        seg, alt_seg = real[lo:hi], alt[a_lo:a_hi]
        pre = _common_prefix(seg, alt_seg)
        suf = min(_common_suffix(seg, alt_seg), len(seg) - pre, len(alt_seg) - pre)
        regions.append((a_lo + pre, a_hi - suf, seg[pre:len(seg) - suf]))
    if any(e > s for (_, e, _), (s, _, _) in zip(regions, regions[1:])):
        return None
    pieces, spans, pos, shift = [], [], 0, 0
    for s, e, text in regions:
        pieces += [alt[pos:s], text]
        spans.append((s + shift, s + shift + len(text)))
        shift += len(text) - (e - s)
        pos = e
    pieces.append(alt[pos:])
    return spans if "".join(pieces) == full else None


def _linear_spans(tokenizer: Any, messages: Messages, full: str, turns: Sequence[int],
                  kw: Mapping[str, Any] | None) -> tuple[list[Span], str] | None:
    """The spans of `prefix_char_spans` from `_rendered_contents` and two renderings of a short window per turn
    (`_window`, the turn last, alone and with a probe content: its closing), so the work grows linearly with the
    conversation; None when a check fails.

    The method is "diff" when a turn renders differently as the last message of its window than in the
    conversation (history re-rendered) or its closing does not follow its content whole.
    """
    contents = _rendered_contents(tokenizer, messages, full, turns, kw)
    if contents is None:
        return None
    spans: list[Span] = []
    method, bound = "prefix", 0
    for i, (c0, c1) in zip(turns, contents):
        window = _window(messages, i)
        upto = render(tokenizer, window, template_kwargs=kw)
        alt_upto = render(tokenizer, _with_content(window, len(window) - 1, _probe_for(messages[i]["content"])),
                          template_kwargs=kw)
        w0 = _common_prefix(upto, alt_upto)
        w1 = max(w0, len(upto) - _common_suffix(upto, alt_upto))
        if upto[w0:w1] != full[c0:c1]:
            method = "diff"
        closing = upto[w1:]
        if full.startswith(closing, c1):
            turn_end = c1 + len(closing)
        else:
            method = "diff"
            common = _common_suffix(upto, alt_upto)
            turn_end = c1 + _closing_in_full(full, c1, upto[len(upto) - common:] if common else "")
            if not any(ch.isspace() for ch in full[c1:turn_end]):  # no next turn found: closed otherwise
                before_next = _closing_before_next(tokenizer, window, kw)  # when last? (harmony: <|return|>)
                if before_next and full.startswith(before_next, c1):
                    turn_end = max(turn_end, c1 + len(before_next))
        start = _raw_start(full, c0, c1, messages[i]["content"], bound)
        if spans and start < spans[-1][1]:
            return None
        spans.append((start, c1 + len(full[c1:turn_end].rstrip())))
        bound = c1
    return spans, method


def assistant_char_spans(tokenizer: Any, messages: Messages, template_kwargs: Mapping[str, Any] | None = None,
                         ) -> tuple[str, list[Span], str]:
    """Render `messages`; return (text, [start, end) of every assistant span in it, method).

    A span runs from the first character of the rendered content to the end of the turn's end-of-turn marker
    (trailing whitespace after the marker excluded). `method` is "prefix", or "diff" when any turn needed the
    per-turn diff because the template re-renders history or closes the last turn differently.

    Linear in the conversation's length (`_linear_spans`); `prefix_char_spans` for templates that fail its checks.
    """
    full = render(tokenizer, messages, template_kwargs=template_kwargs)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return full, [], "prefix"
    try:
        linear = _linear_spans(tokenizer, messages, full, turns, template_kwargs)
    except ChatTemplateError:  # a probe or window rendering the template refuses: the reference method decides
        linear = None
    if linear is not None:
        return full, *linear
    return prefix_char_spans(tokenizer, messages, template_kwargs)


# ---------------------------------------------------------------------------------------- reference method


def prefix_char_spans(tokenizer: Any, messages: Messages, template_kwargs: Mapping[str, Any] | None = None,
                      ) -> tuple[str, list[Span], str]:
    """`assistant_char_spans` by the reference method: per turn, the conversation rendered with that turn's
    content probed, the generation prompt before it and `messages[:i+1]`, whose cost grows with the square of the
    number of turns. Where `messages[:i+1]` does not render as a prefix of the full text (history re-rendered,
    as Qwen3 drops the reasoning of earlier turns), the turn's closing comes from the per-turn diff ("diff")."""
    kw = template_kwargs
    full = render(tokenizer, messages, template_kwargs=kw)
    spans: list[Span] = []
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
        c0 = _raw_start(full, c0, c1, message["content"], start_bound)
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
            if not any(ch.isspace() for ch in full[c1:turn_end]):  # no next turn found: closed otherwise
                before_next = _closing_before_next(tokenizer, messages[: i + 1], kw)  # when last? (harmony: <|return|>)
                if before_next and full.startswith(before_next, c1):
                    turn_end = max(turn_end, c1 + len(before_next))
        end = c1 + len(full[c1:turn_end].rstrip())
        if spans and c0 < spans[-1][1]:
            raise ChatTemplateError(f"{where}: span overlaps the previous assistant turn")
        spans.append((c0, end))
    return full, spans, method
