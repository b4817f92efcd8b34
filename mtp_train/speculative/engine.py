"""Speculative decoding on our engine: `LLMEngine` (scheduler, page pool, seeds) running a speculative step.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al. 2023) lets a cheap proposer guess several tokens that the target then checks in one forward. An admission step
prefills the new prompts with the target, samples their first token and lets the proposer prefill too. Every other
step, for all running sequences at once (`SpeculativeStep._speculate`):

    draft    the proposer gives each sequence a draft tree (`mtp_train.speculative.tree`): a chain of k_b <= k
             tokens (greedy or sampled from its distribution q; a dynamic chain or prompt lookup may draft fewer,
             even none), or a head's tree (`tree_draft.TreeSpec`: EAGLE-2's dynamic tree, a static one, or
             `draft_width` candidates at the first position)
    verify   `tree.layout` puts [t_{L-1}, nodes..] into rows (`VerifyRows`: tokens, positions, slots L-1..); the
             runner takes them as its input (`VerifyRows.step_rows`), the sequences untouched, and the target runs
             them in one forward (each row seeing its ancestors) → a distribution p per row, and the hidden states
             the proposer reads
    accept   `tree.accept`: greedy, the longest path matching the target's argmax; sampled, the Leviathan/Chen
             rule over a chain, multi-candidate rejection sampling over a tree → the accepted path and the
             target's token after it
    commit   the path's K/V move to its positions (`KVCache.copy_token`, for a path off the first slots), the
             rest of the tree stays beyond the cached length, where later steps write over it; the scheduler's
             postprocess appends the emitted tokens and counts t_{L-1} and the path cached
    catch-up the proposer catches up along the path: a chain head in one forward over all the verify rows, with
             the verify's batch information, at once (`Proposer.after_verify`, the seed system's MTP step: it
             also gives the next first draft; rejected rows computed and discarded; for a greedy batch queued
             before acceptance is read on the host, `Proposer.catch_up_greedy`, since the argmax alone decides
             what it reads), other proposers after the scheduler's postprocess, for the sequences that go on
             (`Proposer.update`)

so every sequence advances by its own 1..k+1 tokens per target forward. The forwards return the target layers
the proposer names (`Proposer.hidden_layers`, e.g. an EAGLE-3 head's aux layers), concatenated, in place of the
final hidden it otherwise reads. Pages are reserved for prompt + max_new_tokens + 1 + the largest tree (or the
head's tree rows, when more), and the scheduler grows a sequence's pages to its length + that span before each
step, so a step never runs out of pages. Nothing here changes a `Sequence`: the scheduler alone does. Greedy
speculative output equals plain greedy output token for token (up to floating-point near-ties between the verify
and decode kernels).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from mtp_train.config.device import on_cuda
from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.llm import GenerationStats, LLMEngine, Step
from mtp_train.engine.runner import ModelRunner, StepRows
from mtp_train.engine.sampling import SamplingBatch, greedy_ids, sample
from mtp_train.engine.sequence import SeqStatus, Sequence
from mtp_train.models.base import CausalLM, ForwardOutput
from mtp_train.speculative.metrics import SpecMetrics
from mtp_train.speculative.proposers import Proposer
from mtp_train.speculative.tree import DraftTree, accept, layout


@dataclass
class SpecStats(GenerationStats):
    """GenerationStats plus the speculative counters and the draft / verify time split."""

    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forward + acceptance
    update_seconds: float = 0.0  # the proposer's catch-up after acceptance (with a chain head: the next first draft)
    metrics: SpecMetrics = field(default_factory=lambda: SpecMetrics(1))

    @property
    def verify_steps(self) -> int:
        """Speculative steps: every decode step of this engine drafts and verifies."""
        return self.decode_steps

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "prefill_steps": self.prefill_steps, "verify_steps": self.verify_steps, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s, "prefill_seconds": self.prefill_seconds,
                "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
                "update_seconds": self.update_seconds, **self.metrics.as_dict()}


@dataclass
class _CatchUp:
    """What the proposer reads after the scheduler appended a step's tokens, per sequence of the batch."""

    features: list[torch.Tensor]  # prefill: (prompt len, W) target rows; verify: (n+1, W) the root and the path
    lens: list[int] | None = None  # verify: L before the step
    trees: list[DraftTree] | None = None  # verify: the drafted trees
    paths: list[list[int]] | None = None  # verify: the accepted nodes
    done: bool = False  # the proposer caught up in the step itself (`Proposer.after_verify`): nothing left


