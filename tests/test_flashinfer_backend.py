"""FlashInfer attention backend against the torch reference.

The GPU tests need CUDA and an importable FlashInfer and are skipped otherwise. The CPU tests always
run: module import and backend selection without CUDA, the install hint, and the backend's plumbing
(planning per step, window conversion, kernel choice) against a small stand-in for FlashInfer that
implements its documented semantics in plain torch.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from mtp_train.layers.attention import (
    AttentionMetadata,
    ForwardMode,
    make_attention_backend,
    resolve_backend_name,
)
from mtp_train.layers.attention.torch_backend import TorchBackend
from tests._gpu import needs_flashinfer
from tests._pages import random_block_tables

gpu = needs_flashinfer("flashinfer")

HEAD_DIM = 128
PAGE_SIZE = 4
NUM_PAGES = 64
HEADS = {"gqa": (8, 2), "mha": (4, 4)}
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}


# ------------------------------------------------------------------------------------------------
# helpers shared by the GPU and CPU tests


def _block_tables(kv_lens: list[int], gen: torch.Generator) -> list[list[int]]:
    return random_block_tables(kv_lens, PAGE_SIZE, NUM_PAGES, gen)


def _qkv(t: int, hq: int, hkv: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    """Random q (t, hq, D) and k, v (t, hkv, D); k and v are views into one fused tensor like the model's."""
    q = torch.randn(t, hq, HEAD_DIM, generator=gen).to(device, dtype)
    kv = torch.randn(t, 2 * hkv * HEAD_DIM, generator=gen).to(device, dtype)
    k, v = kv.split(hkv * HEAD_DIM, dim=-1)
    return q, k.view(t, hkv, HEAD_DIM), v.view(t, hkv, HEAD_DIM)


def _reference(q, k, v, cache, meta, hq, hkv, window=None):
    """TorchBackend in float32 on copies: (out (T, Hq, D) fp32, cache after the step or None)."""
    ref = TorchBackend(hq, hkv, HEAD_DIM, window)
    ref.prepare(meta)
    ref_cache = None if cache is None else cache.float().clone()
    out = ref.forward(q.float(), k.float(), v.float(), ref_cache, meta)
    return out, ref_cache


def _run_case(backend, qo_lens, kv_lens, hq, hkv, dtype, device, gen, window=None, with_cache=True):
    """One step through `backend` and the fp32 torch reference; asserts outputs and pools match."""
    tables = _block_tables(kv_lens, gen) if with_cache else None
    meta = AttentionMetadata.build(qo_lens, kv_lens, tables, PAGE_SIZE if with_cache else 0, device=device)
    q, k, v = _qkv(meta.num_tokens, hq, hkv, dtype, device, gen)
    cache = None
    if with_cache:
        # Random values everywhere stand for the cached prefix and for garbage in unused slots.
        cache = torch.randn(NUM_PAGES, 2, PAGE_SIZE, hkv, HEAD_DIM, generator=gen).to(device, dtype)
    want, want_cache = _reference(q, k, v, cache, meta, hq, hkv, window)
    backend.prepare(meta)
    got = backend.forward(q, k, v, cache, meta)
    assert got.shape == (meta.num_tokens, hq, HEAD_DIM) and got.dtype == dtype
    tol = TOL.get(dtype, 2e-2)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    if with_cache:
        torch.testing.assert_close(cache, want_cache.to(dtype), atol=0, rtol=0)
    return meta


# ------------------------------------------------------------------------------------------------
# GPU: the real kernels


def _fi_backend(hq: int, hkv: int, window: int | None = None):
    from mtp_train.layers.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(hq, hkv, HEAD_DIM, window, device="cuda")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_prefill_matches_torch(dtype, heads):
    gen = torch.Generator().manual_seed(0)
    backend = _fi_backend(*heads)
    lens = [5, 17, 33]
    meta = _run_case(backend, lens, lens, *heads, dtype, "cuda", gen, with_cache=False)
    assert meta.mode is ForwardMode.PREFILL
    # With a pool: same attention, and the new K/V land in the pages.
    _run_case(backend, lens, lens, *heads, dtype, "cuda", gen)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_decode_matches_torch(dtype, heads):
    gen = torch.Generator().manual_seed(1)
    backend = _fi_backend(*heads)
    # kv lengths after the step: a token opening a new page (5), one filling a page (8), mid-page ones.
    meta = _run_case(backend, [1, 1, 1, 1], [5, 8, 13, 30], *heads, dtype, "cuda", gen)
    assert meta.mode is ForwardMode.DECODE


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_verify_matches_torch(dtype, heads):
    gen = torch.Generator().manual_seed(2)
    backend = _fi_backend(*heads)
    # 4 draft tokens per sequence on prefixes of 3, 8, 13 and 26 tokens (crossing page boundaries).
    meta = _run_case(backend, [4, 4, 4, 4], [7, 12, 17, 30], *heads, dtype, "cuda", gen)
    assert meta.mode is ForwardMode.VERIFY
    # Uneven new-token counts (chunked prefill next to verification), one sequence without a prefix.
    _run_case(backend, [4, 2, 7, 3], [7, 10, 7, 30], *heads, dtype, "cuda", gen)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["prefill", "decode", "verify"])
