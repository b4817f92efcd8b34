"""GPT-OSS's harmony chat format: golden assistant-only loss masks.

The tokenizer is SmolLM2's (or a small byte-level BPE trained on the spot, `tests/_templates.py`) plus harmony's
special tokens, with `tests/fixtures/chat_templates/harmony.jinja`, which reproduces the structure of GPT-OSS's
template: a system header turn, the system message as developer instructions, `<|start|>{role}<|message|>` turns
closed by `<|end|>`, assistant turns on channels (`<|channel|>final`, and `<|channel|>analysis` from the message's
`thinking` in the last turn only, as the real template drops earlier reasoning), and `<|return|>` closing the last
assistant turn of a training render. The generation prompt is `<|start|>assistant`: the channel header after it is
the model's own output.

The analysis channel is not in the loss yet (an expected failure below): it needs a span per rendered field of the
message, and readers that keep `thinking`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from mtp_train.data.chat import render, tokenize_conversation
from tests._templates import smollm2, trained_bpe

TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "harmony.jinja"
SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
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
    tok = copy.deepcopy(smollm2() or trained_bpe())
    tok.add_tokens(SPECIALS, special_tokens=True)
    tok.eos_token = "<|return|>"
    tok.chat_template = TEMPLATE.read_text()
    return tok


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
