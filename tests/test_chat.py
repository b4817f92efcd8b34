"""Chat rendering and assistant-only loss masks: golden masks for four template families, the linear method against
the reference prefix method, truncation, drops, errors and fingerprints.

The Llama-3, Mistral, Qwen3 and Phi-3 tokenizers come from `tests/_templates.py`: the SmolLM2 tokenizer (or a
small byte-level BPE trained on the spot) plus each family's special tokens and a template reproducing the
structure of that family's (Phi-3's end-of-conversation token exercises the per-turn diff).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from mtp_train.data.chat import (
    ChatTemplateError,
    assistant_char_spans,
    chat_template_fingerprint,
    render,
    tokenize_conversation,
    tokenize_conversations,
    tokenizer_fingerprint,
)
from mtp_train.data.readers import Conversation
from mtp_train.data.spans import prefix_char_spans
from tests._templates import DEFAULT_MODEL, END_OF_TURN, build_families, smollm2, trained_bpe

REGEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "regen_smollm2_greedy.jsonl"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    tok = smollm2()
    if tok is None:
        pytest.skip(f"{DEFAULT_MODEL} missing: run `make model`")
    return tok


@pytest.fixture(scope="session")
def base_tokenizer():
    """Byte-level BPE to build the other families on: SmolLM2's when present, else a trained one."""
    return smollm2() or trained_bpe()


@pytest.fixture(scope="session")
def families(base_tokenizer) -> dict:
    """family name → tokenizer with that family's special tokens and template."""
    return build_families(base_tokenizer)


def masked_text(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m], skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)


def mask_runs(mask: list[int]) -> int:
    return sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1]))


def check_golden(tok, messages, expected_turns: list[str], **kw):
    """Masked tokens decode to the expected assistant texts (each followed by its end-of-turn marker), one
    contiguous run per turn, and the ids are exactly the tokenized rendering."""
    sample = tokenize_conversation(tok, messages, **kw)
    assert sample is not None
    assert masked_text(tok, sample) == "".join(expected_turns)
    assert mask_runs(sample.loss_mask) == len(expected_turns)
    text = render(tok, messages, template_kwargs=kw.get("template_kwargs"))
    assert sample.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    return sample


MULTI_TURN = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4.\n\nThe answer is  4 (two spaces)."},
]
WITH_SYSTEM = [{"role": "system", "content": "You are terse."}, *MULTI_TURN]


# -------------------------------------------------------------------------------------------------- golden


def test_chatml_smollm2_golden(smollm2_tokenizer):
    tok = smollm2_tokenizer
    expected = [m["content"] + "<|im_end|>" for m in MULTI_TURN if m["role"] == "assistant"]
    sample = check_golden(tok, MULTI_TURN, expected)
    text = render(tok, MULTI_TURN)
    assert "You are a helpful AI assistant" in text  # the template's default system turn: rendered, not masked
    # The header before each answer and the newline after each <|im_end|> stay unmasked.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for k, (t, m) in enumerate(zip(sample.input_ids, sample.loss_mask)):
        if m and t == im_end:
            assert tok.decode([sample.input_ids[k + 1]]) == "\n" and sample.loss_mask[k + 1] == 0
    assert spans_method(tok, MULTI_TURN) == "prefix"


def test_chatml_smollm2_system_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    expected = [m["content"] + "<|im_end|>" for m in WITH_SYSTEM if m["role"] == "assistant"]
    check_golden(tok, WITH_SYSTEM, expected)
    text = render(tok, WITH_SYSTEM)
    assert "You are terse." in text and "SmolLM" not in text


@pytest.mark.skipif(not REGEN.is_file(), reason="../shared/data not present")
def test_chatml_smollm2_on_regenerated_conversations(smollm2_tokenizer):
    """Real answers of the default target (long, code, loops): the mask is exact on every one of them."""
    from mtp_train.config import DataConfig
    from mtp_train.data.readers import read_conversations

    convs, _ = read_conversations(DataConfig(paths=[str(REGEN)]), limit=50)
    samples, stats = tokenize_conversations(smollm2_tokenizer, convs)
    assert stats.kept == len(convs) == 50 and stats.diff_method == 0
    for conv, sample in zip(convs, samples):
        expected = "".join(m["content"] + "<|im_end|>" for m in conv.messages if m["role"] == "assistant")
        assert masked_text(smollm2_tokenizer, sample) == expected, conv.id


def spans_method(tok, messages, **kw) -> str:
    return assistant_char_spans(tok, messages, kw or None)[2]


