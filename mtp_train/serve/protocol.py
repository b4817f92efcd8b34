"""The OpenAI request bodies `mtp-serve` takes, with vLLM's extensions that a client of both needs.

Field names follow OpenAI's API and, for what OpenAI lacks, vLLM's: `return_token_ids` (the prompt's token ids, as
`prompt_token_ids`, and each choice's generated ids, as `token_ids`, the stop token included), `top_k`,
`stop_token_ids`, `ignore_eos`, `chat_template_kwargs`. Unknown fields are ignored, as OpenAI-compatible servers
do; fields we cannot honour (n > 1, logprobs, penalties) are refused with a 400 that names them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the usage (and no choices)


class _Request(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # the served model id (None: the one served)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)  # OpenAI's default; 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off (vLLM's -1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # added to the model's own stop tokens
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    n: int = 1
    logprobs: Any = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def unsupported(self) -> str | None:
        """The first setting this server cannot honour, as a message; None when all can be."""
        if self.n != 1:
            return f"n={self.n}: this server answers one choice per request"
        if self.logprobs not in (None, False, 0):
            return "logprobs are not served; ask for return_token_ids instead"
        if self.frequency_penalty or self.presence_penalty:
            return "frequency_penalty and presence_penalty are not supported"
        return None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as our chat rendering takes it (text parts joined; `developer` is OpenAI's `system`)."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name of max_tokens
    chat_template_kwargs: dict[str, Any] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    """`POST /v1/completions`: a text prompt (tokenized as is) or token ids (taken as they are)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    temperature: float = Field(default=1.0, ge=0.0)

    def limit(self) -> int | None:
        return self.max_tokens

    def one_prompt(self) -> str | list[int] | None:
        """The request's one prompt, or None when it holds a batch (or nothing)."""
        p = self.prompt
        if isinstance(p, str) or p == []:
            return p  # an empty list is an empty prompt, refused as such
        if p and all(isinstance(t, int) for t in p):
            return list(p)  # type: ignore[arg-type]
        if isinstance(p, list) and len(p) == 1:
            return p[0]  # type: ignore[return-value]
        return None
