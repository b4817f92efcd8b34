"""A Linear layer with faster CPU paths for the few-row products of decode and verify steps.

On CPU, a fp32 `F.linear` over 1–128 rows is far from the memory bandwidth it could reach (its GEMM
packs the weight on every call). Measured on a 2-core AVX2 machine (bench.cpu_kernels: 30 layers'
worth of SmolLM2 weights per round, so that nothing stays in cache; bench.engine shows the effect on
decode):

* 1–16 rows (decode, verify): the native kernel of `cpu_kernels` streams the weight once, ~1.9× MKL's
  pre-packed GEMM and `F.linear` for one row, 1.1–1.6× `(W @ xᵀ)ᵀ` and 2–3× `F.linear` for 2–16 rows;
* without it, 1 row: MKL's pre-packed GEMM (`torch.ops.mkl._mkl_linear` with a weight packed once
  at load time), ~1.5× `F.linear`; 2–128 rows: `(W @ xᵀ)ᵀ`, ~2× `x @ Wᵀ`;
* more rows (prefill): `F.linear` is the fastest.

For 17–128 rows the rows are padded with zeros to a multiple of 8 (MKL's GEMM is ~1.4× faster there: a batch
that has shrunk to 45 or 63 sequences ran at ~0.7× the speed of 48 or 64), and a wide output such as the lm_head's
is made 2048 weight rows at a time (see `_small_m`).

Those figures are one machine's: which of the native kernel and the torch path takes m = 1..16 rows is measured
on the machine that runs it (`kernel_choice`, op "linear", one class per row count, timed over a set of weights
larger than the last-level cache) and cached with the kernel build; on a CPU with AVX-512, so is which body of the
kernel (AVX-512 or AVX2) serves each row count (op "gemv_isa", measured first).

The results equal `F.linear` up to floating-point summation order. These paths are used only for
inference (no autograd through them); training and GPUs always take `F.linear`.

A draft head may stream its weights as bfloat16 or int8 copies (`stream_linears`): the target verifies every token
a head drafts, so rounding the head's weights changes which tokens it proposes a little, never what is accepted, and
its few-row products read half (bfloat16: 1.7–2× faster for 1–3 rows from memory) or a quarter of the bytes. Its
1–16-row products then take the native gemv over the copy where that measured faster than the float32 path (ops
"linear_bf16", "linear_int8"); everything else keeps the float32 weight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.config.device import on_cpu
from mtp_train.layers import cpu_kernels, kernel_choice

SMALL_M_MAX = 128  # up to this many rows, (W @ xᵀ)ᵀ beats x @ Wᵀ on CPU
GEMV_M_MAX = 16  # up to this many rows the native kernel may serve (measured per row count; compute-bound beyond)
ROW_MULTIPLE = 8  # small-M products are padded to a multiple of this many rows (see _small_m)
WIDE_BLOCK = 2048  # weight rows per product of a wide small-M output (see _small_m)
ROW_CLASSES = tuple(str(m) for m in range(GEMV_M_MAX + 1))  # kernel_choice's class of m rows: ROW_CLASSES[m]


def _mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, w16: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with the CPU inference fast paths above; x: (M, in) or (..., in) → (M, out) / (..., out).

    Args:
        x, weight, bias: as `F.linear`'s.
        packed: MKL-packed copy of weight for 1-row products (`Linear.prepack`), if any.
        w16: a compact copy of weight (N, K) that few-row products may stream instead (`Linear.stream`: bfloat16,
            or `cpu_kernels.int8_copy`), if any.

    Autograd, GPUs and other dtypes take `F.linear`.
    """
    if _cpu_inference(x, weight):
        m = x.shape[0]
        streamed = _gemv_operand(m, weight, w16)
        if streamed is not None:
            return cpu_kernels.gemv(x, streamed, bias, isa=_gemv_isa(m))
        if m == 1 and packed is not None:
            return torch.ops.mkl._mkl_linear(x, packed, weight, bias, 1)
        if 1 < m <= SMALL_M_MAX:
            return _small_m(x, weight, bias)
    return F.linear(x, weight, bias)


