"""The block allocator and the page pool."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine import BlockAllocator, KVCache, OutOfPagesError


def test_allocate_and_free_reuse_pages():
    a = BlockAllocator(4)
    p = a.allocate(3)
    assert len(set(p)) == 3 and a.num_free == 1
    a.free(p[:2])
    assert a.num_free == 3
    q = a.allocate(3)
    assert len(set(q) | {p[2]}) == 4  # never hands out a page in use


def test_exhausted_pages_raise_clear_error_and_take_nothing():
    a = BlockAllocator(2)
    a.allocate(1)
    with pytest.raises(OutOfPagesError, match=r"2 needed, 1 free of 2.*num_pages"):
        a.allocate(2)
    assert a.num_free == 1


def test_double_free_is_refused():
    a = BlockAllocator(2)
    p = a.allocate(1)
    a.free(p)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(p)


def test_kv_cache_ensure_and_truncate():
    kv = KVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
    assert kv.pool.shape == (2, 8, 2, 4, 2, 8)
    assert kv.layers[1].shape == (8, 2, 4, 2, 8)
    pages: list[int] = []
    kv.ensure(pages, 9)
    assert len(pages) == 3
    kv.ensure(pages, 12)
    assert len(pages) == 3
    kv.truncate(pages, 4)
    assert len(pages) == 1 and kv.allocator.num_free == 7
    assert KVCache.bytes_per_token(30, 3, 64, torch.float32) == 30 * 2 * 3 * 64 * 4
