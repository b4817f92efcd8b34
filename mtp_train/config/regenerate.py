"""`mtp-regenerate`: answer the conversations' user turns with the target (self-distillation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.data import DataConfig
from mtp_train.config.endpoints import EndpointsConfig
from mtp_train.config.errors import ConfigError
from mtp_train.config.model import ModelConfig

GENERATORS = ("engine", "openai")  # who answers: our engine in this process | OpenAI-compatible servers
SAMPLING_KEYS = ("n", "temperature", "top_k", "top_p", "max_new_tokens", "seed")  # recorded in the provenance


@dataclass
class RegenerateConfig(EndpointsConfig):
    """`mtp-regenerate`: answer the conversations' user turns with the target (self-distillation). With
    generator=openai, EndpointsConfig's keys (endpoints, served_model, concurrency, timeout, retries, backoff,
    dead_after) name the servers that answer and how the client treats them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    out: str = "runs/regenerate/conversations.jsonl"  # messages JSONL with provenance; a re-run resumes
    n: int = 1  # samples (records) per conversation
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 512  # per assistant turn
    seed: int = 0  # base of the per-request sampling seeds (per prompt, sample index and turn)
    limit: int | None = None  # use only the first N conversations
    max_batch_size: int = 32  # sequences decoded together
    window: int = 1024  # conversations (samples, n > 1) in flight: read, tokenised and answered at a time
    max_prompt_tokens: int = 4096  # longer prompts are skipped and counted
    progress: bool = True  # progress bar on rank 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    generator: str = "engine"  # engine (our engine, here) | openai (OpenAI-compatible servers at `endpoints`)
    # and EndpointsConfig's (generator=openai): endpoints, served_model, concurrency, timeout, retries, backoff,
    # dead_after
    template_check_rows: int = 3  # generator=openai: rows whose prompt token ids each server must render like us

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.generator not in GENERATORS:
            raise ConfigError(f"generator={self.generator!r}: choose one of {', '.join(GENERATORS)}")
        if self.generator == "openai" and not self.endpoints:
            raise ConfigError("generator=openai needs endpoints=[http://host:port,...] (OpenAI-compatible servers "
                              "or a router in front of them)")
        if self.window < 1:
            raise ConfigError(f"window must be >= 1 (conversations in flight), got {self.window}")
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(f"n={self.n} samples per prompt need temperature > 0; greedy decoding "
                              "(temperature=0) gives the same answer every time")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sampling(self) -> dict[str, Any]:
        """How every turn is decoded: recorded in the provenance and checked on resume."""
        return {k: getattr(self, k) for k in SAMPLING_KEYS}
