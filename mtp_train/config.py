"""Typed configuration schemas, mirrored by the YAML files under `conf/`.

Every command's Hydra config is validated against these dataclasses (registered in Hydra's
ConfigStore as `<command>_schema`), so a misspelt key fails at start-up with the key's name
instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


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
    fetch: str | None = "smollm2-135m"  # `mtp-model fetch` name that can create `path` when missing


@dataclass
class DataConfig:
    """Where conversations come from and how they are read (`conf/data/*.yaml`)."""

    name: str = "custom"  # short name recorded in manifests
    paths: list[str] = field(default_factory=list)  # .jsonl/.json/.parquet/.csv files, folders, globs, HF datasets
    format: str = "auto"  # auto | sharegpt | messages | prompt
    field_map: dict[str, str] = field(default_factory=dict)  # our field name → the file's field name
    system_prompt: str | None = None  # added to every conversation that has no system turn
    on_bad_row: str = "error"  # error (stop, naming file:line) | skip (count and report)


@dataclass
class PrecomputeConfig:
    """`mtp-precompute`: conversations → target hidden states as sharded safetensors."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    out: str = "runs/precompute"  # output folder (shards + manifest.json); a re-run resumes
    max_seq_len: int = 2048  # longer samples are truncated (keeping the start)
    limit: int | None = None  # use only the first N conversations
    shard_tokens: int = 131072  # tokens per shard (2·H bytes each for the hidden states)
    batch_tokens: int = 8192  # tokens per packed prefill forward
    aux_layers: list[int] = field(default_factory=list)  # extra HF hidden_states[j] to store (EAGLE-3 features)
    val_fraction: float = 0.02  # share of samples recorded as the validation split
    seed: int = 0  # seeds the train/val split
    verify_on_resume: bool = True  # re-hash finished shards before skipping them
    progress: bool = True  # progress bar on rank 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}


@dataclass
class RegenerateConfig:
    """`mtp-regenerate`: answer the conversations' user turns with the target (self-distillation)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    out: str = "runs/regenerate/conversations.jsonl"  # messages JSONL with provenance; a re-run resumes
    n: int = 1  # samples per prompt
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 512  # per assistant turn
    seed: int = 0  # sampling seed (per prompt and sample index)
    limit: int | None = None  # use only the first N conversations
    max_batch_size: int = 32  # sequences decoded together
    max_prompt_tokens: int = 4096  # longer prompts are skipped and counted
    progress: bool = True  # progress bar on rank 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def resolve_device(device: str) -> str:
    """`auto` → cuda when available, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def register_configs() -> None:
    """Register the schemas with Hydra (idempotent); root YAMLs name them first in their defaults."""
    cs = ConfigStore.instance()
    cs.store(name="precompute_schema", node=PrecomputeConfig)
    cs.store(name="regenerate_schema", node=RegenerateConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