class SpeculativeStep(Step):
    """The draft → verify → accept → commit step of `SpecEngine` (one prefill step for newly admitted prompts)."""

    def __init__(self, proposer: Proposer, k: int, *, use_flashinfer_sampling: bool = True) -> None:
        if k < 1:
            raise ValueError(f"k (draft tokens per step) must be >= 1, got {k}")
        self.proposer, self.k = proposer, k
        self.max_nodes = proposer.max_nodes(k)
        # A step holds t_{L-1}'s successor slots for the whole tree (and for a head's tree rows, which may be more)
        # before its rollback: slots L-1 .. L-1+span-1.
        self.span = max(1 + self.max_nodes, proposer.draft_slots(k))
        self.extra_tokens = self.span
        self.use_flashinfer_sampling = use_flashinfer_sampling
        self._pending: _CatchUp | None = None

    def bind(self, model: CausalLM, runner: ModelRunner) -> None:
        super().bind(model, runner)
        if self.proposer.drafts_trees and model.attn is not None and not model.attn.tree_steps:
            raise ValueError(f"a draft tree (draft_width > 1, or a tree with siblings) verifies several candidates "
                             f"at once, which the {model.attn.name} attention backend of this model cannot; use "
                             "draft_width=1 or a chain")
        self.fused = self.use_flashinfer_sampling and on_cuda(model.device)
        self.proposer.bind(runner.kv)

    def new_stats(self) -> SpecStats:
        return SpecStats(metrics=SpecMetrics(self.k))

    def graphed_steps(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Verify steps of k-token chains; steps where some sequence drafted fewer (a dynamic chain, prompt lookup)
        or a tree run eagerly."""
        return (self.k + 1,), tuple(self.proposer.hidden_layers)

    def enable_graphs(self, max_batch: int, scratch_pages: Seq[int], capture: bool) -> None:
        self.proposer.enable_graphs(max_batch, scratch_pages, capture, verify_rows=self.k + 1)

    def _features(self, out: ForwardOutput) -> torch.Tensor:
        """What the proposer reads of a target forward: (T, H) final hidden, or (T, k·H) its hidden_layers."""
        layers = self.proposer.hidden_layers
        return torch.cat([out.layers[j] for j in layers], -1) if layers else out.hidden

    def _sync(self) -> float:
        if on_cuda(self.model.device):
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter()

    def run(self, batch: list[Sequence], prefill: bool, stats: GenerationStats) -> list[list[int]]:
        assert isinstance(stats, SpecStats)
        return self._prefill(batch, stats) if prefill else self._speculate(batch, stats)

    def _prefill(self, seqs: list[Sequence], stats: SpecStats) -> list[list[int]]:
        t0 = self._sync()
        out = self.runner.forward(StepRows.uncached(seqs), logits="last", hidden_layers=self.proposer.hidden_layers)
        first = sample(out.logits, SamplingBatch([s.params for s in seqs], [s.generator for s in seqs])).tolist()
        self._pending = _CatchUp(list(self._features(out).split([len(s) for s in seqs])))
        stats.prefill_seconds += self._sync() - t0
        return [[t] for t in first]

    def _speculate(self, seqs: list[Sequence], stats: SpecStats) -> list[list[int]]:
        kv = self.runner.kv
        lens = [len(s) for s in seqs]
        # The scheduler grew every sequence's pages to len + span: the proposer writes into slots the verify fills.
        t0 = self._sync()
        trees = self.proposer.propose(seqs, self.k)  # draft
        self._check(trees)
        t1 = self._sync()
        rows = layout(trees, [s.token_ids[-1] for s in seqs], lens)  # verify: t_{L-1} (uncached) and the nodes
        step = rows.step_rows([s.pages for s in seqs])
        # Eager forwards share one build of the step's metadata: the verify's, then the head's over the same rows.
        meta = None if self.runner.graphs else step.metadata(kv.page_size, self.model.device)
        out = self.runner.forward(step, logits="all", hidden_layers=self.proposer.hidden_layers, meta=meta)
        features = self._features(out)
        caught_up, early, argmax = False, 0.0, None
        if all(s.params.greedy for s in seqs):
            # The catch-up reads nothing acceptance decides that the argmax does not: queued before the host reads
            # it (its time counts as the catch-up's; on a GPU, only its launch, the rest overlapping acceptance).
            argmax = greedy_ids(out.logits)  # once, for the catch-up and the acceptance
            tc = time.perf_counter()
            caught_up = self.proposer.catch_up_greedy(seqs, rows, step, meta, features, argmax)
            early = time.perf_counter() - tc
        accepted = accept(trees, out.logits, SamplingBatch([s.params for s in seqs], [s.generator for s in seqs]),
                          fused=self.fused, argmax=argmax)  # accept
        t2 = self._sync()

        for b, (s, a) in enumerate(zip(seqs, accepted)):
            stats.metrics.record(trees[b], a.path, s.seq_id)
            # The target's cache keeps t_{L-1} and the accepted path at their positions (the scheduler counts them
            # cached as it appends the tokens under its stop / length rules); the rest of the tree lies beyond.
            for src, dst in rows.moves(b, a.path):
                kv.copy_token(s.pages, src, dst)
        t3 = self._sync()
        if caught_up or self.proposer.after_verify(seqs, rows, step, meta, features, accepted):  # and next first draft
            self._pending = _CatchUp([], done=True)
            stats.update_seconds += self._sync() - t3 + early
        else:
            hidden = features.split(rows.rows)
            self._pending = _CatchUp([h[rows.path_rows(a.path)] for h, a in zip(hidden, accepted)], lens, trees,
                                     [a.path for a in accepted])
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1 - early
        return [a.tokens for a in accepted]

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def _check(self, trees: list[DraftTree]) -> None:
        if any(len(t) > self.max_nodes or max(t.depths, default=0) > self.k for t in trees):
            raise ValueError(f"proposer {self.proposer.name} drafted a tree of {max(map(len, trees))} nodes with "
                             f"k={self.k} (at most {self.max_nodes} nodes, depth k)")

    def postprocess(self, batch: list[Sequence], stats: GenerationStats) -> None:
        """The proposer forgets finished sequences and catches up on the others (prompt, or the accepted path,
        unless it did in the step)."""
        assert isinstance(stats, SpecStats)
        pending, self._pending = self._pending, None
        assert pending is not None
        keep = [b for b, s in enumerate(batch) if s.status is SeqStatus.RUNNING]
        for s in batch:
            if s.status is not SeqStatus.RUNNING:
                self.proposer.release(s)
        if not keep or pending.done:
            return
        t0 = self._sync()
        seqs = [batch[b] for b in keep]
        if pending.trees is None:  # a prefill: its rows read t_{i+1}, the first token included
            self.proposer.prefill(seqs, torch.cat([pending.features[b] for b in keep]))
            stats.prefill_seconds += self._sync() - t0
            return
        assert pending.lens is not None and pending.paths is not None
        self.proposer.update(seqs, [pending.lens[b] for b in keep], [pending.trees[b] for b in keep],
                             [pending.paths[b] for b in keep], [pending.features[b] for b in keep])
        stats.update_seconds += self._sync() - t0


class SpecEngine(LLMEngine):
    """Batched speculative generation: `generate(prompts, params)` as in LLMEngine, k drafts deep per step."""

    def __init__(self, model: CausalLM, proposer: Proposer, k: int, *, num_pages: int | None = None,
                 page_size: int = 16, kv_cache_gb: float = 1.0, max_batch_size: int = 32,
                 max_batch_tokens: int = 4096, use_flashinfer_sampling: bool = True,
                 cuda_graphs: bool | None = None, kv: KVCache | None = None) -> None:
        step = SpeculativeStep(proposer, k, use_flashinfer_sampling=use_flashinfer_sampling)
        super().__init__(model, num_pages=num_pages, page_size=page_size, kv_cache_gb=kv_cache_gb,
                         max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens, cuda_graphs=cuda_graphs,
                         kv=kv, step=step)
        self.spec = step  # the engine's step, typed

    @property
    def proposer(self) -> Proposer:
        return self.spec.proposer

    @property
    def k(self) -> int:
        return self.spec.k

    @property
    def stats(self) -> SpecStats:
        stats = self.scheduler.stats
        assert isinstance(stats, SpecStats)
        return stats
