"""The OpenAI-compatible servers a command sends its requests to, and how its client treats them.

One set of keys wherever a command talks to running servers: `mtp-regenerate generator=openai` (top-level keys) and
`mtp-precompute backend=vllm vllm.endpoints=[...]` (under `vllm.`) take the same fields by inheriting
`EndpointsConfig`, so a key means the same thing, has the same default and is checked the same way in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.errors import ConfigError


@dataclass
class EndpointsConfig:
    """Running OpenAI-compatible servers (`vllm serve`, `mtp-serve`, SGLang, or a router in front of them) and the
    client's concurrency, retries and health rules (`remote.OpenAIGenerator`, `remote.health`)."""

    endpoints: list[str] = field(default_factory=list)  # base URLs of the servers (http://host:port), or a router
    served_model: str | None = None  # the model id to ask for (null: the one model the servers serve)
    concurrency: int = 8  # requests in flight per endpoint
    timeout: float = 600.0  # seconds one request may take before it is retried
    retries: int = 8  # tries of a request after its first failed on a live endpoint (429, 5xx, timeout, dropped)
    backoff: float = 1.0  # seconds a failing endpoint waits before its first probe (doubled per round, at most 60)
    dead_after: float = 180.0  # seconds of failures in a row after which an endpoint is dead (its requests move)

    def endpoint_key(self, name: str) -> str:
        """The key `name` has on the command line (a subclass nested under a group prefixes it), for errors."""
        return name

    def __post_init__(self) -> None:
        bounds = (("concurrency", self.concurrency >= 1, "a positive integer"),
                  ("timeout", self.timeout > 0, "a positive number of seconds"),
                  ("retries", self.retries >= 0, "0 (no retry) or more"),
                  ("backoff", self.backoff >= 0, "0 or more seconds"),
                  ("dead_after", self.dead_after >= 0, "0 or more seconds"))
        for name, ok, what in bounds:
            if not ok:
                key = self.endpoint_key(name)
                raise ConfigError(f"{key}={getattr(self, name)} is out of range: `{key}` must be {what}")

    def client_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `OpenAIGenerator.connect` these settings give (besides the endpoints)."""
        return {"model": self.served_model, "concurrency": self.concurrency, "timeout": self.timeout,
                "retries": self.retries, "backoff": self.backoff, "dead_after": self.dead_after}
