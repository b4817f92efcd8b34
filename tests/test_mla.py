"""MLA backends over the latent-only paged cache (`mtp_train.layers.attention.mla`).

CPU tests always run: the torch backend against a from-scratch reference (prefill, paged decode over pages of 3,
verify = single steps, what the pool holds), the generic-backend adapter, backend selection without CUDA, and the
FlashInfer backend's plumbing against a small stand-in for `flashinfer.mla` that implements the wrapper's documented
semantics in plain torch. The GPU tests need CUDA and an importable FlashInfer and are skipped otherwise: FlashInfer's
MLA kernels against the torch backend in bf16 for prefill, decode and verify.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from mtp_train.layers.attention import (
    AttentionMetadata,
    LatentAsOneHead,
    TorchMLA,
    make_mla_backend,
    resolve_mla_backend_name,
)
from mtp_train.layers.attention.torch_backend import TorchBackend
from tests._gpu import needs_flashinfer
from tests._pages import random_block_tables

pytestmark = pytest.mark.usefixtures("one_thread")


gpu = needs_flashinfer("flashinfer.mla")

SMALL = (4, 16, 8)  # (H, C, R) for the CPU tests
DEEPSEEK = (16, 512, 64)  # V2-Lite's MLA widths: what FlashInfer's kernels run
SCALE = 0.17  # an expanded head's scale, deliberately not (C + R)^-0.5
NUM_PAGES = 48


def _block_tables(kv_lens: list[int], page_size: int, gen: torch.Generator,
                  num_pages: int = NUM_PAGES) -> list[list[int]]:
    return random_block_tables(kv_lens, page_size, num_pages, gen)


def _tokens(n: int, shape: tuple[int, int, int], gen: torch.Generator, dtype=torch.float32, device="cpu"):
    """Random inputs of n tokens: q_nope (n, H, C), q_pe (n, H, R), c (n, C), k_pe (n, R)."""
    h, c, r = shape
    parts = (torch.randn(n, h, c, generator=gen), torch.randn(n, h, r, generator=gen),
             torch.randn(n, c, generator=gen), torch.randn(n, r, generator=gen))
    return tuple(x.to(device, dtype) for x in parts)


def _reference(q_nope, q_pe, c, k_pe, scale: float) -> torch.Tensor:
    """MLA of one whole sequence from scratch, float64, causal: (n, H, C)."""
    q_nope, q_pe, c, k_pe = (x.double() for x in (q_nope, q_pe, c, k_pe))
    scores = (torch.einsum("qhc,kc->hqk", q_nope, c) + torch.einsum("qhr,kr->hqk", q_pe, k_pe)) * scale
    n = c.shape[0]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,kc->qhc", scores.softmax(-1), c)


def _cat(parts):
    return tuple(torch.cat(xs, 0) for xs in zip(*parts))


def _step(backend, qo_lens, kv_lens, tables, page_size, inputs, cache):
    """One step over packed inputs; returns the output (T, H, C)."""
    meta = AttentionMetadata.build(qo_lens, kv_lens, tables, page_size)
    backend.prepare(meta)
    return backend.forward(*inputs, cache, meta)


# --- the torch backend ------------------------------------------------------------------------------------------


def test_prefill_matches_the_reference_and_writes_one_row_per_token():
    h, c, r = SMALL
    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]
    seqs = [_tokens(n, SMALL, gen) for n in lens]
    mla = TorchMLA(h, c, r, SCALE)
    want = torch.cat([_reference(*s, SCALE) for s in seqs]).float()
    meta = AttentionMetadata.build(lens)  # cache-free (precompute)
    mla.prepare(meta)
    torch.testing.assert_close(mla.forward(*_cat(seqs), None, meta), want, rtol=1e-5, atol=1e-5)

    cache = torch.zeros(NUM_PAGES, 3, c + r)  # (num_pages, page_size, C + R): nothing but the latent rows
    tables = _block_tables(lens, 3, gen)
    got = _step(mla, lens, lens, tables, 3, _cat(seqs), cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for s, table in zip(seqs, tables):
        rows = cache[table].reshape(-1, c + r)[: s[2].shape[0]]
        torch.testing.assert_close(rows, torch.cat([s[2], s[3]], -1), rtol=0, atol=0)


@pytest.mark.parametrize("page_size", [3, 1])
def test_paged_decode_equals_a_full_recompute(page_size):
    h, c, r = SMALL
    gen = torch.Generator().manual_seed(1)
    prompts, steps = [4, 7, 1], 6
    seqs = [_tokens(n + steps, SMALL, gen) for n in prompts]
    tables = _block_tables([n + steps for n in prompts], page_size, gen)
    mla = TorchMLA(h, c, r, SCALE)
    cache = torch.zeros(NUM_PAGES, page_size, c + r)
    _step(mla, prompts, prompts, tables, page_size, _cat([tuple(x[:n] for x in s) for s, n in zip(seqs, prompts)]),
          cache)
    for j in range(steps):
        kv = [n + j + 1 for n in prompts]
        got = _step(mla, [1] * len(seqs), kv, tables, page_size,
                    _cat([tuple(x[n - 1: n] for x in s) for s, n in zip(seqs, kv)]), cache)
        want = torch.stack([_reference(*(x[:n] for x in s), SCALE)[-1] for s, n in zip(seqs, kv)]).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qo_lens", [[4, 4, 4], [4, 2, 5]], ids=["uniform", "ragged"])
def test_verify_equals_single_steps(qo_lens):
    h, c, r = SMALL
    gen = torch.Generator().manual_seed(2)
    prefix = [5, 9, 3]
    total = [p + q for p, q in zip(prefix, qo_lens)]
    seqs = [_tokens(n, SMALL, gen) for n in total]
    tables = _block_tables(total, 3, gen)
    mla = TorchMLA(h, c, r, SCALE)
    caches = [torch.zeros(NUM_PAGES, 3, c + r) for _ in range(2)]
    head = _cat([tuple(x[:p] for x in s) for s, p in zip(seqs, prefix)])
    for cache in caches:
        _step(mla, prefix, prefix, tables, 3, head, cache)
    # several new tokens per sequence in one step ...
    got = _step(mla, qo_lens, total, tables, 3,
                _cat([tuple(x[p:] for x in s) for s, p in zip(seqs, prefix)]), caches[0])
    # ... equal the same tokens fed one step at a time
    singles: list[list[torch.Tensor]] = [[] for _ in seqs]
    for j in range(max(qo_lens)):
        live = [b for b, q in enumerate(qo_lens) if j < q]
        kv = [prefix[b] + j + 1 for b in live]
        out = _step(mla, [1] * len(live), kv, [tables[b] for b in live], 3,
                    _cat([tuple(x[n - 1: n] for x in seqs[b]) for b, n in zip(live, kv)]), caches[1])
        for i, b in enumerate(live):
            singles[b].append(out[i])
    torch.testing.assert_close(got, torch.cat([torch.stack(s) for s in singles]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], caches[1], rtol=0, atol=0)
    want = torch.cat([_reference(*s, SCALE)[p:] for s, p in zip(seqs, prefix)]).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_generic_backend_adapter_and_gradients_match():
    h, c, r = SMALL
    gen = torch.Generator().manual_seed(3)
    lens = [6, 3]
    inputs = [x.requires_grad_() for x in _cat([_tokens(n, SMALL, gen) for n in lens])]
    meta = AttentionMetadata.build(lens)
    inner = TorchBackend(h, 1, c + r)
    inner.scale = SCALE
    adapter, mla = LatentAsOneHead(inner, c), TorchMLA(h, c, r, SCALE)
    grads = []
    for backend in (adapter, mla):
        backend.prepare(meta)
        out = backend.forward(*inputs, None, meta)
        grads.append(torch.autograd.grad(out.square().sum(), inputs))
    torch.testing.assert_close(adapter.forward(*inputs, None, meta), mla.forward(*inputs, None, meta))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="without a cache"):
        adapter.forward(*inputs, torch.zeros(4, 3, c + r), meta)


# --- selection --------------------------------------------------------------------------------------------------


def test_selection_without_cuda_and_named_constraints():
    mod = importlib.import_module("mtp_train.layers.attention.flashinfer_mla")  # imports without CUDA / FlashInfer
    assert mod.FlashInferMLA.name == "flashinfer"
    h, c, r = DEEPSEEK
    assert resolve_mla_backend_name("auto", "cpu", c, r, torch.bfloat16) == "torch"
    assert isinstance(make_mla_backend("auto", h, c, r, SCALE), TorchMLA)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_mla_backend("flashinfer", h, c, r, SCALE, device="cpu")
    # on a CUDA device: shapes and dtypes FlashInfer's kernels do not run go to torch under auto, by name otherwise
    assert resolve_mla_backend_name("auto", "cuda", 32, 8, torch.bfloat16) == "torch"
    assert resolve_mla_backend_name("auto", "cuda", c, r, torch.float32) == "torch"
    with pytest.raises(ValueError, match="kv_lora_rank=512 with qk_rope_head_dim=64.*kv_lora_rank=32"):
        resolve_mla_backend_name("flashinfer", "cuda", 32, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="float16/bfloat16 only, got torch.float32"):
        resolve_mla_backend_name("flashinfer", "cuda", c, r, torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_mla_backend_name("flash", "cpu", c, r)
    with pytest.raises(ValueError, match="softmax scale"):
        TorchMLA(h, c, r, 0.0)


def test_missing_flashinfer_gives_install_hint(monkeypatch):
    from mtp_train.layers.attention.flashinfer_mla import FlashInferMLA

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer.mla` raise ImportError
    monkeypatch.setitem(sys.modules, "flashinfer.mla", None)
    with pytest.raises(ImportError, match=r"pip install 'mtp_train\[gpu\]'"):
        FlashInferMLA(*DEEPSEEK, SCALE, device="cpu")
    assert resolve_mla_backend_name("auto", "cuda", 512, 64, torch.bfloat16) == "torch"


# --- the FlashInfer backend's plumbing, against a stand-in with the wrapper's documented semantics ------------------


class _FakeMLAWrapper:
    """`flashinfer.mla.BatchMLAPagedAttentionWrapper` (0.5.x signatures) in plain torch, recording its plans.

    Semantics as documented: kv_indptr offsets pages in kv_indices, kv_len_arr counts tokens, index tensors are
    int32, causal aligns query i of Q over K tokens at K - Q + i; the output is (T, H, head_dim_ckv).
    """

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        self.plans: list[dict] = []
        self.runs: list[dict] = []

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            if t.dtype != torch.int32:
                raise ValueError("index tensors must be int32")
        self.plans.append(dict(qo=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(), kv_indices=kv_indices.tolist(),
                               kv_lens=kv_len_arr.tolist(), heads=num_heads, dims=(head_dim_ckv, head_dim_kpe),
                               page_size=page_size, causal=causal, sm_scale=sm_scale,
                               dtypes=(q_data_type, kv_data_type)))

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        p = self.plans[-1]
        assert ckv_cache.shape[1] == kpe_cache.shape[1] == p["page_size"]
        assert ckv_cache.stride(-1) == kpe_cache.stride(-1) == 1  # the kernel needs unit-stride rows only
        self.runs.append(dict(ckv_ptr=ckv_cache.data_ptr(), kpe_ptr=kpe_cache.data_ptr(),
                              ckv_strides=ckv_cache.stride(), dtype=q_nope.dtype))
        outs = []
        for b in range(len(p["kv_lens"])):
            pages = p["kv_indices"][p["kv_indptr"][b]: p["kv_indptr"][b + 1]]
            n, q = p["kv_lens"][b], slice(p["qo"][b], p["qo"][b + 1])
            ckv = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[:n].float()
            kpe = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:n].float()
            s = (torch.einsum("qhc,kc->hqk", q_nope[q].float(), ckv)
                 + torch.einsum("qhr,kr->hqk", q_pe[q].float(), kpe)) * p["sm_scale"]
            nq = s.shape[1]
            if p["causal"]:
                pos = torch.arange(nq)[:, None] + n - nq
                s = s.masked_fill(torch.arange(n)[None] > pos, float("-inf"))
            outs.append(torch.einsum("hqk,kc->qhc", s.softmax(-1), ckv).to(q_nope.dtype))
        return torch.cat(outs)


@pytest.fixture
def fake_flashinfer_mla(monkeypatch):
    """A stand-in `flashinfer.mla` module, importable by the backend; returns the FlashInferMLA class."""
    pkg, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = _FakeMLAWrapper
    pkg.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    from mtp_train.layers.attention.flashinfer_mla import FlashInferMLA

    monkeypatch.setattr(FlashInferMLA, "workspace_bytes", 1024)
    return FlashInferMLA


def test_flashinfer_plumbing_prefill_decode_verify(fake_flashinfer_mla):
    h, c, r = 2, 512, 64
    gen = torch.Generator().manual_seed(4)
    fi = fake_flashinfer_mla(h, c, r, SCALE, device="cpu")
    ref = TorchMLA(h, c, r, SCALE)
    ps, dt = 3, torch.bfloat16
    prompts, new = [4, 7], [3, 1]
    total = [p + n for p, n in zip(prompts, new)]
    seqs = [_tokens(n + 1, (h, c, r), gen, dt) for n in total]
    tables = _block_tables([n + 1 for n in total], ps, gen)
    caches = {"fi": torch.zeros(NUM_PAGES, ps, c + r, dtype=dt), "ref": torch.zeros(NUM_PAGES, ps, c + r)}
    steps = [(prompts, prompts, lambda s, p, n: s[:p]),  # prefill, written to the pool
             (new, total, lambda s, p, n: s[p:p + n]),  # verify: several new tokens on a cached prefix
             ([1, 1], [n + 1 for n in total], lambda s, p, n: s[p + n:])]  # decode
    for qo, kv, pick in steps:
        inputs = _cat([tuple(pick(x, p, n) for x in s) for s, p, n in zip(seqs, prompts, new)])
        got = _step(fi, qo, kv, tables, ps, inputs, caches["fi"])
        want = _step(ref, qo, kv, tables, ps, tuple(x.float() for x in inputs), caches["ref"])
        assert got.shape == want.shape == (sum(qo), h, c) and got.dtype == dt
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(caches["fi"].float(), caches["ref"], rtol=0, atol=0)
    wrapper = fi._wrapper
    assert len(wrapper.plans) == 3
    for plan in wrapper.plans:
        assert plan["causal"] is True and plan["sm_scale"] == SCALE and plan["dims"] == (c, r)
        assert plan["heads"] == h and plan["dtypes"] == (dt, dt)
    assert wrapper.plans[0]["page_size"] == 1  # prefill: the new rows themselves, one per page
    assert wrapper.plans[0]["kv_indices"] == list(range(sum(prompts)))
    assert [p["page_size"] for p in wrapper.plans[1:]] == [ps, ps]
    assert wrapper.plans[1]["kv_lens"] == total
    # paged steps read ckv and kpe as views of the one latent buffer: no copy
    cache = caches["fi"]
    for run in wrapper.runs[1:]:
        assert run["ckv_ptr"] == cache.data_ptr()
        assert run["kpe_ptr"] == cache.data_ptr() + c * cache.element_size()
        assert run["ckv_strides"][:2] == cache.stride()[:2]


def test_flashinfer_one_plan_per_step_and_cache_free_prefill(fake_flashinfer_mla):
    h, c, r = 2, 512, 64
    gen = torch.Generator().manual_seed(5)
    fi = fake_flashinfer_mla(h, c, r, SCALE, device="cpu")
    lens = [5, 2]
    inputs = _cat([_tokens(n, (h, c, r), gen, torch.bfloat16) for n in lens])
    meta = AttentionMetadata.build(lens)  # precompute: no cache at all
    with pytest.raises(RuntimeError, match="before prepare"):
        fi.forward(*inputs, None, meta)
    fi.prepare(meta)
    assert fi._wrapper.plans == []  # planning waits for the first layer, which knows the dtype
    outs = [fi.forward(*inputs, None, meta) for _ in range(3)]  # three layers, one plan
    assert len(fi._wrapper.plans) == 1
    want = torch.cat([_reference(*(x[a:b] for x in inputs), SCALE) for a, b in ((0, 5), (5, 7))]).float()
    for out in outs:
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="float16/bfloat16"):
        fi.forward(*(x.float() for x in inputs), None, meta)
    with pytest.raises(ValueError, match="kv_lora_rank=512"):
        fake_flashinfer_mla(h, 32, 8, SCALE, device="cpu")


# --- GPU: FlashInfer's MLA kernels against the torch backend ------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_mla_matches_torch_on_cuda(page_size):
    from mtp_train.layers.attention.flashinfer_mla import FlashInferMLA

    h, c, r = DEEPSEEK
    gen = torch.Generator().manual_seed(6)
    dt, num_pages = torch.bfloat16, 512
    fi, ref = FlashInferMLA(h, c, r, SCALE, device="cuda"), TorchMLA(h, c, r, SCALE)
    prompts, new = [37, 5, 130], [4, 2, 7]
    total = [p + n for p, n in zip(prompts, new)]
    seqs = [_tokens(n + 1, DEEPSEEK, gen, dt, "cuda") for n in total]
    tables = _block_tables([n + 1 for n in total], page_size, gen, num_pages)
    caches = {"fi": torch.zeros(num_pages, page_size, c + r, dtype=dt, device="cuda"),
              "ref": torch.zeros(num_pages, page_size, c + r, device="cuda")}
    # cache-free prefill (precompute), then prefill into the pool, verify, decode
    steps = [(prompts, None, lambda s, p, n: s[:p]), (prompts, prompts, lambda s, p, n: s[:p]),
             (new, total, lambda s, p, n: s[p:p + n]), ([1] * 3, [n + 1 for n in total], lambda s, p, n: s[p + n:])]
    for qo, kv, pick in steps:
        meta = (AttentionMetadata.build(qo, device="cuda") if kv is None
                else AttentionMetadata.build(qo, kv, tables, page_size, device="cuda"))
        inputs = _cat([tuple(pick(x, p, n) for x in s) for s, p, n in zip(seqs, prompts, new)])
        fi.prepare(meta)
        ref.prepare(meta)
        got = fi.forward(*inputs, None if kv is None else caches["fi"], meta)
        want = ref.forward(*(x.float() for x in inputs), None if kv is None else caches["ref"], meta)
        assert got.dtype == dt
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(caches["fi"].float(), caches["ref"], rtol=1e-2, atol=1e-2)
