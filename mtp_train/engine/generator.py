"""What a stage generates through: a `Generator` answers a batch of requests and says its limits, its counters and
what made its answers.

Self-distillation (`mtp_train.regenerate`) talks to this interface alone. A request is token ids in, token ids and a
finish reason out, so that the tokenizer, the chat template and the stop rule stay with the caller
(`mtp_train.engine.turns`) whoever generates: our engine here (`EngineGenerator`), or any other backend that takes
token ids and per-request sampling settings (a client of OpenAI-compatible completion servers, say, spreading a
batch over their endpoints).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp_train.engine.llm import GenerationOutput, LLMEngine
from mtp_train.engine.sampling import SamplingParams

# on_finish(i, output): request i of the batch is done (called once per request, in completion order)
OnFinish = Callable[[int, GenerationOutput], None]


@dataclass(frozen=True)
class GeneratorLimits:
    """How long a request may be, so that a caller skips (and counts) what a generator would refuse."""

    max_context: int  # prompt + answer tokens the model attends over (its max_position_embeddings)
    max_request_tokens: int | None = None  # prompt + max_new_tokens one request may hold in the generator's KV
    # cache (its pages); None: bounded by the context alone


@dataclass(frozen=True)
class GeneratorStats:
    """A generator's counters so far (read them before and after a call for the call's share)."""

    prompt_tokens: int = 0  # prompt tokens of the requests answered
    generated_tokens: int = 0  # tokens generated, stop tokens included
    seconds: float = 0.0  # time spent inside generate


class Generator(ABC):
    """Answers batches of requests: token ids and sampling settings in, token ids and finish reasons out.

    A request's answer depends on its prompt and its `SamplingParams` alone (its own seed), not on the batch it came
    in or on the order requests finish, so a caller may split and resume work freely.
    """

    @abstractmethod
    def generate(self, prompts: Seq[Seq[int]], params: Seq[SamplingParams],
                 on_finish: OnFinish | None = None) -> list[GenerationOutput]:
        """Answer every request of a batch (e.g. one turn of many dialogues); nothing else changes.

        Args:
            prompts: (B,) each request's prompt, token ids (the chat template already applied).
            params: (B,) each request's sampling: temperature, top-k, top-p, max_new_tokens, stop token ids and its
                seed (None: greedy or unseeded).
            on_finish: called as request i completes, with its output (for writing results as they come).

        Returns:
            (B,) outputs in prompt order: the generated token ids (the stop token it ended on included) and the
            finish reason, "stop" or "length".
        """

    @property
    @abstractmethod
    def limits(self) -> GeneratorLimits:
        """The longest context and request this generator takes (a longer request would fail the batch)."""

    @abstractmethod
    def stats(self) -> GeneratorStats:
        """The counters so far: prompt and generated tokens, seconds inside generate."""

    @abstractmethod
    def provenance(self) -> dict[str, Any]:
        """What makes the answers, as plain JSON values: a stage records it with every output and compares it on
        resume, so it names the model (and whatever else decides the tokens), never a time or a load."""


class EngineGenerator(Generator):
    """Our engine as a `Generator`: an `LLMEngine` (or `SpecEngine`: same answers, faster) over a loaded target.

    Args:
        engine: the engine that answers (its pool, batch size and steps as built).
        name: the target's name, as the run's config gives it.
        path: the folder the target was loaded from.
        weights_fingerprint: `mtp_train.models.fingerprint.weights_fingerprint` of that folder.
    """

    def __init__(self, engine: LLMEngine, *, name: str, path: str | Path, weights_fingerprint: str) -> None:
        self.engine = engine
        self._provenance = {"name": name, "path": str(path), "weights_fingerprint": weights_fingerprint}

    def generate(self, prompts: Seq[Seq[int]], params: Seq[SamplingParams],
                 on_finish: OnFinish | None = None) -> list[GenerationOutput]:
        if isinstance(params, SamplingParams):
            raise TypeError("a Generator takes one SamplingParams per request (each with its own seed)")
        return self.engine.generate(prompts, list(params), on_finish=on_finish)

    @property
    def limits(self) -> GeneratorLimits:
        return GeneratorLimits(max_context=self.engine.model.args.max_position_embeddings,
                               max_request_tokens=self.engine.scheduler.max_request_tokens)

    def stats(self) -> GeneratorStats:
        s = self.engine.stats
        return GeneratorStats(s.prompt_tokens, s.generated_tokens, s.seconds)

    def provenance(self) -> dict[str, Any]:
        return dict(self._provenance)
