"""`mtp-precompute`: conversations → target hidden states as sharded safetensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.data import DataConfig
from mtp_train.config.endpoints import EndpointsConfig
from mtp_train.config.model import ModelConfig
from mtp_train.config.vllm import VllmEngineConfig


@dataclass
class VllmCaptureConfig(VllmEngineConfig, EndpointsConfig):
    """`backend=vllm`: the vLLM engine mtp-precompute launches to capture the hidden states, or the running
    `vllm serve` processes it captures through (`endpoints`, started with our connector: `serve_command=true` prints
    how; nothing is launched then). EndpointsConfig's keys (endpoints, served_model, concurrency, timeout, retries,
    backoff, dead_after) apply to those servers."""

    # The connector's capture folder (one file per conversation, removed once its shard is written); null:
    # <out>/capture. With endpoints: the folder those servers write to, as this machine sees it (required).
    spool_dir: str | None = None
    capture_timeout: float = 120.0  # endpoints: seconds a capture file may take to appear once its request is answered
    serve_command: bool = False  # print the `vllm serve` command that captures for these settings, and exit
    max_num_seqs: int = 16  # requests vLLM runs at once
    max_num_batched_tokens: int | None = None  # tokens per vLLM step (null: vLLM's default)
    # and EndpointsConfig's: endpoints, served_model, concurrency, timeout, retries, backoff, dead_after;
    # and VllmEngineConfig's: enforce_eager, tensor_parallel_size, gpu_memory_utilization, cpu_kvcache_gb, engine_args

    def endpoint_key(self, name: str) -> str:
        """EndpointsConfig's keys sit under `vllm.` in mtp-precompute."""
        return f"vllm.{name}"


@dataclass
class PrecomputeConfig:
    """`mtp-precompute`: conversations → target hidden states as sharded safetensors."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    out: str = "runs/precompute"  # output folder (shards + manifest.json); a re-run resumes
    # Replace a finished folder of other settings and remove links found in `out` (else refused by name).
    overwrite: bool = False
    max_seq_len: int = 2048  # longer samples are truncated (keeping the start)
    limit: int | None = None  # use only the first N conversations
    window: int = 1024  # conversations read and tokenized at a time (host memory; the shards do not depend on it)
    shard_tokens: int = 131072  # tokens per shard (2·H bytes each for the hidden states)
    batch_tokens: int = 8192  # tokens per packed prefill forward
    aux_layers: list[int] = field(default_factory=list)  # extra HF hidden_states[j] to store (EAGLE-3 features)
    # Storage of hidden / aux_hidden: bfloat16 | float16 | float32 | float8_e4m3 (fp8 values with a float32 scale
    # per token and layer, dequantised on read: H + 4 bytes per token and layer instead of 2·H).
    hidden_dtype: str = "bfloat16"
    val_fraction: float = 0.02  # share of samples recorded as the validation split
    seed: int = 0  # seeds the train/val split
    verify_on_resume: bool = True  # re-hash finished shards before skipping them
    progress: bool = True  # progress bar on rank 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    backend: str = "engine"  # engine (ours, in this process) | vllm (captured inside vLLM: docs/stages.md)
    vllm_python: str = ".venv-vllm/bin/python"  # backend=vllm: the python of vLLM's environment
    vllm: VllmCaptureConfig = field(default_factory=VllmCaptureConfig)  # backend=vllm: its engine settings