def _cpu_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x is a (M, in) float32 CPU matrix and autograd differentiates neither operand."""
    return (x.dtype == torch.float32 and x.dim() == 2 and on_cpu(x.device)
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


def takes_small_m(x: torch.Tensor, weight: torch.Tensor, w16: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, w16=w16)` computes (W @ xᵀ)ᵀ (see `_small_m`): then a caller may chain products
    in the transposed layout instead (`padded_t`, then `torch.mm(W, ·)`), which spares the copies back to (M, out)."""
    m = x.shape[0]
    return (_cpu_inference(x, weight) and not _takes_gemv(m, weight) and 1 < m <= SMALL_M_MAX
            and not (w16 is not None and _takes_copy(m, w16)))


def _gemv_operand(m: int, weight: torch.Tensor, w16: torch.Tensor | None) -> torch.Tensor | None:
    """What m rows' product streams through the native gemv: the compact copy w16 (if any) where its gemv measured
    faster, else the float32 weight where the gemv serves m rows, else None (another path)."""
    if w16 is not None and _takes_copy(m, w16):
        return w16
    return weight if _takes_gemv(m, weight) else None


def _takes_copy(m: int, copy: torch.Tensor) -> bool:
    """Whether m rows of a product with a compact copy (bfloat16 or int8) take the native gemv over it (kernels
    available, and faster than the float32 path for m rows on this machine: op "linear_bf16" / "linear_int8")."""
    return (m <= GEMV_M_MAX and cpu_kernels.available()
            and kernel_choice.prefers_native(COPY_OPS[copy.dtype], ROW_CLASSES[m]))


def _takes_gemv(m: int, weight: torch.Tensor) -> bool:
    """Whether `linear` gives m rows to the native matrix-vector kernel (fp32 weight, kernels available, and the
    faster path for m rows on this machine)."""
    return (m <= GEMV_M_MAX and weight.dtype == torch.float32 and cpu_kernels.available()
            and kernel_choice.prefers_native("linear", ROW_CLASSES[m]))


def _isa_choice_applies() -> bool:
    """Whether the gemv's body is measured per row count: a CPU that runs both bodies, neither forced
    (`KernelSettings.isa`) and the choice measured (`KernelSettings.choice`)."""
    cfg = cpu_kernels.settings()
    return cpu_kernels.isa() == "avx512" and cfg.isa == "auto" and cfg.choice == "measure"


def _gemv_isa(m: int) -> str | None:
    """The gemv body for m rows: the faster of AVX-512 and AVX2 where both run (op "gemv_isa"); None (the body
    `cpu_kernels.isa()` names) where there is nothing to choose."""
    if not _isa_choice_applies():
        return None
    return "avx512" if kernel_choice.prefers_native("gemv_isa", ROW_CLASSES[m]) else "avx2"


def gemv_weight(lin: nn.Module, m: int) -> torch.Tensor | None:
    """The weight a `Linear` streams through the native gemv for m rows (its compact copy under `stream`, or its
    float32 weight), as `Linear.forward` would choose it; None where it would take another path (another
    module type, a weight or bias not on the CPU in float32, the measured choice torch's for m rows). For callers
    that run the product natively themselves (`cpu_kernels.decoder_layer`)."""
    if type(lin) is not Linear or (lin.bias is not None and lin.bias.dtype != torch.float32):
        return None
    return gemv_operand(m, lin.weight, lin.streamed_w16())


def gemv_operand(m: int, weight: torch.Tensor, w16: torch.Tensor | None) -> torch.Tensor | None:
    """What `linear(x, weight, w16=w16)` streams through the native gemv for m rows (w16, or weight), or None where
    it takes another path (a weight not float32 on the CPU, autograd, the measured choice torch's for m rows): for
    native callers of a bare weight, as `gemv_weight` is for a `Linear`."""
    if (weight.dtype != torch.float32 or not on_cpu(weight.device)
            or (torch.is_grad_enabled() and weight.requires_grad)):
        return None
    streamed = _gemv_operand(m, weight, w16)
    return streamed if streamed is not None and streamed.is_contiguous() else None


def gemv_avx512(m: int) -> bool:
    """Whether m-row products run the gemv's AVX-512 body here (`_gemv_isa`, else the body `cpu_kernels.isa()`
    names)."""
    return (_gemv_isa(m) or cpu_kernels.isa()) == "avx512"


