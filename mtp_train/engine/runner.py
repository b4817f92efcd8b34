"""Model runner: turns a list of sequences into one packed forward over the paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from mtp_train.engine.cuda_graphs import StepGraphs
from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.sequence import Sequence
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.models.base import CausalLM, ForwardOutput


class ModelRunner:
    """Runs `model` over the uncached tokens of a batch of sequences.

    One call is one step of any kind: a prompt prefill (all tokens uncached), a decode step (one
    uncached token per sequence) or a verify step (several). Pages are grown as needed and each
    sequence's `num_cached` advances by the tokens it fed.
    """

    def __init__(self, model: CausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv = kv_cache
        self.device = model.device
        self.graphs: dict[tuple[int, tuple[int, ...]], StepGraphs] = {}  # (q, hidden_layers) → captured steps
        self.scratch_pages: list[int] = []  # the padded rows' pages, taken from the allocator by enable_graphs

    def enable_graphs(self, max_batch: int, q_lens: Seq[int] = (1,), hidden_layers: Seq[int] = (),
                      capture: bool = True) -> None:
        """Run steps of q new tokens per sequence (q in q_lens) through `StepGraphs` from now on.

        Takes the padded rows' scratch pages out of the allocator (enough for max(q_lens) tokens; callers that
        count pages count them: `len(runner.scratch_pages)`).
        hidden_layers: the layers such steps return (a step asking for others runs eagerly).
        """
        need = self.kv.pages_for(max(q_lens))
        if len(self.scratch_pages) < need:
            self.scratch_pages += self.kv.allocator.allocate(need - len(self.scratch_pages))
        layers = tuple(hidden_layers)
        pool = torch.cuda.graph_pool_handle() if capture else None

        def fn(ids: torch.Tensor, hidden: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            rows = torch.arange(ids.shape[0], device=ids.device)
            out = self.model(ids, meta, self.kv.layers, logits_indices=rows, hidden_layers=layers)
            assert out.logits is not None
            return (out.logits, out.hidden, *[out.layers[j] for j in layers])

        for q in q_lens:
            self.graphs[(q, layers)] = StepGraphs(fn, self.model.attn, self.kv, self.scratch_pages, q=q,
                                                  max_batch=max_batch, dtype=self.model.dtype, capture=capture,
                                                  device=self.device, pool=pool)

    def _graphed(self, seqs: Seq[Sequence], logits: str, hidden_layers: Seq[int]) -> StepGraphs | None:
        """The captured steps that can run this step (every sequence q uncached tokens), or None (eager)."""
        if not self.graphs or logits == "none":
            return None
        q = seqs[0].num_uncached
        graphs = self.graphs.get((q, tuple(hidden_layers)))
        if graphs is None or len(seqs) > graphs.max_batch or (logits == "last" and q != 1):
            return None
        if any(s.num_uncached != q for s in seqs):
            return None
        return graphs

    @classmethod
    def create(cls, model: CausalLM, num_pages: int | None = None, page_size: int = 16,
               kv_cache_gb: float = 1.0) -> ModelRunner:
        """Build a runner with its own page pool (`kv_pool`)."""
        return cls(model, kv_pool(model, num_pages, page_size, kv_cache_gb))

    def build_metadata(self, seqs: Seq[Sequence]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Grow pages and pack the uncached tokens: returns input_ids (T,) and the step's metadata."""
        qo_lens, kv_lens, tokens = [], [], []
        for s in seqs:
            n = s.num_uncached
            if n < 1:
                raise ValueError(f"sequence {s.seq_id} has no uncached token to run")
            self.kv.ensure(s.pages, len(s))
            qo_lens.append(n)
            kv_lens.append(len(s))
            tokens.extend(s.token_ids[s.num_cached:])
        meta = AttentionMetadata.build(qo_lens, kv_lens, [s.pages for s in seqs], self.kv.page_size, self.device)
        return torch.tensor(tokens, dtype=torch.long, device=self.device), meta

    @torch.inference_mode()
    def run(self, seqs: Seq[Sequence], logits: str = "last", hidden_layers: Seq[int] = (),
            tree: Seq[Seq[int]] | None = None) -> ForwardOutput:
        """Forward the uncached tokens of `seqs`.

        logits: "last" → (B, V) at each sequence's last token; "all" → (T, V) at every new token;
        "none" → no lm_head. Returned hidden is (T, H) over all new tokens, packed in `seqs` order.
        tree: None, or per sequence the parent of each uncached token (`AttentionMetadata.set_tree`): the tokens
        are then a tree in slot order (candidates verified side by side), and the step runs eagerly.
        """
        graphs = None if tree is not None else self._graphed(seqs, logits, hidden_layers)
        if graphs is not None:
            return self._run_graphed(graphs, seqs, hidden_layers)
        input_ids, meta = self.build_metadata(seqs)
        if tree is not None:
            meta.set_tree(tree)
        if logits == "last":
            idx = meta.qo_indptr[1:].long() - 1
        elif logits == "all":
            idx = torch.arange(meta.num_tokens, device=self.device)
        elif logits == "none":
            idx = None
        else:
            raise ValueError(f"logits must be last|all|none, got {logits!r}")
        out = self.model(input_ids, meta, self.kv.layers, logits_indices=idx, hidden_layers=hidden_layers)
        for s in seqs:
            s.num_cached = len(s)
        return out

    def _run_graphed(self, graphs: StepGraphs, seqs: Seq[Sequence], hidden_layers: Seq[int]) -> ForwardOutput:
        """A decode / verify step through the captured graphs: every new token's logits, as logits="all"."""
        for s in seqs:
            self.kv.ensure(s.pages, len(s))
        tokens = [t for s in seqs for t in s.token_ids[s.num_cached:]]
        logits, hidden, *layers = graphs.run(tokens, [len(s) for s in seqs], [s.pages for s in seqs])
        for s in seqs:
            s.num_cached = len(s)
        return ForwardOutput(hidden=hidden, layers=dict(zip(hidden_layers, layers)), logits=logits)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop tokens (and their cache entries) beyond num_tokens, e.g. rejected draft tokens."""
        del seq.token_ids[num_tokens:]
        seq.num_cached = min(seq.num_cached, num_tokens)
        self.kv.truncate(seq.pages, num_tokens)

    def free(self, seq: Sequence) -> None:
        """Give a finished sequence's pages back to the pool."""
        self.kv.truncate(seq.pages, 0)
        seq.num_cached = 0


