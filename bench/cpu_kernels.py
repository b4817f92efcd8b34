"""The native CPU kernels against the torch operators they replace, one kernel at a time.

Shapes are SmolLM2-135M's (hidden 576, MLP 1536, 9 query / 3 KV heads of 64), and every gemv round runs 30 layers'
worth of distinct weights (q|k|v, o, gate|up, down: 425 MB in fp32) so that nothing stays in cache, as in a real
decode step. Each line: ours vs the baseline, alternately timed, median of per-round ratios (> 1 = ours faster).

* gemv, M = 1, 2, 4, 8, 16 rows: against `F.linear` (what transformers runs), against MKL's pre-packed one-row GEMM
  (M = 1) and against `(W @ xᵀ)ᵀ` (M > 1), the paths `Linear` takes without the kernels; plus the lm_head
  (49152 × 576) at M = 1;
* the gemv against only reading its weights (`gemv_m{M}_vs_read_floor`, bench/floor.c), and what each further row
  costs (least squares over M = 1..5, fastest rounds) beside the same reads with 1–3 FMAs on every loaded vector and
  the time a row's multiply-adds take at this core's measured peak FMA rate: why a verified row is not free here
  (each gemv round is 120 `cpu_kernels.gemv` calls, whose Python side adds the same to every M: the slope is the
  kernel's);
* rms_norm and rope_ on one decode row, against torch's composites;
* paged attention of one decode token over 256 cached tokens in pages of 16, against gathering the pages and SDPA;
* SmolLM2's 30 decoder layers over 1, 2 and 4 rows (256 cached tokens), each layer in one native call against the
  same layer op by op (`layer_m{M}_vs_op_by_op`), and all 30 in one call (`decoder_stack`) against a call per layer
  (`stack_m{M}_vs_layer_calls`).

On a CPU with AVX-512 the gemv's two bodies are also timed against each other at every M
(`gemv_m{M}_avx512_vs_avx2`, > 1 = the AVX-512 body faster). The gemv over bfloat16 copies of the same weights (what a
head streams under `head_weights=bf16`) is timed against the float32 gemv at every M (`gemv_m{M}_bf16_vs_fp32`).

Last, what the first-use measurement of the native-or-torch choice costs on this machine (`kernel_choice.measure` of
each op's probe, not cached): `choice_measure_s` per op, and whether it finished within its deadline.

With `--baseline-source FILE.c` (e.g. an earlier `git show REV:mtp_train/layers/csrc/cpu_kernels.c`) that source is
compiled with the same flags and its gemv timed alternately against ours at every M, each on the body
`cpu_kernels.isa()` names (`gemv_m{M}_vs_baseline_source`; over the bfloat16 copies
`gemv_m{M}_bf16_vs_baseline_source`), and its paged attention against ours at 1, 2, 4 and 8 query rows over 256
and 1024 cached tokens, each call over another of 30 layers' pools so that the K/V come from memory as in a decode step
(`attention_t{T}_ctx{C}_vs_baseline_source`): how a change to a kernel is measured, in one process.

Usage: python -m bench.cpu_kernels [--repeat 5] [--baseline-source FILE.c] [--gemv-only]. The last line printed is
one JSON object.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import compare, parser, report
from mtp_train.layers import cpu_kernels, kernel_choice
from mtp_train.layers.attention import AttentionMetadata, make_attention_backend
from mtp_train.layers.linear import gemv_avx512
from mtp_train.layers.rotary import apply_rotary

H, INTER, HQ, HKV, D, LAYERS, VOCAB = 576, 1536, 9, 3, 64, 30, 49152


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline-source", default=None, help="another kernel source whose gemv ours is timed against")
    ap.add_argument("--gemv-only", action="store_true", help="the gemv's lines only (a kernel change's quick check)")
    args = ap.parse_args(argv)
    from mtp_train.cli.common import configure_from_env

    configure_from_env()  # MTP_TRAIN_CPU_KERNELS, MTP_TRAIN_KERNEL_DIR, CC, as the commands read them
    if not cpu_kernels.available():
        print(f"native CPU kernels unavailable here: {cpu_kernels.unavailable_reason()}")
        report({"available": False, "reason": cpu_kernels.unavailable_reason()})
        return {}
    torch.manual_seed(0)
    res: dict = {"threads": torch.get_num_threads(), "machine": platform.machine(), "isa": cpu_kernels.isa()}
    has_512 = cpu_kernels.cpu_has_avx512()

    shapes = [((HQ + 2 * HKV) * D, H), (H, HQ * D), (2 * INTER, H), (H, INTER)]
    weights = [torch.randn(n, k) for _ in range(LAYERS) for n, k in shapes]
    halves = [w.to(torch.bfloat16) for w in weights]
    mb = sum(w.numel() * 4 for w in weights) / 2**20
    packed = ([torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in weights]
              if torch.backends.mkl.is_available() else None)
    base_lib = _baseline_library(args.baseline_source) if args.baseline_source else None
    other = _baseline_gemv(base_lib) if base_lib is not None else None
    other16 = _baseline_gemv(base_lib, "bf16w") if base_lib is not None else None
    floor, wide = _floor_library(), cpu_kernels.isa() == "avx512"
    row_fns: dict[int, Callable[[], None]] = {}
    with torch.inference_mode():
        for m in (1, 2, 3, 4, 5, 8, 16):
            xs = {k: torch.randn(m, k) for k in (H, INTER, HQ * D)}

            def ours(xs=xs) -> None:
                for w in weights:
                    cpu_kernels.gemv(xs[w.shape[1]], w)

            def f_linear(xs=xs) -> None:
                for w in weights:
                    F.linear(xs[w.shape[1]], w)

            def torch_fast(xs=xs, m=m) -> None:  # what Linear runs without the kernels
                for i, w in enumerate(weights):
                    x = xs[w.shape[1]]
                    if m == 1 and packed is not None:
                        torch.ops.mkl._mkl_linear(x, packed[i], w, None, 1)
                    else:
                        torch.mm(w, x.t()).t().contiguous()

            t_ours, t_lin, r_lin = compare(ours, f_linear, repeat=args.repeat)
            _, _, r_fast = compare(ours, torch_fast, repeat=args.repeat)
            res[f"gemv_m{m}_vs_f_linear"] = r_lin
            res[f"gemv_m{m}_vs_torch_fast_path"] = r_fast
            res[f"gemv_m{m}_gb_s"] = mb / 1024 / t_ours
            row_fns[m] = ours
            _, t_floor, r_floor = compare(ours, lambda: _read(floor, weights, wide, 0), repeat=args.repeat)
            res[f"gemv_m{m}_vs_read_floor"] = r_floor
            print(f"gemv M={m:2d}: {r_floor:.2f}x the time to only read its weights ({t_floor * 1e3:.1f} ms)",
                  flush=True)
            def ours_bf16(xs=xs) -> None:
                for w in halves:
                    cpu_kernels.gemv(xs[w.shape[1]], w)

            _, _, r_bf16 = compare(ours_bf16, ours, repeat=args.repeat)
            res[f"gemv_m{m}_bf16_vs_fp32"] = r_bf16
            print(f"gemv M={m:2d}: over bfloat16 weights {r_bf16:.2f}x over float32", flush=True)
            if has_512:
                def on(isa: str, xs=xs) -> None:
                    for w in weights:
                        cpu_kernels.gemv(xs[w.shape[1]], w, isa=isa)

                _, _, r_isa = compare(lambda: on("avx512"), lambda: on("avx2"), repeat=args.repeat)
                res[f"gemv_m{m}_avx512_vs_avx2"] = r_isa
                print(f"gemv M={m:2d}: the AVX-512 body {r_isa:.2f}x the AVX2 body", flush=True)
            if other is not None:
                _, _, r_src = compare(ours, lambda xs=xs: [other(xs[w.shape[1]], w) for w in weights],
                                      repeat=args.repeat)
                res[f"gemv_m{m}_vs_baseline_source"] = r_src
                assert other16 is not None
                _, _, r_src16 = compare(ours_bf16, lambda xs=xs: [other16(xs[w.shape[1]], w) for w in halves],
                                        repeat=args.repeat)
                res[f"gemv_m{m}_bf16_vs_baseline_source"] = r_src16
                print(f"gemv M={m:2d}: {r_src:.2f}x the baseline source's ({r_src16:.2f}x over bfloat16 weights)",
                      flush=True)
            print(f"gemv M={m:2d}, {mb:.0f} MB of weights: {mb / 1024 / t_ours:.1f} GB/s; {r_lin:.2f}x F.linear "
                  f"({mb / 1024 / t_lin:.1f} GB/s), {r_fast:.2f}x Linear's torch path", flush=True)

        res.update(_row_cost(floor, wide, row_fns, weights, args.repeat))
        if args.gemv_only:
            report(res)
            return res

        lm_head, x = torch.randn(VOCAB, H), torch.randn(1, H)
        _, _, r = compare(lambda: cpu_kernels.gemv(x, lm_head), lambda: F.linear(x, lm_head), repeat=args.repeat)
        res["gemv_lm_head_vs_f_linear"] = r
        print(f"lm_head 49152x576, one row: {r:.2f}x F.linear", flush=True)

        row, w = torch.randn(1, H), torch.rand(H) + 0.5
        _, _, r = compare(lambda: cpu_kernels.rms_norm(row, w, 1e-5),
                          lambda: w * (row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + 1e-5)),
                          repeat=args.repeat * 200)
        res["rms_norm_vs_torch"] = r
        print(f"rms_norm, one row: {r:.2f}x torch's composite", flush=True)

        qkv = torch.randn(1, (HQ + 2 * HKV) * D)
        ang = torch.randn(1, 1, D // 2)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def torch_rope() -> None:
            q, k, _ = qkv.split([HQ * D, HKV * D, HKV * D], -1)
            apply_rotary(q.view(1, HQ, D), cos, sin), apply_rotary(k.view(1, HKV, D), cos, sin)

        _, _, r = compare(lambda: cpu_kernels.rope_(qkv, HQ + HKV, D, cos, sin), torch_rope,
                          repeat=args.repeat * 200)
        res["rope_vs_torch"] = r
        print(f"rope_, one row (q and k): {r:.2f}x torch's apply_rotary", flush=True)

        backend = make_attention_backend("torch", HQ, HKV, D)
        cache = torch.randn(64, 2, 16, HKV, D)
        q, k, v = torch.randn(1, HQ, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
        metas = []
        for native in (True, False):
            meta = AttentionMetadata.build([1], [256], [list(range(3, 19))], 16)
            backend.prepare(meta)
            meta.backend_state["native"] = native
            metas.append(meta)
        _, _, r = compare(lambda: backend.forward(q, k, v, cache, metas[0]),
                          lambda: backend.forward(q, k, v, cache, metas[1]), repeat=args.repeat * 50)
        res["paged_attention_vs_gather_sdpa"] = r
        print(f"paged attention, one token over 256 cached: {r:.2f}x gather + SDPA", flush=True)
        if base_lib is not None:
            res.update(_attention_vs_baseline(base_lib, args.repeat))
        res.update(_decoder_layers(args.repeat))

    import mtp_train.layers.linear  # noqa: F401  (registers the linears' probe)
    import mtp_train.train.divergences  # noqa: F401  (registers the fused loss's probe)

    res["choice_measure_s"], res["choice_complete"] = {}, {}
    for op, probe in sorted(kernel_choice.PROBES.items()):
        t0 = time.perf_counter()
        _, complete = kernel_choice.measure(probe)
        res["choice_measure_s"][op], res["choice_complete"][op] = time.perf_counter() - t0, complete
        print(f"native-or-torch measurement of {op}: {res['choice_measure_s'][op]:.2f} s (budget {probe.budget_s} s"
              f"{'' if complete else ', cut short'})", flush=True)
    report(res)
    return res


def _build(source: str | Path, name: str) -> Path:
    """A C source built with the kernels' flags into a temporary library `name`; its path."""
    import subprocess
    import tempfile

    lib_path = Path(tempfile.mkdtemp()) / name
    subprocess.run([os.environ.get("CC", "cc"), *cpu_kernels.CFLAGS, str(source), "-o", str(lib_path),
                    *cpu_kernels.LIBS], check=True)
    return lib_path


