"""Batched generation with continuous batching over the paged KV cache.

Scheduling (one `step` = one forward): waiting requests are admitted as soon as the batch has room
and the pool can hold them at their longest (prompt + max_new_tokens, counted as a reservation,
so a running sequence never runs out of pages and nothing needs preempting); an admission step
prefills the new prompts, otherwise every running sequence decodes one token. Finished sequences
free their pages at once, and the next step admits whoever waits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from mtp_train.engine.cuda_graphs import supports_graphs
from mtp_train.engine.kv_cache import KVCache, OutOfPagesError
from mtp_train.engine.runner import ModelRunner
from mtp_train.engine.sampling import SamplingBatch, SamplingParams, sample
from mtp_train.engine.sequence import SeqStatus, Sequence
from mtp_train.models.base import CausalLM


def graphs_wanted(flag: bool | None, model: CausalLM) -> bool:
    """Resolve `cuda_graphs`: None → on where they can run (CUDA, the FlashInfer backend, one GPU), else as asked.

    True on CPU runs the same padded fixed-shape steps eagerly (what tests use); True on CUDA with an attention
    backend that cannot be captured is an error that names the fix.
    """
    if flag is None:
        if model.device.type != "cuda" or not supports_graphs(model.attn):
            return False
        # A tensor-parallel target (its layers all-reduce over NCCL) stays eager unless asked.
        from mtp_train.models.tensor_parallel import RowParallelLinear

        return not any(isinstance(m, RowParallelLinear) for m in model.modules())
    if flag and model.device.type == "cuda" and not supports_graphs(model.attn):
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


class LLMEngine:
    """Greedy or sampled generation for many prompts through our model runner."""

    def __init__(self, model: CausalLM, *, num_pages: int | None = None, page_size: int = 16,
                 kv_cache_gb: float = 1.0, max_batch_size: int = 32, max_batch_tokens: int = 4096,
                 cuda_graphs: bool | None = None, kv: KVCache | None = None) -> None:
        self.model = model
        # kv: a page pool shared with other engines that never run at the same time (an evaluation's baseline
        # and methods, interleaved), instead of a pool of its own; num_pages / page_size / kv_cache_gb are unused.
        self.runner = (ModelRunner(model, kv) if kv is not None else
                       ModelRunner.create(model, num_pages=num_pages, page_size=page_size, kv_cache_gb=kv_cache_gb))
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._next_id = 0
        self.reset_stats()
        self.cuda_graphs = graphs_wanted(cuda_graphs, model)
        if self.cuda_graphs:
            self._enable_graphs()

    def _graphed_steps(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(new tokens per sequence, hidden layers returned) of the steps that replay graphs: decode steps."""
        return (1,), ()

    def _enable_graphs(self) -> None:
        """The `_graphed_steps` replay CUDA graphs from now on (`mtp_train.engine.cuda_graphs`)."""
        q_lens, layers = self._graphed_steps()
        self.runner.enable_graphs(self.max_batch_size, q_lens, layers, capture=self.model.device.type == "cuda")
        self.runner.kv.reserved += len(self.runner.scratch_pages)  # the padded rows' pages: out of the pool for good

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. after a warm-up generation)."""
        self.stats = GenerationStats()

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Seq[int], params: SamplingParams | None = None) -> Sequence:
        """Queue a request; raises OutOfPagesError if it could never fit in the pool."""
        seq = Sequence.new(self._next_id, list(prompt_ids), params, device=self.model.device)
        self._next_id += 1
        if seq.params.stop_token_ids is None and not seq.params.ignore_eos:
            seq.params.stop_token_ids = list(self.model.args.eos_token_ids)
        need = self.runner.kv.pages_for(self.reserve_tokens(seq))
        if need > self.runner.kv.num_pages:
            raise OutOfPagesError(
                f"request {seq.seq_id} needs {need} pages ({self.reserve_tokens(seq)} tokens at page size "
                f"{self.runner.kv.page_size}) but the pool has {self.runner.kv.num_pages}; raise num_pages/"
                "kv_cache_gb or lower max_new_tokens"
            )
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling -----------------------------------------------------------------------------
    def reserve_tokens(self, seq: Sequence) -> int:
        """Tokens of KV a sequence may ever occupy; its pages are reserved at admission."""
        return seq.max_len

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        tokens = 0
        kv = self.runner.kv
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            need = kv.pages_for(self.reserve_tokens(seq))
            if kv.reserved + need > kv.num_pages:
                break
            if admitted and tokens + len(seq) > self.max_batch_tokens:
                break
            self.waiting.popleft()
            kv.reserved += need
            tokens += len(seq)
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
        return admitted

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.runner.free(seq)
        self.runner.kv.reserved -= self.runner.kv.pages_for(self.reserve_tokens(seq))

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

    def step(self) -> list[Sequence]:
        """Run one forward (prefill of newly admitted prompts, else one decode step for all running).

        Returns the sequences that finished in this step.
        """
        admitted = self._admit()
        batch = admitted if admitted else self.running
        if not batch:
            return []
        out = self.runner.run(batch, logits="last")
        if admitted:
            self.stats.prefill_steps += 1
            self.stats.prompt_tokens += sum(len(s) for s in admitted)
            self.running.extend(admitted)
        else:
            self.stats.decode_steps += 1
        next_tokens = sample(out.logits, SamplingBatch([s.params for s in batch], [s.generator for s in batch]))
        finished = [seq for seq, tok in zip(batch, next_tokens.tolist()) if self._emit(seq, [tok])]
        if finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return finished

    @torch.inference_mode()
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 on_finish: Callable[[int, GenerationOutput], None] | None = None,
                 progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt (token ids); outputs come back in prompt order.

        params: one SamplingParams for all (prompt i seeded with seed + i), or one per prompt (seeds as
        given). on_finish(index, output) is called as
        each request completes (for streaming results to disk).
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
        index = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            index[self.add_request(prompt, p).seq_id] = i
        results: list[GenerationOutput | None] = [None] * len(prompts)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        t0 = time.perf_counter()
        while self.has_unfinished():
            for seq in self.step():
                res = GenerationOutput(seq.token_ids[: seq.num_prompt_tokens], seq.output_ids, seq.finish_reason)
                i = index[seq.seq_id]
                results[i] = res
                if on_finish:
                    on_finish(i, res)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{self.stats.generated_tokens / (time.perf_counter() - t0):.1f}")
        self.stats.seconds += time.perf_counter() - t0
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]