@torch.inference_mode()
def prefill_hidden(model: CausalLM, token_lists: Seq[Seq[int]],
                   hidden_layers: Seq[int] = ()) -> ForwardOutput:
    """Cache-free packed prefill of several sequences (stage-one precompute): no pages, no lm_head.

    Returns hidden (T, H) after the final norm over all tokens, packed in order, plus the
    requested intermediate layers.
    """
    lens = [len(t) for t in token_lists]
    meta = AttentionMetadata.build(lens, device=model.device)
    ids = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long, device=model.device)
    return model(ids, meta, None, hidden_layers=hidden_layers)


def kv_pool(model: CausalLM, num_pages: int | None = None, page_size: int = 16, kv_cache_gb: float = 1.0) -> KVCache:
    """A page pool for `model`: num_pages pages, or as many as kv_cache_gb holds.

    The pool has the model's layout (`args.kv_layout`): K/V pages, or MLA's latent rows for DeepSeek-V2.
    """
    a = model.args
    layout = a.kv_layout
    if num_pages is None:
        per_token = KVCache.bytes_per_token(a.num_layers, layout, model.dtype)
        num_pages = max(1, int(kv_cache_gb * 2**30) // (per_token * page_size))
    return KVCache(a.num_layers, num_pages, page_size, layout, model.dtype, model.device)
