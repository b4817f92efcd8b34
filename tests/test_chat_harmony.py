"""GPT-OSS's harmony chat format: golden assistant-only loss masks.

The tokenizer is SmolLM2's (or a small byte-level BPE trained on the spot, `tests/_templates.py`) plus harmony's
special tokens, with `tests/fixtures/chat_templates/harmony.jinja`, which reproduces the structure of GPT-OSS's
template: a system header turn, the system message as developer instructions, `<|start|>{role}<|message|>` turns
closed by `<|end|>`, assistant turns on channels (`<|channel|>final`, and `<|channel|>analysis` from the message's
`thinking` in the last turn only, as the real template drops earlier reasoning), and `<|return|>` closing the last
assistant turn of a training render. The generation prompt is `<|start|>assistant`: the channel header after it is
the model's own output.

The loss covers the final channel's content and its end token, and the analysis channel's content (the message's
`thinking`, which the readers fill from a record's `thinking` or `reasoning_content`) and its `<|end|>`; the
headers between them stay outside.
"""

from __future__ import annotations

import json

import pytest

from mtp_train.config import DataConfig
from mtp_train.data.chat import assistant_char_spans, render, tokenize_conversation
from mtp_train.data.readers import read_conversations
from mtp_train.data.spans import prefix_char_spans
from tests._templates import build_family, smollm2, trained_bpe

SYSTEM_HEADER = "<|start|>system<|message|>You are ChatGPT"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
ANALYSIS = "<|start|>assistant<|channel|>analysis<|message|>"

ONE_TURN = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris is the capital of France."}]
MULTI_TURN = [{"role": "system", "content": "You are terse."}, *ONE_TURN,
              {"role": "user", "content": "And 2 + 2?"},
              {"role": "assistant", "content": "2 + 2 = 4.\n\nThe answer is  4 (two spaces).",
               "thinking": "The user adds two and two: four."}]


@pytest.fixture(scope="module")
def harmony():
    return build_family(smollm2() or trained_bpe(), "harmony")


def masked_text(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m], skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)


def unmasked_text(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m], skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)


def test_the_fixture_renders_harmony(harmony):
    text = render(harmony, MULTI_TURN)
    assert text.startswith(SYSTEM_HEADER) and "Reasoning: medium" in text
    assert "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n<|end|>" in text
    assert f"<|start|>user<|message|>And 2 + 2?<|end|>{ANALYSIS}The user adds two and two: four.<|end|>{FINAL}" in text
    assert f"{FINAL}Paris is the capital of France.<|end|><|start|>user" in text  # an earlier turn: final only
    assert text.endswith("(two spaces).<|return|>")
    prompt = render(harmony, MULTI_TURN[:-1], add_generation_prompt=True)
    assert prompt.endswith("<|end|><|start|>assistant") and ANALYSIS not in prompt
    assert render(harmony, MULTI_TURN, template_kwargs={"reasoning_effort": "high"}).count("Reasoning: high") == 1


def test_a_single_turn_masks_the_final_content_and_its_return(harmony):
    sample = tokenize_conversation(harmony, ONE_TURN)
    assert masked_text(harmony, sample) == "Paris is the capital of France.<|return|>"
    assert sample.input_ids == harmony(render(harmony, ONE_TURN), add_special_tokens=False)["input_ids"]
    # the system header turn, the user turn and the assistant's role and channel header are outside the loss
    assert unmasked_text(harmony, sample).endswith(f"What is the capital of France?<|end|>{FINAL}")


def test_system_developer_user_turns_and_headers_stay_outside_the_loss(harmony):
    sample = tokenize_conversation(harmony, MULTI_TURN)
    masked = masked_text(harmony, sample)
    for outside in ("ChatGPT", "Reasoning", "# Instructions", "You are terse.", "capital of France?", "And 2 + 2?",
                    "<|start|>", "<|channel|>", "<|message|>", "user<|", "developer<|", "analysis",
                    "final"):
        assert outside not in masked, outside
    assert "Paris is the capital of France." in masked and "(two spaces).<|return|>" in masked
    assert masked.endswith("2 + 2 = 4.\n\nThe answer is  4 (two spaces).<|return|>")
    assert sample.input_ids == harmony(render(harmony, MULTI_TURN), add_special_tokens=False)["input_ids"]


