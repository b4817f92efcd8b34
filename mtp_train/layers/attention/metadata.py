"""Per-step attention metadata: built once per forward by the engine, read by every layer.

A step packs the new tokens of B sequences into one flat buffer of T tokens (no padding). Sequence b
contributes `qo_lens[b]` new tokens whose positions are the last `qo_lens[b]` of its `kv_lens[b]`
tokens. The three modes are special cases of that one shape:

* prefill: no cached prefix (`kv_lens == qo_lens`), e.g. stage-one precompute or a prompt prefill;
* decode:  one new token per sequence;
* verify:  several new tokens per sequence on top of a cached prefix (speculative verification,
  chunked prefill).

With a paged KV cache, the K/V of sequence b live in pages `block_tables[b]`; token j of the sequence
sits at page `block_tables[b][j // page_size]`, offset `j % page_size`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class ForwardMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about one forward step (shapes in comments)."""

    mode: ForwardMode
    qo_lens: list[int]  # (B,) new tokens per sequence, on the host
    kv_lens: list[int]  # (B,) tokens in each sequence's KV after this step, on the host
    qo_indptr: torch.Tensor  # (B+1,) int32 offsets of each sequence's new tokens in the packed batch
    positions: torch.Tensor  # (T,) int64 absolute position of every new token
    page_size: int = 0  # tokens per KV page; 0 when the step uses no KV cache
    block_tables: torch.Tensor | None = None  # (B, max_pages) int32 page ids, padded with 0
    slot_pages: torch.Tensor | None = None  # (T,) int64 page id that receives each new token's K/V
    slot_offsets: torch.Tensor | None = None  # (T,) int64 offset inside that page
    kv_indptr: torch.Tensor | None = None  # (B+1,) int32 FlashInfer layout: offsets into kv_indices
    kv_indices: torch.Tensor | None = None  # (sum pages,) int32 page ids of all sequences, concatenated
    kv_last_page_len: torch.Tensor | None = None  # (B,) int32 tokens used in each sequence's last page
    # A tree step (`set_tree`): the new tokens of a sequence are a tree laid out in slot order, so `positions`
    # stay their slots (where K/V go, what causality counts) while RoPE and a sliding window take each token's
    # position in its branch (the cached prefix, then its depth).
    rope_positions: torch.Tensor | None = None  # (T,) int64 position each new token stands at (rotated to)
    tree_bits: torch.Tensor | None = None  # (T,) int64 bit i = the token sees new token i of its own sequence
    # Filled by the backend's `prepare` (e.g. masks, planned kernels), shared by all layers of the step.
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def uses_cache(self) -> bool:
        return self.page_size > 0

    @property
    def rotary_positions(self) -> torch.Tensor:
        """(T,) the positions RoPE rotates to: the tokens' depths in a tree step, else their positions."""
        return self.positions if self.rope_positions is None else self.rope_positions

    def set_tree(self, parents: Sequence[Sequence[int]]) -> None:
        """Make the new tokens of each sequence a tree (speculative verification of several candidates at once).

        parents[b][i]: the index among sequence b's new tokens of token i's parent, -1 for a root (whose parent
        is the cached prefix: always the first token, and any other of a forest, e.g. a head's level of draft rows
        over several first drafts), and < i otherwise (a parent comes first in slot order). Token i then sees the
        cached prefix, its ancestors and itself, and is rotated to position kv_len - qo_len + depth (a root's
        depth 0). A sequence's new tokens are at most 64 (the bits of one int64; bit 63 is its sign bit).
        """
        if len(parents) != self.batch_size:
            raise ValueError(f"{len(parents)} parent lists for {self.batch_size} sequences")
        bits: list[int] = []
        rope: list[int] = []
        for b, (par, q, kv) in enumerate(zip(parents, self.qo_lens, self.kv_lens)):
            if len(par) != q:
                raise ValueError(f"sequence {b} has {q} new tokens but {len(par)} parents")
            if q > 64:
                raise ValueError(f"a tree step takes at most 64 new tokens per sequence, sequence {b} has {q}")
            mine: list[int] = []
            depth: list[int] = []
            for i, p in enumerate(par):
                if (i == 0 and p != -1) or not -1 <= p < i:
                    raise ValueError(f"sequence {b}: token {i} has parent {p}; the first token's is -1 and every "
                                     "other's -1 or an earlier token")
                mine.append((mine[p] if p >= 0 else 0) | (1 << i))
                depth.append(depth[p] + 1 if p >= 0 else 0)
            bits += [m - (1 << 64) if m >= 1 << 63 else m for m in mine]  # as int64 (two's complement)
            rope += [kv - q + d for d in depth]
        dev = self.positions.device
        self.tree_bits = torch.tensor(bits, dtype=torch.int64, device=dev)
        self.rope_positions = torch.tensor(rope, dtype=torch.int64, device=dev)

    @classmethod
    def build(
        cls,
        qo_lens: Sequence[int],
        kv_lens: Sequence[int] | None = None,
        block_tables: Sequence[Sequence[int]] | None = None,
        page_size: int = 0,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata of one step.

        qo_lens: new tokens per sequence. kv_lens: total tokens per sequence after the step (default:
        equal to qo_lens, i.e. a prefill). block_tables: page ids per sequence (enough pages for
        kv_lens); None means attention among the new tokens only, with nothing written to a cache.
        """
        qo = [int(n) for n in qo_lens]
        kv = list(qo) if kv_lens is None else [int(n) for n in kv_lens]
        if len(kv) != len(qo):
            raise ValueError(f"qo_lens has {len(qo)} sequences but kv_lens has {len(kv)}")
        if any(q < 1 for q in qo):
            raise ValueError(f"every sequence needs at least one new token, got qo_lens={qo}")
        if any(k < q for q, k in zip(qo, kv)):
            raise ValueError(f"kv_lens {kv} must be >= qo_lens {qo}")
        if block_tables is None and kv != qo:
            raise ValueError("a step with a cached prefix (kv_lens > qo_lens) needs block tables")

        if kv == qo:
            mode = ForwardMode.PREFILL
        elif all(q == 1 for q in qo):
            mode = ForwardMode.DECODE
        else:
            mode = ForwardMode.VERIFY

        # Host lists, then one tensor each: a decode or verify step's few rows cost a handful of small copies here,
        # where torch ops (cumsum, repeat_interleave, indexing) cost ~5-10 µs apiece, ~25 of them per step.
        starts = [k - q for q, k in zip(qo, kv)]  # the i-th new token of sequence b sits at kv_len - qo_len + i
        pos = [s0 + i for s0, q in zip(starts, qo) for i in range(q)]
        indptr = [0]
        for q in qo:
            indptr.append(indptr[-1] + q)
        positions = torch.tensor(pos, dtype=torch.int64)
        meta = cls(mode=mode, qo_lens=qo, kv_lens=kv, qo_indptr=torch.tensor(indptr, dtype=torch.int32).to(device),
                   positions=positions.to(device))
        if block_tables is None:
            return meta
        if page_size < 1:
            raise ValueError("page_size must be >= 1 when block tables are given")
        if len(block_tables) != len(qo):
            raise ValueError(f"{len(block_tables)} block tables for {len(qo)} sequences")
        for b, (pages, n) in enumerate(zip(block_tables, kv)):
            need = -(-n // page_size)
            if len(pages) < need:
                raise ValueError(f"sequence {b} holds {n} tokens and needs {need} pages, has {len(pages)}")
        pages_used = [list(p[: -(-n // page_size)]) for p, n in zip(block_tables, kv)]
        max_pages = max(len(p) for p in pages_used)
        bt = torch.tensor([p + [0] * (max_pages - len(p)) for p in pages_used], dtype=torch.int32)
        slot_pages = torch.tensor([pages[x // page_size] for pages, s0, q in zip(pages_used, starts, qo)
                                   for x in range(s0, s0 + q)], dtype=torch.int64)
        slot_offsets = torch.tensor([x % page_size for x in pos], dtype=torch.int64)
        kv_ptr = [0]
        for p in pages_used:
            kv_ptr.append(kv_ptr[-1] + len(p))
        kv_indptr = torch.tensor(kv_ptr, dtype=torch.int32)
        kv_indices = torch.tensor([i for p in pages_used for i in p], dtype=torch.int32)
        last = torch.tensor([(n - 1) % page_size + 1 for n in kv], dtype=torch.int32)
        meta.page_size = page_size
        meta.block_tables = bt.to(device)
        meta.slot_pages = slot_pages.to(device)
        meta.slot_offsets = slot_offsets.to(device)
        meta.kv_indptr = kv_indptr.to(device)
        meta.kv_indices = kv_indices.to(device)
        meta.kv_last_page_len = last.to(device)
        return meta