@pytest.mark.parametrize("messages", [MULTI_TURN, WITH_SYSTEM], ids=["no-system", "system"])
def test_llama3_golden(families, messages):
    tok = families["llama3"]
    expected = [m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant"]
    sample = check_golden(tok, messages, expected)
    text = render(tok, messages)
    assert text.startswith("<|begin_of_text|><|start_header_id|>")
    assert ("<|start_header_id|>system" in text) == (messages[0]["role"] == "system")  # no default system
    assert sample.loss_mask[0] == 0 and spans_method(tok, messages) == "prefix"


@pytest.mark.parametrize("messages", [MULTI_TURN, WITH_SYSTEM], ids=["no-system", "system"])
def test_mistral_golden(families, messages):
    tok = families["mistral"]
    expected = [m["content"] + "</s>" for m in messages if m["role"] == "assistant"]
    check_golden(tok, messages, expected)
    text = render(tok, messages)
    assert text.startswith("<s>[INST] ") and text.endswith("</s>")
    if messages[0]["role"] == "system":
        assert "[INST] You are terse.\n\nWhat is" in text  # folded into the first user turn, unmasked


QWEN3_THINKING = [
    {"role": "system", "content": "Think before answering."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nTwo plus two makes four.\n</think>\n\nThe answer is 4."},
    {"role": "user", "content": "And 3 * 3?"},
    {"role": "assistant", "content": "<think>\nThree times three is nine.\n</think>\n\nIt is 9."},
]


def test_qwen3_thinking_multi_turn_uses_per_turn_diff(families):
    tok = families["qwen3"]
    text = render(tok, QWEN3_THINKING)
    # The template drops the reasoning of the earlier turn and keeps it in the last one, so rendering a prefix
    # of the conversation does not give a prefix of this text.
    assert "Two plus two" not in text and "Three times three" in text
    upto_first = render(tok, QWEN3_THINKING[:3])
    assert not text.startswith(upto_first)
    assert spans_method(tok, QWEN3_THINKING) == "diff"
    # The first answer was produced after its reasoning, which this rendering drops: it stays out of the loss.
    check_golden(tok, QWEN3_THINKING, [QWEN3_THINKING[4]["content"] + "<|im_end|>"])


def test_qwen3_inserted_empty_think_block_is_not_masked(families):
    tok = families["qwen3"]
    messages = [*QWEN3_THINKING[:2], {"role": "assistant", "content": "The answer is 4."}, QWEN3_THINKING[3],
                {"role": "assistant", "content": "It is 9."}]
    assert "<think>\n\n</think>\n\nIt is 9." in render(tok, messages)  # the template adds it, the data did not
    check_golden(tok, messages, ["The answer is 4.<|im_end|>", "It is 9.<|im_end|>"])
    # A single turn renders as a plain prefix: the fast path, same answer.
    single = QWEN3_THINKING[:3]
    assert spans_method(tok, single) == "prefix"
    check_golden(tok, single, [single[2]["content"] + "<|im_end|>"])


def test_qwen3_template_kwargs_reach_the_template(families):
    tok = families["qwen3"]
    prompt = QWEN3_THINKING[:2]
    assert render(tok, prompt, add_generation_prompt=True, template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    check_golden(tok, QWEN3_THINKING, [QWEN3_THINKING[4]["content"] + "<|im_end|>"],
                 template_kwargs={"enable_thinking": False})


def _with_reasoning(message: dict, reasoning: str) -> dict:
    """An assistant message as the readers give it: the reasoning under both names templates read."""
    return {**message, "thinking": reasoning, "reasoning_content": reasoning}


QWEN3_REASONING = [*QWEN3_THINKING[:2],
                   _with_reasoning({"role": "assistant", "content": "The answer is 4."}, "Two plus two makes four."),
                   QWEN3_THINKING[3],
                   _with_reasoning({"role": "assistant", "content": "It is 9."}, "\nThree times three is nine.\n")]


def test_qwen3_reasoning_content_field_renders_and_is_in_the_loss(families):
    """Qwen3's template reads `reasoning_content`: the last turn's <think> block renders as from the content's own
    block, and its reasoning, `</think>` and the answer are in the loss (one run; the template's `<think>` opener
    stays outside like the empty block it inserts); the earlier turn's reasoning is dropped by the template, and
    with it that turn leaves the loss."""
    tok = families["qwen3"]
    text = render(tok, QWEN3_REASONING)
    assert text == render(tok, QWEN3_THINKING)
    sample = check_golden(tok, QWEN3_REASONING, ["Three times three is nine.\n</think>\n\nIt is 9.<|im_end|>"])
    assert "Two plus two" not in masked_text(tok, sample)
    assert spans_method(tok, QWEN3_REASONING) == "diff"  # the window renders the first turn's reasoning
    assert assistant_char_spans(tok, QWEN3_REASONING) == prefix_char_spans(tok, QWEN3_REASONING)


@pytest.mark.parametrize("family", ["llama3", "mistral", "phi3"])
def test_a_reasoning_field_the_template_does_not_render_changes_nothing(families, family):
    tok = families[family]
    messages = [m if m["role"] != "assistant" else _with_reasoning(m, "Some reasoning.") for m in MULTI_TURN]
    assert render(tok, messages) == render(tok, MULTI_TURN)
    assert tokenize_conversation(tok, messages) == tokenize_conversation(tok, MULTI_TURN)
    assert assistant_char_spans(tok, messages) == assistant_char_spans(tok, MULTI_TURN)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3", "phi3"])
def test_awkward_contents(families, family):
    """Whitespace runs, unicode, a probe character and marker-like text inside the content stay exact."""
    tok = families[family]
    answers = ["Tabs\tand  spaces,\nnew lines\n\nand émojis 🙂.", "Private \ue000 use and a literal [INST]-ish word."]
    messages = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": answers[0]},
                {"role": "user", "content": "Again."}, {"role": "assistant", "content": answers[1]}]
    last_closing = "<|end|>\n<|endoftext|>" if family == "phi3" else END_OF_TURN[family]
    check_golden(tok, messages, [answers[0] + END_OF_TURN[family], answers[1] + last_closing])


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_content_holding_the_first_probe_characters_keeps_its_mask(families, family):
    """U+E000-U+E002 (icon-font glyphs, say) were the only probes: content holding all three stopped the run. Any
    other private-use character stands in now, and the mask is as exact as for any content."""
    answer = "Glyphs \ue000\ue001\ue002 in the answer."
    messages = [{"role": "user", "content": "Icons \ue000\ue001\ue002?"}, {"role": "assistant", "content": answer}]
    check_golden(families[family], messages, [answer + END_OF_TURN[family]])


def test_end_of_conversation_token_after_the_last_turn(families):
    """Phi-3 closes the conversation with an extra token after the last answer only, so earlier turns must not
    take it (nor the next turn's header) for part of their closing: per-turn diff, cut at the next header."""
    tok = families["phi3"]
    text = render(tok, MULTI_TURN)
    assert text.endswith("<|end|>\n<|endoftext|>") and text.count("<|endoftext|>") == 1
    assert spans_method(tok, MULTI_TURN) == "diff"
    answers = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]
    check_golden(tok, MULTI_TURN, [answers[0] + "<|end|>", answers[1] + "<|end|>\n<|endoftext|>"])


def test_assistant_spans_end_at_the_marker(families):
    tok = families["qwen3"]
    text, spans, _, rerendered = assistant_char_spans(tok, QWEN3_THINKING)
    assert [text[a:b] for a, b in spans] == [QWEN3_THINKING[4]["content"] + "<|im_end|>"]
    assert rerendered == [2]  # the message index of the first answer
    plain = [{"role": m["role"], "content": m["content"].split("\n\n")[-1]} for m in QWEN3_THINKING]
    text, spans, _, rerendered = assistant_char_spans(tok, plain)
    assert [text[a:b] for a, b in spans] == ["The answer is 4.<|im_end|>", "It is 9.<|im_end|>"] and rerendered == []
    assert all(text[b] == "\n" for _, b in spans)  # the newline the template writes after <|im_end|> is outside


# ------------------------------------------------------------------------------------ truncation and drops


def test_truncation_keeps_the_start(families):
    tok = families["llama3"]
    full = tokenize_conversation(tok, MULTI_TURN)
    first_masked = full.loss_mask.index(1)
    cut = first_masked + 3
    sample = tokenize_conversation(tok, MULTI_TURN, max_seq_len=cut)
    assert sample.truncated and not full.truncated
    assert sample.input_ids == full.input_ids[:cut] and sample.loss_mask == full.loss_mask[:cut]
    assert tokenize_conversation(tok, MULTI_TURN, max_seq_len=len(full.input_ids)).truncated is False


def test_dropped_samples_are_counted(families):
    tok = families["mistral"]
    full = tokenize_conversation(tok, MULTI_TURN)
    before_answer = full.loss_mask.index(1)  # no assistant token fits
    prompt_only = [{"role": "user", "content": "Only a question."}]
    assert tokenize_conversation(tok, prompt_only) is None
    assert tokenize_conversation(tok, MULTI_TURN, max_seq_len=before_answer) is None
    convs = [Conversation("a", MULTI_TURN, "f.jsonl", 1), Conversation("b", prompt_only, "f.jsonl", 2),
             Conversation("c", WITH_SYSTEM, "f.jsonl", 3)]
    samples, stats = tokenize_conversations(tok, convs, max_seq_len=before_answer + 2)
    assert [s.id for s in samples] == ["a"]  # c's system text pushes its answer past the limit
    assert (stats.conversations, stats.kept, stats.truncated) == (3, 1, 1)
    assert (stats.dropped_no_assistant, stats.dropped_truncated, stats.dropped) == (1, 1, 2)
    assert stats.tokens == before_answer + 2 and stats.loss_tokens == 2
    samples, stats = tokenize_conversations(tok, convs)
    assert [s.id for s in samples] == ["a", "c"] and stats.truncated == 0 and stats.dropped == 1
    with pytest.raises(ValueError, match="max_seq_len"):
        tokenize_conversation(tok, MULTI_TURN, max_seq_len=0)


def test_diff_method_is_counted(families):
    _, stats = tokenize_conversations(families["qwen3"], [QWEN3_THINKING, QWEN3_THINKING[:3]])
    assert stats.diff_method == 1 and stats.kept == 2


# ------------------------------------------------------------------------------------------------- errors


def test_no_template_is_a_clear_error(families):
    tok = copy.deepcopy(families["llama3"])
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenize_conversation(tok, MULTI_TURN)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenize_conversations(tok, [])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        chat_template_fingerprint(tok)


def test_template_failure_is_wrapped(families):
    # The Mistral template refuses two user turns in a row.
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tokenize_conversation(families["mistral"], bad)


def test_a_conversation_the_template_refuses_is_a_bad_row(families):
    """One conversation the template fails on names its file and line, or is skipped and counted; the others are
    tokenized as usual."""
    from mtp_train.data.readers import DataError

    tok = families["mistral"]  # refuses two user turns in a row
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    convs = [Conversation("a", MULTI_TURN, "f.jsonl", 1), Conversation("b", bad, "f.jsonl", 2),
             Conversation("c", WITH_SYSTEM[1:], "f.jsonl", 3)]
    with pytest.raises(DataError, match=r"^f\.jsonl:2: template_error: .*roles must alternate"):
        tokenize_conversations(tok, convs)
    samples, stats = tokenize_conversations(tok, convs, on_bad_row="skip")
    assert [s.id for s in samples] == ["a", "c"] and stats.dropped_template_error == 1 and stats.dropped == 1
    assert stats.template_error_examples[0].startswith("f.jsonl:2: chat template failed")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):  # plain messages have no file to name
        tokenize_conversations(tok, [MULTI_TURN, bad])


