"""The settings of a vLLM engine we launch (`vllm.*` of mtp-precompute backend=vllm and mtp-eval backend=vllm)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class VllmEngineConfig:
    """How a launched vLLM engine runs, whatever it is launched for; each command's settings extend it."""

    enforce_eager: bool = True  # no torch.compile or CUDA graphs (the CPU build needs it; quicker to start)
    tensor_parallel_size: int = 1  # GPUs per vLLM engine
    gpu_memory_utilization: float | None = None  # GPU share vLLM takes (null: vLLM's default)
    cpu_kvcache_gb: int = 2  # CPU build: VLLM_CPU_KVCACHE_SPACE when the environment does not set it
    engine_args: dict[str, Any] = field(default_factory=dict)  # further vllm.LLM keyword arguments

    def llm_kwargs(self, **own: Any) -> dict[str, Any]:
        """The `vllm.LLM` keyword arguments of these settings: the shared ones, then the caller's `own` (None values
        left out: vLLM's default), then `engine_args` over all of them (the user's last word)."""
        kwargs: dict[str, Any] = {"enforce_eager": self.enforce_eager,
                                  "tensor_parallel_size": self.tensor_parallel_size,
                                  "gpu_memory_utilization": self.gpu_memory_utilization, **own}
        return {k: v for k, v in kwargs.items() if v is not None} | dict(self.engine_args)