def _floor_library() -> ctypes.CDLL:
    """bench/floor.c built with the kernels' flags: `read_fma_f32` (the reads, with m FMAs a vector) and
    `fma_rate`."""
    lib = ctypes.CDLL(str(_build(Path(__file__).with_name("floor.c"), "floor.so")))
    lib.read_fma_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.read_fma_f32.restype = ctypes.c_float
    lib.fma_rate.argtypes = [ctypes.c_int, ctypes.c_long]
    lib.fma_rate.restype = ctypes.c_double
    return lib


def _read(floor: ctypes.CDLL, weights: list[torch.Tensor], wide: bool, m: int) -> None:
    """One round of bench/floor.c's reads over `weights` (float32), with m (0..3) FMAs on every loaded vector."""
    for w in weights:
        floor.read_fma_f32(w.data_ptr(), w.numel(), torch.get_num_threads(), int(wide), m)


def _row_cost(floor: ctypes.CDLL, wide: bool, fns: dict[int, Callable[[], None]], weights: list[torch.Tensor],
              repeat: int) -> dict:
    """What each further row costs the gemv over the 30 layers, beside three floors: only reading the weights, the
    same reads with m = 1..3 FMAs on every loaded vector (the rows' arithmetic with nothing else of the gemv's loop:
    what this core can hide behind its reads), and the time one row's multiply-adds take at the core's peak rate.

    M = 1..5 (the rows a verify or tree step streams) and the reads are timed in turn, round after round, and each
    keeps its fastest round: on a shared machine the slowest rounds are other jobs' (a median of 5 can still hold one).
    The cost of a row is the least-squares slope of the gemv's times over M.

    Args:
        floor: bench/floor.c's library; wide: whether the gemv runs its AVX-512 body.
        fns: M → one gemv round over the 30 layers; weights: those layers' weights (N, K) float32.
        repeat: rounds = 4 × repeat.
    """
    ms = [m for m in sorted(fns) if m <= 5]
    best = {("gemv", m): float("inf") for m in ms} | {("read", m): float("inf") for m in range(4)}
    for _ in range(4 * repeat):
        for kind, m in best:
            t0 = time.perf_counter()
            fns[m]() if kind == "gemv" else _read(floor, weights, wide, m)
            best[kind, m] = min(best[kind, m], time.perf_counter() - t0)
    gemv = {m: best["gemv", m] for m in ms}
    mean_m, mean_t = sum(ms) / len(ms), sum(gemv.values()) / len(ms)
    slope = sum((m - mean_m) * (gemv[m] - mean_t) for m in ms) / sum((m - mean_m) ** 2 for m in ms)
    rate = max(floor.fma_rate(int(wide), 20_000_000) for _ in range(3))  # vector FMAs / s, one core
    at_peak = sum(w.numel() for w in weights) / (16 if wide else 8) / rate / torch.get_num_threads()
    reads = {m: best["read", m] for m in range(4)}
    print("gemv, fastest rounds: " + ", ".join(f"M={m} {t * 1e3:.2f}" for m, t in gemv.items()) + " ms; reads "
          + ", ".join(f"with {m} FMA {t * 1e3:.2f}" for m, t in reads.items()) + " ms", flush=True)
    print(f"gemv: each further row +{slope * 1e3:.2f} ms ({slope / gemv[1]:.1%} of one row's time); its multiply-adds "
          f"at this core's peak ({rate / 1e9:.2f} G vector FMA/s) take {at_peak * 1e3:.2f} ms; on the bare reads "
          f"+{(reads[1] - reads[0]) * 1e3:.2f} / +{(reads[2] - reads[0]) * 1e3:.2f} / "
          f"+{(reads[3] - reads[0]) * 1e3:.2f} ms at 1 / 2 / 3 FMA", flush=True)
    return {"gemv_fastest_s": gemv, "read_fma_fastest_s": reads, "gemv_s_per_row": slope,
            "gemv_row_fraction": slope / gemv[1], "fma_rate_per_core": rate, "gemv_row_fma_s_at_peak": at_peak}


