"""Parity on the real default model (SmolLM2-135M-Instruct, converted by `make model`)."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.models import load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip, briefly.",
]


@pytest.fixture(scope="module")
def pair(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = load_model(default_model_dir, dtype="float32", backend="torch")
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return ours, hf, tok


def _chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


def test_config_is_the_expected_model(pair):
    ours, _, _ = pair
    a = ours.args
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.vocab_size) == (30, 576, 9, 3, 49152)
    assert a.tie_word_embeddings and a.eos_token_ids == [2]


def test_hidden_states_and_logits_match_transformers(pair):
    ours, hf, tok = pair
    ids = _chat(tok, PROMPTS[2])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
        out = prefill_hidden(ours, [ids], hidden_layers=[0, 15, 30])
        logits = ours.compute_logits(out.hidden)
    for j in (0, 15, 30):
        torch.testing.assert_close(out.layers[j], ref.hidden_states[j][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=2e-4)


def test_greedy_answers_equal_transformers_generate(pair):
    ours, hf, tok = pair
    prompts = [_chat(tok, p) for p in PROMPTS]
    # all three in one batch, small pages: exercises packing and page boundaries on the real model
    outs = LLMEngine(ours, num_pages=64, page_size=8).generate(prompts, SamplingParams(max_new_tokens=32))
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=32,
                              pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
        assert out.output_ids == ref, (tok.decode(out.output_ids), tok.decode(ref))
        assert tok.decode(out.output_ids, skip_special_tokens=True).strip()
