"""The native CPU kernels equal torch's results, build once into their cache, and step aside cleanly."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from mtp_train.cli.common import kernel_settings_from_env
from mtp_train.layers import cpu_kernels
from mtp_train.layers.cpu_kernels import KernelSettings
from mtp_train.layers.linear import GEMV_M_MAX, Linear
from mtp_train.layers.norm import RMSNorm

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 17])
@pytest.mark.parametrize("k", [8, 37, 576, 1536])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_f_linear(m, k, bias, threads):
    torch.manual_seed(m * 1000 + k)
    n = 3 if k == 8 else 301  # odd N: the last thread chunk is short
    w, b = torch.randn(n, k), (torch.randn(n) if bias else None)
    x = torch.randn(m, k)
    torch.testing.assert_close(cpu_kernels.gemv(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


needs_avx512 = pytest.mark.skipif(not cpu_kernels.cpu_has_avx512(), reason="this CPU has no AVX-512F/VL/DQ")


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("k", [8, 15, 37, 576])
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_the_bf16_weight_gemv_equals_f_linear_over_the_rounded_weight(m, k, isa, threads):
    """A bfloat16 weight is widened exactly: the product is F.linear over `weight.float()` (float32 sums), for
    every row pairing and K around the 8- and 16-wide registers and their scalar tails, on both bodies."""
    if isa == "avx512" and not cpu_kernels.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512F/VL/DQ")
    g = torch.Generator().manual_seed(m * 1000 + k)
    n = 5 if k < 16 else 203  # odd N: the last thread chunk is short
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b, x = torch.randn(n, generator=g), torch.randn(m, k + 3, generator=g)[:, :k]  # strided rows
    torch.testing.assert_close(cpu_kernels.gemv(x, w, b, isa=isa), F.linear(x, w.float(), b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_kernels.gemv(x, w, isa=isa), F.linear(x, w.float()), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("k", [8, 15, 37, 576])
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_the_int8_weight_gemv_equals_f_linear_over_the_scaled_rows(m, k, isa, threads):
    """An `int8_copy` (int8 rows, a float32 scale each after them, a zero row among them): the product is F.linear over
    scale · rows, for every row pairing and K around the registers and their scalar tails (N·K not a multiple of 4
    included: the scales start at the next multiple), on both bodies; a bare int8 tensor is refused by name."""
    if isa == "avx512" and not cpu_kernels.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512F/VL/DQ")
    g = torch.Generator().manual_seed(m * 1000 + k)
    n = 5 if k < 16 else 203
    w = torch.randn(n, k, generator=g)
    w[1] = 0.0
    w8 = cpu_kernels.int8_copy(w)
    ref = cpu_kernels.int8_weight(w8)
    assert w8.dtype == torch.int8 and w8.shape == (n, k) and torch.equal(ref[1], torch.zeros(k))
    assert (ref - w).abs().max() <= w.abs().amax(1).max() / 254 + 1e-6  # half a step of the row's scale
    b, x = torch.randn(n, generator=g), torch.randn(m, k + 3, generator=g)[:, :k]
    torch.testing.assert_close(cpu_kernels.gemv(x, w8, b, isa=isa), F.linear(x, ref, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_kernels.gemv(x, w8, isa=isa), F.linear(x, ref), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="int8_copy"):
        cpu_kernels.gemv(x, w8.clone(), isa=isa)


@needs_avx512
@pytest.mark.parametrize("m", range(1, GEMV_M_MAX + 2))
@pytest.mark.parametrize("k", [1, 15, 16, 17, 37, 64, 577])
def test_the_avx512_gemv_equals_the_avx2_gemv_and_f_linear(m, k, threads):
    """Every row count the kernel takes (and one more), K below, at and around the 16-wide register and its tail."""
    g = torch.Generator().manual_seed(m * 1000 + k)
    n = 5 if k < 16 else 203  # odd N: the last thread chunk is short
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(m, k + 3, generator=g)[:, :k]
    y512, y2 = cpu_kernels.gemv(x, w, b, isa="avx512"), cpu_kernels.gemv(x, w, b, isa="avx2")
    torch.testing.assert_close(y512, y2, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y512, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_kernels.gemv(x, w, isa="avx512"), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_avx512
def test_the_gemv_runs_avx512_where_the_cpu_has_it_unless_held_to_avx2(kernel_settings):
    assert cpu_kernels.isa() == ("avx2" if cpu_kernels.settings().isa == "avx2" else "avx512")
    x, w = torch.randn(3, 40), torch.randn(9, 40)
    for isa in ("avx2", "avx512"):
        kernel_settings(KernelSettings(isa=isa, choice="native"))
        assert cpu_kernels.isa() == isa
        assert torch.equal(cpu_kernels.gemv(x, w), cpu_kernels.gemv(x, w, isa=isa))


@needs_kernels
@pytest.mark.skipif(cpu_kernels.cpu_has_avx512(), reason="this CPU has AVX-512: the test is for one without")
def test_a_cpu_without_avx512_never_runs_it(kernel_settings):
    kernel_settings(KernelSettings(isa="avx512", choice="native"))  # asked for, not there: AVX2 with a warning
    assert cpu_kernels.isa() == "avx2"
    x, w = torch.randn(2, 40), torch.randn(9, 40)
    torch.testing.assert_close(cpu_kernels.gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="AVX-512"):
        cpu_kernels.gemv(x, w, isa="avx512")
    with pytest.raises(RuntimeError, match="AVX-512"):
        cpu_kernels.soft_ce_(torch.randn(2, 40), torch.randn(2, 40), isa="avx512")


def test_kernel_settings_refuse_an_unknown_isa_or_choice():
    with pytest.raises(ValueError, match="isa"):
        KernelSettings(isa="avx1024")
    with pytest.raises(ValueError, match="choice"):
        KernelSettings(choice="fastest")


@needs_kernels
def test_gemv_reads_strided_rows_and_large_outputs(threads):
    torch.manual_seed(0)
    wide = torch.randn(5, 700)
    x = wide[:, 50:626]  # rows 700 floats apart, not contiguous
    w = torch.randn(49152, 576)  # an lm_head: split over threads
    out = cpu_kernels.gemv(x, w)
    assert out.shape == (5, 49152) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="575 columns"):
        cpu_kernels.gemv(torch.randn(1, 575), w)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("k", [7, 64, 576])
def test_rms_norm_equals_torch(m, k):
    torch.manual_seed(k)
    x, w = torch.randn(m, k + 3)[:, :k], torch.randn(k)  # strided rows too
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (k,), w, 1e-5),
                               rtol=1e-5, atol=1e-5)


@needs_kernels
def test_layers_take_the_kernels_in_inference_and_autograd_in_training():
    torch.manual_seed(1)
    lin, norm = Linear(64, 96, bias=True), RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    x = torch.randn(GEMV_M_MAX, 64)
    with torch.inference_mode():
        assert torch.equal(lin(x), cpu_kernels.gemv(x, lin.weight, lin.bias))
        assert torch.equal(norm(x), cpu_kernels.rms_norm(x, norm.weight, 1e-6))
    xg = x.clone().requires_grad_(True)
    lin(norm(xg)).sum().backward()
    assert xg.grad is not None and lin.weight.grad is not None and norm.weight.grad is not None


@pytest.fixture
def kernel_settings():
    """`cpu_kernels.configure`, for the test to set what it needs; the settings before it come back afterwards."""
    before = cpu_kernels.settings()
    yield cpu_kernels.configure
    cpu_kernels.configure(before)


def test_build_is_cached_and_atomic(tmp_path):
    cc = cpu_kernels.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    assert cpu_kernels.find_compiler("no-such-compiler") == cc  # a compiler that is not there: the usual ones
    first = cpu_kernels.build_library(cc, tmp_path)
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build_library(cc, tmp_path) == first and first.stat().st_mtime_ns == mtime  # reused
    # no temporary left behind: the library, its build record and the build lock
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, cpu_kernels.record_path(first).name,
                                                                ".build.lock"])


def test_a_failed_build_names_the_source(tmp_path):
    cc = cpu_kernels.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    bad = tmp_path / "bad.c"
    bad.write_text("int broken( {\n")
    with pytest.raises(RuntimeError, match="bad.c"):
        cpu_kernels.build_library(cc, tmp_path / "out", source=bad)
    assert [p.name for p in (tmp_path / "out").iterdir()] == [".build.lock"]  # no library, no record


def test_switched_off_falls_back_to_torch_paths(kernel_settings):
    was = cpu_kernels.available()
    kernel_settings(KernelSettings(enabled=False))
    assert not cpu_kernels.available() and cpu_kernels.unavailable_reason() == "switched off"
    lin = Linear(32, 16)
    x = torch.randn(1, 32)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    kernel_settings(KernelSettings(choice="native"))  # decided again, on the build already made
    assert cpu_kernels.available() == was


def test_the_commands_take_the_settings_from_the_environment(kernel_settings, tmp_path):
    assert kernel_settings_from_env({}) == KernelSettings(off_reason="MTP_TRAIN_CPU_KERNELS=0")
    env = {"MTP_TRAIN_CPU_KERNELS": "0", "MTP_TRAIN_KERNEL_DIR": str(tmp_path), "CC": "clang"}
    assert kernel_settings_from_env(env) == KernelSettings(enabled=False, cache_dir=tmp_path, compiler="clang",
                                                           off_reason="MTP_TRAIN_CPU_KERNELS=0")
    assert kernel_settings_from_env({"MTP_TRAIN_CPU_KERNELS": "1", "MTP_TRAIN_KERNEL_DIR": "", "CC": "",
                                     "MTP_TRAIN_KERNEL_ISA": "", "MTP_TRAIN_KERNEL_CHOICE": ""}) == \
        kernel_settings_from_env({})  # empty values keep the defaults
    forced = kernel_settings_from_env({"MTP_TRAIN_KERNEL_ISA": "avx2", "MTP_TRAIN_KERNEL_CHOICE": "torch"})
    assert (forced.isa, forced.choice) == ("avx2", "torch")
    with pytest.raises(ValueError, match="choice"):
        kernel_settings_from_env({"MTP_TRAIN_KERNEL_CHOICE": "quick"})
    kernel_settings(kernel_settings_from_env({"MTP_TRAIN_CPU_KERNELS": "0"}))
    assert not cpu_kernels.available() and cpu_kernels.unavailable_reason() == "MTP_TRAIN_CPU_KERNELS=0"


@needs_kernels
@pytest.mark.parametrize("head_dim", [16, 64, 6])
def test_rope_in_place_equals_apply_rotary(head_dim):
    from mtp_train.layers.rotary import apply_rotary

    torch.manual_seed(head_dim)
    t, heads = 5, 3
    qkv = torch.randn(t, heads * head_dim + 7)  # trailing columns (v) stay untouched
    ang = torch.randn(t, 1, head_dim // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    want = apply_rotary(qkv[:, :heads * head_dim].view(t, heads, head_dim), cos, sin).reshape(t, -1)
    tail = qkv[:, heads * head_dim:].clone()
    cpu_kernels.rope_(qkv, heads, head_dim, cos, sin)
    torch.testing.assert_close(qkv[:, :heads * head_dim], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * head_dim:], tail)


@needs_kernels
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (40, 2)])
@pytest.mark.parametrize("head_dim", [40, 20, 136])  # the kernel's blocks: 8-wide (and a tail), 64 columns, 64 + 8
def test_paged_attention_equals_the_gathered_sdpa_path(window, heads, head_dim, threads):
    """The kernel's attention equals gather + SDPA, and the new tokens' K/V it writes land where torch puts them."""
    from mtp_train.layers.attention import AttentionMetadata, make_attention_backend

    hq, hkv = heads
    torch.manual_seed(hq)
    backend = make_attention_backend("torch", hq, hkv, head_dim, window)
    cache = torch.randn(40, 2, 3, hkv, head_dim)
    qo, kv = [1, 4, 2], [7, 13, 9]  # a decode row and two verify runs in one step, pages of 3
    pages = [[5, 0, 2], [10, 11, 30, 13, 14], [20, 22, 21]]
    q, k, v = torch.randn(7, hq, head_dim) * 3, torch.randn(7, hkv, head_dim), torch.randn(7, hkv, head_dim)
    outs, pools = [], []
    for native in (True, False):
        meta = AttentionMetadata.build(qo, kv, pages, 3)
        pools.append(cache.clone())
        with torch.inference_mode():
            backend.prepare(meta)
            assert meta.backend_state["native"]
            meta.backend_state["native"] = native
            outs.append(backend.forward(q, k, v, pools[-1], meta))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=3e-5)
    assert torch.equal(pools[0], pools[1])  # the kernel wrote the new K/V where torch's indexed writes put them


@needs_kernels
@pytest.mark.parametrize("window", [None, 5, 19])  # 19: a window that starts inside an 8-key block
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("chunk", [None, 8, 12])  # 8, 12: long tokens split into chunks, attended apart and merged
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("isa", ["auto", "avx2"])  # auto: the AVX-512 blocks where the CPU has them
def test_paged_attention_over_pages_of_16_equals_the_gathered_sdpa_path(window, head_dim, chunk, sinks, isa, threads,
                                                                         monkeypatch, kernel_settings):
    """Pages of 16 and contexts of a few pages: the kernel's blocks of queries (a sequence's rows times the query
    heads of a K/V head) and of four keys, their tails, split spans, beside SDPA."""
    from mtp_train.layers.attention import AttentionMetadata, make_attention_backend

    kernel_settings(KernelSettings(isa=isa, choice="native"))
    if chunk is not None:
        monkeypatch.setattr(cpu_kernels, "ATTENTION_CHUNK", chunk)

    torch.manual_seed(head_dim)
    backend = make_attention_backend("torch", 6, 2, head_dim, window)
    cache = torch.randn(24, 2, 16, 2, head_dim)
    qo, kv = [1, 3, 2], [40, 53, 18]
    pages = [[5, 0, 2], [10, 11, 23, 13], [20, 22]]
    q, k, v = torch.randn(6, 6, head_dim) * 3, torch.randn(6, 2, head_dim), torch.randn(6, 2, head_dim)
    sink = torch.randn(6) * 2 if sinks else None  # GPT-OSS's: one more logit per head in the softmax, no value
    outs = []
    for native in (True, False):
        meta = AttentionMetadata.build(qo, kv, pages, 16)
        with torch.inference_mode():
            backend.prepare(meta)
            meta.backend_state["native"] = native
            outs.append(backend.forward(q, k, v, cache.clone(), meta, sinks=sink))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=3e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_paged_attention_of_one_sequence_splits_its_queries_over_the_threads(rows, isa, threads, kernel_settings):
    """One sequence's decode or verify step over 200 cached tokens and 2 K/V heads: fewer (K/V head, chunk) tasks
    than two a thread, so each one's query vectors are split in parts, tasks of their own; SDPA's answer."""
    from mtp_train.layers.attention import AttentionMetadata, make_attention_backend

    kernel_settings(KernelSettings(isa=isa, choice="native"))
    torch.manual_seed(rows)
    backend = make_attention_backend("torch", 8, 2, 64, None)
    cache = torch.randn(14, 2, 16, 2, 64)
    q, k, v = torch.randn(rows, 8, 64) * 3, torch.randn(rows, 2, 64), torch.randn(rows, 2, 64)
    outs = []
    for native in (True, False):
        meta = AttentionMetadata.build([rows], [200], [list(range(13))], 16)
        with torch.inference_mode():
            backend.prepare(meta)
            meta.backend_state["native"] = native
            outs.append(backend.forward(q, k, v, cache.clone(), meta))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=3e-5)


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"])
def test_model_decode_and_verify_equal_the_torch_paths(tiny_checkpoints, family):
    """Whole-model steps through the paged cache: the native paths give torch's logits and hidden states."""
    from mtp_train.engine import ModelRunner, Sequence
    from mtp_train.models import load_model

    model = load_model(tiny_checkpoints[family][0], dtype="float32")
    vocab = model.args.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 19, 33)]  # the mistral window is 16: the longer ones slide
    outs = []
    for native in (True, False):
        runner = ModelRunner.create(model, num_pages=64, page_size=4)
        seqs = [Sequence.new(i, p) for i, p in enumerate(prompts)]
        steps = []
        with torch.inference_mode(), (nullcontext() if native else cpu_kernels.disabled()):
            runner.run(seqs)
            for step in range(6):  # decode steps, then verify steps of 3 new tokens
                for s in seqs:
                    s.token_ids.extend([(7 * step + s.seq_id) % vocab] * (1 if step < 3 else 3))
                out = runner.run(seqs, logits="all")
                steps.append((out.hidden, out.logits))
        outs.append(steps)
    for (h_n, l_n), (h_t, l_t) in zip(*outs):
        torch.testing.assert_close(h_n, h_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l_n, l_t, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_a_decoder_layer_in_one_native_call_equals_the_layer_op_by_op(tiny_checkpoints, family, weights,
                                                                      monkeypatch):
    """Decode, verify and tree steps: the whole stack of layers runs as one `decoder_stack` call, or (where the stack
    steps aside) every layer as one `decoder_layer` call (qkv bias, q/k norms, a sliding window, bfloat16 and int8
    weight copies as a head streams them), and each gives the op-by-op layers' hidden states (those asked for too),
    logits and K/V pages."""
    from mtp_train.engine import ModelRunner, Sequence
    from mtp_train.layers.linear import stream_linears
    from mtp_train.models import load_model
    from mtp_train.models.base import CausalLM
    from mtp_train.models.families import llama

    model = load_model(tiny_checkpoints[family][0], dtype="float32")
    if weights != "fp32":
        assert stream_linears(model.model.layers, weights) > 0
    vocab, n_layers = model.args.vocab_size, model.args.num_layers
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
    calls: dict[str, list[int]] = {"stack": [], "layer": []}
    real_stack, real_layer = cpu_kernels.decoder_stack, cpu_kernels.decoder_layer
    monkeypatch.setattr(cpu_kernels, "decoder_stack",
                        lambda *a, **k: calls["stack"].append((len(a[0]), a[1].shape[0])) or real_stack(*a, **k))
    monkeypatch.setattr(cpu_kernels, "decoder_layer", lambda *a: calls["layer"].append(a[1].shape[0]) or real_layer(*a))
    outs = []
    for way in ("stack", "layer", "op by op"):
        if way == "layer":
            monkeypatch.setattr(CausalLM, "_native_plans", lambda self, *a: None)
        if way == "op by op":
            monkeypatch.setattr(llama.DecoderLayer, "native_plan", lambda self, *a: None)
        runner = ModelRunner.create(model, num_pages=64, page_size=4)
        seqs = [Sequence.new(i, p) for i, p in enumerate(prompts)]
        steps = []
        with torch.inference_mode():
            runner.run(seqs)
            for step in range(5):  # decode steps, verify steps of 3 new tokens, then a tree of 4 (root, 2, 1)
                rows = 1 if step < 2 else 3 if step < 4 else 4
                for s in seqs:
                    s.token_ids.extend([(7 * step + s.seq_id + j) % vocab for j in range(rows)])
                tree = [[-1, 0, 0, 1]] * len(seqs) if rows == 4 else None
                out = runner.run(seqs, logits="all", tree=tree, hidden_layers=(0, 1, n_layers))
                steps.append((out.hidden, out.logits, [out.layers[j] for j in (0, 1, n_layers)]))
        outs.append((steps, [c.clone() for c in runner.kv.layers]))
        row_counts = [r * len(seqs) for r in (1, 1, 3, 3, 4)]
        if way == "stack":
            assert calls == {"stack": [(n_layers, m) for m in row_counts], "layer": []}
        if way == "layer":
            assert calls["layer"] == [m for m in row_counts for _ in range(n_layers)]
    (torch_steps, torch_kv) = outs[-1]
    for fused_steps, fused_kv in outs[:-1]:
        for (h_n, l_n, s_n), (h_t, l_t, s_t) in zip(fused_steps, torch_steps):
            torch.testing.assert_close(h_n, h_t, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(l_n, l_t, rtol=1e-5, atol=1e-5)
            for a, b in zip(s_n, s_t):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(fused_kv, torch_kv):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_disabled_switches_every_path_off_and_back():
    was = cpu_kernels.available()
    with cpu_kernels.disabled():
        assert not cpu_kernels.available()
        with cpu_kernels.disabled():
            assert not cpu_kernels.available()
        assert not cpu_kernels.available()
    assert cpu_kernels.available() == was


@needs_kernels
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_kernels_share_torchs_openmp_runtime():
    """Loading the kernels adds no OpenMP runtime: their parallel regions run on torch's own threads.

    (Other libraries may vendor theirs under another soname, e.g. sentencepiece; those are not ours to share.)
    """
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch does not run on OpenMP")
    torch_lib = os.path.dirname(torch.__file__)
    assert any(r.startswith(torch_lib) for r in cpu_kernels._openmp_runtimes())
    assert cpu_kernels._threads_ok


@needs_kernels
def test_serves_only_float32_cpu_inference():
    x, w = torch.randn(2, 8), torch.randn(8)
    assert cpu_kernels.serves(x, w)
    assert not cpu_kernels.serves(x.bfloat16(), w) and not cpu_kernels.serves(x, w.double())
    wg = w.clone().requires_grad_(True)
    assert not cpu_kernels.serves(x, wg)  # autograd needs torch's ops
    with torch.no_grad():
        assert cpu_kernels.serves(x, wg)
    with cpu_kernels.disabled():
        assert not cpu_kernels.serves(x, w)


@needs_kernels
@pytest.mark.parametrize("v", [3, 96, 8195])
def test_soft_ce_equals_torch(v, threads):
    """Per-row CE, target argmax, rank of it among the head's logits, α = Σ min(q, p), and softmax(z) - softmax(t)
    over z."""
    g = torch.Generator().manual_seed(v)
    t = torch.randn(37, v, generator=g) * 3
    z = (t + torch.randn(37, v, generator=g) * 2).contiguous()  # close enough that some rows rank 0, 1, 2
    p = t.softmax(-1)
    ref_ce = torch.logsumexp(z, -1) - (p * z).sum(-1)
    ref_best = t.argmax(-1)
    ref_rank = (z > z.gather(1, ref_best[:, None])).sum(-1)
    ref_dz = z.softmax(-1) - p
    ref_alpha = torch.minimum(z.softmax(-1), p).sum(-1)
    zz, tt = z.clone(), t.clone()
    ce, best, rank, alpha = cpu_kernels.soft_ce_(zz, tt)
    torch.testing.assert_close(ce, ref_ce)
    torch.testing.assert_close(alpha, ref_alpha)
    assert best.tolist() == ref_best.tolist() and rank.tolist() == ref_rank.tolist()
    torch.testing.assert_close(zz, ref_dz)
    if v > 3:
        assert {0, 1, 2} <= set(rank.tolist())  # a test that can tell top-1 from top-3


@needs_avx512
@pytest.mark.parametrize("v", [1, 15, 16, 17, 96, 8195])
def test_the_avx512_soft_ce_equals_the_avx2_soft_ce(v, threads):
    """Both bodies, V below, at and around the 16-wide register: the same CE, argmax, rank and gradient."""
    g = torch.Generator().manual_seed(v)
    t = torch.randn(21, v, generator=g) * 3
    z = (t + torch.randn(21, v, generator=g) * 2).contiguous()
    outs = []
    for isa in ("avx512", "avx2"):
        zz, tt = z.clone(), t.clone()
        outs.append((*cpu_kernels.soft_ce_(zz, tt, isa=isa), zz))
    (ce5, best5, rank5, a5, dz5), (ce2, best2, rank2, a2, dz2) = outs
    torch.testing.assert_close(ce5, ce2)
    torch.testing.assert_close(a5, a2)
    torch.testing.assert_close(dz5, dz2)
    assert best5.tolist() == best2.tolist() and rank5.tolist() == rank2.tolist()
    torch.testing.assert_close(ce5, torch.logsumexp(z, -1) - (t.softmax(-1) * z).sum(-1))


# --- only the library built here is ever loaded -------------------------------------------------------------------

PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int mtp_gemv_f32(void) { return 0; }
"""


def _library_name(tmp_path) -> str:
    """The name the kernels' build takes in any folder (the hash of source and flags)."""
    cc = cpu_kernels.find_compiler()
    return cpu_kernels.build_library(cc, tmp_path / "probe").name


def _plant(tmp_path, at) -> tuple:
    """A shared object at `at` whose constructor would create a marker file when loaded; (marker, its bytes)."""
    marker = tmp_path / "planted-ran"
    src = tmp_path / "planted.c"
    src.write_text(PLANTED_C % marker)
    res = subprocess.run([cpu_kernels.find_compiler(), "-shared", "-fPIC", str(src), "-o", str(at)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return marker, at.read_bytes()


def _kernels_work() -> None:
    x, w = torch.randn(2, 40), torch.randn(7, 40)
    torch.testing.assert_close(cpu_kernels.gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "kernel" in r.getMessage()]


@needs_kernels
@pytest.mark.parametrize("record", ["none", "of-the-real-build"])
def test_a_planted_library_is_never_loaded_but_rebuilt(tmp_path, kernel_settings, caplog, record):
    """A shared object put under the library's name (with no build record, or beside the record of the real build)
    is not loaded: its constructor never runs; it is rebuilt, with one warning naming it, and the kernels work."""
    name = _library_name(tmp_path)
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    if record == "of-the-real-build":
        real = cpu_kernels.build_library(cpu_kernels.find_compiler(), cache)
        assert real.name == name
    lib = cache / name
    marker, planted = _plant(tmp_path, lib)
    kernel_settings(KernelSettings(cache_dir=cache))
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    assert not marker.exists()  # the planted constructor never ran
    assert lib.read_bytes() != planted and cpu_kernels.verify_library(lib, cpu_kernels.SOURCE.read_bytes()) == ""
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and f"not loading {lib}" in warnings[0] and "rebuilding it" in warnings[0], warnings
    _kernels_work()


@needs_kernels
@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_corrupt_library_is_rebuilt_and_the_kernels_work(tmp_path, kernel_settings, caplog, damage):
    cache = tmp_path / "kernels"
    lib = cpu_kernels.build_library(cpu_kernels.find_compiler(), cache)
    good = lib.read_bytes()
    bad = good[: len(good) // 3] if damage == "truncated" else good[:-64] + bytes(b ^ 0xFF for b in good[-64:])
    lib.write_bytes(bad)
    assert "sha256" in cpu_kernels.verify_library(lib, cpu_kernels.SOURCE.read_bytes())
    kernel_settings(KernelSettings(cache_dir=cache))
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    assert lib.read_bytes() == good  # the same build again
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and f"not loading {lib}" in warnings[0] and "sha256" in warnings[0], warnings
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    _kernels_work()


@needs_kernels
def test_a_folder_others_can_write_is_not_used(tmp_path, kernel_settings, caplog):
    """In a folder writable by others nothing is loaded (a library and its record could be anyone's): the kernels
    stay off with one warning naming the folder and the fix; the planted library's constructor never runs."""
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    marker, _ = _plant(tmp_path, cache / _library_name(tmp_path))
    kernel_settings(KernelSettings(cache_dir=cache))
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert not cpu_kernels.available()
    assert not marker.exists()
    assert "writable by others" in cpu_kernels.unavailable_reason() and f"chmod go-w {cache}" in \
        cpu_kernels.unavailable_reason()
    assert len(_warnings(caplog)) == 1


@needs_kernels
def test_a_link_to_a_private_folder_is_followed(tmp_path, kernel_settings):
    """A kernel folder that is a link leads to its target, which is checked (and used) like the folder itself."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    lib = cpu_kernels.build_library(cpu_kernels.find_compiler(), link)
    assert lib.parent == real.resolve() and lib.is_file()
    real.chmod(0o775)
    with pytest.raises(cpu_kernels.KernelDirError, match=f"{link} \\(a link to {real.resolve()}\\) is writable"):
        cpu_kernels.build_library(cpu_kernels.find_compiler(), link)


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["mtp", "eagle1", "mtp-aux", "eagle3", "eagle3.1"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_a_chain_heads_step_in_one_native_call_equals_its_step_op_by_op(tiny_checkpoints, family, kind, weights,
                                                                        monkeypatch):
    """Catch-up rows from the target, chained draft rows from the head's own output and a tree's rows: each head
    step runs as one `head_step` call (mtp with every norm and a draft vocabulary, eagle1 with none, an aux head's
    steps from the target's aux layers through its aux fc and from its own output, eagle3 with its layer over
    [norm(e) ; norm(g)] and its pre-norm features, EAGLE-3.1 with its aux norms and normed features; bfloat16 and
    int8 copies as `stream_weights` makes them), and gives the op-by-op step's features, logits and K/V pages."""
    from mtp_train.config import HeadConfig
    from mtp_train.engine.kv_cache import KVCache
    from mtp_train.heads import build_head
    from mtp_train.layers.attention import AttentionMetadata

    path = tiny_checkpoints[family][0]
    cfg = {"mtp": HeadConfig(type="mtp", draft_vocab_size=64),
           "eagle1": HeadConfig(type="eagle1"),
           "mtp-aux": HeadConfig(type="mtp", features="aux", aux_layers=[1, 2]),
           "eagle3": HeadConfig(type="eagle3", aux_layers=[1, 2], draft_vocab_size=64),
           "eagle3.1": HeadConfig.of(type="eagle3", aux_layers=[1, 2], draft_vocab_size=64, aux_norm=True,
                                  norm_output=True)}[kind]
    head = build_head(cfg, path, dtype="float32").eval()
    with torch.no_grad():  # weights away from their init (norms at 1, zero biases) so that every part counts
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    head.stream_weights(None if weights == "fp32" else weights)
    h, vocab = head.args.hidden_size, head.args.vocab_size
    g = torch.Generator().manual_seed(0)
    # (rows per sequence, kv lengths after the step, from_target, tree parents or None)
    steps = [([5, 7], [5, 7], True, None), ([1, 1], [6, 8], True, None), ([3, 3], [9, 11], True, None),
             ([1, 1], [10, 12], False, None), ([4, 4], [14, 16], True, [[-1, 0, 0, 1]] * 2),
             ([2, 2], [16, 18], False, None)]
    inputs = []
    for qo, _, from_target, _ in steps:
        width = head.input_width if from_target else h
        inputs.append((torch.randn(sum(qo), width, generator=g), torch.randint(0, vocab, (sum(qo),), generator=g)))
    calls = []
    real = cpu_kernels.head_step
    monkeypatch.setattr(cpu_kernels, "head_step", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    outs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(type(head), "native_step", lambda self, *a: None)
        layers, layout = head.kv_shape
        kv = KVCache(layers, 16, 4, layout, dtype=torch.float32)
        pages = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        got = []
        with torch.inference_mode():
            for (qo, kv_lens, from_target, tree), (hidden, ids) in zip(steps, inputs):
                meta = AttentionMetadata.build(qo, kv_lens, pages, 4)
                if tree is not None:
                    meta.set_tree(tree)
                last = meta.qo_indptr[1:].long() - 1
                out = head(hidden, ids, meta, kv.layers[0], from_target=from_target, logits_indices=last)
                got.append((out.hidden, out.logits))
        outs.append((got, kv.layers[0].clone()))
        if fused:  # the prefill stays op by op (no native attention there)
            assert calls == [sum(q) for q, _, _, _ in steps[1:]]
    (fused_steps, fused_kv), (torch_steps, torch_kv) = outs
    for (h_n, l_n), (h_t, l_t) in zip(fused_steps, torch_steps):
        torch.testing.assert_close(h_n, h_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l_n, l_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_kv, torch_kv, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_head_step_refuses_a_token_outside_the_embedding(tiny_checkpoints):
    from mtp_train.config import HeadConfig
    from mtp_train.engine.kv_cache import KVCache
    from mtp_train.heads import build_head
    from mtp_train.layers.attention import AttentionMetadata

    head = build_head(HeadConfig(type="mtp"), tiny_checkpoints["llama"][0], dtype="float32").eval()
    layers, layout = head.kv_shape
    kv = KVCache(layers, 4, 4, layout, dtype=torch.float32)
    with torch.inference_mode():
        meta = AttentionMetadata.build([1], [3], [[0]], 4)
        ids = torch.tensor([head.args.vocab_size])
        with pytest.raises(IndexError, match="outside the embedding"):
            head(torch.randn(1, head.args.hidden_size), ids, meta, kv.layers[0], from_target=True,
                 logits_indices=torch.tensor([0]))


@needs_kernels
def test_the_stacks_plans_follow_the_weights_from_step_to_step(tiny_checkpoints, monkeypatch):
    """`CausalLM._native_plans` keeps the last step's plans; a weight changed in place, a bfloat16 copy switched on
    and remade, a parameter replaced: each next step computes with the weights as they are then."""
    from mtp_train.engine import ModelRunner, Sequence
    from mtp_train.layers.linear import stream_linears
    from mtp_train.models import load_model
    from mtp_train.models.base import CausalLM

    model = load_model(tiny_checkpoints["llama"][0], dtype="float32")
    vocab = model.args.vocab_size
    prompt = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    real = CausalLM._native_plans

    def logits(stacked: bool) -> torch.Tensor:
        monkeypatch.setattr(CausalLM, "_native_plans", real if stacked else lambda self, *a: None)
        runner = ModelRunner.create(model, num_pages=16, page_size=4)
        seq = Sequence.new(0, prompt)
        with torch.inference_mode():
            runner.run([seq])
            seq.token_ids.append(5)
            return runner.run([seq], logits="all").logits

    qkv = model.model.layers[1].self_attn.qkv_proj
    changes = [lambda: None,
               lambda: qkv.weight.mul_(1.5),
               lambda: stream_linears(model.model.layers, "bf16"),
               lambda: qkv.weight.mul_(0.5),  # the copy is made again
               lambda: setattr(qkv, "weight", torch.nn.Parameter(torch.randn_like(qkv.weight), requires_grad=False))]
    for change in changes:
        with torch.no_grad():
            change()
        torch.testing.assert_close(logits(True), logits(False), rtol=1e-5, atol=1e-5)
    assert model._stack_memo is not None and model._stack_memo.plans[1][1].weights.wqkv.dtype == torch.bfloat16


@needs_kernels
def test_a_heads_kept_step_plan_follows_its_weights_from_step_to_step(tiny_checkpoints, monkeypatch):
    """`MTPHead.native_step` keeps its plans from step to step; a weight changed in place, a bfloat16 copy switched on
    and remade, a parameter replaced, the frozen lm_head changed under a draft vocabulary: each next step computes
    with the weights as they are then (the op-by-op step's features and logits)."""
    from mtp_train.config import HeadConfig
    from mtp_train.engine.kv_cache import KVCache
    from mtp_train.head_types.mtp.head import MTPHead
    from mtp_train.heads import build_head
    from mtp_train.layers.attention import AttentionMetadata

    head = build_head(HeadConfig(type="mtp", draft_vocab_size=64), tiny_checkpoints["llama"][0],
                      dtype="float32").eval()
    g = torch.Generator().manual_seed(1)
    hidden, ids = torch.randn(2, head.input_width, generator=g), torch.randint(0, head.args.vocab_size, (2,),
                                                                             generator=g)
    real = MTPHead.native_step

    def step(native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(MTPHead, "native_step", real if native else lambda self, *a: None)
        layers, layout = head.kv_shape
        kv = KVCache(layers, 8, 4, layout, dtype=torch.float32)
        with torch.inference_mode():
            meta = AttentionMetadata.build([2], [6], [[0, 1]], 4)
            out = head(hidden, ids, meta, kv.layers[0], from_target=True, logits_indices=torch.tensor([0, 1]))
        return out.hidden, out.logits

    fc, qkv = head.fc, head.layers[0].self_attn.qkv_proj
    lm = head.require_frozen().lm_head
    changes = [lambda: None,
               lambda: fc.weight.mul_(1.5),
               lambda: head.stream_weights("bf16"),
               lambda: qkv.weight.mul_(0.5),  # the copy is made again
               lambda: lm.mul_(2.0),  # the draft vocabulary's rows (and their copy) are taken again
               lambda: setattr(fc, "weight", torch.nn.Parameter(torch.randn_like(fc.weight), requires_grad=False))]
    calls = []
    monkeypatch.setattr(cpu_kernels, "head_step", lambda *a, f=cpu_kernels.head_step: calls.append(1) or f(*a))
    for i, change in enumerate(changes):
        with torch.no_grad():
            change()
        (h_n, l_n), (h_t, l_t) = step(True), step(False)
        assert len(calls) == i + 1  # the native step ran
        torch.testing.assert_close(h_n, h_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l_n, l_t, rtol=1e-5, atol=1e-5)
    assert head._step_memo is not None and head._step_memo.plans[(2, 2)]