def test_multi_turn_golden_masks_each_final_answer_with_the_end_token_it_renders(harmony):
    """Earlier turns close with <|end|>, the last with <|return|>: each is in the loss as the template renders it."""
    plain = [{k: v for k, v in m.items() if k != "thinking"} for m in MULTI_TURN]
    sample = tokenize_conversation(harmony, plain)
    assert masked_text(harmony, sample) == ("Paris is the capital of France.<|end|>"
                                            "2 + 2 = 4.\n\nThe answer is  4 (two spaces).<|return|>")
    runs = sum(1 for k, m in enumerate(sample.loss_mask) if m and (k == 0 or not sample.loss_mask[k - 1]))
    assert runs == 2


def test_the_analysis_channel_and_its_end_token_are_in_the_loss(harmony):
    sample = tokenize_conversation(harmony, MULTI_TURN)
    last = MULTI_TURN[-1]
    assert masked_text(harmony, sample) == ("Paris is the capital of France.<|end|>"
                                            f"{last['thinking']}<|end|>{last['content']}<|return|>")
    # three runs: the analysis channel's header and the final channel's header between them stay outside
    runs = sum(1 for k, m in enumerate(sample.loss_mask) if m and (k == 0 or not sample.loss_mask[k - 1]))
    assert runs == 3
    assert unmasked_text(harmony, sample).endswith(f"And 2 + 2?<|end|>{ANALYSIS}{FINAL}")
    assert sample.input_ids == harmony(render(harmony, MULTI_TURN), add_special_tokens=False)["input_ids"]


def test_the_reasoning_of_earlier_turns_is_dropped_by_the_template_and_outside_the_loss(harmony):
    """harmony renders the analysis of the last turn only: an earlier turn's `thinking` is not in the text, and
    that turn, which the target answered after its reasoning, is outside the loss (docs/stages.md)."""
    messages = [dict(m) for m in MULTI_TURN]
    messages[2]["thinking"] = "Recall the capital."
    assert "Recall" not in render(harmony, messages)
    sample = tokenize_conversation(harmony, messages)
    assert sample.input_ids == tokenize_conversation(harmony, MULTI_TURN).input_ids
    last = MULTI_TURN[-1]
    assert masked_text(harmony, sample) == f"{last['thinking']}<|end|>{last['content']}<|return|>"


def test_the_linear_method_equals_the_reference_method_with_reasoning(harmony):
    messages = [dict(m) for m in MULTI_TURN]
    messages[2]["thinking"] = "Recall the capital."
    for conv in (MULTI_TURN, messages, MULTI_TURN[:3], [*MULTI_TURN[1:3], MULTI_TURN[3]]):
        assert assistant_char_spans(harmony, conv) == prefix_char_spans(harmony, conv), conv


@pytest.mark.parametrize("name", ["thinking", "reasoning_content"])
def test_a_records_reasoning_reaches_the_analysis_channel_through_the_readers(harmony, tmp_path, name):
    """A messages record with `thinking` or `reasoning_content` (the name Qwen3's and DeepSeek's data use) renders
    the analysis channel with GPT-OSS's template, and it is in the loss."""
    last = MULTI_TURN[-1]
    turns = [*MULTI_TURN[:-1], {"role": "assistant", "content": last["content"], name: last["thinking"]}]
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"id": "r", "messages": turns}) + "\n", encoding="utf-8")
    convs, _ = read_conversations(DataConfig(paths=[str(path)]))
    sample = tokenize_conversation(harmony, convs[0])
    assert ANALYSIS + last["thinking"] + "<|end|>" in render(harmony, convs[0].messages)
    assert masked_text(harmony, sample).endswith(f"{last['thinking']}<|end|>{last['content']}<|return|>")
