"""Tree steps of up to 64 rows per sequence (the visibility bits' full width, bit 63 included) through the native CPU
kernel, SDPA's masks and torch MLA, against a float64 reference that masks each row to the prefix and its own
ancestors; FlashInfer's custom mask on CUDA (skipped without it)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionMetadata, TorchMLA
from mtp_train.layers.attention.torch_backend import TorchBackend
from tests._gpu import needs_flashinfer
from tests._pages import random_block_tables

pytestmark = pytest.mark.usefixtures("one_thread")

HQ, HKV, D = 4, 2, 16
PAGE, PAGES = 4, 96


def _trees(rows: list[int], gen: torch.Generator) -> list[list[int]]:
    """A random tree per sequence over its new rows: row 0 the root, every other row's parent an earlier row."""
    return [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)] for n in rows]


def _visible(prefix: int, parents: list[int]) -> torch.Tensor:
    """(Q, prefix + Q) bool: row i sees the prefix, its ancestors and itself."""
    q = len(parents)
    mask = torch.zeros(q, prefix + q, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(q):
        j = i
        while j >= 0:
            mask[i, prefix + j] = True
            j = parents[j]
    return mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 reference: q (Q, Hq, D), k/v (S, Hq, Dv), mask (Q, S) → (Q, Hq, Dv)."""
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v.double())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rows", [[64], [64, 64], [64, 17]])
@pytest.mark.parametrize("page", [PAGE, 16])  # 16: the native kernel's 8-key blocks, hidden keys inside them
@pytest.mark.parametrize("chunk", [None, 8])  # 8: the native kernel's split tokens, some chunks wholly hidden
def test_a_64_row_tree_step_sees_each_rows_ancestors_only(native, rows, page, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(cpu_kernels, "ATTENTION_CHUNK", chunk)
    if native and not cpu_kernels.available():
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(len(rows) * 100 + rows[-1])
    prefix = [7, 12][: len(rows)]
    total = [p + r for p, r in zip(prefix, rows)]
    tables = random_block_tables(total, page, PAGES, gen)
    trees = _trees(rows, gen)
    backend = TorchBackend(HQ, HKV, D)
    cache = torch.zeros(PAGES, 2, page, HKV, D)
    ks = [torch.randn(n, HKV, D, generator=gen) for n in total]
    vs = [torch.randn(n, HKV, D, generator=gen) for n in total]
    qs = [torch.randn(r, HQ, D, generator=gen) for r in rows]
    pre = AttentionMetadata.build(prefix, prefix, tables, page)
    backend.prepare(pre)
    backend.forward(torch.cat([torch.randn(p, HQ, D, generator=gen) for p in prefix]),
                    torch.cat([k[:p] for k, p in zip(ks, prefix)]), torch.cat([v[:p] for v, p in zip(vs, prefix)]),
                    cache, pre)
    meta = AttentionMetadata.build(rows, total, tables, page)
    meta.set_tree(trees)
    assert (meta.tree_bits < 0).any()  # row 63 of a chain-like branch sets the sign bit
    with contextlib.nullcontext() if native else cpu_kernels.disabled():
        backend.prepare(meta)
        got = backend.forward(torch.cat(qs), torch.cat([k[p:] for k, p in zip(ks, prefix)]),
                              torch.cat([v[p:] for v, p in zip(vs, prefix)]), cache, meta)
    group = HQ // HKV
    want = torch.cat([_attend(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), _visible(p, t),
                              backend.scale) for q, k, v, p, t in zip(qs, ks, vs, prefix, trees)])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [[64], [64, 30]])
def test_a_64_row_tree_step_through_torch_mla(rows):
    h, c, r = 4, 16, 8
    scale = 0.17
    gen = torch.Generator().manual_seed(7)
    prefix = [5, 9][: len(rows)]
    total = [p + n for p, n in zip(prefix, rows)]
    tables = random_block_tables(total, 3, PAGES, gen)
    trees = _trees(rows, gen)
    mla = TorchMLA(h, c, r, scale)
    cache = torch.zeros(PAGES, 3, c + r)
    seqs = [(torch.randn(n, h, c, generator=gen), torch.randn(n, h, r, generator=gen),
             torch.randn(n, c, generator=gen), torch.randn(n, r, generator=gen)) for n in total]
    pre = AttentionMetadata.build(prefix, prefix, tables, 3)
    mla.prepare(pre)
    mla.forward(*(torch.cat([s[i][:p] for s, p in zip(seqs, prefix)]) for i in range(4)), cache, pre)
    meta = AttentionMetadata.build(rows, total, tables, 3)
    meta.set_tree(trees)
    mla.prepare(meta)
    got = mla.forward(*(torch.cat([s[i][p:] for s, p in zip(seqs, prefix)]) for i in range(4)), cache, meta)
    want = []
    for (qn, qp, cc, kp), p, t in zip(seqs, prefix, trees):
        q = torch.cat([qn[p:], qp[p:]], -1)  # (Q, H, C+R) against keys [c, k_pe], values c
        k = torch.cat([cc, kp], -1)[:, None].expand(-1, h, -1)
        want.append(_attend(q, k, cc[:, None].expand(-1, h, -1), _visible(p, t), scale))
    torch.testing.assert_close(got.double(), torch.cat(want), rtol=1e-4, atol=1e-4)


@needs_flashinfer("flashinfer")
def test_a_64_row_tree_step_through_flashinfers_custom_mask():
    from mtp_train.layers.attention import make_attention_backend

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    rows, prefix = [64, 40], [9, 20]
    total = [p + n for p, n in zip(prefix, rows)]
    tables = random_block_tables(total, PAGE, PAGES, gen)
    trees = _trees(rows, gen)
    backend = make_attention_backend("flashinfer", HQ, HKV, D, device=dev)
    ref = TorchBackend(HQ, HKV, D)
    ks = torch.randn(sum(total), HKV, D, generator=gen)
    vs = torch.randn(sum(total), HKV, D, generator=gen)
    qs = torch.randn(sum(rows), HQ, D, generator=gen)
    outs = []
    for b, device in ((backend, dev), (ref, torch.device("cpu"))):
        dtype = torch.float16 if b is backend else torch.float32
        cache = torch.zeros(PAGES, 2, PAGE, HKV, D, device=device, dtype=dtype)
        k, v = ks.split(total), vs.split(total)
        pre = AttentionMetadata.build(prefix, prefix, tables, PAGE, device)
        b.prepare(pre)
        b.forward(torch.zeros(sum(prefix), HQ, D, device=device, dtype=cache.dtype),
                  torch.cat([x[:p] for x, p in zip(k, prefix)]).to(device, cache.dtype),
                  torch.cat([x[:p] for x, p in zip(v, prefix)]).to(device, cache.dtype), cache, pre)
        meta = AttentionMetadata.build(rows, total, tables, PAGE, device)
        meta.set_tree(trees)
        b.prepare(meta)
        outs.append(b.forward(qs.to(device, cache.dtype), torch.cat([x[p:] for x, p in zip(k, prefix)]).to(
            device, cache.dtype), torch.cat([x[p:] for x, p in zip(v, prefix)]).to(device, cache.dtype), cache,
            meta).float().cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