def padded_t(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) → (K, M + pad) view: xᵀ with zero columns up to a multiple of ROW_MULTIPLE (see `_small_m`)."""
    pad = -x.shape[0] % ROW_MULTIPLE
    return (torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x).t()


def _small_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K), 1 < M <= SMALL_M_MAX, weight (N, K) → (M, N) row-major, as (W @ xᵀ)ᵀ.

    MKL's GEMM runs ~1.4× faster when this M is a multiple of ROW_MULTIPLE (e.g. 64 rows: ~115 GFLOP/s on a
    (3072, 576) weight, 63 rows: ~80), so x gets zero rows up to one; each output row depends on its own input
    row only, so the real rows come out the same. A wide output (the lm_head) is made WIDE_BLOCK weight rows at
    a time through a scratch that stays in cache, and transposed from there: ~1.2× the one big product + copy.
    """
    m = x.shape[0]
    n = weight.shape[0]
    xt = padded_t(x)  # (K, M + pad)
    pad = xt.shape[1] - m
    if n < 2 * WIDE_BLOCK:
        out = torch.mm(weight, xt)[:, :m].t().contiguous()
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        buf = torch.empty(WIDE_BLOCK, m + pad, dtype=x.dtype, device=x.device)
        for lo in range(0, n, WIDE_BLOCK):
            b = buf[: min(n, lo + WIDE_BLOCK) - lo]
            torch.mm(weight[lo: lo + WIDE_BLOCK], xt, out=b)
            out[:, lo: lo + b.shape[0]].copy_(b[:, :m].t())
    if bias is not None:
        out += bias
    return out


_generation = [0]  # bumped whenever what a module streams may have changed (see `streaming_generation`)


def streaming_generation() -> int:
    """A counter that changes whenever the weight a module's product streams may have changed without any tensor's
    address or version showing it: a `Linear` switching its bfloat16 copy on or off or making it again, and any
    parameter or submodule registered on any module (a weight or a layer replaced). For callers that keep a
    decision about many modules' weights from step to step (`CausalLM._native_plans`)."""
    return _generation[0]


def _bump(*_: object) -> None:
    _generation[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_bump)
nn.modules.module.register_module_module_registration_hook(_bump)


# What few-row products may stream in place of a float32 weight (`Linear.stream`), and each one's kernel choice
COPY_KINDS = ("bf16", "int8")
COPY_OPS = {torch.bfloat16: "linear_bf16", torch.int8: "linear_int8"}


