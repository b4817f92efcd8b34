"""The block allocator and the page pool."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine import BlockAllocator, KVCache, OutOfPagesError
from mtp_train.layers.attention import KVLayout


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
    kv = KVCache(num_layers=2, num_pages=8, page_size=4, layout=KVLayout(2, 8))
    assert kv.pool.shape == (2, 8, 2, 4, 2, 8)
    assert kv.layers[1].shape == (8, 2, 4, 2, 8)
    pages: list[int] = []
    kv.ensure(pages, 9)
    assert len(pages) == 3
    kv.ensure(pages, 12)
    assert len(pages) == 3
    kv.truncate(pages, 4)
    assert len(pages) == 1 and kv.allocator.num_free == 7
    assert KVCache.bytes_per_token(30, KVLayout(3, 64), torch.float32) == 30 * 2 * 3 * 64 * 4


def test_latent_pool_holds_one_row_per_token_half_of_a_k_and_v_head():
    # MLA (DeepSeek-V2-Lite widths): one [c ; k_pe] row of kv_lora_rank + rope = 512 + 64 per token and layer
    latent = KVLayout(1, 512 + 64, latent=True)
    kv = KVCache(num_layers=3, num_pages=5, page_size=4, layout=latent, dtype=torch.bfloat16)
    assert kv.pool.shape == (3, 5, 4, 576) and kv.layers[0].shape == (5, 4, 576)
    per_token = KVCache.bytes_per_token(27, latent, torch.bfloat16)
    assert per_token == 27 * 576 * 2  # (C + R) · dtype bytes per layer
    assert 2 * per_token == KVCache.bytes_per_token(27, KVLayout(1, 576), torch.bfloat16)  # the old K + V slots
    assert kv.pool.numel() * kv.pool.element_size() == 3 * 5 * 4 * 576 * 2
    with pytest.raises(ValueError, match="one row per token"):
        KVLayout(2, 576, latent=True)
