"""Chat template rendering and where each assistant turn sits in it, derived from the template itself.

An assistant span runs from the first character of a turn's rendered content to the end of that turn's
end-of-turn marker as the template renders it (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...); whitespace after the
marker, role headers and text a template inserts before the content (an empty `<think></think>`) are outside.
A turn's reasoning (`REASONING_FIELDS`), where the template renders it, is a field of its own with a span of its
own: from its first character to where the next message's header starts (harmony's analysis channel ends with
its `<|end|>`, before `<|start|>assistant<|channel|>final`), or up to the content when no header comes between
(Qwen3's `</think>` and the blank line after it). No marker string is known to this module; every boundary
comes from renderings:

* Where a field sits: the conversation is rendered again with the field replaced by a probe character; the text
  that differs from the real rendering is the rendered field. (When the template rewrote the start of the
  content, e.g. re-formatted a `<think>` block, the raw content is matched where it ends.) A field whose probe is
  not rendered (the reasoning of earlier turns, which harmony and Qwen3 drop) has no span.
* Where a field that another field of its turn follows ends: the text between the two up to the generation
  prompt (the header a next message starts with), when it holds one.
* Where the turn ends: the text after its last field when the turn is rendered as the last message (its
  closing), matched after that field. Where it does not follow as a whole (an end-of-conversation token after the
  last turn only), the closing's common ending with a probe rendering is matched and cut at its last whitespace;
  where nothing of it follows (harmony closes the last turn with `<|return|>`, the others with `<|end|>`), the
  closing the turn gets when another follows it (rendered with a generation prompt, less the prompt).

`assistant_char_spans` takes them from a constant number of renderings of the whole conversation plus two short
renderings per turn (four for a turn with two rendered fields: `_linear_spans`), so the work grows linearly with
the conversation; `prefix_char_spans`, the reference method (a probe rendering of the whole conversation per field
and renderings of `messages[:i+1]` per turn, whose cost grows with the square of the turns), remains for templates
that fail the linear method's checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Messages = Sequence[Mapping[str, str]]
Span = tuple[int, int]  # [start, end) character offsets in the rendered text
# Private-use characters: no template special-cases them and real text rarely contains them. A probe must not occur
# in the content it stands in for, or the diff could run into the content; the first absent one is used, so text
# holding U+E000-U+E002 (icon fonts put glyphs there) takes another from the rest of the private-use area.
PROBES = ("\ue000", "\ue001", "\ue002", *(chr(c) for c in range(0xE003, 0xF900)))
# The names templates read an assistant message's reasoning under: GPT-OSS's harmony template `thinking`, Qwen3's
# and DeepSeek's `reasoning_content`. Readers set every one of them to the record's reasoning, so a field is the
# group of names that carry one text, probed together.
REASONING_FIELDS = ("thinking", "reasoning_content")
CONTENT = ("content",)
Field = tuple[str, ...]


class ChatTemplateError(ValueError):
    """The tokenizer has no usable chat template, or a rendering could not be mapped back to its turns."""


def require_template(tokenizer: Any) -> None:
    """Raise ChatTemplateError naming the tokenizer when it has no chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(f"tokenizer {name!r} has no chat template; set `tokenizer.chat_template` to one")


TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")  # where a folder keeps it


