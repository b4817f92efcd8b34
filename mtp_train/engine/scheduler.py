"""Who runs next: admission, page reservation and the counters of one engine (nano-vllm's `scheduler.py` split).

An engine step reads schedule → run → postprocess. `Scheduler.schedule` admits waiting requests while the batch has
room and the page pool can promise each its longest length (`reserve_tokens`: prompt + max_new_tokens, plus the rows
a step may hold beyond it, e.g. a speculative step's draft tree): an admission step prefills the admitted prompts,
any other step runs every running sequence; the batch's pages grow to hold what the step may write. The step reads
the sequences and changes none of them. `Scheduler.postprocess` appends what the step produced under the stop /
length rules, counts the step's K/V as cached and finishes sequences, whose pages and reservation come back at once:
the scheduler is the one place a `Sequence` changes.

Reservations are counted in the pool (`KVCache.reserved`), not here, so engines sharing one pool (an evaluation's
baseline and methods) admit against one count. Every admitted sequence is promised its pages for its whole life, so
a step never runs out of pages and nothing is ever preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from mtp_train.engine.kv_cache import KVCache, OutOfPagesError
from mtp_train.engine.sequence import SeqStatus, Sequence


@dataclass
class GenerationStats:
    """Counters of a generate call."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class Scheduler:
    """The waiting queue, the running batch and their pages over one (possibly shared) pool.

    kv: the page pool; max_batch_size: running sequences at most; max_batch_tokens: prompt tokens one admission
    step prefills at most (the first admitted prompt always fits); extra_tokens: KV rows a step may hold beyond a
    sequence's longest length, reserved with it; new_stats: the counters `reset_stats` starts (an engine's own
    kind of `GenerationStats`).
    """

    def __init__(self, kv: KVCache, *, max_batch_size: int, max_batch_tokens: int, extra_tokens: int = 0,
                 new_stats: Callable[[], GenerationStats] = GenerationStats) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.kv = kv
        self.max_batch_size, self.max_batch_tokens, self.extra_tokens = max_batch_size, max_batch_tokens, extra_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.new_stats = new_stats
        self.stats = new_stats()

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. after a warm-up generation)."""
        self.stats = self.new_stats()

    def reserve_tokens(self, seq: Sequence) -> int:
        """Tokens of KV a sequence may ever occupy; its pages are reserved at admission."""
        return seq.max_len + self.extra_tokens

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + max_new_tokens) `add` takes: the pool's tokens less a step's extra rows."""
        return self.kv.num_pages * self.kv.page_size - self.extra_tokens

    def hold(self, num_pages: int) -> None:
        """Keep pages out of every engine's admission for good (e.g. a CUDA-graph step's scratch pages)."""
        self.kv.reserved += num_pages

    def add(self, seq: Sequence) -> None:
        """Queue a request; raises OutOfPagesError if it could never fit in the pool."""
        need = self.kv.pages_for(self.reserve_tokens(seq))
        if need > self.kv.num_pages:
            raise OutOfPagesError(
                f"request {seq.seq_id} needs {need} pages ({self.reserve_tokens(seq)} tokens at page size "
                f"{self.kv.page_size}) but the pool has {self.kv.num_pages}; raise num_pages/kv_cache_gb or lower "
                "max_new_tokens"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The batch of the next step and whether it is a prefill: newly admitted prompts, else every running
        sequence (empty when nothing runs). Each one's pages hold its tokens and extra_tokens slots after them,
        all a step may write (within its reservation: a running sequence is shorter than its longest length)."""
        admitted = self._admit()
        if admitted:
            self.running.extend(admitted)
            self.stats.prefill_steps += 1
            self.stats.prompt_tokens += sum(len(s) for s in admitted)
            batch, prefill = admitted, True
        else:
            if self.running:
                self.stats.decode_steps += 1
            batch, prefill = self.running, False
        for s in batch:
            self.kv.ensure(s.pages, len(s) + self.extra_tokens)
        return batch, prefill

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        tokens = 0
        kv = self.kv
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            need = kv.pages_for(self.reserve_tokens(seq))
            if kv.reserved + need > kv.num_pages:
                break  # promised to running sequences (of this engine or another on the pool)
            if admitted and tokens + len(seq) > self.max_batch_tokens:
                break
            self.waiting.popleft()
            kv.reserved += need
            tokens += len(seq)
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
        return admitted

    def postprocess(self, batch: Seq[Sequence], tokens: Seq[Seq[int]]) -> list[Sequence]:
        """Append each sequence's new tokens (tokens: (B,) each 1 or more) and return those that finished.

        A step leaves K/V in a sequence's pages for all its tokens before the last one it emitted (a decode step:
        the token it fed; a verify step: the last token and the accepted drafts), so a sequence that goes on has
        every token but its newest cached.
        """
        finished = []
        for s, new in zip(batch, tokens, strict=True):
            if not new:
                raise ValueError(f"a step emitted no token for sequence {s.seq_id}")
            if self._emit(s, new):
                finished.append(s)
            else:
                s.num_cached = len(s) - 1
        if finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return finished

    def _emit(self, seq: Sequence, tokens: Seq[int]) -> bool:
        """Append generated tokens one by one until a stop token or max_new_tokens; True if seq finished.

        Tokens after the stop are dropped (a speculative step may emit several at once).
        """
        p = seq.params
        for tok in tokens:
            seq.token_ids.append(tok)
            self.stats.generated_tokens += 1
            if not p.ignore_eos and p.stop_token_ids and tok in p.stop_token_ids:
                self._finish(seq, "stop")
                return True
            if len(seq.output_ids) >= p.max_new_tokens:
                self._finish(seq, "length")
                return True
        return False

    def abort(self, seq: Sequence) -> bool:
        """Finish a waiting or running request now (finish reason "abort"), between steps: a server's client went
        away or its stop string appeared. Its pages and reservation come back at once. False when it had already
        finished."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
            return True
        if seq.status is SeqStatus.RUNNING:
            self._finish(seq, "abort")
            self.running = [s for s in self.running if s is not seq]
            return True
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        """The sequence's pages go back to the pool, and its reservation with them."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.truncate(seq.pages, 0)
        seq.num_cached = 0
        self.kv.reserved -= self.kv.pages_for(self.reserve_tokens(seq))