def test_sliding_window_matches_torch(mode):
    gen = torch.Generator().manual_seed(3)
    hq, hkv = HEADS["gqa"]
    backend = _fi_backend(hq, hkv, window=8)
    if mode == "prefill":
        _run_case(backend, [5, 17, 33], [5, 17, 33], hq, hkv, torch.bfloat16, "cuda", gen, window=8,
                  with_cache=False)
    elif mode == "decode":
        _run_case(backend, [1, 1, 1, 1], [5, 8, 13, 30], hq, hkv, torch.bfloat16, "cuda", gen, window=8)
    else:
        _run_case(backend, [4, 4, 4, 4], [7, 12, 17, 30], hq, hkv, torch.bfloat16, "cuda", gen, window=8)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_prefill_then_decode_and_verify_chain(heads):
    """A prompt prefill writes the pool, then decode and verify steps read it: both backends agree."""
    hq, hkv = heads
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    fi, ref = _fi_backend(hq, hkv), TorchBackend(hq, hkv, HEAD_DIM)
    prompt = [6, 11, 3]
    tables = _block_tables([n + 9 for n in prompt], gen)  # room for 1 decode + 8 verified tokens
    fi_cache = torch.zeros(NUM_PAGES, 2, PAGE_SIZE, hkv, HEAD_DIM, device="cuda", dtype=dtype)
    ref_cache = fi_cache.float()
    kv = [0, 0, 0]
    for qo in (prompt, [1, 1, 1], [4, 4, 4], [4, 4, 4]):
        kv = [n + q for n, q in zip(kv, qo)]
        meta = AttentionMetadata.build(qo, kv, tables, PAGE_SIZE, device="cuda")
        q, k, v = _qkv(meta.num_tokens, hq, hkv, dtype, "cuda", gen)
        ref.prepare(meta)
        want = ref.forward(q.float(), k.float(), v.float(), ref_cache, meta)
        fi.prepare(meta)
        got = fi.forward(q, k, v, fi_cache, meta)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fi_cache, ref_cache.to(dtype), atol=0, rtol=0)


