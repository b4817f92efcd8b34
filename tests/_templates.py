"""Tokenizers of five chat-template families for the loss-mask tests.

The Llama-3, Mistral, Qwen3, Phi-3 and GPT-OSS (harmony) tokenizers are the SmolLM2 tokenizer (or, without it, a
small byte-level BPE trained on the spot) plus each family's special tokens, with a template from
`tests/fixtures/chat_templates/` that reproduces the structure of that family's template.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"

FAMILY_TOKENS = {  # family → (special tokens, plain added tokens, bos, eos)
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], [],
               "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]"], [], "<s>", "</s>"),
    # Qwen3's think markers are ordinary added tokens (they survive skip_special_tokens).
    "qwen3": (["<|im_start|>", "<|im_end|>"], ["<think>", "</think>"], None, "<|im_end|>"),
    "phi3": (["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], [], None, "<|endoftext|>"),
    "harmony": (["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"], [], None, "<|return|>"),
}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>", "qwen3": "<|im_end|>",
               "phi3": "<|end|>"}

CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital.",
    "user assistant system Hello! How are you? I am fine, thank you. Let me think step by step.",
    "2 + 2 = 4. 3 * 3 = 9. The answer is 42. def add(a, b):\n    return a + b\n",
]


def trained_bpe():
    """A small byte-level BPE with ChatML specials, for when the SmolLM2 folder is absent."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")


@functools.cache
def smollm2():
    """The real SmolLM2 tokenizer (with its ChatML template), or None when the model folder is absent."""
    if not (DEFAULT_MODEL / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def build_family(base: Any, name: str) -> Any:
    """A copy of `base` with family `name`'s special tokens and template."""
    special, plain, bos, eos = FAMILY_TOKENS[name]
    tok = copy.deepcopy(base)
    tok.add_tokens(special, special_tokens=True)
    if plain:
        tok.add_tokens(plain, special_tokens=False)
    if bos is not None:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def build_families(base: Any) -> dict[str, Any]:
    """family name → a copy of `base` with that family's special tokens and template."""
    return {name: build_family(base, name) for name in FAMILY_TOKENS}