def _baseline_library(source: str) -> object:
    """Another kernel source built with our flags into a temporary library, its functions declared as ours."""
    return cpu_kernels._open(_build(source, "baseline.so"))[0]


def _baseline_gemv(lib: object, weights: str = "f32") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The baseline library's gemv over `weights` (f32, or bf16w: bfloat16 bits), on the body `cpu_kernels.isa()`
    names (ours runs there too): (x (M, K), w (N, K)) → y."""
    threads = torch.get_num_threads()
    fn = getattr(lib, f"mtp_gemv_{weights}" + ("_avx512" if cpu_kernels.isa() == "avx512" else ""))

    def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty(m, n)
        fn(x.data_ptr(), x.stride(0), w.data_ptr(), None, y.data_ptr(), n, m, n, k, threads)
        return y

    return gemv


def _attention_step(library: object | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    pools: list[torch.Tensor], step: tuple) -> Callable[[], object]:
    """One step's paged attention over every pool, through `cpu_kernels.paged_attention` on our build (None) or on
    `library` (the same Python wrapper around another build)."""
    def layers() -> object:
        saved = cpu_kernels._lib
        if library is not None:
            cpu_kernels._lib = library
        try:
            return [cpu_kernels.paged_attention(q, pool, step, D ** -0.5, None, k=k, v=v) for pool in pools]
        finally:
            cpu_kernels._lib = saved
    return layers


def _decoder_layers(repeat: int) -> dict[str, float]:
    """SmolLM2's 30 decoder layers (random weights) over 1, 2 and 4 rows of one sequence with 256 cached tokens, each
    layer in one native call (`DecoderLayer.native`) against the same layer op by op (its kernels one call each),
    and the 30 layers chained in ONE call (`cpu_kernels.decoder_stack`) against a call per layer:
    {layer_m{M}_vs_op_by_op: op-by-op s / one-call s, stack_m{M}_vs_layer_calls: per-layer calls s / stack s}."""
    from mtp_train.layers.attention.torch_backend import TorchBackend
    from mtp_train.models.families.llama import DecoderLayer, parse_config

    a = parse_config({"model_type": "llama", "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HQ,
                      "num_key_value_heads": HKV, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
                      "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                      "hidden_act": "silu"}, "SmolLM2's shapes")
    layers = [DecoderLayer(a, layer=i).eval() for i in range(LAYERS)]
    out: dict[str, float] = {}
    ps, ctx = 16, 256
    pages = ctx // ps + 1
    pools = [torch.randn(pages, 2, ps, HKV, D) for _ in range(LAYERS)]
    backend = TorchBackend(HQ, HKV, D)
    with torch.inference_mode():
        for m in (1, 2, 4):
            meta = AttentionMetadata.build([m], [ctx], [list(range(pages))], ps)
            backend.prepare(meta)
            x = torch.randn(m, H)
            ang = torch.randn(m, 1, D // 2)
            cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

            def run(one_call: bool, m: int = m, x: torch.Tensor = x, cos: torch.Tensor = cos,
                    sin: torch.Tensor = sin, meta: AttentionMetadata = meta) -> list[torch.Tensor]:
                outs = []
                for layer, pool in zip(layers, pools):
                    if one_call:
                        y = layer.native(x, cos, sin, backend, pool, meta)
                        assert y is not None, f"the layer did not run as one native call for {m} rows"
                    else:
                        layer.native = lambda *args: None  # the op-by-op path, this call only
                        y = layer(x, cos, sin, backend, pool, meta)
                        del layer.native
                    outs.append(y)
                return outs

            torch.testing.assert_close(run(True), run(False), rtol=1e-4, atol=1e-4)
            t_one, _, r = compare(lambda: run(True), lambda: run(False), repeat=repeat * 4)
            out[f"layer_m{m}_vs_op_by_op"] = r
            print(f"decoder layer, {m} row(s) over {ctx} cached, {LAYERS} layers: {t_one * 1e6 / LAYERS:.1f} us a "
                  f"layer in one call, {r:.2f}x the layer op by op", flush=True)
            plans = [layer.native_plan(x, backend, pool, meta) for layer, pool in zip(layers, pools)]
            use512 = gemv_avx512(m)

            def stack(x: torch.Tensor = x, cos: torch.Tensor = cos, sin: torch.Tensor = sin,
                      meta: AttentionMetadata = meta, plans: list = plans, use512: bool = use512) -> torch.Tensor:
                return cpu_kernels.decoder_stack(plans, x, cos, sin, pools, meta.backend_state["native_args"],
                                                 use512)[0]

            def chained(x: torch.Tensor = x, cos: torch.Tensor = cos, sin: torch.Tensor = sin,
                        meta: AttentionMetadata = meta) -> torch.Tensor:
                y = x
                for layer, pool in zip(layers, pools):
                    y = layer.native(y, cos, sin, backend, pool, meta)
                return y

            torch.testing.assert_close(stack(), chained(), rtol=1e-4, atol=1e-4)
            t_stack, _, r = compare(stack, chained, repeat=repeat * 4)
            out[f"stack_m{m}_vs_layer_calls"] = r
            print(f"decoder stack, {m} row(s): {t_stack * 1e6 / LAYERS:.1f} us a layer in one call for all "
                  f"{LAYERS}, {r:.2f}x a call per layer", flush=True)
    return out


def _attention_vs_baseline(lib: object, repeat: int) -> dict[str, float]:
    """Our paged attention against the baseline library's, one decode / verify step's calls (LAYERS layers' pools
    of SmolLM2's heads, pages of 16): {attention_t{T}_ctx{C}_vs_baseline_source: baseline s / ours s}."""
    out: dict[str, float] = {}
    ps = 16
    for ctx in (256, 1024):
        pages = ctx // ps + 1
        pools = [torch.randn(pages, 2, ps, HKV, D) for _ in range(LAYERS)]
        for t in (1, 2, 4, 8):
            meta = AttentionMetadata.build([t], [ctx], [list(range(pages))], ps)
            slots = meta.slot_pages * ps + meta.slot_offsets
            step = cpu_kernels.paged_attention_args(meta.block_tables, meta.qo_indptr, meta.positions, ctx,
                                                    slots=slots)
            q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
            ours, base = _attention_step(None, q, k, v, pools, step), _attention_step(lib, q, k, v, pools, step)
            torch.testing.assert_close(ours(), base(), rtol=1e-4, atol=1e-5)  # the same attention, whatever the speed
            t_ours, _, r = compare(ours, base, repeat=repeat * 10)
            out[f"attention_t{t}_ctx{ctx}_vs_baseline_source"] = r
            print(f"paged attention, {t} row(s) over {ctx} cached, {LAYERS} layers: {t_ours * 1e6 / LAYERS:.1f} us a "
                  f"layer, {r:.2f}x the baseline source's", flush=True)
    return out


if __name__ == "__main__":
    main()
