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


@dataclass
class Request:
    """One request of a `Generator.stream`: what to answer, how, and what the caller and its errors call it."""

    prompt: list[int]  # the prompt's token ids (the chat template already applied)
    params: SamplingParams  # its sampling settings, with its own seed (None: greedy or unseeded)
    key: Any = None  # the caller's handle, handed back with the answer
    name: str | None = None  # what an error calls the request (e.g. "conversation c3 turn 2"); None: a number


# feed(): the requests ready now ([]: none yet, more may follow an answer), or None when none will ever come
Feed = Callable[[], list[Request] | None]
# on_answer(request, output): a request of the stream is answered (once per request, in completion order)
OnAnswer = Callable[[Request, GenerationOutput], None]


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

    def stream(self, feed: Feed, on_answer: OnAnswer) -> None:
        """Answer requests handed in as the run goes, until `feed` has no more and every one is answered.

        The caller keeps a bounded window of work in flight: `feed()` is asked whenever the generator can take
        more (at least once after each answer), and `on_answer` may make the next requests ready (a dialogue's next
        turn, the next conversation). Each request is answered as `generate` would answer it alone: its output
        depends on its prompt and params, not on what it was fed with.

        This default answers each feed's requests as one batch; generators that batch continuously (our engine)
        or keep requests in flight (servers) take them as they come.

        Args:
            feed: the requests ready now; [] when none is (there must then be requests in flight); None at the end.
            on_answer: called as each request completes, with its output.
        """
        while (requests := feed()) is not None:
            if not requests:
                raise RuntimeError("the feed gave no request while none was in flight")
            self.generate([r.prompt for r in requests], [r.params for r in requests],
                          on_finish=lambda i, out, batch=requests: on_answer(batch[i], out))

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

    def stream(self, feed: Feed, on_answer: OnAnswer) -> None:
        """Requests enter the engine's queue as they are fed (`LLMEngine.stream`): its continuous batching keeps
        the batch full while the caller's window refills."""

        def engine_feed() -> list[tuple[list[int], SamplingParams, Request]] | None:
            requests = feed()
            return None if requests is None else [(r.prompt, r.params, r) for r in requests]

        self.engine.stream(engine_feed, on_answer)

    @property
    def limits(self) -> GeneratorLimits:
        return GeneratorLimits(max_context=self.engine.model.args.max_position_embeddings,
                               max_request_tokens=self.engine.scheduler.max_request_tokens)

    def stats(self) -> GeneratorStats:
        s = self.engine.stats
        return GeneratorStats(s.prompt_tokens, s.generated_tokens, s.seconds)

    def provenance(self) -> dict[str, Any]:
        return dict(self._provenance)
