"""The target model and how our engine runs it (`conf/model/*.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """The target model and how our engine runs it (`conf/model/*.yaml`)."""

    name: str = "smollm2-135m"  # short name, used in output folder names and manifests
    path: str = "models/smollm2-135m-instruct"  # Hugging Face folder: config.json + safetensors + tokenizer
    dtype: str = "auto"  # auto (checkpoint dtype) | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    backend: str = "auto"  # attention backend: auto (flashinfer on CUDA when installed) | torch | flashinfer
    page_size: int = 16  # tokens per KV-cache page
    kv_cache_gb: float = 1.0  # memory for the paged KV cache of one engine
    tp: int = 1  # tensor-parallel ranks per model replica (mtp-precompute under torchrun; groups of consecutive ranks)
    fetch: str | None = "smollm2-135m"  # `mtp-model fetch` name: creates `path` when missing, if its default folder
