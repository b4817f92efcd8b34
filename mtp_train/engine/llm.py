"""Batched generation with continuous batching over the paged KV cache.

One `LLMEngine.step` is one forward and reads schedule → run → postprocess: the `Scheduler` picks the batch (newly
admitted prompts, else every running sequence) and reserves their pages, the engine's `Step` runs it and says which
tokens each sequence emits, and the scheduler appends them, finishing sequences at a stop token or max_new_tokens
(their pages free at once, and the next step admits whoever waits). A step reads its batch and changes no sequence:
the scheduler is the one place a sequence changes. Engines differ by their `Step` alone: plain
decoding (`DecodeStep`: one token per sequence) here, speculative decoding in `mtp_train.speculative.engine`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import torch

from mtp_train.config.device import on_cuda
from mtp_train.engine.cuda_graphs import supports_graphs
from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.runner import ModelRunner, StepRows
from mtp_train.engine.sampling import SamplingBatch, SamplingParams, sample
from mtp_train.engine.scheduler import GenerationStats, Scheduler
from mtp_train.engine.sequence import SeqStatus, Sequence
from mtp_train.models.base import CausalLM

__all__ = ["DecodeStep", "GenerationOutput", "GenerationStats", "LLMEngine", "Step", "graphs_wanted"]


def graphs_wanted(flag: bool | None, model: CausalLM) -> bool:
    """Resolve `cuda_graphs`: None → on where they can run (CUDA, the FlashInfer backend, one GPU), else as asked.

    True on CPU runs the same padded fixed-shape steps eagerly (what tests use); True on CUDA with an attention
    backend that cannot be captured is an error that names the fix.
    """
    if flag is None:
        if not on_cuda(model.device) or not supports_graphs(model.attn):
            return False
        # A tensor-parallel target (its layers all-reduce over NCCL) stays eager unless asked.
        from mtp_train.models.tensor_parallel import RowParallelLinear

        return not any(isinstance(m, RowParallelLinear) for m in model.modules())
    if flag and on_cuda(model.device) and not supports_graphs(model.attn):
        raise ValueError(f"cuda_graphs=True needs the flashinfer attention backend, the model runs "
                         f"{getattr(model.attn, 'name', type(model.attn).__name__)}; load it with "
                         "attention_backend=flashinfer (pip install 'mtp_train[gpu]') or set cuda_graphs=False")
    return bool(flag)


@dataclass
class GenerationOutput:
    """The result of one request."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"


