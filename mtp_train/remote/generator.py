"""`OpenAIGenerator`: the `Generator` interface over one or more OpenAI-compatible endpoints.

A batch (one turn of many dialogues) goes into one queue; every endpoint runs `concurrency` workers that take the
next request, send it to `/v1/completions` as token ids and hand the answer to `on_finish` as it arrives. A failed
try (a dropped connection, a timeout, 429, 5xx: a server killed, restarting or overloaded) puts the request back
in the queue for any endpoint, and the worker that failed waits before its next try, twice as long after each
failure in a row: a dead server's workers soon take almost nothing while the live ones drain the queue. A request
that failed more than `retries` times stops the run with its last reason. Answers depend on the prompt and the
request's own seed alone, so a retried request, on any server, gives what the first try would have given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import httpx

from mtp_train.data.readers import Conversation
from mtp_train.engine.generator import Generator, GeneratorLimits, GeneratorStats, OnFinish
from mtp_train.engine.llm import GenerationOutput
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import prompt_ids
from mtp_train.remote.http import RemoteError, Retryable, backoff_seconds, base_url, request_json

FINISH_REASONS = ("stop", "length")
CONNECT_TIMEOUT = 10.0  # seconds to reach an endpoint at start-up


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
        retries: tries of a request after its first before the run stops.
        backoff: seconds a worker waits after its first failure (doubled per failure in a row, at most 60).
    """

    def __init__(self, endpoints: Seq[str], *, model: str, max_context: int, root: str | None = None,
                 weights_fingerprint: str | None = None, concurrency: int = 8, timeout: float = 600.0,
                 retries: int = 8, backoff: float = 1.0) -> None:
        self.endpoints = [base_url(e) for e in endpoints]
        self.model, self.max_context = model, max_context
        self.root, self.weights_fingerprint = root, weights_fingerprint
        self.concurrency, self.timeout, self.retries, self.backoff = concurrency, timeout, retries, backoff
        self._prompt_tokens = self._generated_tokens = 0
        self._seconds = 0.0
        self.retried = 0  # failed tries so far (each put its request back in the queue)

    # ------------------------------------------------------------------------------------------------ set-up

    @classmethod
    def connect(cls, endpoints: Seq[str], *, model: str | None = None, **kw: Any) -> OpenAIGenerator:
        """Ask every endpoint for its models (`GET /v1/models`) and build the generator.

        Raises RemoteError, one line each, for an endpoint that does not answer, a model it does not serve, or
        endpoints that serve different models when none is named.

        Args:
            endpoints: base URLs.
            model: the model id to ask for; None: the one model the endpoints serve.
            kw: the constructor's settings (concurrency, timeout, retries, backoff).
        """
        if not endpoints:
            raise RemoteError("no endpoints: name at least one OpenAI-compatible server (endpoints=[http://...])")
        urls = [base_url(e) for e in endpoints]
        cards = asyncio.run(_models(urls))
        chosen = model
        for url, served in zip(urls, cards):
            ids = [c.get("id") for c in served]
            if chosen is None:
                if len(ids) != 1:
                    raise RemoteError(f"{url} serves {len(ids)} models ({', '.join(map(str, ids))}); choose one with "
                                      "served_model=ID")
                chosen = ids[0]
            if chosen not in ids:
                raise RemoteError(f"model {chosen!r} is not served by {url}; it serves: {', '.join(map(str, ids))}")
        assert chosen is not None
        card = next(c for c in cards[0] if c.get("id") == chosen)
        lens = [int(c["max_model_len"]) for s in cards for c in s if c.get("id") == chosen and c.get("max_model_len")]
        root = card.get("root")
        fingerprint = None
        if root and (Path(root) / "config.json").is_file():  # the weights folder is on this machine
            from mtp_train.models.fingerprint import weights_fingerprint

            fingerprint = weights_fingerprint(root)
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
                theirs = answer.get("prompt_token_ids")
                if theirs is None:
                    raise RemoteError(f"{url} returned no prompt_token_ids: it must honour return_token_ids (vLLM >= "
                                      "0.10.2, mtp-serve) for its template to be checked")
                if list(theirs) != mine:
                    at = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
                    show = lambda ids, at=at: f"{ids[at]} {tokenizer.decode([ids[at]])!r}" if at < len(ids) else \
                        "the end"
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
                 extra: Seq[dict[str, Any]] | None = None) -> list[GenerationOutput]:
        """The `Generator` call; `extra`: per request, further fields of its `/v1/completions` body (vLLM's
        `kv_transfer_params` for a capture)."""
        if isinstance(params, SamplingParams):
            raise TypeError("a Generator takes one SamplingParams per request (each with its own seed)")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if extra is not None and len(extra) != len(prompts):
            raise ValueError(f"{len(extra)} extra bodies for {len(prompts)} prompts")
        t0 = time.perf_counter()
        try:
            return asyncio.run(self._generate([list(p) for p in prompts], list(params), on_finish,
                                              list(extra) if extra is not None else None))
        finally:
            self._seconds += time.perf_counter() - t0

    def post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        """POST `body` to `path` (e.g. "/v1/completions") of the endpoint `url` (one of `endpoints`), retried like
        a generation request; its JSON answer. RemoteError when it refuses or keeps failing."""

        async def ask() -> Any:
            async with self._client() as client:
                return await self._retrying(client, url, "POST", f"{url}{path}", body)

        return asyncio.run(ask())

    # -------------------------------------------------------------------------------------------- internals

    def _client(self) -> httpx.AsyncClient:
        n = self.concurrency * len(self.endpoints)
        return httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, CONNECT_TIMEOUT)),
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    async def _retrying(self, client: httpx.AsyncClient, url: str, method: str, target: str, body: Any) -> Any:
        """One request to one endpoint, tried again on a retryable failure (for the few set-up requests)."""
        for failures in range(1, self.retries + 2):
            try:
                return await request_json(client, method, target, body)
            except Retryable as exc:
                if failures > self.retries:
                    raise RemoteError(f"gave up after {failures} tries: {exc}") from None
                self.retried += 1
                await asyncio.sleep(backoff_seconds(self.backoff, failures, exc.retry_after))
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

    def _output(self, url: str, prompt: list[int], p: SamplingParams, answer: Any) -> GenerationOutput:
        """The answer as our engine gives it (token ids with the stop token, "stop" | "length")."""
        choice = (answer.get("choices") or [{}])[0]
        ids = choice.get("token_ids")
        if ids is None:
            raise RemoteError(f"{url} returned no token_ids: it must honour return_token_ids (vLLM >= 0.10.2, "
                              "mtp-serve)")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != prompt:
            raise RemoteError(f"{url} did not take the prompt's token ids as sent (a server that re-tokenizes?)")
        reason = choice.get("finish_reason")
        if reason not in FINISH_REASONS:
            raise Retryable(f"{url}: finish reason {reason!r}")  # aborted by the server: ask again
        ids = [int(t) for t in ids]
        if reason == "stop" and not p.ignore_eos and (not ids or ids[-1] not in (p.stop_token_ids or [])):
            raise RemoteError(f"{url} stopped on a token that is not a stop token of ours ({ids[-1:] or 'none'}); "
                              "the server stops on something else (its own stop strings or EOS ids)")
        return GenerationOutput(prompt, ids, reason)

    async def _generate(self, prompts: list[list[int]], params: list[SamplingParams], on_finish: OnFinish | None,
                        extra: list[dict[str, Any]] | None = None) -> list[GenerationOutput]:
        results: list[GenerationOutput | None] = [None] * len(prompts)
        queue: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        for i in range(len(prompts)):
            queue.put_nowait((i, 0))
        left = len(prompts)
        workers = len(self.endpoints) * self.concurrency

        async def work(client: httpx.AsyncClient, url: str) -> None:
            nonlocal left
            failures = 0  # this worker's failures in a row
            while True:
                item = await queue.get()
                if item is None:
                    return
                i, tries = item
                try:
                    body = self.completion_body(prompts[i], params[i]) | (extra[i] if extra is not None else {})
                    answer = await request_json(client, "POST", f"{url}/v1/completions", body)
                    out = self._output(url, prompts[i], params[i], answer)
                except Retryable as exc:
                    if tries >= self.retries:
                        raise RemoteError(f"request {i} failed {tries + 1} times, the last: {exc}") from None
                    self.retried += 1
                    queue.put_nowait((i, tries + 1))  # for whichever endpoint is free
                    failures += 1
                    await asyncio.sleep(backoff_seconds(self.backoff, failures, exc.retry_after))
                    continue
                failures = 0
                results[i] = out
                self._prompt_tokens += len(out.prompt_ids)
                self._generated_tokens += len(out.output_ids)
                if on_finish is not None:
                    on_finish(i, out)
                left -= 1
                if left == 0:
                    for _ in range(workers):
                        queue.put_nowait(None)

        if not prompts:
            return []
        async with self._client() as client:
            tasks = [asyncio.create_task(work(client, url)) for url in self.endpoints for _ in range(self.concurrency)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return results  # type: ignore[return-value]


async def _models(urls: list[str]) -> list[list[dict[str, Any]]]:
    """Each endpoint's model cards; RemoteError for one that does not answer."""
    out = []
    async with httpx.AsyncClient(timeout=CONNECT_TIMEOUT) as client:
        for url in urls:
            try:
                body = await request_json(client, "GET", f"{url}/v1/models")
            except Retryable as exc:
                raise RemoteError(f"endpoint {url} is unreachable ({exc}); is the server running and listening "
                                  "there?") from None
            data = body.get("data") if isinstance(body, dict) else None
            if not isinstance(data, list):
                raise RemoteError(f"{url}/v1/models did not answer an OpenAI model list")
            out.append(data)
    return out
