"""`mtp-serve`: our engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.errors import ConfigError
from mtp_train.config.eval import check_head_weights
from mtp_train.config.model import ModelConfig


@dataclass
class ServeConfig:
    """`mtp-serve`: our engine behind an OpenAI-compatible HTTP server (`/v1/models`, `/v1/chat/completions`,
    `/v1/completions`, `/metrics`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    host: str = "127.0.0.1"  # address to listen on (0.0.0.0: every interface)
    port: int = 8000  # TCP port
    served_model_name: str | None = None  # the model id clients name; None: model.name
    head_ckpt: str | None = None  # a trained head (mtp-train's heads/step-N): speculative decoding with it
    k: int = 3  # draft depth of the head (tokens proposed per step)
    verify_fingerprint: bool = True  # the head must have been trained on these target weights
    head_weights: str = "bf16"  # on CPU in float32: bf16 (the head streams a bfloat16 copy of its weights), int8, fp32
    max_batch_size: int = 32  # sequences decoded together
    max_tokens: int | None = None  # default max_tokens of a request that names none; None: the rest of the context
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the chat template of every chat
    # request (a request's own `chat_template_kwargs` are added over them)
    log_level: str = "warning"  # the HTTP server's log level (uvicorn's: critical | error | warning | info | debug)
    trust_request_chat_template: bool = False  # take a request's chat_template_kwargs.chat_template (runs on our CPU)
    request_timeout: float = 30.0  # seconds a client has to send a whole request (headers and body); then 408, closed
    max_body_bytes: int = 4 * 2**20  # a larger request body gets a 413
    max_header_bytes: int = 16 * 2**10  # request line and headers together; more gets a 400

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.k < 1:
            raise ConfigError(f"k must be >= 1, got {self.k}")
        check_head_weights(self.head_weights)
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1 or null, got {self.max_tokens}")
        if not 0 < self.request_timeout < float("inf"):
            raise ConfigError(f"request_timeout must be a positive number of seconds, got {self.request_timeout}")
        if self.max_body_bytes < 1 or self.max_header_bytes < 1:
            raise ConfigError(f"max_body_bytes and max_header_bytes must be >= 1, got {self.max_body_bytes} and "
                              f"{self.max_header_bytes}")

    @property
    def model_id(self) -> str:
        """The id clients name in `model`."""
        return self.served_model_name or self.model.name
