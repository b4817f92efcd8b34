"""The OpenAI request bodies `mtp-serve` takes, with vLLM's extensions that a client of both needs.

Field names follow OpenAI's API and, for what OpenAI lacks, vLLM's: `return_token_ids` (the prompt's token ids, as
`prompt_token_ids`, and each choice's generated ids, as `token_ids`, the stop token included), `top_k`,
`stop_token_ids`, `ignore_eos`, `chat_template_kwargs`. Unknown fields are ignored, as OpenAI-compatible servers
do; fields we cannot honour (n > 1, logprobs, penalties, `echo`, `best_of`, `suffix`, tools, ... : `REFUSED`) are
refused with a 400 that names them. Sampling values are bounded (`MAX_TEMPERATURE`, `MIN_TEMPERATURE`, `MIN_TOP_P`,
a 64-bit seed) and must be finite, and every string must be valid Unicode (no lone surrogate, which JSON's `\\ud800`
escapes can carry): what the engine could not sample, encode or tokenize is refused here with a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MIN_TEMPERATURE = 1e-5  # below it (0 excepted) softmax(logits / t) overflows float32 or is one-hot anyway
MAX_TEMPERATURE = 100.0  # above it the distribution is uniform for every purpose: surely a mistake
MIN_TOP_P = 1e-8  # below float32's resolution of a cumulative probability
SEED_RANGE = (-(2**63), 2**63 - 1)  # OpenAI's and vLLM's: a signed 64-bit integer
MAX_STOP = 16  # stop strings of a request (each is searched for in the answer after every step)
MAX_STOP_TOKEN_IDS = 256

# Fields of OpenAI's (or vLLM's) requests this server does not implement, with the values that ask for nothing
# (which are taken, so that a client sending its defaults is served); any other value is refused with a 400.
REFUSED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "prompt_embeds": (None,),
}


def _strings(value: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(path, string) of every string in a parsed JSON value, keys included (iterative: a body may nest deeply)."""
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            yield path, v
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(k, str):
                    yield sub, k
                stack.append((sub, item))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(v))


def _printable(path: str) -> str:
    """A field path that is itself valid UTF-8 (a key may hold the surrogate)."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the usage (and no choices)


Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)]


class _Request(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="allow")  # unknown fields are kept only to be checked against REFUSED

    model: str | None = None  # the served model id (None: the one served)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = Field(default=1.0, ge=MIN_TOP_P, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1)  # 0 or -1: off (vLLM's -1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # added to the model's own
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    n: int = 1
    logprobs: Any = None
    frequency_penalty: float = Field(default=0.0, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Refuse a string that UTF-8 cannot encode (a lone surrogate): the tokenizer, the chat template and the
        response's encoding would each fail on it."""
        for path, text in _strings(data):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"{_printable(path) or 'the body'} holds a lone surrogate at character {exc.start} "
                                 f"(not valid Unicode): send UTF-8 text") from None
        return data

    def unsupported(self) -> tuple[str, str] | None:
        """The first setting this server cannot honour, as (field, message); None when all can be."""
        if self.n != 1:
            return "n", f"n={self.n}: this server answers one choice per request"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not served; ask for return_token_ids instead"
        if self.frequency_penalty or self.presence_penalty:
            return "frequency_penalty", "frequency_penalty and presence_penalty are not supported"
        if 0 < self.temperature < MIN_TEMPERATURE:
            return "temperature", (f"temperature={self.temperature}: use 0 for greedy decoding, or at least "
                                   f"{MIN_TEMPERATURE}")
        extra = self.model_extra or {}
        for name, harmless in REFUSED.items():
            if name in extra and not any(type(extra[name]) is type(h) and extra[name] == h for h in harmless):
                return name, f"`{name}` is not supported by this server (send it unset)"
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
