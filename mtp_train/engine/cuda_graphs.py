"""CUDA graphs for the engine's fixed-shape steps: target decode and verify, the head's draft steps.

At batch 1 a decode step of a small target is a few hundred kernel launches of microseconds each: the GPU waits
on Python. A step whose shape is fixed — B sequences with q new tokens each (decode: q = 1; verify at a fixed
draft length k: q = k + 1; a head's draft step: q = 1) — is captured once per batch bucket and replayed:

* buckets: 1, 2, 4, 8, then multiples of 8 up to the engine's batch size; a step of B sequences replays the
  smallest bucket P >= B, captured on first use;
* static buffers: token ids (P·q,), positions, slot pages / offsets (where each token's K/V is written), and the
  input features (P·q, H) for a head; a replay copies the step's values into them;
* padding: rows B..P-1 are fed token 0 at positions 0..q-1 of scratch pages the runner keeps out of the
  allocator (one page unless q exceeds the page size), so they write nowhere a sequence reads and attend to
  those pages alone; their outputs are dropped;
* attention: FlashInfer's CUDA-graph wrappers (`FlashInferBackend.graph_wrapper`), one per bucket, whose index
  buffers keep their addresses; before every replay `plan_graph` re-plans the wrapper on the host, writing the
  step's pages into those buffers in place, and pins the plan in the step's metadata so the captured layers
  never plan.

Outputs are copied out of the graph's memory (a later replay of any graph may reuse it). Where capture is not
possible — CPU, the torch or MLA attention backends, prompt prefills, steps of mixed lengths — the engine runs
eagerly. `capture=False` runs the same padded fixed-shape steps eagerly (on CPU, with the torch backend): it is
how the padding and the output slicing are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from mtp_train.config.device import on_cuda
from mtp_train.engine.kv_cache import KVCache
from mtp_train.layers.attention import AttentionMetadata

# fn(token_ids (T,), hidden (T, W) or None, meta) → per-token outputs, each with T leading rows
StepFn = Callable[[torch.Tensor, torch.Tensor | None, AttentionMetadata], tuple[torch.Tensor, ...]]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_batch (and max_batch itself), vLLM's capture sizes."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def supports_graphs(attn: object) -> bool:
    """Whether an attention backend can run inside a CUDA graph (FlashInfer's paged kernels can)."""
    return hasattr(attn, "graph_wrapper") and hasattr(attn, "plan_graph")


class _Bucket:
    """The static buffers, the FlashInfer wrapper and the captured graph of one batch size."""

    def __init__(self, size: int, q: int, width: int | None, device: torch.device, dtype: torch.dtype) -> None:
        t = size * q
        self.size = size
        self.ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.slot_pages = torch.zeros(t, dtype=torch.long, device=device)
        self.slot_offsets = torch.zeros(t, dtype=torch.long, device=device)
        self.qo_indptr = torch.arange(0, t + 1, q, dtype=torch.int32, device=device)  # q tokens per row, always
        self.hidden = None if width is None else torch.zeros(t, width, dtype=dtype, device=device)
        self.wrapper = None  # the FlashInfer CUDA-graph wrapper (capture mode)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()


class StepGraphs:
    """Replays `fn` over fixed-shape steps of q new tokens per sequence, one captured graph per batch bucket.

    fn: the step's forward on the static buffers (it must read nothing else that changes between steps); attn:
    the attention backend the forward runs (FlashInfer's when capture is on); kv: the KV pool the step writes
    (its page ids); scratch_pages: page ids outside the allocator for the padded rows (enough for q tokens);
    q: new tokens per sequence; max_batch: the largest batch; width: the input features' width (None: fn reads
    no hidden); dtype: the features' dtype; capture: record CUDA graphs (else run the padded step eagerly).
    """

    def __init__(self, fn: StepFn, attn: object, kv: KVCache, scratch_pages: Seq[int], *, q: int, max_batch: int,
                 width: int | None = None, dtype: torch.dtype = torch.float32, capture: bool = True,
                 device: torch.device | str = "cpu", pool: object | None = None) -> None:
        if q < 1:
            raise ValueError(f"a captured step has at least one new token per sequence, got {q}")
        if len(scratch_pages) < kv.pages_for(q):
            raise ValueError(f"padded rows of {q} tokens need {kv.pages_for(q)} scratch pages at page size "
                             f"{kv.page_size}, got {len(scratch_pages)}")
        self.device = torch.device(device)
        if capture:
            if not on_cuda(self.device):
                raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
            if not supports_graphs(attn):
                raise ValueError(f"the {getattr(attn, 'name', type(attn).__name__)} attention backend cannot run "
                                 "inside a CUDA graph; use the flashinfer backend or run eagerly")
        self.fn, self.attn, self.kv = fn, attn, kv
        self.scratch = list(scratch_pages[: kv.pages_for(q)])  # a padded row's block table
        self.q, self.width, self.dtype, self.capture = q, width, dtype, capture
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.pool = pool  # the buckets' graphs share this memory pool; outputs are copied out after each replay
        self._buckets: dict[int, _Bucket] = {}
        self.replays = 0  # steps run through this object (tests and the GPU check read it)
        self.captures = 0

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket holding `batch` sequences."""
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} is above the largest captured batch {self.max_batch}")

    def _padded_meta(self, size: int, kv_lens: Seq[int], block_tables: Seq[Seq[int]],
                     device: torch.device | str) -> AttentionMetadata:
        """Metadata of the padded step: real rows first, then rows of q tokens on the scratch pages."""
        pad = size - len(kv_lens)
        kv = list(kv_lens) + [self.q] * pad
        tables = [list(t) for t in block_tables] + [self.scratch] * pad
        return AttentionMetadata.build([self.q] * size, kv, tables, self.kv.page_size, device)

    def run(self, token_ids: Seq[int] | torch.Tensor, kv_lens: Seq[int], block_tables: Seq[Seq[int]],
            hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """One step of B = len(kv_lens) sequences, q tokens each → fn's outputs for the real B·q rows.

        token_ids: (B·q,) packed, host ints or a tensor (on the device: read there, with no synchronisation);
        kv_lens: (B,) tokens per sequence after the step; block_tables: (B,) page ids
        (enough for kv_lens); hidden: (B·q, width) input features, when fn reads them.
        """
        b, q = len(kv_lens), self.q
        if len(token_ids) != b * q:
            raise ValueError(f"{len(token_ids)} tokens for {b} sequences of {q}")
        if (hidden is None) != (self.width is None):
            raise ValueError("hidden must be given exactly when the step reads features (width)")
        size, n = self.bucket_for(b), b * q
        if isinstance(token_ids, torch.Tensor):
            ids = torch.zeros(size * q, dtype=torch.long, device=token_ids.device)
            ids[:n] = token_ids
        else:
            ids = torch.zeros(size * q, dtype=torch.long)
            ids[:n] = torch.as_tensor(list(token_ids), dtype=torch.long)
        self.replays += 1
        if not self.capture:
            meta = self._padded_meta(size, kv_lens, block_tables, self.device)
            feats = None
            if hidden is not None:
                feats = torch.zeros(size * q, hidden.shape[-1], dtype=self.dtype, device=self.device)
                feats[:n] = hidden.to(self.device, self.dtype)
            return tuple(o[:n] for o in self.fn(ids.to(self.device), feats, meta))
        host = self._padded_meta(size, kv_lens, block_tables, "cpu")
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _Bucket(size, q, self.width, self.device, self.dtype)
        assert host.slot_pages is not None and host.slot_offsets is not None
        bucket.ids.copy_(ids, non_blocking=True)
        bucket.positions.copy_(host.positions, non_blocking=True)
        bucket.slot_pages.copy_(host.slot_pages, non_blocking=True)
        bucket.slot_offsets.copy_(host.slot_offsets, non_blocking=True)
        if bucket.hidden is not None and hidden is not None:
            bucket.hidden[:n].copy_(hidden.to(self.dtype), non_blocking=True)
            bucket.hidden[n:].zero_()
        meta = self._static_meta(bucket, host)
        if bucket.graph is None:
            self._capture(bucket, meta)
        else:
            bucket.graph.replay()
        return tuple(o[:n].clone() for o in bucket.outputs)

    def _static_meta(self, bucket: _Bucket, host: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata over the bucket's static device buffers, planned on the bucket's wrapper."""
        meta = AttentionMetadata(mode=host.mode, qo_lens=host.qo_lens, kv_lens=host.kv_lens,
                                 qo_indptr=bucket.qo_indptr, positions=bucket.positions,
                                 page_size=host.page_size, slot_pages=bucket.slot_pages,
                                 slot_offsets=bucket.slot_offsets, kv_indices=host.kv_indices,
                                 kv_indptr=host.kv_indptr, kv_last_page_len=host.kv_last_page_len)
        if bucket.wrapper is None:
            # every page of the pool once, plus the scratch pages once per padded row
            bucket.wrapper = self.attn.graph_wrapper(host.mode, bucket.size,  # type: ignore[attr-defined]
                                                     self.kv.num_pages + bucket.size * len(self.scratch))
        self.attn.plan_graph(bucket.wrapper, meta, self.dtype, self.kv.pool.dtype)  # type: ignore[attr-defined]
        return meta

    def _capture(self, bucket: _Bucket, meta: AttentionMetadata) -> None:
        """Warm up on a side stream (lazy inits, autotuning), then capture fn on the static buffers.

        The warm-up runs the real step: its outputs are those of this step, so the capture's own run (whose
        values are the same) is the step's result and nothing is computed twice in a way that matters.
        """
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.fn(bucket.ids, bucket.hidden, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.outputs = tuple(self.fn(bucket.ids, bucket.hidden, meta))
        bucket.graph = graph
        self.captures += 1
        # Capturing records the kernels without running them: replay once for this step's outputs.
        graph.replay()