class Step(ABC):
    """What an engine runs over the batch its scheduler picked: the one thing engines differ by.

    extra_tokens: KV rows a step may hold beyond a sequence's tokens: reserved at admission beyond its longest
    length, and in its pages before each step (`Scheduler.schedule`).
    """

    extra_tokens: int = 0
    model: CausalLM  # set by bind
    runner: ModelRunner

    def bind(self, model: CausalLM, runner: ModelRunner) -> None:
        """Called once by the engine, before anything runs: the target and its runner (and page pool)."""
        self.model, self.runner = model, runner

    def new_stats(self) -> GenerationStats:
        """The counters this step fills (the scheduler starts them afresh on `reset_stats`)."""
        return GenerationStats()

    def graphed_steps(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(new tokens per sequence, hidden layers returned) of the target steps that replay graphs: decode steps."""
        return (1,), ()

    def enable_graphs(self, max_batch: int, scratch_pages: Seq[int], capture: bool) -> None:
        """Graphs of the step's own forwards beyond the target's (a proposer's draft steps); none by default."""
        return None

    @abstractmethod
    def run(self, batch: list[Sequence], prefill: bool, stats: GenerationStats) -> list[list[int]]:
        """Forward the batch (prompts when prefill, else running sequences) → the tokens each one emits (one or
        more each).

        Reads the sequences and changes none of them (the scheduler's postprocess appends the tokens); leaves K/V
        in their pages for every token before the last one emitted, within the slots `schedule` grew the pages to.
        """

    def postprocess(self, batch: list[Sequence], stats: GenerationStats) -> None:
        """After the scheduler appended the tokens: sequences still running go on, the others finished."""
        return None

    def release(self, seq: Sequence) -> None:
        """A running sequence was aborted between steps (`LLMEngine.abort`): forget whatever the step keeps of it."""
        return None


class DecodeStep(Step):
    """Plain decoding: one sampled token per sequence and forward."""

    def run(self, batch: list[Sequence], prefill: bool, stats: GenerationStats) -> list[list[int]]:
        out = self.runner.forward(StepRows.uncached(batch), logits="last")
        tokens = sample(out.logits, SamplingBatch([s.params for s in batch], [s.generator for s in batch]))
        return [[t] for t in tokens.tolist()]


class LLMEngine:
    """Greedy or sampled generation for many prompts through our model runner.

    kv: a page pool shared with other engines that never run at the same time (an evaluation's baseline and
    methods, interleaved), instead of a pool of its own; num_pages / page_size / kv_cache_gb are then unused.
    step: what each step runs (default plain decoding); cuda_graphs: None = where they can run (`graphs_wanted`).
    """

    def __init__(self, model: CausalLM, *, num_pages: int | None = None, page_size: int = 16,
                 kv_cache_gb: float = 1.0, max_batch_size: int = 32, max_batch_tokens: int = 4096,
                 cuda_graphs: bool | None = None, kv: KVCache | None = None, step: Step | None = None) -> None:
        self.model = model
        self.runner = (ModelRunner(model, kv) if kv is not None else
                       ModelRunner.create(model, num_pages=num_pages, page_size=page_size, kv_cache_gb=kv_cache_gb))
        self.max_batch_size = max_batch_size
        self.stepper = step if step is not None else DecodeStep()
        self.stepper.bind(model, self.runner)
        self.scheduler = Scheduler(self.runner.kv, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                   extra_tokens=self.stepper.extra_tokens, new_stats=self.stepper.new_stats)
        self._next_id = 0
        self.cuda_graphs = graphs_wanted(cuda_graphs, model)
        if self.cuda_graphs:
            # the step's fixed-shape forwards replay CUDA graphs from now on (`mtp_train.engine.cuda_graphs`)
            q_lens, layers = self.stepper.graphed_steps()
            capture = on_cuda(model.device)
            self.runner.enable_graphs(max_batch_size, q_lens, layers, capture=capture)
            self.scheduler.hold(len(self.runner.scratch_pages))  # the padded rows' pages: out of the pool for good
            self.stepper.enable_graphs(max_batch_size, self.runner.scratch_pages, capture)

    @property
    def stats(self) -> GenerationStats:
        return self.scheduler.stats

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. after a warm-up generation)."""
        self.scheduler.reset_stats()

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    def reserve_tokens(self, seq: Sequence) -> int:
        """Tokens of KV a sequence may ever occupy; its pages are reserved at admission."""
        return self.scheduler.reserve_tokens(seq)

    def add_request(self, prompt_ids: Seq[int], params: SamplingParams | None = None) -> Sequence:
        """Queue a request; raises OutOfPagesError if it could never fit in the pool."""
        seq = Sequence.new(self._next_id, list(prompt_ids), params, device=self.model.device)
        self._next_id += 1
        if seq.params.stop_token_ids is None and not seq.params.ignore_eos:
            seq.params.stop_token_ids = list(self.model.args.eos_token_ids)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, seq: Sequence) -> bool:
        """Finish a request between steps (finish reason "abort"): its pages come back and the step forgets it.
        False when it had already finished."""
        running = seq.status is SeqStatus.RUNNING
        if not self.scheduler.abort(seq):
            return False
        if running:
            self.stepper.release(seq)
        return True

    def step(self) -> list[Sequence]:
        """One forward: schedule → run → postprocess. Returns the sequences that finished in it."""
        batch, prefill = self.scheduler.schedule()
        if not batch:
            return []
        stats = self.scheduler.stats
        tokens = self.stepper.run(batch, prefill, stats)
        finished = self.scheduler.postprocess(batch, tokens)
        self.stepper.postprocess(batch, stats)
        return finished
    @torch.inference_mode()
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 on_finish: Callable[[int, GenerationOutput], None] | None = None,
                 progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt (token ids); outputs come back in prompt order.

        params: one SamplingParams for all (prompt i seeded with seed + i), or one per prompt (seeds as
        given). on_finish(index, output) is called as each request completes (for streaming results to disk).
        Requests enter the engine through `stream`, a batch's worth ahead of the scheduler: the batches are the
        ones all prompts queued at once would give, without a `Sequence` per prompt up front.
        """
        if params is None or isinstance(params, SamplingParams):
            # One setting for all: prompt i is seeded with seed + i, so prompts never share a random stream
            # and a prompt's output does not depend on the batch it runs in.
            base = params or SamplingParams()
            params = [replace(base, seed=None if base.seed is None else base.seed + i,
                              stop_token_ids=None if base.stop_token_ids is None else list(base.stop_token_ids))
                      for i in range(len(prompts))]
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        results: list[GenerationOutput | None] = [None] * len(prompts)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        t0 = time.perf_counter()
        queued = 0

        def feed() -> list[tuple[Seq[int], SamplingParams, int]] | None:
            nonlocal queued
            if queued == len(prompts):
                return None
            end = min(queued + self.max_batch_size, len(prompts))
            batch = [(prompts[i], params[i], i) for i in range(queued, end)]
            queued = end
            return batch

        def finished(i: int, res: GenerationOutput) -> None:
            results[i] = res
            if on_finish:
                on_finish(i, res)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(tok_s=f"{self.stats.generated_tokens / (time.perf_counter() - t0):.1f}")

        try:
            self.stream(feed, finished)
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def stream(self, feed: Callable[[], Seq[tuple[Seq[int], SamplingParams, Any]] | None],
               on_finish: Callable[[Any, GenerationOutput], None]) -> None:
        """Generate for requests handed in as the run goes, until `feed` has no more and every one is answered.

        Before each step, while fewer than `max_batch_size` requests wait, `feed()` is asked for more: a list of
        (prompt ids, sampling params, tag) to queue now (empty: none ready yet; more may follow an answer), or None
        when none will ever come. on_finish(tag, output) is called as each request completes; it may make more
        requests ready for the next `feed()` (a dialogue's next turn). Keeping a batch's worth waiting gives the
        scheduler the batches that queuing everything at once would, while only the requests in flight are held.

        Raises RuntimeError when `feed` gives nothing while nothing is in flight and more is to come (it would
        wait forever).
        """
        inflight: dict[int, tuple[Sequence, Any]] = {}  # seq_id → (its sequence, the caller's tag)
        exhausted = False
        t0 = time.perf_counter()
        try:
            while True:
                while not exhausted and len(self.waiting) < self.max_batch_size:
                    got = feed()
                    if got is None:
                        exhausted = True
                    elif not got:
                        break
                    else:
                        for prompt, p, tag in got:
                            seq = self.add_request(prompt, p)
                            inflight[seq.seq_id] = (seq, tag)
                if not self.has_unfinished():
                    if exhausted:
                        return
                    raise RuntimeError("the feed gave no request while none was in flight")
                for seq in self.step():
                    res = GenerationOutput(seq.token_ids[: seq.num_prompt_tokens], seq.output_ids, seq.finish_reason)
                    on_finish(inflight.pop(seq.seq_id)[1], res)
        except BaseException:
            # A stopped run (an error in a callback, Ctrl-C) leaves nothing queued: the engine stays usable.
            for seq, _ in inflight.values():
                self.abort(seq)
            raise
        finally:
            self.stats.seconds += time.perf_counter() - t0
