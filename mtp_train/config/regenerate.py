"""`mtp-regenerate`: answer the conversations' user turns with the target (self-distillation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.data import DataConfig
from mtp_train.config.errors import ConfigError
from mtp_train.config.model import ModelConfig

GENERATORS = ("engine", "openai")  # who answers: our engine in this process | OpenAI-compatible servers
SAMPLING_KEYS = ("n", "temperature", "top_k", "top_p", "max_new_tokens", "seed")  # recorded in the provenance


@dataclass
class RegenerateConfig:
    """`mtp-regenerate`: answer the conversations' user turns with the target (self-distillation)."""

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
    endpoints: list[str] = field(default_factory=list)  # generator=openai: base URLs (http://host:port), or a router
    served_model: str | None = None  # generator=openai: the model id to ask for; None: the one model served
    concurrency: int = 8  # generator=openai: requests in flight per endpoint
    timeout: float = 600.0  # generator=openai: seconds one request may take before it is retried
    retries: int = 8  # generator=openai: retries of a request failed on live endpoints (429, 5xx, timeout, dropped)
    backoff: float = 1.0  # generator=openai: a failing endpoint's wait before its first probe (doubled, at most 60 s)
    dead_after: float = 180.0  # generator=openai: seconds of failures in a row after which an endpoint is dead
    template_check_rows: int = 3  # generator=openai: rows whose prompt token ids each server must render like us

    def __post_init__(self) -> None:
        if self.generator not in GENERATORS:
            raise ConfigError(f"generator={self.generator!r}: choose one of {', '.join(GENERATORS)}")
        if self.generator == "openai" and not self.endpoints:
            raise ConfigError("generator=openai needs endpoints=[http://host:port,...] (OpenAI-compatible servers "
                              "or a router in front of them)")
        if self.backoff < 0:
            raise ConfigError(f"backoff must be >= 0 seconds, got {self.backoff}")
        if self.dead_after < 0:
            raise ConfigError(f"dead_after must be >= 0 seconds, got {self.dead_after}")
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