# ------------------------------------------------------------------------------------------- fingerprints


def test_fingerprints(families):
    tok = families["llama3"]
    twin = copy.deepcopy(tok)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(twin)
    assert chat_template_fingerprint(tok) == chat_template_fingerprint(twin)
    assert len(tokenizer_fingerprint(tok)) == len(chat_template_fingerprint(tok)) == 64
    # Runtime settings do not matter; the vocabulary, special tokens and template do.
    twin.backend_tokenizer.enable_truncation(16)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(twin)
    twin.add_tokens(["<|new|>"], special_tokens=True)
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(twin)
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(families["mistral"])
    twin.chat_template = tok.chat_template + " "
    assert chat_template_fingerprint(tok) != chat_template_fingerprint(twin)


# ------------------------------------------------------------------------------------------------- cost


class _CountingTemplate:
    """The tokenizer's apply_chat_template, counting the messages it renders (the work a rendering does)."""

    def __init__(self, tok):
        self.inner, self.messages, self.calls = tok.apply_chat_template, 0, 0

    def __call__(self, conversation, *args, **kwargs):
        self.calls += 1
        self.messages += len(conversation)
        return self.inner(conversation, *args, **kwargs)


def _rendered_messages(tok, turns: int, reasoning: bool = False, runs: int | None = None, supervised: int | None = None,
                       ) -> int:
    counter = _CountingTemplate(tok)
    tok.apply_chat_template = counter
    try:
        messages = [{"role": "system", "content": "Be brief."}]
        for t in range(turns):
            answer = {"role": "assistant", "content": f"Answer {t}."}
            messages += [{"role": "user", "content": f"Question {t}?"},
                         _with_reasoning(answer, f"Reasoning {t}.") if reasoning else answer]
        sample = tokenize_conversation(tok, messages)
    finally:
        del tok.apply_chat_template
    expected = (turns if supervised is None else supervised) + (runs or 0)
    assert sample is not None and mask_runs(sample.loss_mask) == expected
    return counter.messages