@gpu
@pytest.mark.gpu
def test_plan_reused_across_layers_and_interleaved_steps():
    """Several layers share one plan; a step run after another step of its mode is re-planned."""
    hq, hkv = HEADS["gqa"]
    gen = torch.Generator().manual_seed(5)
    backend = _fi_backend(hq, hkv)
    tables = _block_tables([9, 14], gen)
    cache = torch.randn(NUM_PAGES, 2, PAGE_SIZE, hkv, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
    metas = [AttentionMetadata.build([1, 1], kv, tables, PAGE_SIZE, device="cuda")
             for kv in ([8, 13], [9, 14])]
    inputs = [_qkv(2, hq, hkv, torch.bfloat16, "cuda", gen) for _ in metas]
    for meta in metas:
        backend.prepare(meta)
    outs = []
    for meta, (q, k, v) in zip(metas, inputs):
        outs.append([backend.forward(q, k, v, cache.clone(), meta) for _ in range(3)])  # 3 "layers"
    for meta, (q, k, v), layer_outs in zip(metas, inputs, outs):
        want, _ = _reference(q, k, v, cache, meta, hq, hkv)
        for got in layer_outs:
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------
# CPU: always run


def test_module_imports_and_selection_without_cuda():
    mod = importlib.import_module("mtp_train.layers.attention.flashinfer_backend")
    assert mod.FlashInferBackend.name == "flashinfer"
    assert resolve_backend_name("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_attention_backend("flashinfer", 8, 2, 64, device="cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("flash", "cpu")


def test_missing_flashinfer_gives_install_hint(monkeypatch):
    from mtp_train.layers.attention.flashinfer_backend import FlashInferBackend

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'mtp_train\[gpu\]'"):
        FlashInferBackend(8, 2, 64, device="cpu")


def _attend(q, k, v, causal: bool, window_left: int, sm_scale: float,
            custom: torch.Tensor | None = None) -> torch.Tensor:
    """FlashInfer's documented semantics for one request, in fp32.

    q: (Q, Hq, D); k, v: (K, Hkv, D). Query i sits at position K - Q + i; with `causal` it sees keys
    j <= that position, and with window_left >= 0 only keys j >= position - window_left. custom: the request's
    (Q·K,) slice of a plan's `custom_mask` (True = attend), which replaces `causal`.
    """
    n_q, n_k = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    pos = torch.arange(n_q)[:, None] + n_k - n_q
    j = torch.arange(n_k)[None]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool) if custom is None else custom.view(n_q, n_k).cpu()
    if causal and custom is None:
        allowed &= j <= pos
    if window_left >= 0:
        allowed &= j >= pos - window_left
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


class _FakeWrapper:
    """Records constructor and plan calls; the plan signatures mirror FlashInfer's (>= 0.2.5)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_tensor_cores=False):
        assert kv_layout == "NHD"
        self.use_tensor_cores = use_tensor_cores
        self.plans: list[dict] = []

    def _gather(self, paged_kv_cache):
        """Per request: (K, Hkv, D) keys and values read through the planned page table."""
        p = self.plans[-1]
        indptr, indices, last = p["kv_indptr"].tolist(), p["kv_indices"].tolist(), p["last"].tolist()
        for b in range(len(last)):
            pages = indices[indptr[b]: indptr[b + 1]]
            n = (len(pages) - 1) * p["page_size"] + last[b]
            kv = paged_kv_cache[pages]  # (P, 2, page_size, Hkv, D)
            yield (kv[:, 0].reshape(-1, *kv.shape[-2:])[:n], kv[:, 1].reshape(-1, *kv.shape[-2:])[:n])


class _FakeRagged(_FakeWrapper):
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, non_blocking=True):
        self.plans.append(dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), causal=causal,
                               window_left=window_left, sm_scale=sm_scale,
                               dtypes=(q_data_type, kv_data_type)))

    def run(self, q, k, v):
        p = self.plans[-1]
        qo, kv = p["qo"], p["kv"]
        return torch.cat([_attend(q[qo[b]: qo[b + 1]], k[kv[b]: kv[b + 1]], v[kv[b]: kv[b + 1]], p["causal"],
                                  p["window_left"], p["sm_scale"]) for b in range(len(qo) - 1)])


class _FakePaged(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
             packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
             sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, non_blocking=True):
        self.plans.append(dict(qo=qo_indptr.tolist(), kv_indptr=paged_kv_indptr,
                               kv_indices=paged_kv_indices, last=paged_kv_last_page_len, page_size=page_size,
                               causal=causal, window_left=window_left, sm_scale=sm_scale, custom=custom_mask,
                               dtypes=(q_data_type, kv_data_type)))

    def run(self, q, paged_kv_cache):
        p = self.plans[-1]
        qo, outs, at = p["qo"], [], 0
        for b, (k, v) in enumerate(self._gather(paged_kv_cache)):
            n = (qo[b + 1] - qo[b]) * k.shape[0]  # this request's slice of the flattened custom mask
            custom = None if p["custom"] is None else p["custom"][at:at + n]
            at += n
            outs.append(_attend(q[qo[b]: qo[b + 1]], k, v, p["causal"], p["window_left"], p["sm_scale"], custom))
        return torch.cat(outs)


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True):
        self.plans.append(dict(kv_indptr=indptr, kv_indices=indices, last=last_page_len,
                               page_size=page_size, window_left=window_left, sm_scale=sm_scale,
                               dtypes=(q_data_type, kv_data_type)))

    def run(self, q, paged_kv_cache):
        p = self.plans[-1]
        return torch.cat([_attend(q[b: b + 1], k, v, False, p["window_left"], p["sm_scale"])
                          for b, (k, v) in enumerate(self._gather(paged_kv_cache))])


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A stand-in `flashinfer` module with the three wrappers, importable by the backend."""
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithRaggedKVCacheWrapper = _FakeRagged
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePaged
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    from mtp_train.layers.attention.flashinfer_backend import FlashInferBackend

    monkeypatch.setattr(FlashInferBackend, "workspace_bytes", 1024)
    return FlashInferBackend


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_plumbing_against_documented_semantics(fake_flashinfer, heads, window):
    hq, hkv = heads
    gen = torch.Generator().manual_seed(6)
    backend = fake_flashinfer(hq, hkv, HEAD_DIM, window, device="cpu")
    assert backend.window_left == (-1 if window is None else window - 1)
    for qo, kv, cached in (([5, 17, 9], [5, 17, 9], False), ([5, 17, 9], [5, 17, 9], True),
                           ([1, 1, 1, 1], [5, 8, 13, 30], True), ([4, 4, 4, 4], [7, 12, 17, 30], True),
                           ([4, 2, 7, 3], [7, 10, 7, 30], True)):
        _run_case(backend, qo, kv, hq, hkv, torch.bfloat16, "cpu", gen, window=window, with_cache=cached)
    decode = backend._wrappers["decode"]
    assert decode.use_tensor_cores is (hq // hkv >= 4)
    for wrapper in backend._wrappers.values():
        for plan in wrapper.plans:
            assert plan["sm_scale"] == pytest.approx(HEAD_DIM**-0.5)
            assert plan["dtypes"] == (torch.bfloat16, torch.bfloat16)
            assert plan.get("causal", True) is True


def _tree_case(backend, device, dtype, gen, hq=8, hkv=2, window=None):
    """A tree step (`set_tree`) of two sequences through `backend` against the fp32 torch reference (whose window
    counts the tree's positions: tests/test_tree_windows.py)."""
    qo, kv = [5, 3], [12, 20]
    meta = AttentionMetadata.build(qo, kv, _block_tables(kv, gen), PAGE_SIZE, device=device)
    meta.set_tree([[-1, 0, 1, 0, 0], [-1, 0, 0]])  # a chain of 2 with two siblings; two siblings alone
    q, k, v = _qkv(meta.num_tokens, hq, hkv, dtype, device, gen)
    cache = torch.randn(NUM_PAGES, 2, PAGE_SIZE, hkv, HEAD_DIM, generator=gen).to(device, dtype)
    want, _ = _reference(q, k, v, cache, meta, hq, hkv, window)
    backend.prepare(meta)
    got = backend.forward(q, k, v, cache, meta)
    tol = TOL.get(dtype, 2e-2)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # and the tree changed something: the same step as plain chains attends differently
    chain = AttentionMetadata.build(qo, kv, meta.block_tables.tolist(), PAGE_SIZE, device=device)
    plain, _ = _reference(q, k, v, cache, chain, hq, hkv, window)
    assert not torch.allclose(plain, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_tree_step_plans_a_custom_mask(fake_flashinfer, window):
    backend = fake_flashinfer(8, 2, HEAD_DIM, window, device="cpu")
    _tree_case(backend, "cpu", torch.bfloat16, torch.Generator().manual_seed(9), window=window)
    plan = backend._wrappers["paged"].plans[-1]
    assert plan["custom"] is not None and plan["window_left"] == -1  # the window is in the mask, by tree position


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_tree_step_matches_torch(window):
    _tree_case(_fi_backend(8, 2, window), "cuda", torch.bfloat16, torch.Generator().manual_seed(9), window=window)


def test_one_plan_per_step_and_replan_when_interleaved(fake_flashinfer):
    hq, hkv = HEADS["gqa"]
    gen = torch.Generator().manual_seed(7)
    backend = fake_flashinfer(hq, hkv, HEAD_DIM, device="cpu")
    tables = _block_tables([9, 14], gen)
    cache = torch.randn(NUM_PAGES, 2, PAGE_SIZE, hkv, HEAD_DIM, generator=gen).to(torch.bfloat16)
    metas = [AttentionMetadata.build([1, 1], kv, tables, PAGE_SIZE) for kv in ([8, 13], [9, 14])]
    inputs = [_qkv(2, hq, hkv, torch.bfloat16, "cpu", gen) for _ in metas]
    for meta in metas:
        backend.prepare(meta)
    wrapper = backend._wrappers["decode"]
    assert wrapper.plans == []  # planning waits for the first layer, which knows the dtypes
    for meta, (q, k, v) in zip(metas, inputs):
        for _ in range(3):  # three layers of one step share one plan
            got = backend.forward(q, k, v, cache.clone(), meta)
        want, _ = _reference(q, k, v, cache, meta, hq, hkv)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert len(wrapper.plans) == 2
    q, k, v = inputs[0]
    backend.forward(q, k, v, cache.clone(), metas[0])  # the wrapper now holds step 2's plan: re-plan
    assert len(wrapper.plans) == 3


def test_rejects_float32_and_unprepared_steps(fake_flashinfer):
    backend = fake_flashinfer(4, 4, HEAD_DIM, device="cpu")
    meta = AttentionMetadata.build([3])
    q, k, v = _qkv(3, 4, 4, torch.bfloat16, "cpu", torch.Generator().manual_seed(8))
    with pytest.raises(RuntimeError, match="before prepare"):
        backend.forward(q, k, v, None, meta)
    backend.prepare(meta)
    with pytest.raises(TypeError, match="float16/bfloat16"):
        backend.forward(q.float(), k.float(), v.float(), None, meta)
    with pytest.raises(ValueError, match="sliding_window"):
        fake_flashinfer(4, 4, HEAD_DIM, 0, device="cpu")
