"""Speculative decoding on our engine: one scheduler and one page allocation for target and proposer.

`SpecEngine` is `LLMEngine` (continuous batching, page reservation, per-request seeds) with a speculative
step. An admission step prefills the new prompts with the target, samples their first token and lets the
proposer prefill too. Every other step, for all running sequences at once:

    draft    the proposer guesses d_1..d_k_b, k_b <= k per sequence (greedy, or sampled from its filtered
             distribution q; a dynamic chain or prompt lookup may draft fewer, even none)
    verify   the target runs [t_{L-1}, d_1..d_k_b] in one forward → k_b+1 distributions p (and hidden states);
             a proposer may add alternatives a_2..a_w for d_1 (greedy sequences), verified in the same forward as
             a tree (each alternative a child of t_{L-1}, rows after the chain)
    accept   greedy: the longest prefix equal to the target's argmax, then the target's token (or, when d_1
             missed, the alternative equal to the target's token and the target's token after it);
             sampled: the Leviathan/Chen rule (`mtp_train.speculative.acceptance`) with the request's generator
    rollback the rejected drafts leave the sequence and the target's cache; the proposer catches up

so every sequence advances by its own 1..k+1 tokens per target forward. The prefill and verify forwards return
the target layers the proposer names (`Proposer.hidden_layers`, e.g. an EAGLE-3 head's aux layers), concatenated,
in place of the final hidden it otherwise reads; a proposer that names none costs no extra copy. Pages are
reserved for prompt + max_new_tokens + k + 1 tokens, so a step never runs out of pages. Greedy speculative output
equals plain greedy output token for token (up to floating-point near-ties between the verify and decode kernels).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.llm import GenerationStats, LLMEngine, graphs_wanted
from mtp_train.engine.sampling import SamplingBatch, filtered_probs, sample
from mtp_train.engine.sequence import SeqStatus, Sequence
from mtp_train.models.base import CausalLM, ForwardOutput
from mtp_train.speculative.acceptance import accept_greedy, accept_stochastic, accept_stochastic_flashinfer
from mtp_train.speculative.metrics import SpecMetrics
from mtp_train.speculative.proposers import Proposal, Proposer

METHODS = ("none", "mtp", "draft", "ngram")


@dataclass
class SpecStats(GenerationStats):
    """GenerationStats plus the speculative counters and the draft / verify time split."""

    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forward + acceptance
    update_seconds: float = 0.0  # the proposer's catch-up after acceptance
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


class SpecEngine(LLMEngine):
    """Batched speculative generation: `generate(prompts, params)` as in LLMEngine, k drafts per step."""

    def __init__(self, model: CausalLM, proposer: Proposer, k: int, *, num_pages: int | None = None,
                 page_size: int = 16, kv_cache_gb: float = 1.0, max_batch_size: int = 32,
                 max_batch_tokens: int = 4096, use_flashinfer_sampling: bool = True,
                 cuda_graphs: bool | None = None, kv: KVCache | None = None) -> None:
        if k < 1:
            raise ValueError(f"k (draft tokens per step) must be >= 1, got {k}")
        self.k = k  # before the base constructor: its reset_stats() sizes the metrics by k
        super().__init__(model, num_pages=num_pages, page_size=page_size, kv_cache_gb=kv_cache_gb,
                         max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens, cuda_graphs=False, kv=kv)
        self.proposer = proposer
        if proposer.max_alternatives and model.attn is not None and not model.attn.tree_steps:
            raise ValueError(f"first-draft alternatives (draft_width > 1) verify a tree of candidates, which the "
                             f"{model.attn.name} attention backend of this model cannot; use draft_width=1")
        proposer.bind(self.runner.kv)
        self.use_flashinfer_sampling = use_flashinfer_sampling and model.device.type == "cuda"
        self.cuda_graphs = graphs_wanted(cuda_graphs, model)
        if self.cuda_graphs:
            self._enable_graphs()

    def _graphed_steps(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Verify steps of k drafts per sequence; steps where some sequence drafted fewer (a dynamic chain, prompt
        lookup) run eagerly."""
        return (self.k + 1,), tuple(self.proposer.hidden_layers)

    def _enable_graphs(self) -> None:
        """The verify steps replay CUDA graphs, and so do the proposer's draft steps."""
        super()._enable_graphs()
        self.proposer.enable_graphs(self.max_batch_size, self.runner.scratch_pages, self.model.device.type == "cuda")

    def reset_stats(self) -> None:
        self.stats = SpecStats(metrics=SpecMetrics(self.k))

    def reserve_tokens(self, seq: Sequence) -> int:
        # A step may hold k drafts (and the proposer's first-draft alternatives) beyond the last token before the
        # rollback.
        return seq.max_len + self.k + 1 + self.proposer.max_alternatives

    def _finish(self, seq: Sequence, reason: str) -> None:
        super()._finish(seq, reason)
        self.proposer.release(seq)

    def _features(self, out: ForwardOutput) -> torch.Tensor:
        """What the proposer reads of a target forward: (T, H) final hidden, or (T, k·H) its hidden_layers."""
        layers = self.proposer.hidden_layers
        return torch.cat([out.layers[j] for j in layers], -1) if layers else out.hidden

    def _sync(self) -> float:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter()

    def step(self) -> list[Sequence]:
        """One prefill of newly admitted prompts, else one draft → verify → accept step for all running."""
        admitted = self._admit()
        if admitted:
            return self._prefill(admitted)
        if not self.running:
            return []
        finished = self._speculate(self.running)
        if finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return finished

    def _prefill(self, seqs: list[Sequence]) -> list[Sequence]:
        t0 = self._sync()
        out = self.runner.run(seqs, logits="last", hidden_layers=self.proposer.hidden_layers)
        first = sample(out.logits, SamplingBatch([s.params for s in seqs], [s.generator for s in seqs])).tolist()
        for s, tok in zip(seqs, first):
            s.token_ids.append(tok)
        self.proposer.prefill(seqs, self._features(out))  # its rows read t_{i+1}, the first token included
        self.stats.prefill_steps += 1
        self.stats.prompt_tokens += sum(s.num_prompt_tokens for s in seqs)
        finished = []
        for s, tok in zip(seqs, first):
            s.token_ids.pop()  # emitted again through _emit, which applies the stop / length rules
            if self._emit(s, [tok]):
                finished.append(s)
            else:
                self.running.append(s)
        self.stats.prefill_seconds += self._sync() - t0
        return finished

    def _accept(self, seqs: Seq[Sequence], proposal: Proposal, logits: list[torch.Tensor]
                ) -> tuple[list[int], list[list[int]], list[int | None]]:
        """proposal: k_b drafts (and a_b first-draft alternatives) per sequence; logits: (B,) each (1+k_b+a_b, V)
        → (accepted n, emitted tokens, the index of the accepted alternative or None) per sequence.

        Sequences are verified in groups of equal draft length, each group as one batch. A greedy sequence whose
        chain's first draft missed takes an alternative equal to the target's token, and the target's token after
        that alternative (its own row) as the bonus.
        """
        num = [0] * len(seqs)
        tokens: list[list[int]] = [[] for _ in seqs]
        taken: list[int | None] = [None] * len(seqs)
        groups: dict[tuple[bool, int], list[int]] = {}
        for b, (s, d) in enumerate(zip(seqs, proposal.tokens)):
            if proposal.alternatives_of(b) and not (s.params.greedy and d):
                raise ValueError(f"proposer {self.proposer.name} gave first-draft alternatives to a sampled "
                                 "sequence or one without a chain; they are verified greedily only")
            groups.setdefault((s.params.greedy, len(d)), []).append(b)
        for (greedy, k_b), rows in groups.items():
            drafts = torch.tensor([proposal.tokens[b] for b in rows], dtype=torch.long,
                                  device=logits[0].device).view(len(rows), k_b)
            if greedy:
                res = accept_greedy(drafts, torch.stack([logits[b][:k_b + 1] for b in rows]))
                for b, n, t in zip(rows, res.num_accepted, res.tokens):
                    num[b], tokens[b] = n, t
                    alts = proposal.alternatives_of(b)
                    if n == 0 and t[0] in alts:  # the target's token is a runner-up: accept it, bonus after it
                        i = alts.index(t[0])
                        num[b], taken[b] = 1, i
                        tokens[b] = [t[0], int(logits[b][1 + k_b + i].argmax())]
                continue
            # FlashInfer's fused kernel draws from one generator for the batch: it fits unseeded requests only.
            fused = self.use_flashinfer_sampling and k_b > 0 and all(seqs[b].generator is None for b in rows)
            # groups of positions into `rows`: the whole group at once when fused, else one sequence at a time
            for pos in [list(range(len(rows)))] if fused else [[i] for i in range(len(rows))]:
                group = [rows[i] for i in pos]
                p = torch.stack([filtered_probs(logits[b], seqs[b].params.temperature, seqs[b].params.top_k,
                                                seqs[b].params.top_p) for b in group])  # (G, k_b+1, V)
                q = torch.stack([_draft_probs(proposal, b, p.shape[-1]) for b in group]).to(p.device)  # (G, k_b, V)
                d = drafts[pos].to(p.device)
                res = (accept_stochastic_flashinfer(d, q, p) if fused
                       else accept_stochastic(d, q, p, [seqs[b].generator for b in group]))
                for b, n, t in zip(group, res.num_accepted, res.tokens):
                    num[b], tokens[b] = n, t
        return num, tokens, taken

    def _speculate(self, seqs: list[Sequence]) -> list[Sequence]:
        k, kv = self.k, self.runner.kv
        lens = [len(s) for s in seqs]
        for s in seqs:
            # the proposer writes into pages the verify then fills (alternatives add rows after the chain)
            kv.ensure(s.pages, len(s) + k + self.proposer.max_alternatives)

        t0 = self._sync()
        proposal = self.proposer.propose(seqs, k)
        drafted = proposal.lengths
        alts = [proposal.alternatives_of(b) for b in range(len(seqs))]
        if any(d > k for d in drafted) or any(len(a) > self.proposer.max_alternatives for a in alts):
            raise ValueError(f"proposer {self.proposer.name} drafted {max(drafted)} tokens with k={k} (and at most "
                             f"{max(map(len, alts))} alternatives with max_alternatives "
                             f"{self.proposer.max_alternatives})")
        t1 = self._sync()
        for s, d, a in zip(seqs, proposal.tokens, alts):
            s.token_ids.extend(d + a)
        # Verified rows per sequence: the last token, the chain, then the alternatives, each a child of the last
        # token (a tree step when there are any: rows see only their ancestors).
        tree = ([[-1, *range(d), *[0] * len(a)] for d, a in zip(drafted, alts)] if any(alts) else None)
        # (Σ (1+k_b+a_b), V): each sequence's last token, drafts and alternatives
        out = self.runner.run(seqs, logits="all", hidden_layers=self.proposer.hidden_layers, tree=tree)
        rows = [1 + d + len(a) for d, a in zip(drafted, alts)]
        logits = list(out.logits.split(rows))
        num, emitted, taken = self._accept(seqs, proposal, logits)
        t2 = self._sync()

        finished, alive, alive_idx = [], [], []
        for b, (s, n_tok, n) in enumerate(zip(seqs, lens, num)):
            self.stats.metrics.add(n, drafted[b], len(alts[b]), taken[b] is not None)
            if taken[b] is not None:
                # The accepted alternative's K/V sit in its own row's slot; position L's slot must hold them.
                kv.copy_token(s.pages, n_tok + drafted[b] + taken[b], n_tok)
            # Roll back: the drafts leave the token list (the accepted ones come back through _emit, which
            # applies the stop / length rules) but the cache keeps t_{L-1} and the n accepted drafts.
            del s.token_ids[n_tok:]
            kv.truncate(s.pages, n_tok + n)
            if self._emit(s, emitted[b]):
                finished.append(s)
                continue
            # The target's cache keeps t_{L-1} and the accepted drafts; the new token stays uncached.
            s.num_cached = n_tok + n
            alive.append(s)
            alive_idx.append(b)
        self.stats.decode_steps += 1
        if alive:
            hidden = self._features(out).split(rows)
            feats, verified = [], []
            for b in alive_idx:
                if taken[b] is None:
                    feats.append(hidden[b][:drafted[b] + 1])
                    verified.append(drafted[b])
                else:  # the proposer sees the path it took: the last token, then the accepted alternative
                    r = 1 + drafted[b] + taken[b]
                    feats.append(torch.cat([hidden[b][:1], hidden[b][r:r + 1]]))
                    verified.append(1)  # and none of its own chain rows (they followed another first draft)
            self.proposer.update(alive, [lens[b] for b in alive_idx], [num[b] for b in alive_idx], feats, verified)
        t3 = self._sync()
        self.stats.draft_seconds += t1 - t0
        self.stats.verify_seconds += t2 - t1
        self.stats.update_seconds += t3 - t2
        return finished


def _draft_probs(proposal: Proposal, b: int, vocab_size: int) -> torch.Tensor:
    """q (k_b, V) of sequence b: the proposer's distributions, or one-hot at its drafts when it is deterministic."""
    q = proposal.probs[b]
    if q is not None:
        return q
    d = torch.tensor(proposal.tokens[b], dtype=torch.long)
    return torch.zeros(len(d), vocab_size).scatter_(1, d.view(-1, 1), 1.0)