@pytest.mark.parametrize("family, reasoning", [("llama3", False), ("mistral", False), ("qwen3", False),
                                               ("phi3", False), ("harmony", False), ("llama3", True),
                                               ("qwen3", True), ("harmony", True)])
def test_loss_mask_renders_grow_linearly_with_the_turns(families, family, reasoning):
    """Deriving the masks renders a number of messages proportional to the conversation, Qwen3's re-rendered
    history included: a constant number of renderings of the whole conversation and a window of a few messages
    per turn, not a prefix of the conversation per turn (which grew with the square of the turns: 0.8 / 3.2 /
    12.9 s for 100 / 200 / 400 turns). With reasoning in every answer the template renders it for the last turn
    only (harmony: one more run, the analysis channel; Qwen3: the same run) or never (Llama-3)."""
    tok = copy.deepcopy(families[family])
    extra = 1 if reasoning and family == "harmony" else 0
    # Qwen3 and harmony drop the reasoning of earlier turns: those turns leave the loss, the last one stays.
    last_only = 1 if reasoning and family in ("qwen3", "harmony") else None
    counts = [_rendered_messages(tok, n, reasoning, extra, last_only) for n in (25, 50, 100)]
    per_turn = [c / n for c, n in zip(counts, (25, 50, 100))]
    # four renderings of the whole conversation and two windows a turn; harmony's earlier turns, which close
    # otherwise as the last one, four windows more (the turn with a generation prompt: `_closing_before_next`);
    # a reasoning the conversation does not render, one window more (does the window render it?)
    assert max(per_turn) <= (27 if family == "harmony" else 15) + 3 * reasoning, counts
    assert counts[2] - counts[1] == 2 * (counts[1] - counts[0]), counts  # exactly linear