def template_source(tokenizer: Any) -> str:
    """The file a tokenizer's chat template was read from (the first of TEMPLATE_FILES in its folder), or a
    description of it when it was not read from a folder."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    for name in TEMPLATE_FILES:
        if str(folder) and (folder / name).is_file():
            return str(folder / name)
    return "the tokenizer's chat template"


def check_template(tokenizer: Any, source: str | None = None) -> None:
    """Raise ChatTemplateError naming the template's file (`source`, by default `template_source`) when the
    template does not parse: a syntax error is the template's fault, never one data row's."""
    import jinja2

    require_template(tokenizer)
    template = tokenizer.chat_template
    for name in sorted(template) if isinstance(template, dict) else [None]:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                          **({"chat_template": name} if name else {}))
        except jinja2.TemplateSyntaxError as exc:
            which = f" {name!r}" if name else ""
            raise ChatTemplateError(
                f"{source or template_source(tokenizer)}: the chat template{which} does not parse: {exc.message} "
                f"at line {exc.lineno} of the template; fix the template there") from None
        except Exception:  # noqa: BLE001 - a template may refuse this one message; only syntax is checked here
            pass


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


def _fields(message: Mapping[str, str]) -> list[Field]:
    """The fields of an assistant message a template may render: its content, and its reasoning when it has one."""
    reasoning = tuple(k for k in REASONING_FIELDS if isinstance(message.get(k), str) and message[k].strip())
    return [CONTENT, reasoning] if reasoning else [CONTENT]


def _with_field(messages: Messages, i: int, text: str, keys: Field = CONTENT) -> list[dict[str, str]]:
    """`messages` with the field `keys` of message i set to `text`."""
    out = [dict(m) for m in messages]
    out[i].update(dict.fromkeys(keys, text))
    return out


def _generation_prompt(tokenizer: Any, history: Messages, kw: Mapping[str, Any] | None) -> str:
    """What the template adds after `history` for the next assistant turn ('' when it cannot tell)."""
    before = render(tokenizer, history, template_kwargs=kw)
    prompted = render(tokenizer, history, add_generation_prompt=True, template_kwargs=kw)
    return prompted[len(before):] if prompted.startswith(before) else ""


def _gap_end(full: str, r1: int, n0: int, prompt: str) -> int:
    """End of the span of a field that another field of its turn follows at `n0` (the analysis channel before the
    final one): the text between them up to where a next message's header starts (the generation prompt: harmony's
    `<|start|>assistant`), trailing whitespace excluded; all of it when no header starts there (Qwen3's
    `</think>` before the answer)."""
    gap = full[r1:n0]
    cut = gap.find(prompt) if prompt else -1
    return n0 if cut < 0 else r1 + len(gap[:cut].rstrip())


def _merged(spans: Sequence[Span]) -> list[Span]:
    """Touching spans as one, so that a token across their boundary stays in the loss."""
    out: list[Span] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
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


def _closing_before_next(tokenizer: Any, window: Messages, kw: Mapping[str, Any] | None,
                         keys: Field = CONTENT) -> str:
    """The text after the last turn's content of `window` when the template renders that turn as one that another
    follows ('' when it cannot tell): the window rendered with a generation prompt, less that prompt.

    For a template that closes the last turn otherwise (harmony: `<|return|>` last, `<|end|>` before the next
    turn). The prompt is what the template adds after the user turn before (`window[:-1]` with and without it).
    `keys` is the turn's last rendered field.
    """
    if len(window) < 2:
        return ""
    try:
        probe = _probe_for(window[-1][keys[0]])
        gen = render(tokenizer, window, add_generation_prompt=True, template_kwargs=kw)
        gen_alt = render(tokenizer, _with_field(window, len(window) - 1, probe, keys), add_generation_prompt=True,
                         template_kwargs=kw)
        prompt = _generation_prompt(tokenizer, window[:-1], kw)
    except ChatTemplateError:
        return ""
    tail = gen[len(gen) - _common_suffix(gen, gen_alt):]  # the closing, then the prompt
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


Slot = tuple[int, Field]  # (message index, field)


def _probed(messages: Messages, slots: Sequence[Slot], probes: Sequence[str]) -> list[dict[str, str]]:
    out = [dict(m) for m in messages]
    for (i, keys), p in zip(slots, probes):
        out[i].update(dict.fromkeys(keys, p))
    return out


def _rendered_fields(tokenizer: Any, messages: Messages, full: str, slots: Sequence[Slot],
                     kw: Mapping[str, Any] | None) -> list[tuple[Slot, Span]] | None:
    """(field, [c0, c1) in `full` of its changed text) of every rendered assistant field, in the order of the text,
    from four renderings of the conversation; None when the template's rendering of a field depends on another
    field's text.

    With every field probed (`alt`), the probes split the template's text into pieces; a field whose probe is not
    there is not rendered (harmony and Qwen3 drop the reasoning of earlier turns) and stays probed throughout. A
    rendering with the rendered fields of one parity (by their order in `alt`) probed and the others real holds
    each real field between two probes, so its diff against `alt` between those probes is what that field's text
    changes: the rendered text, plus text the template derives from it (a `<think>` block). That is the
    whole-conversation probe diff of the reference method, for every field at once, and it depends only on the
    template rendering each field from its own text and its place in the conversation (Qwen3 keeps the reasoning
    of the turns after the last user message only); checked by rebuilding `full` from `alt` and the diffs.
    """
    used = set(full).union(*(messages[i][k] for i, keys in slots for k in keys))
    probes = [p for p in PROBES if p not in used][:len(slots)]
    if len(probes) < len(slots):
        return None
    alt = render(tokenizer, _probed(messages, slots, probes), template_kwargs=kw)
    at = [alt.find(p) for p in probes]
    if any(a >= 0 and alt.count(p) != 1 for a, p in zip(at, probes)):
        return None
    if any(a < 0 and keys == CONTENT for a, (_, keys) in zip(at, slots)):
        return None
    order = sorted((k for k, a in enumerate(at) if a >= 0), key=at.__getitem__)
    if [slots[k][0] for k in order] != sorted(slots[k][0] for k in order):  # turns in order, each one's together
        return None
    hidden = [k for k, a in enumerate(at) if a < 0]
    by_parity = []
    for parity in (0, 1):  # parity p: fields n with n % 2 == p real, the others probed
        other = hidden + [k for n, k in enumerate(order) if n % 2 != parity]
        by_parity.append(render(tokenizer, _probed(messages, [slots[k] for k in other], [probes[k] for k in other]),
                                template_kwargs=kw) if other else full)
    shown = [probes[k] for k in order]
    at_alt = [at[k] for k in order]
    regions: list[tuple[int, int, str]] = []  # per field: [start, end) in alt replaced by the text in the real one
    for n in range(len(order)):
        real = by_parity[n % 2]
        lo = real.find(shown[n - 1]) + 1 if n else 0  # the neighbours are probed in `real`
        hi = real.find(shown[n + 1]) if n + 1 < len(order) else len(real)
        if lo < (1 if n else 0) or hi < lo:
            return None
        a_lo = at_alt[n - 1] + 1 if n else 0
        a_hi = at_alt[n + 1] if n + 1 < len(order) else len(alt)
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
    return [(slots[k], span) for k, span in zip(order, spans)] if "".join(pieces) == full else None


def _diff_turn_end(tokenizer: Any, full: str, c1: int, upto: str, alt_upto: str, window: Messages,
                   kw: Mapping[str, Any] | None, keys: Field) -> int:
    """Where a turn whose last field ends at `c1` ends, from the closing it gets as the last turn of `window`
    (`upto`, and `alt_upto` with that field probed) where that closing does not follow it whole in `full`."""
    common = _common_suffix(upto, alt_upto)
    turn_end = c1 + _closing_in_full(full, c1, upto[len(upto) - common:] if common else "")
    if not any(ch.isspace() for ch in full[c1:turn_end]):  # no next turn found: closed otherwise
        before_next = _closing_before_next(tokenizer, window, kw, keys)  # when last? (harmony: <|return|>)
        if before_next and full.startswith(before_next, c1):
            turn_end = max(turn_end, c1 + len(before_next))
    return turn_end


def _by_turn(located: Sequence[tuple[Slot, Span]]) -> list[tuple[int, list[tuple[Field, Span]]]]:
    """The located fields grouped by turn, in the order of the text."""
    out: list[tuple[int, list[tuple[Field, Span]]]] = []
    for (i, keys), span in located:
        if not out or out[-1][0] != i:
            out.append((i, []))
        out[-1][1].append((keys, span))
    return out


def _linear_spans(tokenizer: Any, messages: Messages, full: str, turns: Sequence[int],
                  kw: Mapping[str, Any] | None) -> tuple[list[Span], str, list[int]] | None:
    """The spans of `prefix_char_spans` from `_rendered_fields` and two renderings of a short window per turn
    (`_window`, the turn last, alone and with its last field probed: its closing; two more for a turn with two
    rendered fields: the generation prompt that starts a next message; one for a field the conversation does not
    render: whether the window does), so the work grows linearly with the conversation; None when a check fails.

    The method is "diff" when a turn renders differently as the last message of its window than in the
    conversation (history re-rendered) or its closing does not follow its content whole. A turn whose fields
    render otherwise as the last message than in the conversation has no span; their message indices are
    returned last.
    """
    located = _rendered_fields(tokenizer, messages, full, [(i, keys) for i in turns for keys in _fields(messages[i])],
                               kw)
    if located is None:
        return None
    spans: list[Span] = []
    method, bound, last_end = "prefix", 0, 0
    rerendered: list[int] = []
    for i, fields in _by_turn(located):
        window = _window(messages, i)
        hidden = [keys for keys in _fields(messages[i]) if keys not in dict(fields)]
        prompt = _generation_prompt(tokenizer, window[:-1], kw) if len(fields) > 1 and len(window) > 1 else ""
        turn: list[Span] = []
        for n, (keys, (c0, c1)) in enumerate(fields):
            start = _raw_start(full, c0, c1, messages[i][keys[0]], bound)
            if start < last_end:
                return None
            bound = c1
            if n + 1 < len(fields):
                turn.append((start, _gap_end(full, c1, fields[n + 1][1][0], prompt)))
                last_end = turn[-1][1]
                continue
            upto = render(tokenizer, window, template_kwargs=kw)
            alt_upto = render(tokenizer, _with_field(window, len(window) - 1, _probe_for(messages[i][keys[0]]), keys),
                              template_kwargs=kw)
            w0 = _common_prefix(upto, alt_upto)
            w1 = max(w0, len(upto) - _common_suffix(upto, alt_upto))
            changed = upto[w0:w1] != full[c0:c1]
            for keys_hidden in hidden:  # a field the conversation drops and the window renders: history re-rendered
                probe = _probe_for(messages[i][keys_hidden[0]])
                changed |= render(tokenizer, _with_field(window, len(window) - 1, probe, keys_hidden),
                                  template_kwargs=kw) != upto
            closing = upto[w1:]
            if full.startswith(closing, c1) and not changed:
                turn_end = c1 + len(closing)
            else:
                method = "diff"
                turn_end = c1 + len(closing) if full.startswith(closing, c1) else \
                    _diff_turn_end(tokenizer, full, c1, upto, alt_upto, window, kw, keys)
            turn.append((start, c1 + len(full[c1:turn_end].rstrip())))
            last_end = turn[-1][1]
            if changed:
                rerendered.append(i)
            else:
                spans.extend(turn)
    return _merged(spans), method, rerendered


def assistant_char_spans(tokenizer: Any, messages: Messages, template_kwargs: Mapping[str, Any] | None = None,
                         ) -> tuple[str, list[Span], str, list[int]]:
    """Render `messages`; return (text, [start, end) of every assistant span in it, method, rerendered).

    A span runs from the first character of a rendered field (the content, or the reasoning where the template
    renders it) to the end of the end-of-turn marker after it (trailing whitespace after the marker excluded); a
    field another field of its turn follows ends where a next message's header starts (`_gap_end`). `method` is
    "prefix", or "diff" when any turn needed the per-turn diff because the template re-renders history or closes
    the last turn differently.

    `rerendered` lists the message indices of the turns left without a span: those whose fields the template
    renders otherwise in the conversation than as its last message, i.e. than when the target produced the turn
    (Qwen3 and harmony drop the reasoning of turns before the last user message; a <think> block in a content is
    cut from it). The tokens of such a turn in this rendering follow a context the target never answered from;
    they stay out of the loss.

    Linear in the conversation's length (`_linear_spans`); `prefix_char_spans` for templates that fail its checks.
    """
    full = render(tokenizer, messages, template_kwargs=template_kwargs)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return full, [], "prefix", []
    try:
        linear = _linear_spans(tokenizer, messages, full, turns, template_kwargs)
    except ChatTemplateError:  # a probe or window rendering the template refuses: the reference method decides
        linear = None
    if linear is not None:
        return full, *linear
    return prefix_char_spans(tokenizer, messages, template_kwargs)


# ---------------------------------------------------------------------------------------- reference method


def prefix_char_spans(tokenizer: Any, messages: Messages, template_kwargs: Mapping[str, Any] | None = None,
                      ) -> tuple[str, list[Span], str, list[int]]:
    """`assistant_char_spans` by the reference method: per field of a turn, the conversation rendered with that
    field probed, and per turn the generation prompt before it and `messages[:i+1]`, whose cost grows with the
    square of the number of turns. Where `messages[:i+1]` does not render as a prefix of the full text (history
    re-rendered, as Qwen3 drops the reasoning of earlier turns), the turn's closing comes from the per-turn diff
    ("diff"); a turn whose fields render otherwise there than in the full text has no span (listed last)."""
    kw = template_kwargs
    full = render(tokenizer, messages, template_kwargs=kw)
    spans: list[Span] = []
    method = "prefix"
    rerendered: list[int] = []
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

        # Field spans: what changes when only that field changes; a field that changes nothing is not rendered.
        fields, hidden = [], []
        for keys in _fields(message):
            probe = _probe_for(message[keys[0]])
            alt = render(tokenizer, _with_field(messages, i, probe, keys), template_kwargs=kw)
            if alt == full and keys != CONTENT:
                hidden.append((keys, probe))
                continue
            c0 = _common_prefix(full, alt)
            c1 = max(c0, len(full) - _common_suffix(full, alt))
            raw = _raw_start(full, c0, c1, message[keys[0]], start_bound)
            if raw < start_bound:
                raise ChatTemplateError(f"{where}: its {keys[0]} changes the rendering before the turn starts")
            fields.append((raw, c1, keys, probe, c0))
        fields.sort()
        prompt = _generation_prompt(tokenizer, messages[:i], kw) if len(fields) > 1 and i else ""
        turn: list[Span] = []
        for (c0, c1, *_), (n0, *_) in zip(fields, fields[1:]):
            if spans and c0 < spans[-1][1]:
                raise ChatTemplateError(f"{where}: span overlaps the previous assistant span")
            turn.append((c0, _gap_end(full, c1, n0, prompt)))
        c0, c1, keys, probe, diff0 = fields[-1]

        # Turn end: from the prefix rendering when it is a prefix of the full text, else per-turn diff.
        upto = render(tokenizer, messages[: i + 1], template_kwargs=kw)
        alt_upto = render(tokenizer, _with_field(messages[: i + 1], i, probe, keys), template_kwargs=kw)
        w0 = _common_prefix(upto, alt_upto)
        changed = upto[w0:max(w0, len(upto) - _common_suffix(upto, alt_upto))] != full[diff0:c1]
        changed |= any(render(tokenizer, _with_field(messages[: i + 1], i, p, k), template_kwargs=kw) != upto
                       for k, p in hidden)
        if full.startswith(upto) and len(upto) >= c1:
            turn_end = len(upto)
        else:
            method = "diff"
            turn_end = _diff_turn_end(tokenizer, full, c1, upto, alt_upto, messages[: i + 1], kw, keys)
        end = c1 + len(full[c1:turn_end].rstrip())
        if spans and c0 < spans[-1][1]:
            raise ChatTemplateError(f"{where}: span overlaps the previous assistant span")
        turn.append((c0, end))
        if changed:
            rerendered.append(i)
        else:
            spans.extend(turn)
    return full, _merged(spans), method, rerendered
