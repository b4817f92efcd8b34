"""Paged KV cache: one pool tensor per model and a plain-Python block allocator over a free list.

Pool layout, by the model's `KVLayout` (`ModelArgs.kv_layout`):

* K/V (Llama family): (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim); layer i's slice is
  FlashInfer's NHD paged layout, so the torch and FlashInfer backends read the same memory;
* MLA latent (DeepSeek-V2): (num_layers, num_pages, page_size, kv_lora_rank + qk_rope_head_dim), one [c ; k_pe]
  row per token and layer — half of storing it as a K head plus a V head.
"""

from __future__ import annotations

from collections import deque

import torch

from mtp_train.layers.attention import KVLayout


class OutOfPagesError(RuntimeError):
    """The KV page pool cannot hold what was asked for."""


class BlockAllocator:
    """Hands out page ids from a free list; O(1) allocate/free per page."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n pages; raises OutOfPagesError (taking none) when fewer are free."""
        if n > len(self._free):
            raise OutOfPagesError(
                f"KV cache out of pages: {n} needed, {len(self._free)} free of {self.num_pages}; "
                "give the engine more pages (num_pages / kv_cache_gb), or lower the batch size or max length"
            )
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; freeing a page that is not in use is a bug and raises."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._used.remove(p)
            self._free.append(p)


class KVCache:
    """The page pool of one model plus its allocator.

    A sequence owns a list of page ids; `ensure` grows it to hold a number of tokens and
    `truncate` shrinks it (to nothing when a sequence finishes).
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, layout: KVLayout,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.layout = layout
        # Zeroed, not empty: masked-out slots still enter the attention matmul (weight 0), and
        # uninitialised memory may hold NaN/inf, for which 0 * NaN = NaN.
        self.pool = torch.zeros(num_layers, num_pages, *layout.page_shape(page_size), dtype=dtype, device=device)
        # per-layer views: (num_pages, 2, page_size, Hkv, D), or (num_pages, page_size, C + R) for the latent layout
        self.layers = list(self.pool.unbind(0))
        self.allocator = BlockAllocator(num_pages)
        # Pages promised to admitted sequences (for their whole length) or held out for good (CUDA-graph scratch
        # pages), kept here rather than by an engine so that engines sharing the pool admit against one count.
        self.reserved = 0

    @staticmethod
    def bytes_per_token(num_layers: int, layout: KVLayout, dtype: torch.dtype) -> int:
        """Pool bytes per cached token over all layers."""
        return num_layers * layout.values_per_token * torch.empty((), dtype=dtype).element_size()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def ensure(self, pages: list[int], num_tokens: int) -> None:
        """Append pages to `pages` (in place) until they hold num_tokens tokens."""
        extra = self.pages_for(num_tokens) - len(pages)
        if extra > 0:
            pages.extend(self.allocator.allocate(extra))

    def truncate(self, pages: list[int], num_tokens: int) -> None:
        """Free the pages beyond those needed for num_tokens tokens (in place)."""
        keep = self.pages_for(num_tokens)
        if len(pages) > keep:
            self.allocator.free(pages[keep:])
            del pages[keep:]

    def copy_token(self, pages: list[int], src: int, dst: int) -> None:
        """Copy token `src`'s cached entries (every layer) over token `dst`'s, both within the sequence `pages`
        (e.g. an accepted tree candidate's K/V to the slot its position owns)."""
        ps = self.page_size
        sp, so, dp, do = pages[src // ps], src % ps, pages[dst // ps], dst % ps
        if self.layout.latent:  # (layers, pages, page_size, C + R)
            self.pool[:, dp, do] = self.pool[:, sp, so]
        else:  # (layers, pages, 2, page_size, Hkv, D)
            self.pool[:, dp, :, do] = self.pool[:, sp, :, so]