PIECES = ["Yes.", "  padded  ", "\nleading newline", "two\n\nparagraphs", "trailing\n", "<think>\nhmm\n</think>\n\nOK.",
          "<think></think>bare", "<|im_end|> and [INST] as text", "émoji 🙂", "\ue000 probe", "x"]


def _random_conversation(rng, family: str) -> list[dict[str, str]]:
    """1-4 user/assistant exchanges (an optional system turn first, an optional user turn last) of pieces that
    exercise whitespace handling, think blocks, marker-like text and probe characters; some answers with reasoning."""
    messages = [{"role": "system", "content": rng.choice(PIECES)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        answer = {"role": "assistant", "content": " ".join(rng.sample(PIECES, rng.randint(1, 2)))}
        if rng.random() < 0.4:
            answer = _with_reasoning(answer, rng.choice(PIECES))
        messages += [{"role": "user", "content": rng.choice(PIECES)}, answer]
    if rng.random() < 0.3 and family != "mistral":  # Mistral's template demands an answer last
        messages.append({"role": "user", "content": "More?"})
    return messages


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3", "phi3", "harmony"])
def test_linear_spans_equal_the_prefix_method(families, family):
    """On random conversations the linear derivation gives exactly the spans of the per-turn prefix renderings,
    for templates that render each turn by itself and for Qwen3's, which rewrites the earlier answers, with and
    without reasoning (harmony and Qwen3 render it in the last turns only)."""
    import random

    rng = random.Random(family)
    tok = copy.deepcopy(families[family])
    counter = tok.apply_chat_template = _CountingTemplate(tok)
    for _ in range(12):
        messages = _random_conversation(rng, family)
        counter.calls = 0
        text, spans, _, rerendered = assistant_char_spans(tok, messages)
        turns = sum(m["role"] == "assistant" for m in messages)
        with_reasoning = sum("thinking" in m for m in messages)
        # the linear method answered, not the fallback (two more renderings for a turn with two fields, four for
        # a harmony turn closed otherwise as the last one)
        per_turn = 6 if family == "harmony" else 2
        assert counter.calls <= 4 + per_turn * turns + 2 * with_reasoning, messages
        reference = prefix_char_spans(tok, messages)
        assert (text, spans, rerendered) == (reference[0], reference[1], reference[3]), messages
