"""Model runner: one packed forward over the paged KV cache, of the rows a step names (`StepRows`).

The runner reads its input and writes K/V into the pages it is given; it changes no `Sequence`. An engine's step
builds the rows (`StepRows.uncached` for a prefill or decode step, `VerifyRows.step_rows` for a speculative verify
step) and the scheduler alone changes a sequence: `schedule` grows its pages, `postprocess` appends the tokens a
step emitted and counts its cache (`mtp_train.engine.scheduler`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from mtp_train.engine.cuda_graphs import StepGraphs
from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.sequence import Sequence
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.models.base import CausalLM, ForwardOutput


@dataclass(frozen=True)
class StepRows:
    """The rows of one packed forward: per sequence its new tokens, the slots they take and its pages.

    Sequence b's q_b tokens take slots starts[b] .. starts[b]+q_b-1 of its pages (slot j: page pages[b][j //
    page_size], offset j % page_size) and attend to the slots before them (its cached prefix) and, causally or
    along `tree`, to each other; a token is rotated to its slot, or in a tree to starts[b] + its depth.
    """

    tokens: list[list[int]]  # (B,) each (q_b,) token ids, in slot order
    starts: list[int]  # (B,) the slot of each sequence's first row (the length of its cached prefix)
    pages: list[list[int]]  # (B,) each sequence's page ids, enough for starts[b] + q_b slots
    tree: list[list[int]] | None = None  # (B,) each (q_b,) a row's parent among its sequence's rows, -1 for the
    # first (`AttentionMetadata.set_tree`); None: causal

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.starts) == len(self.pages):
            raise ValueError(f"rows of {len(self.tokens)} sequences with {len(self.starts)} starts and "
                             f"{len(self.pages)} page lists")
        if any(not t for t in self.tokens):
            raise ValueError("every sequence of a step needs at least one row")

    @classmethod
    def uncached(cls, seqs: Seq[Sequence], tree: Seq[Seq[int]] | None = None) -> StepRows:
        """The uncached tokens of each sequence (a prompt prefill, a decode step): read, never changed.

        tree: None (causal), or per sequence the parent of each uncached token.
        """
        return cls([s.token_ids[s.num_cached:] for s in seqs], [s.num_cached for s in seqs],
                   [list(s.pages) for s in seqs], None if tree is None else [list(p) for p in tree])

    @property
    def qo_lens(self) -> list[int]:
        """(B,) rows per sequence."""
        return [len(t) for t in self.tokens]

    @property
    def kv_lens(self) -> list[int]:
        """(B,) slots each sequence attends over after the step: its prefix and its rows."""
        return [s + len(t) for s, t in zip(self.starts, self.tokens)]

    def metadata(self, page_size: int, device: torch.device | str) -> AttentionMetadata:
        """The step's attention metadata (page tables, slots, positions; the tree's visibility and depths)."""
        meta = AttentionMetadata.build(self.qo_lens, self.kv_lens, self.pages, page_size, device)
        if self.tree is not None:
            meta.set_tree(self.tree)
        return meta


class ModelRunner:
    """Runs `model` over the rows of one step (`forward`): a prompt prefill, a decode step (one row per sequence)
    or a verify step (several, a chain or a tree).

    `run`, `free`: for code that drives sequences by hand, without a scheduler (tests, benchmarks, GPU checks);
    the engines never call them.
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

    def _graphed(self, rows: StepRows, logits: str, hidden_layers: Seq[int]) -> StepGraphs | None:
        """The captured steps that can run this step (every sequence q causal rows), or None (eager)."""
        if not self.graphs or logits == "none" or rows.tree is not None:
            return None
        q = len(rows.tokens[0])
        graphs = self.graphs.get((q, tuple(hidden_layers)))
        if graphs is None or len(rows.tokens) > graphs.max_batch or (logits == "last" and q != 1):
            return None
        if any(len(t) != q for t in rows.tokens):
            return None
        return graphs

    @classmethod
    def create(cls, model: CausalLM, num_pages: int | None = None, page_size: int = 16,
               kv_cache_gb: float = 1.0) -> ModelRunner:
        """Build a runner with its own page pool (`kv_pool`)."""
        return cls(model, kv_pool(model, num_pages, page_size, kv_cache_gb))

    @torch.inference_mode()
    def forward(self, rows: StepRows, logits: str = "last", hidden_layers: Seq[int] = (),
                meta: AttentionMetadata | None = None) -> ForwardOutput:
        """Forward the rows of one step, writing their K/V into their slots (the pages must hold them).

        logits: "last" → (B, V) at each sequence's last row; "all" → (T, V) at every row; "none" → no lm_head.
        meta: `rows.metadata(...)` when the caller built it (to share the step's batch information with another
        forward over the same rows, e.g. a head's catch-up); built here when None.
        Returned hidden is (T, H) over all rows, packed in order. A causal step of q rows per sequence replays
        CUDA graphs when they are enabled for q (`enable_graphs`); a tree step runs eagerly.
        """
        graphs = self._graphed(rows, logits, hidden_layers)
        if graphs is not None:  # every row's logits, as logits="all" (for q = 1 the same as "last")
            out = graphs.run([t for ts in rows.tokens for t in ts], rows.kv_lens, rows.pages)
            logits_all, hidden, *layers = out
            return ForwardOutput(hidden=hidden, layers=dict(zip(hidden_layers, layers)), logits=logits_all)
        if meta is None:
            meta = rows.metadata(self.kv.page_size, self.device)
        if logits == "last":
            idx = meta.qo_indptr[1:].long() - 1
        elif logits == "all":
            idx = torch.arange(meta.num_tokens, device=self.device)
        elif logits == "none":
            idx = None
        else:
            raise ValueError(f"logits must be last|all|none, got {logits!r}")
        input_ids = torch.tensor([t for ts in rows.tokens for t in ts], dtype=torch.long, device=self.device)
        return self.model(input_ids, meta, self.kv.layers, logits_indices=idx, hidden_layers=hidden_layers)

    def run(self, seqs: Seq[Sequence], logits: str = "last", hidden_layers: Seq[int] = (),
            tree: Seq[Seq[int]] | None = None) -> ForwardOutput:
        """Drive sequences by hand: grow their pages, forward their uncached tokens (`forward`), count them cached.

        tree: None, or per sequence the parent of each uncached token (`StepRows.tree`).
        """
        for s in seqs:
            if s.num_uncached < 1:
                raise ValueError(f"sequence {s.seq_id} has no uncached token to run")
            self.kv.ensure(s.pages, len(s))
        out = self.forward(StepRows.uncached(seqs, tree), logits, hidden_layers)
        for s in seqs:
            s.num_cached = len(s)
        return out

    def free(self, seq: Sequence) -> None:
        """Give a sequence driven by hand its pages back to the pool."""
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