def weight_copy(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The compact copy of a float32 weight (N, K) that few-row products stream: "bf16" (bfloat16, half the bytes)
    or "int8" (`cpu_kernels.int8_copy`: int8 rows and a scale per row, a quarter)."""
    if kind == "bf16":
        return w.detach().to(torch.bfloat16).contiguous()
    if kind == "int8":
        return cpu_kernels.int8_copy(w)
    raise ValueError(f"a weight copy is one of {', '.join(COPY_KINDS)}, not {kind!r}")


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) with the CPU inference fast paths above."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None  # MKL-packed copy of the weight for 1-row products
        self._w16: torch.Tensor | None = None  # compact copy streamed by few-row products (`stream`)
        self._w16_kind: str | None = None  # its kind: COPY_KINDS
        self._w16_version = -1  # the weight's version the copy was made from (an optimizer step bumps it)
        self._w16_on = False  # whether products stream the copy

    def prepack(self) -> None:
        """Pack the weight for MKL's 1-row GEMM (CPU, fp32). Call again if the weight changes.

        Not needed (and not done: the packed copy doubles the weight's memory) when the native kernel
        serves 1-row products.
        """
        w = self.weight
        if (on_cpu(w.device) and w.dtype == torch.float32 and _mkl_packing_available()
                and not _takes_gemv(1, w)):
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), 1)

    def stream(self, kind: str | None) -> None:
        """Let few-row CPU products stream a compact copy of the weight (`kind`: "bf16" or "int8", `weight_copy`)
        or the weight itself (None). Only a float32 CPU weight gets one; it is made once and kept when switched off
        (made again if the weight changes, or for another kind), so switching off and on is free."""
        w = self.weight
        if kind is not None and kind not in COPY_KINDS:
            raise ValueError(f"Linear.stream: kind is one of {', '.join(COPY_KINDS)} or None, not {kind!r}")
        if not (kind and on_cpu(w.device) and w.dtype == torch.float32):
            if self._w16_on:
                _bump()
            self._w16_on = False
            return
        if self._w16 is None or self._w16_kind != kind or self._w16_version != tensor_version(w):
            self._w16, self._w16_kind, self._w16_version = weight_copy(w, kind), kind, tensor_version(w)
            _bump()
        if not self._w16_on:
            _bump()
        self._w16_on = True

    @property
    def w16(self) -> torch.Tensor | None:
        """The compact copy (bfloat16 or int8) few-row products stream (`stream`), or None."""
        return self._w16 if self._w16_on else None

    def streamed_w16(self) -> torch.Tensor | None:
        """The compact copy few-row products stream now (made again if the weight changed in place since), or None
        (`stream` off)."""
        if not self._w16_on:
            return None
        if self._w16_version != tensor_version(self.weight):
            self.stream(self._w16_kind)  # the weight changed in place since the copy was made
        return self._w16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, in) or (..., in) → (M, out) / (..., out)."""
        return linear(x, self.weight, self.bias, self._packed, self.streamed_w16())


def prepack_linears(module: nn.Module) -> int:
    """Pack every `Linear` of `module` for CPU 1-row products; returns how many were packed."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            m.prepack()
            n += m._packed is not None
    return n


def tensor_version(t: torch.Tensor) -> int:
    """t's in-place version counter (-1 for an inference tensor, which has none: it is changed only in place inside
    inference mode, which a draft head's inference never does)."""
    return -1 if t.is_inference() else t._version


class PlanMemo:
    """Native plans kept from step to step (`plans`, by whatever the caller keys them: a row count) while `key`
    holds (the caller's: the kernels' and the streamed weights' generations, grad mode, the attention backend) and
    nothing they read moved: no parameter's address, no version of a tensor a copy was made from (a bfloat16 copy's
    weight, a draft vocabulary's rows). `CausalLM._native_plans` and a head's one-call step keep theirs here."""

    __slots__ = ("key", "params", "ptrs", "watched", "plans")

    def __init__(self, key: tuple, params: list[torch.Tensor], watched: list[torch.Tensor]) -> None:
        self.key, self.params = key, params
        self.ptrs = [p.data_ptr() for p in params]
        self.watched = [(t, tensor_version(t)) for t in watched]
        self.plans: dict = {}

    def valid(self) -> bool:
        return ([p.data_ptr() for p in self.params] == self.ptrs
                and all(tensor_version(t) == v for t, v in self.watched))

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the module decides again over its own weights (the plans' ctypes cannot be copied)

    def __reduce__(self) -> tuple:
        return _no_memo, ()


def _no_memo() -> None:
    return None


def stream_linears(module: nn.Module, kind: str | None) -> int:
    """`Linear.stream(kind)` on every `Linear` of `module`; returns how many stream a copy now.

    For a draft head's inference only: its drafts may change a little (the target's verification decides what is
    accepted), its few-row products read half (bf16) or a quarter (int8) of the bytes.
    """
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            m.stream(kind)
            n += m.w16 is not None
    return n


# ---- the native-or-torch measurement (kernel_choice) ---------------------------------------------------------------

PROBE_SHAPES = ((2048, 768), (768, 2048))  # (out, in) of the probe's weights: a small LLM's MLP, in turn
PROBE_MB_MIN, PROBE_MB_MAX = 16, 96  # the probe's weights in MiB: twice the last-level cache within these


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), 32 MiB where it cannot be read."""
    best = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            best = max(best, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return best or 32 << 20


def _probe_weights() -> list[torch.Tensor]:
    """Weights that do not fit the last-level cache, in the shapes of a small LLM's MLP."""
    # twice the cache: a cyclic read of a little more than it still hits partly (replacement is not strict LRU)
    target = min(max(2 * _last_level_cache_bytes(), PROBE_MB_MIN << 20), PROBE_MB_MAX << 20)
    weights: list[torch.Tensor] = []
    while sum(w.numel() * 4 for w in weights) < target:
        weights.append(torch.full(PROBE_SHAPES[len(weights) % len(PROBE_SHAPES)], 0.01))
    return weights


def _probe_setup() -> Callable[[str], tuple[Callable[[], object], Callable[[], object]]]:
    """Weights that do not fit the last-level cache (each product streams them from memory, as a model's layers
    do); for a class of m rows: (the native gemv over all of them, `linear`'s torch path over all of them)."""
    weights = _probe_weights()
    packed = ([torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in weights]
              if _mkl_packing_available() else [None] * len(weights))

    def work(cls: str) -> tuple[Callable[[], object], Callable[[], object]]:
        m = int(cls)
        xs = {k: torch.full((m, k), 0.5) for k in {w.shape[1] for w in weights}}

        isa = _gemv_isa(m)  # the body `linear` runs for m rows (decided before this probe: `after`)

        def native() -> None:
            for w in weights:
                cpu_kernels.gemv(xs[w.shape[1]], w, isa=isa)

        def reference() -> None:  # what `linear` runs for m rows without the kernel (packed when prepack packs)
            for w, p in zip(weights, packed):
                x = xs[w.shape[1]]
                if m == 1 and p is not None:
                    torch.ops.mkl._mkl_linear(x, p, w, None, 1)
                elif m == 1:
                    F.linear(x, w)
                else:
                    _small_m(x, w, None)

        return native, reference

    return work


def _isa_probe_setup() -> Callable[[str], tuple[Callable[[], object], Callable[[], object]]]:
    """The same weights as the linears' probe; for a class of m rows: (the AVX-512 body over all of them, the AVX2
    body over all of them)."""
    weights = _probe_weights()

    def work(cls: str) -> tuple[Callable[[], object], Callable[[], object]]:
        xs = {k: torch.full((int(cls), k), 0.5) for k in {w.shape[1] for w in weights}}

        def body(isa: str) -> Callable[[], None]:
            def run() -> None:
                for w in weights:
                    cpu_kernels.gemv(xs[w.shape[1]], w, isa=isa)
            return run

        return body("avx512"), body("avx2")

    return work


def _copy_probe_setup(kind: str) -> Callable[[], Callable[[str], tuple[Callable[[], object], Callable[[], object]]]]:
    """The probe of a compact copy's kind (`weight_copy`)."""
    return lambda: _copies_probe(kind)


def _copies_probe(kind: str) -> Callable[[str], tuple[Callable[[], object], Callable[[], object]]]:
    """The linears' probe weights; for a class of m rows: (the native gemv over their `kind` copies, what `linear`
    runs for m rows over the float32 weights)."""
    weights = _probe_weights()
    halves = [weight_copy(w, kind) for w in weights]

    def work(cls: str) -> tuple[Callable[[], object], Callable[[], object]]:
        m = int(cls)
        xs = {k: torch.full((m, k), 0.5) for k in {w.shape[1] for w in weights}}
        isa = _gemv_isa(m)

        def native() -> None:
            for w in halves:
                cpu_kernels.gemv(xs[w.shape[1]], w, isa=isa)

        def reference() -> None:
            for w in weights:
                linear(xs[w.shape[1]], w)

        return native, reference

    return work


kernel_choice.register(kernel_choice.Probe("gemv_isa", ROW_CLASSES[1:], _isa_probe_setup, budget_s=0.4,
                                           paths=("avx512", "avx2"), applies=_isa_choice_applies))
kernel_choice.register(kernel_choice.Probe("linear", ROW_CLASSES[1:], _probe_setup, budget_s=0.4, version=2,
                                           after=("gemv_isa",)))
kernel_choice.register(kernel_choice.Probe("linear_bf16", ROW_CLASSES[1:], _copy_probe_setup("bf16"), budget_s=0.4,
                                           paths=("bf16", "fp32"),
                                           after=("gemv_isa", "linear")))
kernel_choice.register(kernel_choice.Probe("linear_int8", ROW_CLASSES[1:], _copy_probe_setup("int8"), budget_s=0.4,
                                           paths=("int8", "fp32"),
                                           after=("gemv_isa", "linear")))
