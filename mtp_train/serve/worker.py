"""One thread steps the engine; request handlers enqueue their requests and await what it publishes.

The engine is not thread-safe and need not be: `EngineWorker` alone touches it. A handler `submit`s a prompt and its
sampling (from the event loop's thread); the worker admits every request waiting in its inbox before each step, so
requests that arrive together are prefilled and decoded together by our scheduler (continuous batching), and after
each step it posts each request's new token ids, then its finish, to the handler's asyncio queue. An aborted
request (its client went away, a stop string appeared) is finished between steps and its pages come back. A request
whose rows cannot be sampled (`SamplingError`) fails alone: the step changed no sequence (`Step.run`'s contract), so
it is aborted and the others step again; any other failed step fails every request it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from mtp_train.engine.kv_cache import OutOfPagesError
from mtp_train.engine.llm import LLMEngine
from mtp_train.engine.sampling import SamplingError, SamplingParams
from mtp_train.engine.sequence import SeqStatus, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tokens:
    """New token ids of a request (one step's worth)."""

    ids: list[int]


@dataclass(frozen=True)
class Finished:
    """The request is over: "stop" | "length" | "abort", and its speculative counters when a head drafts
    (verify steps, accepted draft tokens)."""

    reason: str
    spec_steps: int = 0
    spec_accepted: int = 0


@dataclass(frozen=True)
class Failed:
    """The request was refused or its step failed: an HTTP status and a message for the client."""

    status: int
    message: str


Event = Tokens | Finished | Failed


@dataclass
class Request:
    """One request in flight: what the worker reads, and where it posts what happens to it."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None  # set by the worker once admitted to the engine
    sent: int = 0  # output tokens posted so far

    def post(self, event: Event) -> None:
        """Hand an event to the handler's loop (from the worker's thread)."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits this request any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class WorkerCounters:
    """What the worker did, for `/metrics`."""

    steps: int = 0  # engine steps
    batched: int = 0  # sequences summed over the steps (batched / steps: the mean batch)
    max_batch: int = 0  # the largest batch of one step
    finished: int = 0  # requests finished by the engine
    aborted: int = 0
    failed: int = 0  # requests whose step raised


class EngineWorker:
    """The engine's one thread: admits submitted requests, steps, publishes tokens and finishes.

    Args:
        engine: `LLMEngine` or `SpecEngine` over the loaded target.
        vocab_size: the target's vocabulary; prompt ids outside it are refused (they would fail the whole step).
    """

    def __init__(self, engine: LLMEngine, vocab_size: int) -> None:
        self.engine = engine
        self.vocab_size = vocab_size
        self.counters = WorkerCounters()
        self._inbox: queue.Queue[Request | None] = queue.Queue()
        self._aborts: queue.Queue[Request] = queue.Queue()
        self._active: dict[int, Request] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet taken by the worker."""
        return self._inbox.qsize()

    @property
    def running(self) -> int:
        """Requests in the engine (waiting for pages or decoding)."""
        return len(self._active)

    def submit(self, prompt: Seq[int], params: SamplingParams) -> Request:
        """Queue a request from the event loop's thread; await its `events`."""
        req = Request(list(prompt), params, asyncio.get_running_loop())
        self._inbox.put(req)
        return req

    def abort(self, req: Request) -> None:
        """Finish a request early (thread-safe); its handler has stopped listening."""
        self._aborts.put(req)
        self._inbox.put(None)  # wake an idle worker

    def start(self) -> EngineWorker:
        """Start the engine thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread after its current step; requests in flight are failed."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join()
        for req in list(self._active.values()):
            req.post(Failed(503, "the server is shutting down"))
        self._active.clear()

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._take(block=not engine.has_unfinished())
            self._abort()
            if self._stop.is_set() or not engine.has_unfinished():
                continue
            try:
                engine.step()
            except SamplingError as exc:  # those rows' requests fail; the rest run again in the next step
                log.warning("sampling failed: %s", exc)
                self._fail_rows(exc)
                continue
            except Exception as exc:  # a failed step must not kill the server: fail what it held
                log.exception("engine step failed")
                self._fail_all(f"the engine step failed: {type(exc).__name__}: {exc}")
                continue
            batch = self._publish()
            c = self.counters
            c.steps += 1
            c.batched += batch
            c.max_batch = max(c.max_batch, batch)

    def _take(self, block: bool) -> None:
        """Admit every submitted request (waiting for one when the engine is idle)."""
        while True:
            try:
                req = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if req is None:
                continue
            bad = next((t for t in req.prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                req.post(Failed(400, f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"))
                continue
            try:
                seq = self.engine.add_request(req.prompt, req.params)
            except (OutOfPagesError, ValueError) as exc:
                req.post(Failed(400, str(exc)))
                continue
            req.seq = seq
            self._active[seq.seq_id] = req

    def _abort(self) -> None:
        while True:
            try:
                req = self._aborts.get_nowait()
            except queue.Empty:
                return
            if req.seq is not None and self._active.pop(req.seq.seq_id, None) is not None:
                self.engine.abort(req.seq)
                self._spec_counts(req.seq)
                self.counters.aborted += 1

    def _spec_counts(self, seq: Sequence) -> tuple[int, int]:
        """(verify steps, accepted draft tokens) of a finished sequence, taken out of the engine's counters (a
        server's counters would otherwise grow with every request it ever answered)."""
        metrics = getattr(self.engine.stats, "metrics", None)
        if metrics is None:
            return 0, 0
        steps, accepted = metrics.by_request.pop(seq.seq_id, (0, 0))
        return steps, accepted

    def _publish(self) -> int:
        """Post every active request's new tokens, and the finish of those that are done; return how many
        requests the step advanced (its batch)."""
        advanced = 0
        for sid, req in list(self._active.items()):
            seq = req.seq
            assert seq is not None
            out = seq.output_ids
            if len(out) > req.sent:
                req.post(Tokens(out[req.sent:]))
                req.sent = len(out)
                advanced += 1
            if seq.status is SeqStatus.FINISHED:
                del self._active[sid]
                steps, accepted = self._spec_counts(seq)
                req.post(Finished(seq.finish_reason or "stop", steps, accepted))
                self.counters.finished += 1
        return advanced

    def _fail_rows(self, exc: SamplingError) -> None:
        """Fail the requests whose sampling parameters are `exc.params` (by identity), and only those; every request
        when none of them is ours (stepping again would fail again)."""
        failing = {id(p) for p in exc.params}
        if not any(r.seq is not None and id(r.seq.params) in failing for r in self._active.values()):
            self._fail_all(f"the engine step failed: {exc}")
            return
        for sid, req in list(self._active.items()):
            seq = req.seq
            if seq is None or id(seq.params) not in failing:
                continue
            self.engine.abort(seq)
            self._spec_counts(seq)
            del self._active[sid]
            req.post(Failed(500, f"sampling this request failed: {exc}"))
            self.counters.failed += 1

    def _fail_all(self, message: str) -> None:
        for req in list(self._active.values()):
            if req.seq is not None:
                try:
                    self.engine.abort(req.seq)
                except Exception:  # noqa: BLE001 (the engine is in an unknown state; the request fails either way)
                    log.exception("could not abort request %d", req.seq.seq_id)
            req.post(Failed(500, message))
            self.counters.failed += 1
        self._active.clear()

    def describe(self) -> dict[str, Any]:
        """The counters, as plain values."""
        c = self.counters
        return {"steps": c.steps, "batched": c.batched, "max_batch": c.max_batch, "finished": c.finished,
                "aborted": c.aborted, "failed": c.failed, "running": self.running, "waiting": self.waiting}
