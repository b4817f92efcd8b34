"""`OpenAIGenerator`: the `Generator` interface over one or more OpenAI-compatible endpoints.

Requests go into one queue: a batch at once (`generate`), or as the caller's window makes them ready (`stream`: the
queue is refilled from its `feed` after every answer, so it never holds more than the window); every endpoint runs
`concurrency` workers that take the next request, send it to `/v1/completions` as token ids and hand the answer on
as it arrives. Each
endpoint has its health (`health.EndpointHealth`): a failed try (a dropped or refused connection, a timeout, 429,
5xx: a server killed, restarting or overloaded) puts the request back at the head of the queue for any endpoint
and starts the endpoint's failing streak, during which it sends one probe at a time after a backoff of its own
while the live endpoints drain the queue. An endpoint failing for `dead_after` seconds is dead, and the requests
it still held go back to the queue; with no endpoint left, the run stops in one line naming each endpoint and its
last error. A request that failed more than `retries` times on live endpoints (a probe's failure is the
endpoint's, not the request's) stops the run with its last reason. Answers depend on the prompt and the request's
own seed alone, so a retried request, on any server, gives what the first try would have given.

Every answer is checked before it is handed on (`check_answer`): token ids inside the vocabulary, no more of them
than asked for, a finish reason we know and that agrees with the answer. A server that breaks these is refused in
one line naming it and the request: its answers would otherwise become training data.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import httpx

from mtp_train.data.readers import Conversation
from mtp_train.engine.generator import (
    Feed,
    Generator,
    GeneratorLimits,
    GeneratorStats,
    OnAnswer,
    OnFinish,
    Request,
)
from mtp_train.engine.llm import GenerationOutput
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import prompt_ids
from mtp_train.remote.health import PROBE, EndpointHealth
from mtp_train.remote.http import RemoteError, Retryable, backoff_seconds, base_url, one_line, request_json

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")  # how an answer ends (our engine's reasons)
RETRY_REASONS = ("abort", "error")  # vLLM's, for a request the server dropped (shut down, preempted): asked again
MAX_TOKEN_ID = 1 << 31  # the bound of token ids when the vocabulary is not known (tokenizers decode 32-bit ids)
CONNECT_TIMEOUT = 10.0  # seconds to reach an endpoint at start-up
DEAD_AFTER = 180.0  # seconds of failures in a row before an endpoint is dead (the configs' default)


class OpenAIGenerator(Generator):
    """Answers through OpenAI-compatible servers that return token ids (vLLM >= 0.10.2, `mtp-serve`).

    Build it with `connect`, which asks every endpoint what it serves.

    Args:
        endpoints: base URLs (http://host:port, with or without /v1): servers, or one router in front of them.
        model: the served model id every endpoint serves.
        max_context: the shortest context the endpoints report (`max_model_len`).
        root: the weights folder the server names (`root` of `/v1/models`), when it names one.
        weights_fingerprint: its fingerprint, when that folder is on this machine.
        concurrency: requests in flight per endpoint.
        timeout: seconds one try may take.
        retries: failed tries of a request on live endpoints, after its first, before the run stops.
        backoff: seconds a failing endpoint waits before its first probe (doubled per round, at most 60).
        dead_after: seconds of failures in a row after which an endpoint is dead (`health`).
        vocab_size: the target's vocabulary: every answered token id must be below it (None: below 2^31).
    """

    def __init__(self, endpoints: Seq[str], *, model: str, max_context: int, root: str | None = None,
                 weights_fingerprint: str | None = None, concurrency: int = 8, timeout: float = 600.0,
                 retries: int = 8, backoff: float = 1.0, dead_after: float = DEAD_AFTER,
                 vocab_size: int | None = None) -> None:
        self.endpoints = [base_url(e) for e in endpoints]
        self.model, self.max_context = model, max_context
        self.root, self.weights_fingerprint = root, weights_fingerprint
        self.concurrency, self.timeout, self.retries, self.backoff = concurrency, timeout, retries, backoff
        self.dead_after, self.vocab_size = dead_after, vocab_size
        self.health = {url: EndpointHealth(url, backoff, dead_after) for url in self.endpoints}  # for the whole run
        self._prompt_tokens = self._generated_tokens = 0
        self._seconds = 0.0
        self.retried = 0  # failed tries so far (each put its request back in the queue)

    # ------------------------------------------------------------------------------------------------ set-up

    @classmethod
    def connect(cls, endpoints: Seq[str], *, model: str | None = None, **kw: Any) -> OpenAIGenerator:
        """Ask every endpoint for its models (`GET /v1/models`) and build the generator.

        Raises RemoteError, one line each, for an endpoint that does not answer, a model it does not serve,
        endpoints that serve different models when none is named, or a model card that is not one (a `max_model_len`
        that is not a positive integer). The vocabulary is read from the served weights folder's config.json when
        that folder is on this machine and none is given.

        Args:
            endpoints: base URLs.
            model: the model id to ask for; None: the one model the endpoints serve.
            kw: the constructor's settings (concurrency, timeout, retries, backoff, dead_after, vocab_size).
        """
        if not endpoints:
            raise RemoteError("no endpoints: name at least one OpenAI-compatible server (endpoints=[http://...])")
        urls = [base_url(e) for e in endpoints]
        cards = asyncio.run(_models(urls))
        chosen = model
        for url, served in zip(urls, cards):
            ids = [c["id"] for c in served]
            if chosen is None:
                if len(ids) != 1:
                    raise RemoteError(f"{url} serves {len(ids)} models ({', '.join(map(str, ids))}); choose one with "
                                      "served_model=ID")
                chosen = ids[0]
            if chosen not in ids:
                raise RemoteError(f"model {chosen!r} is not served by {url}; it serves: {', '.join(map(str, ids))}")
        assert chosen is not None
        card = next(c for c in cards[0] if c.get("id") == chosen)
        lens = [n for url, served in zip(urls, cards) for c in served if c["id"] == chosen
                for n in [_max_model_len(url, c)] if n is not None]
        root = card.get("root")
        fingerprint = None
        if isinstance(root, str) and root and (Path(root) / "config.json").is_file():  # the folder is on this machine
            from mtp_train.models.fingerprint import weights_fingerprint

            fingerprint = weights_fingerprint(root)
            if kw.get("vocab_size") is None:
                kw["vocab_size"] = _vocab_size(Path(root) / "config.json")
        return cls(urls, model=chosen, max_context=min(lens) if lens else 1 << 31, root=root,
                   weights_fingerprint=fingerprint, **kw)

    def check_template(self, conversations: Seq[Conversation], tokenizer: Any,
                       template_kwargs: dict[str, Any] | None = None, rows: int = 3) -> int:
        """Refuse servers whose chat template renders differently from ours; return the rows checked.

        The first `rows` conversations with a user turn, up to their last user turn (earlier assistant turns
        included, so the history's rendering is checked too), go to every endpoint's `/v1/chat/completions`
        (one token, greedy, `return_token_ids`); its `prompt_token_ids` must equal our rendering
        (`mtp_train.engine.turns.prompt_ids`), which the loss masks rely on. Raises RemoteError naming the
        endpoint, the conversation and the first differing position.
        """
        picked: list[tuple[Conversation, list[dict[str, str]]]] = []
        for conv in conversations:
            if len(picked) >= rows:
                break
            last_user = max((i for i, m in enumerate(conv.messages) if m["role"] == "user"), default=None)
            if last_user is not None:
                picked.append((conv, [{"role": m["role"], "content": m["content"]}
                                      for m in conv.messages[: last_user + 1]]))
        if not picked:
            return 0
        kwargs = dict(template_kwargs or {})
        ours = [prompt_ids(tokenizer, msgs, kwargs) for _, msgs in picked]

        async def ask() -> list[list[Any]]:
            async with self._client() as client:
                return [[await self._retrying(client, url, "POST", f"{url}/v1/chat/completions", {
                    "model": self.model, "messages": msgs, "max_tokens": 1, "temperature": 0,
                    "return_token_ids": True, **({"chat_template_kwargs": kwargs} if kwargs else {})})
                    for _, msgs in picked] for url in self.endpoints]

        for url, answers in zip(self.endpoints, asyncio.run(ask())):
            for (conv, _), mine, answer in zip(picked, ours, answers):
                theirs = answer.get("prompt_token_ids") if isinstance(answer, dict) else None
                if theirs is None:
                    raise RemoteError(f"{url} returned no prompt_token_ids: it must honour return_token_ids (vLLM >= "
                                      "0.10.2, mtp-serve) for its template to be checked")
                if not isinstance(theirs, list) or any(type(t) is not int for t in theirs):
                    raise RemoteError(f"{url} returned prompt_token_ids that are not a list of integers")
                if theirs != mine:
                    at = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
                    show = lambda ids, at=at: "the end" if at >= len(ids) else \
                        f"{ids[at]} {_decoded(tokenizer, ids[at])}"
                    raise RemoteError(
                        f"{url} renders conversation {conv.id} ({conv.source}:{conv.line}) differently from our chat "
                        f"template: first difference at token {at} (server: {show(theirs)}, ours: {show(mine)}); "
                        "serve the model with the tokenizer and chat template of model.path")
        return len(picked)

    # ---------------------------------------------------------------------------------------- the interface

    @property
    def limits(self) -> GeneratorLimits:
        return GeneratorLimits(max_context=self.max_context)

    def stats(self) -> GeneratorStats:
        return GeneratorStats(self._prompt_tokens, self._generated_tokens, self._seconds)

    def provenance(self) -> dict[str, Any]:
        return {"served_model": self.model, "path": self.root, "weights_fingerprint": self.weights_fingerprint}

    def generate(self, prompts: Seq[Seq[int]], params: Seq[SamplingParams], on_finish: OnFinish | None = None,
                 extra: Seq[dict[str, Any]] | None = None, names: Seq[str] | None = None) -> list[GenerationOutput]:
        """The `Generator` call, with two further per-request lists.

        Args:
            prompts: (B,) each request's prompt, token ids.
            params: (B,) each request's sampling settings.
            on_finish: called as request i completes, with its output.
            extra: per request, further fields of its `/v1/completions` body (vLLM's `kv_transfer_params` for a
                capture).
            names: per request, what an error calls it (e.g. "sample 'c3'"); None: "request i of B".
        """
        if isinstance(params, SamplingParams):
            raise TypeError("a Generator takes one SamplingParams per request (each with its own seed)")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if extra is not None and len(extra) != len(prompts):
            raise ValueError(f"{len(extra)} extra bodies for {len(prompts)} prompts")
        if names is not None and len(names) != len(prompts):
            raise ValueError(f"{len(names)} names for {len(prompts)} prompts")
        n = len(prompts)
        if not n:
            return []
        labels = list(names) if names is not None else [f"request {i + 1} of {n}" for i in range(n)]
        requests = [Request(list(p), q, key=i, name=label) for i, (p, q, label) in enumerate(zip(prompts, params,
                                                                                                  labels))]
        results: list[GenerationOutput | None] = [None] * n
        fed = False

        def feed() -> list[Request] | None:
            nonlocal fed
            if fed:
                return None
            fed = True
            return requests

        def answered(r: Request, out: GenerationOutput) -> None:
            results[r.key] = out
            if on_finish is not None:
                on_finish(r.key, out)

        self._run(feed, answered, list(extra) if extra is not None else None)
        return results  # type: ignore[return-value]

    def stream(self, feed: Feed, on_answer: OnAnswer) -> None:
        """`Generator.stream`: the fed requests wait in one queue (no longer than the caller's window), from which
        every endpoint's `concurrency` workers take the next; `feed` is asked again after every answer. Retries,
        probes and dead endpoints as for a batch (module docstring); an error names the request by its `name`."""
        self._run(feed, on_answer, None)

    def post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        """POST `body` to `path` (e.g. "/v1/completions") of the endpoint `url` (one of `endpoints`), retried like
        a set-up request (`_retrying`); its JSON answer. RemoteError when it refuses or keeps failing."""

        async def ask() -> Any:
            async with self._client() as client:
                return await self._retrying(client, url, "POST", f"{url}{path}", body)

        return asyncio.run(ask())

    def live_endpoints(self) -> list[str]:
        """The endpoints not declared dead."""
        return [url for url in self.endpoints if not self.health[url].dead]

    # -------------------------------------------------------------------------------------------- internals

    def _client(self) -> httpx.AsyncClient:
        n = self.concurrency * len(self.endpoints)
        return httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, CONNECT_TIMEOUT)),
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    async def _retrying(self, client: httpx.AsyncClient, url: str, method: str, target: str, body: Any) -> Any:
        """One request to one endpoint (the few set-up requests: a template check, a capture probe), tried again
        on a retryable failure: at most `retries` times and for at most `dead_after` seconds after its first
        failure, the last try at that bound."""
        first: float | None = None
        for failures in range(1, self.retries + 2):
            try:
                return await request_json(client, method, target, body)
            except Retryable as exc:
                now = time.monotonic()
                first = now if first is None else first
                if failures > self.retries or now - first >= self.dead_after:
                    raise RemoteError(f"{url} failed {failures} times in {now - first:.1f} s (retries={self.retries}, "
                                      f"dead_after={self.dead_after:g}), the last: {exc}") from None
                self.retried += 1
                wait = backoff_seconds(self.backoff, failures, exc.retry_after)
                await asyncio.sleep(min(wait, first + self.dead_after - now))
        raise AssertionError("unreachable")

    def completion_body(self, prompt: list[int], p: SamplingParams) -> dict[str, Any]:
        """A `/v1/completions` request: token ids in, vLLM's sampling extensions, token ids back."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": p.max_new_tokens,
                                "temperature": p.temperature, "top_p": p.top_p, "return_token_ids": True}
        if p.top_k > 0:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _output(self, url: str, name: str, prompt: list[int], p: SamplingParams, answer: Any) -> GenerationOutput:
        """The answer as our engine gives it (token ids with the stop token, "stop" | "length"), checked
        (`check_answer`)."""
        return check_answer(answer, prompt, p, vocab_size=self.vocab_size or MAX_TOKEN_ID,
                            max_context=self.max_context, where=f"{url} answering {name}")

    def _run(self, feed: Feed, on_answer: OnAnswer, extra: list[dict[str, Any]] | None) -> None:
        """`_stream` in an event loop of its own, its time counted."""
        t0 = time.perf_counter()
        try:
            asyncio.run(self._stream(feed, on_answer, extra))
        finally:
            self._seconds += time.perf_counter() - t0

    async def _stream(self, feed: Feed, on_answer: OnAnswer, extra: list[dict[str, Any]] | None) -> None:
        """Answer every request `feed` gives through the live endpoints (module docstring); `extra[request.key]`:
        further body fields of a request."""
        jobs: dict[int, Request] = {}  # requests fed and not answered yet, by number
        pending: collections.deque[int] = collections.deque()  # numbers neither answered nor in flight, in order
        tries: dict[int, int] = {}  # failed tries of each request on live endpoints
        numbers = itertools.count()
        left = 0  # requests fed and not answered
        exhausted = False  # feed said no more will come
        changed = asyncio.Event()  # set (and replaced) whenever a worker may have something new to do
        gone = {url: asyncio.Event() for url in self.endpoints}  # set when the endpoint is declared dead
        for h in self.health.values():
            h.probing = False  # no probe of an earlier call is in flight

        def refill() -> int:
            """Queue what `feed` has ready; the number queued."""
            nonlocal left, exhausted
            if exhausted:
                return 0
            got = feed()
            if got is None:
                exhausted = True
                return 0
            for r in got:
                i = next(numbers)
                jobs[i], tries[i] = r, 0
                pending.append(i)
            left += len(got)
            if not left and not exhausted:
                raise RuntimeError("the feed gave no request while none was in flight")
            return len(got)

        def name(i: int) -> str:
            return jobs[i].name or f"request {i + 1}"

        refill()
        if not left:
            return
        self._check_alive(left)

        def notify() -> None:
            nonlocal changed
            changed.set()
            changed = asyncio.Event()

        def declare_dead(url: str) -> None:
            """Send nothing more to `url`, hand its requests in flight back; RemoteError when none is left."""
            h = self.health[url]
            h.declare_dead()
            if gone[url].is_set():
                return
            now = time.monotonic()
            log.warning("endpoint %s is dead (failing for %.1f s, last: %s); the %d requests left go to %s", url,
                        now - (h.failing_since or now), h.last_error, left,
                        ", ".join(self.live_endpoints()) or "no endpoint")
            gone[url].set()
            notify()
            self._check_alive(left)

        async def send(client: httpx.AsyncClient, url: str, i: int) -> GenerationOutput | None:
            """Request i's answer from `url`; None when the endpoint is declared dead meanwhile (by another worker,
            or here, when its `dead_after` runs out while this try is in flight)."""
            h = self.health[url]
            r = jobs[i]
            body = self.completion_body(r.prompt, r.params) | (extra[r.key] if extra is not None else {})
            task = asyncio.ensure_future(request_json(client, "POST", f"{url}/v1/completions", body))
            # its failure is read below, or dropped with the task when the run stops: never an unread exception
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            stop = asyncio.ensure_future(gone[url].wait())
            try:
                while not task.done() and not stop.done():
                    deadline = h.deadline  # a streak may start (or end) while this try is in flight
                    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED,
                                       timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))
                    if not task.done() and h.expired(time.monotonic()):
                        declare_dead(url)
                        break
            finally:
                stop.cancel()
                dropped = not task.done()
                if dropped:  # dead (or the run stops): the request goes elsewhere
                    task.cancel()
            if dropped:
                return None
            return self._output(url, name(i), r.prompt, r.params, task.result())

        async def work(client: httpx.AsyncClient, url: str) -> None:
            nonlocal left
            h = self.health[url]
            while left:
                now = time.monotonic()
                if h.expired(now):
                    declare_dead(url)
                turn = h.admit(now)
                if turn is None:
                    return  # dead
                if not isinstance(turn, str) or not pending:
                    # until something changes (an answer, a failure, a request back in the queue) or, for a
                    # failing endpoint, until its next probe is due or its dead_after runs out
                    timeout = turn if isinstance(turn, float) else math.inf
                    if h.deadline is not None:
                        timeout = min(timeout, max(h.deadline - now, 0.0))
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(changed.wait(), None if timeout == math.inf else timeout)
                    continue
                i = pending.popleft()
                probe = turn == PROBE
                if probe:
                    h.start_probe()
                sent_at = time.monotonic()
                try:
                    out = await send(client, url, i)
                except Retryable as exc:
                    self.retried += 1
                    now = time.monotonic()
                    if not probe:
                        tries[i] += 1
                    if tries[i] > self.retries:
                        raise RemoteError(f"{name(i)} failed {tries[i]} times on live endpoints (retries="
                                          f"{self.retries}), the last: {exc}") from None
                    pending.appendleft(i)  # first in line for whichever endpoint sends next
                    if h.failed(now, sent_at, str(exc), exc.retry_after):
                        declare_dead(url)
                    notify()
                    continue
                if out is None:
                    pending.appendleft(i)  # the endpoint died while this was in flight
                    notify()
                    return
                was_failing = h.failing_since is not None
                h.succeeded(sent_at)
                r = jobs.pop(i)
                del tries[i]
                self._prompt_tokens += len(out.prompt_ids)
                self._generated_tokens += len(out.output_ids)
                left -= 1
                on_answer(r, out)
                if refill() or was_failing or not left:  # new requests queued, or a change the others wait for
                    notify()

        async with self._client() as client:
            tasks = [asyncio.create_task(work(client, url)) for url in self.endpoints for _ in range(self.concurrency)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _check_alive(self, left: int) -> None:
        """RemoteError, naming every endpoint and its last error, when none is left."""
        if self.live_endpoints():
            return
        now = time.monotonic()
        raise RemoteError(one_line(
            f"no endpoint left, {left} requests unanswered: every endpoint failed for dead_after={self.dead_after:g} s "
            f"in a row: {'; '.join(self.health[url].describe(now) for url in self.endpoints)}; restart the servers "
            "and run again with the same out (it resumes), or raise dead_after for longer restarts", 2000))


def check_answer(answer: Any, prompt: list[int], p: SamplingParams, *, vocab_size: int, max_context: int,
                 where: str) -> GenerationOutput:
    """A `/v1/completions` answer as our engine's output, after checking what becomes training data.

    Raises RemoteError (`where` names the endpoint and the request) for an answer without token ids, ids that are
    not integers in [0, vocab_size), more ids than `max_new_tokens` (one more allowed when the last is a stop
    token, for a server that does not count it), another prompt than the one sent, a finish reason that is missing
    or unknown, "stop" on a token that is not a stop token of ours, or "length" before `max_new_tokens` and the
    context were reached. Raises Retryable for vLLM's "abort" / "error" (the server dropped the request).

    Args:
        answer: the JSON body.
        prompt: the prompt's token ids as sent.
        p: the request's sampling settings.
        vocab_size: the target's vocabulary size.
        max_context: the shortest context the endpoints serve (a "length" may come from it).
        where: "<endpoint> answering <request>", for the messages.
    """
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        raise RemoteError(f"{where} returned no completion choice: {one_line(json.dumps(answer), 200)}")
    ids = choice.get("token_ids")
    if ids is None:
        raise RemoteError(f"{where} returned no token_ids: the server must honour return_token_ids (vLLM >= 0.10.2, "
                          "mtp-serve)")
    if not isinstance(ids, list) or any(type(t) is not int for t in ids):  # bool and float are not token ids
        raise RemoteError(f"{where} returned token_ids that are not a list of integers: "
                          f"{one_line(json.dumps(ids), 120)}")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RemoteError(f"{where} returned token id {bad}, outside the vocabulary [0, {vocab_size}): the server "
                          "runs another model or tokenizer than model.path")
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and list(echoed) != prompt:
        raise RemoteError(f"{where} did not take the prompt's token ids as sent (a server that re-tokenizes?)")
    reason = choice.get("finish_reason")
    if reason in RETRY_REASONS:
        raise Retryable(f"{where}: finish reason {reason!r}")  # dropped by the server (shut down, preempted)
    if reason not in FINISH_REASONS:
        raise RemoteError(f"{where} ended its answer with finish_reason {reason!r}; an answer ends with "
                          f"{' or '.join(FINISH_REASONS)} ({' and '.join(RETRY_REASONS)} are asked again)")
    stops = p.stop_token_ids or []
    on_stop = bool(ids) and ids[-1] in stops
    if len(ids) > p.max_new_tokens + (reason == "stop" and on_stop):
        raise RemoteError(f"{where} returned {len(ids)} tokens for max_tokens={p.max_new_tokens}: the server does "
                          "not honour max_tokens")
    if reason == "stop" and not p.ignore_eos and not on_stop:
        raise RemoteError(f"{where} stopped on a token that is not a stop token of ours ({ids[-1:] or 'none'}); "
                          "the server stops on something else (its own stop strings or EOS ids)")
    if reason == "length" and len(ids) < p.max_new_tokens and len(prompt) + len(ids) < max_context:
        raise RemoteError(f"{where} ended with finish_reason 'length' after {len(ids)} of max_tokens="
                          f"{p.max_new_tokens} tokens, with {len(prompt) + len(ids)} of the context's {max_context}: "
                          "the answer was cut short")
    return GenerationOutput(prompt, ids, reason)


def _decoded(tokenizer: Any, token: int) -> str:
    """The token's text, quoted, or why there is none (an id outside the tokenizer's vocabulary)."""
    if not 0 <= token < len(tokenizer):
        return f"(outside the tokenizer's {len(tokenizer)} tokens)"
    return repr(tokenizer.decode([token]))


def _max_model_len(url: str, card: dict[str, Any]) -> int | None:
    """The card's `max_model_len` (None when it gives none); RemoteError when it is not a positive integer."""
    n = card.get("max_model_len")
    if n is None:
        return None
    if type(n) is not int or n < 1:
        raise RemoteError(f"{url}/v1/models gives max_model_len={one_line(json.dumps(n), 60)} for model "
                          f"{card['id']!r}: not a positive integer (the context length in tokens); is it an "
                          "OpenAI-compatible server (vLLM, SGLang, mtp-serve)?")
    return n


def _vocab_size(config: Path) -> int | None:
    """`vocab_size` of a weights folder's config.json (its text model's for a multimodal one), None if absent."""
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    n = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return n if type(n) is int and n > 0 else None


async def _models(urls: list[str]) -> list[list[dict[str, Any]]]:
    """Each endpoint's model cards (dicts with a string id); RemoteError for one that does not answer them."""
    out = []
    async with httpx.AsyncClient(timeout=CONNECT_TIMEOUT) as client:
        for url in urls:
            try:
                body = await request_json(client, "GET", f"{url}/v1/models")
            except Retryable as exc:
                raise RemoteError(f"endpoint {url} is unreachable ({exc}); is the server running and listening "
                                  "there?") from None
            data = body.get("data") if isinstance(body, dict) else None
            if not isinstance(data, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str)
                                                     for c in data):
                raise RemoteError(f"{url}/v1/models did not answer an OpenAI model list (cards with a string id)")
            out.append(data)
    return out
