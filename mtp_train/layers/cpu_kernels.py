"""Native CPU kernels, compiled on first use, for the few-row fp32 work of decode and verify steps.

A batch-1 decode step reads every weight once per token, so on CPU it is bound by memory bandwidth,
and the BLAS paths torch offers for 1–16 rows reach about half of it (MKL's GEMM is built for large
products). `gemv` (csrc/cpu_kernels.c) streams each weight matrix once, keeps the few input rows in
L1 and splits the rows of W over torch's own OpenMP threads (serial instead if loading it would bring a second
OpenMP runtime into the process). `rms_norm` and `rope_` replace torch's
composites of 5–7 small ops (each op costs microseconds of dispatch on a decode row, ×30 layers).
`paged_attention` attends decode / verify tokens straight over the pages
(the torch path gathers every page of the sequence into a contiguous copy first, then runs SDPA).
`decoder_layer` runs a whole Llama-family decoder layer over a step's few rows in one call (those kernels, the
SiLU MLP and the residuals, its weights' addresses made once per layer: `LayerPlan`), sparing ~20 dispatches per
layer and step (1.23–1.26× the layer op by op on SmolLM2's shapes). `soft_ce_` is training's: the fused soft
cross-entropy's per-row work over a (C, V) logits chunk in one read.
See `python -m bench.cpu_kernels` and `python -m bench.engine` for what they buy.

The kernel is plain C (AVX2 + FMA, no torch headers) and is called through ctypes, so building it
takes about a second with the system C compiler and needs nothing from the Python environment. The gemv, the
kernel that streams the weights, and the fused loss, which streams a logits chunk, also have AVX-512 bodies in the
same library (per-function target attributes: the library still loads on an AVX2-only machine); they run where the
CPU offers AVX-512F/VL/DQ (`isa()` says which runs; `KernelSettings.isa` can hold them to AVX2). The other kernels
stay AVX2: they are bound by dispatch or by cache-resident rows, not by reading memory. The gemv also reads bfloat16
and int8 weights (a draft head's, `Linear.stream`), widened in registers: activations and sums stay float32, so VNNI
and AMX (integer and bf16 products) have no work. The
library goes to the settings' cache folder (`KernelSettings.cache_dir`, by default `~/.cache/mtp_train/kernels`),
named by a hash of its source and flags, written atomically, so concurrent processes share one build.

Loading a shared object runs its code, so a library is loaded only when it is the one built here: each build
records beside it (`mtp_cpu_kernels_<tag>.json`, written atomically) the sha256 and size of the `.so`, the hash of
its source and the compiler flags, and `build_library` checks the file against that record before it is handed to
`ctypes.CDLL`. A library that does not match (planted, corrupt, truncated, a link, or one without a record) is never
loaded: it is rebuilt under a fresh temporary name and renamed over it, with one warning naming the file. The
record guards against a damaged or swapped file; what keeps other users from planting one (record and all) is the
folder: it must be a directory owned by this user and writable by nobody else (a link to such a directory is
followed), else nothing in it is loaded or written and the kernels stay off with a warning saying how to fix it.
This module reads no environment: `configure` sets the settings (the commands call it once, from the
environment variables `mtp_train.cli.common.kernel_settings_from_env` documents); a program that never calls it
gets the kernels, built into the default folder with the first C compiler found. Where they cannot be used (not
x86-64 with AVX2, no compiler, a failed build, switched off), `available()` is False and callers keep torch's
paths; the reason is logged once. Where they can, which of native and torch each op takes is `kernel_choice`'s
(measured once per machine and cached beside the build).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_train.config.device import on_cpu
from mtp_train.fileio import atomic_write_text

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c99")
LIBS = ("-lm",)
COMPILERS = ("cc", "gcc", "clang")  # tried in order, after KernelSettings.compiler
# Positions per task of `paged_attention`: a token attending to more is split into chunks of this many, attended on
# both cores and merged. Timed alternately (bench.cpu_kernels --baseline-source) on one decode token, 2 cores, 30
# layers' pools: see docs/results.md (2026-12-04) for the figures behind this size.
ATTENTION_CHUNK = 256


@dataclass(frozen=True)
class KernelSettings:
    """Whether the native kernels are used, where they are built, and with which compiler."""

    enabled: bool = True  # False: every caller takes torch's paths
    cache_dir: Path | None = None  # where the built library is kept (shared by processes); None: default_cache_dir()
    compiler: str | None = None  # a C compiler (name on PATH or path) tried before COMPILERS
    off_reason: str = "switched off"  # what the log gives as the reason when enabled is False
    isa: str = "auto"  # gemv, soft_ce_, paged attention: auto (AVX-512 where the CPU has it, else AVX2), avx2, avx512
    choice: str = "measure"  # native-or-torch per op: measure (kernel_choice), native (always), torch (never native)

    def __post_init__(self) -> None:
        if self.isa not in ISAS:
            raise ValueError(f"KernelSettings.isa must be one of {ISAS}, got {self.isa!r}")
        if self.choice not in CHOICES:
            raise ValueError(f"KernelSettings.choice must be one of {CHOICES}, got {self.choice!r}")


ISAS = ("auto", "avx2", "avx512")
CHOICES = ("measure", "native", "torch")


_lock = threading.Lock()
_settings = KernelSettings()
_lib: ctypes.CDLL | None = None
_tried = False
_reason = ""
_off = 0  # depth of `disabled()` blocks
_threads_ok = False  # True when the library bound to the OpenMP runtime already loaded (else one thread)
_opened: dict[Path, tuple[ctypes.CDLL, bool]] = {}  # built libraries loaded so far (see `_open`)
_isa = ""  # the gemv's, soft_ce_'s and paged attention's instruction set once loaded: "avx512" or "avx2"
_gemv_fn = None  # the library's gemv entry point for `_isa`
_soft_ce_fn = None  # and its soft_ce_ entry point
_gemv_by_isa: dict[str, object] = {}  # "avx2" / "avx512" → the gemv entry point, resolved once per load (hot path)
_gemv_bf16_by_isa: dict[str, object] = {}  # and the entry point of the bfloat16-weight gemv
_gemv_i8_by_isa: dict[str, object] = {}  # and of the int8-weight gemv
_library: Path | None = None  # the loaded build
_generation = 0  # bumped by `configure`: what was decided on the settings before is decided again


def configure(settings: KernelSettings) -> None:
    """Use `settings` from now on: whether the kernels are used and how they are built is decided again at the
    next use (call it before models run; a library already loaded stays loaded and is reused)."""
    global _settings, _lib, _tried, _reason, _threads_ok, _isa, _gemv_fn, _soft_ce_fn, _library, _generation
    global _gemv_by_isa, _gemv_bf16_by_isa, _gemv_i8_by_isa
    with _lock:
        _settings, _lib, _tried, _reason, _threads_ok = settings, None, False, "", False
        _isa, _gemv_fn, _soft_ce_fn, _library, _gemv_by_isa, _gemv_bf16_by_isa = "", None, None, None, {}, {}
        _gemv_i8_by_isa = {}
        _generation += 1


def settings() -> KernelSettings:
    """The settings in force (from `configure`, else the defaults)."""
    return _settings


def generation() -> int:
    """A number that changes at every `configure` (what depends on the settings compares it)."""
    return _generation


def default_cache_dir() -> Path:
    """`~/.cache/mtp_train/kernels`."""
    return Path.home() / ".cache" / "mtp_train" / "kernels"


def find_compiler(preferred: str | None = None) -> str | None:
    """The path of `preferred` when it is on PATH (or a path), else of the first of COMPILERS found; None if none."""
    for name in (preferred, *COMPILERS):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class KernelDirError(RuntimeError):
    """The kernel cache folder is not private to this user (others could plant a library there)."""


RECORD_FORMAT = "mtp_train.cpu_kernels/1"  # the build record beside each library


def _build_tag(src: bytes) -> str:
    """The hash naming a build: its source and flags."""
    return hashlib.sha256(src + " ".join(CFLAGS + LIBS).encode()).hexdigest()[:16]


def _private_dir(cache_dir: Path) -> Path:
    """`cache_dir` (created 0700 when missing) resolved through links; KernelDirError unless it is a directory
    owned by this user that nobody else may write to, the only kind where a library found is one of ours."""
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    real = cache_dir.resolve()
    st = os.stat(real)
    shown = f"{cache_dir}" + (f" (a link to {real})" if real != cache_dir.absolute() else "")
    if not stat.S_ISDIR(st.st_mode):
        raise KernelDirError(f"the kernel folder {shown} is not a directory")
    if st.st_uid != os.geteuid():
        raise KernelDirError(f"the kernel folder {shown} belongs to uid {st.st_uid}, not to this user "
                             f"({os.geteuid()}): a library there could be anyone's; point MTP_TRAIN_KERNEL_DIR at a "
                             f"folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelDirError(f"the kernel folder {shown} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                             f"a library there could be anyone's; run `chmod go-w {real}` or point "
                             f"MTP_TRAIN_KERNEL_DIR at a folder of your own")
    return real


def record_path(library: Path) -> Path:
    """The build record of `library`: `<name>.json` beside it."""
    return library.with_suffix(".json")


def _file_sha256(path: Path) -> tuple[str, int]:
    """(hex sha256, size) of a regular file read without following a link at its name."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        h, size = hashlib.sha256(), 0
        while block := os.read(fd, 1 << 20):
            h.update(block)
            size += len(block)
        return h.hexdigest(), size
    finally:
        os.close(fd)


def _expected_record(src: bytes, library: Path) -> dict:
    """What a record of a build of `src` says apart from the library's own digest."""
    return {"format": RECORD_FORMAT, "file": library.name, "source_sha256": hashlib.sha256(src).hexdigest(),
            "cflags": list(CFLAGS), "libs": list(LIBS)}


def verify_library(library: Path, src: bytes) -> str:
    """Why `library` is not the build of `src` recorded beside it ('' when it is: then it may be loaded)."""
    try:
        st = os.lstat(library)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a link or other)"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user"
    rec_path = record_path(library)
    try:
        if not stat.S_ISREG(os.lstat(rec_path).st_mode):
            return f"its build record {rec_path.name} is not a regular file"
        record = json.loads(rec_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no build record {rec_path.name} beside it"
    except (OSError, ValueError) as exc:
        return f"its build record {rec_path.name} is unreadable ({exc})"
    if not isinstance(record, dict) or {k: record.get(k) for k in _expected_record(src, library)} != \
            _expected_record(src, library):
        return f"its build record {rec_path.name} is of another build"
    digest, size = _file_sha256(library)
    if size != record.get("bytes") or digest != record.get("sha256"):
        return f"sha256 {digest[:16]}… of {size} bytes, its build record says {str(record.get('sha256'))[:16]}… " \
               f"of {record.get('bytes')} bytes"
    return ""


def _compile(cc: str, source: Path, src: bytes, out: Path) -> None:
    """Build `source` into a fresh temporary name beside `out`, record it, then rename both into place."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *CFLAGS, str(source), "-o", tmp, *LIBS], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source}:\n{res.stderr.strip()[-2000:]}")
        digest, size = _file_sha256(Path(tmp))
        record = {**_expected_record(src, out), "sha256": digest, "bytes": size, "compiler": cc}
        # The record first: a reader between the two renames sees a library that does not match it and rebuilds,
        # never an unrecorded library accepted.
        atomic_write_text(record_path(out), json.dumps(record, indent=1) + "\n")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_library(cc: str, cache_dir: Path, source: Path = SOURCE) -> Path:
    """The verified library of `source` in `cache_dir` (see the module docstring): an existing build is reused
    when it matches its record, anything else there under its name is rebuilt (atomically); its path.

    Raises KernelDirError for a folder others can write to, RuntimeError for a failed build."""
    src = source.read_bytes()
    folder = _private_dir(Path(cache_dir))
    out = folder / f"mtp_cpu_kernels_{_build_tag(src)}.so"
    # One check-and-build at a time per folder: a second process waits, then finds the build made.
    with folder_lock(folder):
        why = verify_library(out, src)
        if why:
            if why != "missing":
                log.warning("native CPU kernels: not loading %s (%s); rebuilding it", out, why)
            _compile(cc, source, src, out)
            why = verify_library(out, src)
            if why:
                raise RuntimeError(f"the kernel library just built at {out} does not verify: {why}")
    return out


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """The kernel folder's lock (`.build.lock`, flock'd): one build, or one measurement, at a time per folder."""
    lock_fd = os.open(folder / ".build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock_fd)


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f
                    if any(n in line for n in ("libgomp", "libiomp", "libomp")) and "/" in line}
    except OSError:
        return set()


def _open(path: Path) -> tuple[ctypes.CDLL, bool]:
    """Load the built library at `path` and declare its functions; (library, whether it may use threads).

    Once per path and process (`_opened`): after `configure` the same build is reused, and a second look at the
    OpenMP runtimes would no longer see which one loading it brought in.
    """
    if path in _opened:
        return _opened[path]
    before = _openmp_runtimes()
    lib = ctypes.CDLL(str(path))
    # (an earlier source that `bench.cpu_kernels --baseline-source` builds may lack the int8 gemv)
    gemvs = ("mtp_gemv_f32", "mtp_gemv_f32_avx512", "mtp_gemv_bf16w", "mtp_gemv_bf16w_avx512", "mtp_gemv_i8w",
             "mtp_gemv_i8w_avx512")
    for fn in (getattr(lib, name) for name in gemvs if hasattr(lib, name)):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.mtp_cpu_avx512.argtypes = []
    lib.mtp_cpu_avx512.restype = ctypes.c_int
    fn = lib.mtp_paged_attention_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
                   ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    fn.restype = None
    fn = lib.mtp_rope_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    fn = lib.mtp_rmsnorm_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_float]
    fn.restype = None
    # The layer calls: their own arguments, then the page size and the step's attention arguments
    # (`_layer_step_args`) in one order, then the instruction-set flag(s) and the thread count.
    p, i = ctypes.c_void_p, ctypes.c_int
    step = [i, p, i, p, i, p, p, p, p, p, ctypes.c_long, p, ctypes.c_long]  # ps, then _layer_step_args
    for fn, head, tail in ((lib.mtp_decoder_layer_f32, [p, p, p, i, p, p, p], [i, i]),
                           (lib.mtp_decoder_stack_f32, [p, i, p, p, p, p, i, p, p], [i, i]),
                           (lib.mtp_head_step_f32, [p, p, ctypes.c_long, p, i, p, i, p, p, p, p, p], [i, i, i])):
        fn.argtypes = [*head, *step, *tail]
        fn.restype = ctypes.c_int
    for fn, ret in ((lib.mtp_soft_ce_f32, None), (lib.mtp_soft_ce_f32_avx512, ctypes.c_int)):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ret
    # Our libgomp.so.1 binds to the one torch already loaded, so our parallel regions reuse torch's
    # threads. If loading it brought a runtime of its own (a torch built on another OpenMP), that
    # runtime's spinning threads would share the cores with torch's: stay serial then.
    added = _openmp_runtimes() - before
    threads_ok = bool(before) and not added
    if not threads_ok:
        log.info("native CPU kernels run single-threaded: their OpenMP runtime is not torch's (%s)",
                 sorted(added) or "none found")
    _opened[path] = lib, threads_ok
    return _opened[path]


def _load() -> ctypes.CDLL | None:
    """Build and load the library once per `configure`; None (with `_reason` set) where it cannot be used."""
    global _lib, _tried, _reason, _threads_ok, _isa, _gemv_fn, _soft_ce_fn, _library, _gemv_by_isa, _gemv_bf16_by_isa
    global _gemv_i8_by_isa
    with _lock:
        if _tried:
            return _lib
        _tried = True
        cfg = _settings
        if not cfg.enabled:
            _reason = cfg.off_reason
        elif platform.machine().lower() not in ("x86_64", "amd64"):
            _reason = f"needs x86-64, this is {platform.machine()}"
        elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
            _reason = f"needs AVX2, this CPU offers {torch.backends.cpu.get_cpu_capability()}"
        elif (cc := find_compiler(cfg.compiler)) is None:
            _reason = "no C compiler (cc/gcc/clang) on PATH"
        else:
            try:
                _library = build_library(cc, Path(cfg.cache_dir or default_cache_dir()))
                _lib, _threads_ok = _open(_library)
                _isa = _pick_isa(_lib, cfg.isa)
                _gemv_by_isa = {"avx2": _lib.mtp_gemv_f32, "avx512": _lib.mtp_gemv_f32_avx512}
                _gemv_bf16_by_isa = {"avx2": _lib.mtp_gemv_bf16w, "avx512": _lib.mtp_gemv_bf16w_avx512}
                _gemv_i8_by_isa = {"avx2": _lib.mtp_gemv_i8w, "avx512": _lib.mtp_gemv_i8w_avx512}
                _gemv_fn = _gemv_by_isa[_isa]
                _soft_ce_fn = _lib.mtp_soft_ce_f32_avx512 if _isa == "avx512" else _lib.mtp_soft_ce_f32
                _lib.mtp_set_attention_avx512.argtypes = [ctypes.c_int]  # paged attention's blocks follow `_isa`
                _lib.mtp_set_attention_avx512(int(_isa == "avx512"))
            except (OSError, RuntimeError) as e:
                # unexpected on a machine that should build them: say so where it is seen
                _reason = str(e)
                log.warning("native CPU kernels could not be built or loaded, CPU decoding runs ~2x slower on "
                            "torch's paths: %s", _reason)
                return None
        if _lib is None:
            log.info("native CPU kernels not used (%s); torch's paths serve decode steps", _reason)
        return _lib


def _pick_isa(lib: ctypes.CDLL, wanted: str) -> str:
    """The instruction set of gemv and soft_ce_ for `wanted` (KernelSettings.isa) on this CPU: AVX-512 only where
    it runs."""
    has_512 = bool(lib.mtp_cpu_avx512())
    if wanted == "avx512" and not has_512:
        log.warning("native CPU kernels: KernelSettings.isa=avx512, but this CPU does not offer AVX-512F/VL/DQ; "
                    "gemv and soft_ce_ run on AVX2")
    return "avx512" if has_512 and wanted != "avx2" else "avx2"


def isa() -> str:
    """The instruction set gemv and soft_ce_ run on ("avx512" or "avx2"; '' when the kernels are not available)."""
    return _isa if available() else ""


def cpu_has_avx512() -> bool:
    """Whether this CPU (and OS) runs the AVX-512 kernels (False when the kernels are not available)."""
    lib = _load()
    return lib is not None and bool(lib.mtp_cpu_avx512())


def loaded_library() -> Path | None:
    """The kernel library in use (its build record lies beside it: `record_path`); None when not available."""
    return _library if available() else None


def _require() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels are not available: {_reason}")
    return lib


def available() -> bool:
    """True when the native kernels can run here (builds it on the first call)."""
    if _tried:  # the per-call fast path: no lock once decided
        return _lib is not None and not _off
    return _load() is not None and not _off


def serves(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the native kernels take an op on x (and its other operands): all float32 on the CPU, nothing that
    autograd has to differentiate, and the kernels available. Shape rules stay with each caller."""
    if x.dtype != torch.float32 or not on_cpu(x.device) or any(t.dtype != torch.float32 for t in others):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in others)):
        return False
    return available()


@contextmanager
def disabled() -> Iterator[None]:
    """Inside the block every caller takes torch's paths (e.g. to compare both in one process)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True or has not been asked yet)."""
    return _reason


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         isa: str | None = None) -> torch.Tensor:
    """x (M, K) float32 CPU, weight (N, K) contiguous, bias (N,) contiguous or None → x @ weightᵀ + bias, (M, N).

    Meant for small M (decode, verify); equals `F.linear` up to summation order. A bfloat16 weight is widened
    exactly inside the kernel (float32 sums and output: `F.linear` over `weight.float()`), streaming half the bytes;
    an int8 one (`int8_copy`: its rows' scales after them) gives `F.linear` over `int8_weight(weight)`, a quarter.
    Call only when `available()`; x with a non-unit inner stride is made contiguous first. (Kept lean: it runs ~120
    times per decode step.)

    Args:
        x, weight, bias: as above (weight float32, bfloat16 or an `int8_copy`; x and bias float32).
        isa: None (the instruction set in use, `isa()`), or "avx2" / "avx512" to run that body (to compare them);
            "avx512" on a CPU without it raises RuntimeError.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n, kw = weight.shape
    if kw != k:
        raise ValueError(f"gemv: x has {k} columns, the weight {tuple(weight.shape)} has {kw}")
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    lib = _lib or _require()
    if weight.dtype == torch.bfloat16:
        fn = _gemv_bf16_by_isa.get(isa or _isa) or _by_isa(isa, lib.mtp_gemv_bf16w, lib.mtp_gemv_bf16w_avx512)
    elif weight.dtype == torch.int8:
        _check_int8("gemv", weight)
        fn = _gemv_i8_by_isa.get(isa or _isa) or _by_isa(isa, lib.mtp_gemv_i8w, lib.mtp_gemv_i8w_avx512)
    else:
        fn = _gemv_fn if isa is None else (_gemv_by_isa.get(isa)
                                           or _by_isa(isa, lib.mtp_gemv_f32, lib.mtp_gemv_f32_avx512))
    if fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
          y.data_ptr(), n, m, n, k, torch.get_num_threads() if _threads_ok else 1):
        raise RuntimeError("gemv: this CPU does not run the AVX-512 body (AVX-512F/VL/DQ)")
    return y


def _int8_scales_at(n: int, k: int) -> int:
    """The byte offset of an (n, k) `int8_copy`'s scales in its storage: after the rows, rounded up to 4."""
    return (n * k + 3) // 4 * 4


def int8_copy(w: torch.Tensor) -> torch.Tensor:
    """(N, K) float weight → its int8 copy: (N, K) int8 rows q with W ≈ scale[n] · q[n] (per row, symmetric:
    scale = max |W[n]| / 127), the N float32 scales stored right after the rows in the same storage, where the
    native gemv reads them (`int8_scales`). A quarter of float32's bytes, for weights whose rounding is harmless
    (a draft head's: the target verifies every token it drafts)."""
    n, k = w.shape
    w = w.detach().float()
    scale = w.abs().amax(1) / 127.0
    q = torch.where(scale[:, None] > 0, torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]),
                    torch.zeros((), dtype=w.dtype)).clamp_(-127, 127).to(torch.int8)
    at = _int8_scales_at(n, k)
    buf = torch.zeros(at + 4 * n, dtype=torch.int8, device=w.device)
    buf[at:].view(torch.float32).copy_(scale)
    rows = buf[:n * k].view(n, k)
    rows.copy_(q)
    return rows


def int8_scales(w8: torch.Tensor) -> torch.Tensor:
    """(N,) float32: the scales an `int8_copy` keeps after its rows."""
    _check_int8("int8_scales", w8)
    n, k = w8.shape
    at = _int8_scales_at(n, k)
    return torch.empty(0, dtype=torch.int8, device=w8.device).set_(w8.untyped_storage(), 0, (at + 4 * n,))[
        at:].view(torch.float32)


def int8_weight(w8: torch.Tensor) -> torch.Tensor:
    """(N, K) float32: what an `int8_copy` stands for, scale[n] · q[n] (the reference its products equal)."""
    return w8.float() * int8_scales(w8)[:, None]


def _check_int8(what: str, w8: torch.Tensor) -> None:
    """w8 is an `int8_copy` (rows at the start of a storage that holds its scales after them), else ValueError."""
    n, k = w8.shape
    if (w8.storage_offset() != 0 or not w8.is_contiguous()
            or w8.untyped_storage().nbytes() < _int8_scales_at(n, k) + 4 * n):
        raise ValueError(f"{what}: an int8 weight {tuple(w8.shape)} must come from int8_copy (its rows' scales "
                         "follow them in its storage)")


def _by_isa(isa: str, avx2_fn: object, avx512_fn: object) -> object:
    """The entry point of `isa` ("avx2" or "avx512"; ValueError for anything else)."""
    if isa not in ("avx2", "avx512"):
        raise ValueError(f"isa must be None, 'avx2' or 'avx512', got {isa!r}")
    return avx512_fn if isa == "avx512" else avx2_fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (M, K) float32 CPU with unit inner stride, weight (K,) float32 → weight * x / sqrt(mean(x²) + eps).

    Equals the float32 RMSNorm up to summation order. Call only when `available()`.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    m, k = x.shape
    y = torch.empty(m, k, dtype=torch.float32)
    lib = _lib or _require()
    lib.mtp_rmsnorm_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), m, k, eps)
    return y


class PagedAttentionStep:
    """The per-step arguments of `paged_attention` (`paged_attention_args`: built once per step, shared by every
    layer): the step's tables as the kernel reads them, their addresses, and the scratch the kernel writes (made at
    the first layer of a shape and reused by the next ones: a forward's layers run one after another).

    Attributes:
        block_tables: (B, max_pages) int32; qo_indptr: (B + 1,) int32; positions: (T,) int64.
        max_kv: the longest sequence's token count.
        tree_bits, tree_pos, slots: (T,) int64 or None (see `paged_attention_args`).
    """

    __slots__ = ("block_tables", "qo_indptr", "positions", "max_kv", "tree_bits", "tree_pos", "slots", "ptrs",
                 "_scratch")

    def __init__(self, block_tables: torch.Tensor, qo_indptr: torch.Tensor, positions: torch.Tensor, max_kv: int,
                 tree_bits: torch.Tensor | None, tree_pos: torch.Tensor | None, slots: torch.Tensor | None) -> None:
        self.block_tables, self.qo_indptr, self.positions = block_tables, qo_indptr, positions
        self.max_kv, self.tree_bits, self.tree_pos, self.slots = int(max_kv), tree_bits, tree_pos, slots
        # the kernel's step arguments, read once: (block tables, max pages, qo_indptr, B, positions, tree bits, tree
        # positions, slots), the last three None where absent
        self.ptrs = (block_tables.data_ptr(), block_tables.shape[1], qo_indptr.data_ptr(), qo_indptr.shape[0] - 1,
                     positions.data_ptr(), *(None if x is None else x.data_ptr() for x in (tree_bits, tree_pos, slots)))
        self._scratch: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor | None, int, int | None]] = {}

    def scratch(self, t: int, hq: int, d: int, chunk: int) -> tuple[int, int | None]:
        """Addresses of the kernel's scratch for t rows of hq heads of d: the scores (t·hq·max_kv floats) and, when
        a token may be split into chunks, their partials (t·hq·⌈max_kv / chunk⌉·(d + 2) floats), else None."""
        got = self._scratch.get((t, hq, d, chunk))
        if got is None:
            scores = torch.empty(t * hq * self.max_kv, dtype=torch.float32)
            partials = (torch.empty(t * hq * -(-self.max_kv // chunk) * (d + 2), dtype=torch.float32)
                        if self.max_kv > chunk else None)
            got = (scores, partials, scores.data_ptr(), None if partials is None else partials.data_ptr())
            self._scratch[(t, hq, d, chunk)] = got
        return got[2], got[3]


def paged_attention_args(block_tables: torch.Tensor, qo_indptr: torch.Tensor, positions: torch.Tensor,
                         max_kv: int, tree_bits: torch.Tensor | None = None,
                         tree_pos: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> PagedAttentionStep:
    """The per-step arguments of `paged_attention` (built once per step, shared by every layer).

    tree_bits: None, or (T,) int64 for a tree step (`AttentionMetadata.tree_bits`: bit i = the token sees new
    token i of its own sequence; positions are then slots). tree_pos: None, or in a tree step the (T,) positions
    the tokens stand at (`AttentionMetadata.rope_positions`), which a sliding window counts. slots: None, or the
    (T,) slot of each new token's K/V (page id * page size + offset), for a `paged_attention` that writes them.
    """
    bits = None if tree_bits is None else tree_bits.to(torch.int64).contiguous()
    tpos = None if tree_bits is None or tree_pos is None else tree_pos.to(torch.int64).contiguous()
    dst = None if slots is None else slots.to(torch.int64).contiguous()
    return PagedAttentionStep(block_tables.to(torch.int32).contiguous(), qo_indptr.to(torch.int32).contiguous(),
                              positions.to(torch.int64).contiguous(), max_kv, bits, tpos, dst)


def _attention_chunk(chunk: int | None = None) -> int:
    """The positions per task of a long token's attention: `chunk`, or `ATTENTION_CHUNK` (read at call time), at
    least 8."""
    return max(8, int(ATTENTION_CHUNK if chunk is None else chunk))


def _layer_step_args(step: PagedAttentionStep, m: int, hq: int, d: int) -> tuple:
    """What every layer call (`decoder_layer`, `decoder_stack`, `head_step`) passes after its pool's page size: the
    step's tables (`PagedAttentionStep.ptrs`), the scores scratch, the longest sequence, the partials scratch and the
    chunk, for m rows of hq query heads of d."""
    chunk = _attention_chunk()
    scores, partials = step.scratch(m, hq, d, chunk)
    return (*step.ptrs, scores, step.max_kv, partials, chunk)


def _rope_rows(cos: torch.Tensor, sin: torch.Tensor, m: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, D) or (M, 1, D) cos and sin → (M, D) contiguous, as the layer calls read them."""
    return cos.reshape(m, d).contiguous(), sin.reshape(m, d).contiguous()


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, step: PagedAttentionStep, scale: float,
                    sliding_window: int | None, sinks: torch.Tensor | None = None,
                    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                    chunk: int | None = None) -> torch.Tensor:
    """Decode / verify attention read straight from one layer's pages (no gather, no mask tensor).

    Args:
        q: (T, Hq, D) float32.
        kv_cache: (num_pages, 2, page_size, Hkv, D) float32 contiguous, holding the new tokens' K/V already, or
            receiving them here (k, v).
        step: from `paged_attention_args` (the step's block tables, qo_indptr, positions, longest sequence, tree
            bits and positions, slots).
        scale, sliding_window: the layer's.
        sinks: None, or (Hq,) attention-sink logits (GPT-OSS), each joining its head's softmax denominator.
        k, v: None, or the new tokens' (T, Hkv, D) float32 K and V, written into the cache at the step's slots
            (`paged_attention_args(slots=...)`) before attending: the indexed writes of torch's path in the kernel.
        chunk: a token attending to more positions than this has them split into chunks of this many, attended
            as separate tasks and merged (so that the cores share one long sequence's keys); at least 8;
            None: `ATTENTION_CHUNK`.

    Token t attends causally to its own sequence (within the sliding window, if any, counted in tree positions in a
    tree step; in a tree step only to the new tokens its bits name). Returns (T, Hq, D). Call only when
    `available()`. (Kept lean: it runs once per layer and step.)
    """
    if not kv_cache.is_contiguous():
        raise ValueError("paged_attention needs a contiguous KV pool")
    if not q.is_contiguous():
        q = q.contiguous()
    t, hq, d = q.shape
    if (k is None) != (v is None) or (k is not None and step.slots is None):
        raise ValueError("paged_attention: k and v go together, with the step's slots (paged_attention_args)")
    if k is not None:
        if not k.is_contiguous():
            k = k.contiguous()
        if not v.is_contiguous():
            v = v.contiguous()
        if k.shape != (t, kv_cache.shape[3], d) or v.shape != k.shape or step.slots.shape[0] != t:  # it writes there
            raise ValueError(f"paged_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                             f"{(t, kv_cache.shape[3], d)}, with one slot each ({step.slots.shape[0]} given)")
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
        if sinks.shape != (hq,):
            raise ValueError(f"paged_attention: sinks {tuple(sinks.shape)} need one logit per query head ({hq})")
    chunk = _attention_chunk(chunk)
    scores, partials = step.scratch(t, hq, d, chunk)
    out = torch.empty(t, hq, d, dtype=torch.float32)
    bt, max_pages, indptr, num_seqs, pos, bits, tree_pos, slots = step.ptrs
    (_lib or _require()).mtp_paged_attention_f32(
        q.data_ptr(), t, hq, kv_cache.shape[3], d, kv_cache.data_ptr(), kv_cache.shape[2], bt, max_pages, indptr,
        num_seqs, pos, sliding_window or 0, scale, scores, step.max_kv, out.data_ptr(),
        torch.get_num_threads() if _threads_ok else 1, bits, None if sinks is None else sinks.data_ptr(), tree_pos,
        None if k is None else k.data_ptr(), None if v is None else v.data_ptr(), None if k is None else slots,
        chunk, partials)
    return out


class _Layer(ctypes.Structure):
    """csrc/cpu_kernels.c's `mtp_layer`: one decoder layer's weights and shapes."""

    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("wqkv", ctypes.c_void_p), ("wo", ctypes.c_void_p),
                ("wgu", ctypes.c_void_p), ("wd", ctypes.c_void_p), ("bqkv", ctypes.c_void_p),
                ("bo", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("wkinds", ctypes.c_int), ("H", ctypes.c_int), ("I", ctypes.c_int),
                ("Hq", ctypes.c_int), ("Hkv", ctypes.c_int), ("D", ctypes.c_int), ("window", ctypes.c_int)]


@dataclass(frozen=True)
class LayerWeights:
    """What `LayerPlan` reads of a Llama-family decoder layer (all float32 CPU contiguous, except the four
    projection weights, each float32, bfloat16 or an `int8_copy`; None = absent).

    Attributes:
        ln1: (H,) the input RMSNorm's weight, or None (a head block without it); ln2: (H,) the post-attention one.
        q_norm, k_norm: (D,) Qwen3's per-head norms, or None.
        wqkv: (Hq·D + 2·Hkv·D, H); wo: (H, Hq·D); wgu: (2I, H), gate rows then up rows; wd: (H, I).
        bqkv: (Hq·D + 2·Hkv·D,) or None; bo: (H,) or None; sinks: (Hq,) attention-sink logits, or None.
    """

    ln1: torch.Tensor | None
    ln2: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wqkv: torch.Tensor
    wo: torch.Tensor
    wgu: torch.Tensor
    wd: torch.Tensor
    bqkv: torch.Tensor | None
    bo: torch.Tensor | None
    sinks: torch.Tensor | None


class LayerPlan:
    """One decoder layer as `decoder_layer` runs it: its weights' addresses and shapes, made once (per set of
    weights: a head that switches to its bfloat16 copies gets another plan) and kept by the layer.

    The plan holds the tensors it points to, so they outlive it; `key` is what it was made from (the projection
    weights' addresses), for the layer to tell whether it still applies.
    """

    __slots__ = ("key", "weights", "qkv_in", "struct", "address")

    def __init__(self, w: LayerWeights, heads: tuple[int, int, int], eps: float, scale: float,
                 window: int | None, qkv_in: int | None = None) -> None:
        hq, hkv, d = heads
        h, i = w.wo.shape[0], w.wd.shape[1]
        # qkv_in: what q/k/v read, H (norm1(x)) or, in a head step only, EAGLE-3's 2H [e ; h] (`HeadPlan`)
        shapes = {"wqkv": (hq * d + 2 * hkv * d, qkv_in or h), "wo": (h, hq * d), "wgu": (2 * i, h), "wd": (h, i)}
        for name, shape in shapes.items():
            t = getattr(w, name)
            if (tuple(t.shape) != shape or t.dtype not in (torch.float32, torch.bfloat16, torch.int8)
                    or not t.is_contiguous()):
                raise ValueError(f"decoder_layer: {name} {tuple(t.shape)} {t.dtype} must be {shape}, contiguous, "
                                 "float32, bfloat16 or int8")
            if t.dtype == torch.int8:
                _check_int8(f"decoder_layer: {name}", t)
        self.key = tuple(getattr(w, n).data_ptr() for n in shapes)
        self.weights = w  # kept alive for the addresses below
        self.qkv_in = qkv_in or h

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        kinds = _weight_kinds((w.wqkv, w.wo, w.wgu, w.wd))
        self.struct = _Layer(ptr(w.ln1), ptr(w.ln2), ptr(w.q_norm), ptr(w.k_norm), ptr(w.wqkv), ptr(w.wo),
                             ptr(w.wgu), ptr(w.wd), ptr(w.bqkv), ptr(w.bo), ptr(w.sinks), eps, scale, kinds, h, i,
                             hq, hkv, d, window or 0)
        self.address = ctypes.addressof(self.struct)


def _weight_kinds(weights: Sequence[torch.Tensor]) -> int:
    """The C plans' `wkinds` bits (csrc's WKIND): weight j is bfloat16 where bit j is set, int8 where bit j + 4 is."""
    return sum((1 << j) * (t.dtype == torch.bfloat16) + (16 << j) * (t.dtype == torch.int8)
               for j, t in enumerate(weights))


class LayerPlans(dict):
    """A layer's `LayerPlan`s by key, at most `MAX` (a plan holds its weights: a layer whose weights were replaced
    must not keep the old ones alive); never copied or pickled with the module that holds it (its ctypes structures
    cannot be, and a copy's weights are other tensors anyway)."""

    MAX = 4

    def add(self, key: tuple[int, ...], plan: LayerPlan) -> LayerPlan:
        if len(self) >= self.MAX:
            self.clear()
        self[key] = plan
        return plan

    def __deepcopy__(self, memo: dict) -> LayerPlans:
        return LayerPlans()

    def __reduce__(self) -> tuple:
        return LayerPlans, ()


def decoder_layer(plan: LayerPlan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  step: PagedAttentionStep, use512: bool) -> torch.Tensor:
    """A whole Llama-family decoder layer over the few rows of a decode or verify step, in one native call:
    out = x + o(attention(rope(qkv(norm1(x))))), then out + down(silu(gate) · up)(norm2(out)), the step's new K/V
    written into the pool at its slots (what `DecoderLayer.forward` computes op by op, without ~20 dispatches).

    Args:
        plan: the layer (`LayerPlan`).
        x: (M, H) float32 contiguous, the layer's input (not changed).
        cos, sin: (M, D) or (M, 1, D) float32, the rows' rotate-half RoPE.
        kv_cache: the layer's pool (num_pages, 2, page_size, Hkv, D) float32 contiguous.
        step: the step's attention arguments (`paged_attention_args`, with slots).
        use512: the gemv's AVX-512 body (only where `cpu_has_avx512()`), else AVX2.
    Returns (M, H). Call only when `available()`; the caller checks shapes and dtypes (kept lean: once per layer and
    step).
    """
    s = plan.struct
    m = x.shape[0]
    cos, sin = _rope_rows(cos, sin, m, s.D)
    out = torch.empty_like(x)
    if (_lib or _require()).mtp_decoder_layer_f32(
            plan.address, x.data_ptr(), out.data_ptr(), m, cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(),
            kv_cache.shape[2], *_layer_step_args(step, m, s.Hq, s.D), int(use512),
            torch.get_num_threads() if _threads_ok else 1):
        raise MemoryError(f"decoder_layer: no memory for the scratch of {m} rows")
    return out


def decoder_stack(plans: Sequence[LayerPlan], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_caches: Sequence[torch.Tensor], step: PagedAttentionStep, use512: bool,
                  saved: Collection[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """A model's decoder layers one after another over the few rows of a decode or verify step, in ONE native call
    (`decoder_layer` for each, without a return to Python between them: between two layers whose weights flushed
    the caches, the interpreter's few microseconds of work per layer cost tens).

    Args:
        plans: each layer's `LayerPlan`, in order (all of the same hidden size).
        x: (M, H) float32 contiguous, the first layer's input (not changed).
        cos, sin: (M, D) or (M, 1, D) float32, the rows' rotate-half RoPE (every layer's: one head size).
        kv_caches: each layer's pool (num_pages, 2, page_size, Hkv, D) float32 contiguous, one page size.
        step: the step's attention arguments (`paged_attention_args`, with slots).
        use512: the gemv's AVX-512 body.
        saved: indices i whose layer input (HF `hidden_states[i]`) is returned too.
    Returns ((M, H) the last layer's output, {i: (M, H) layer i's input}). Call only when `available()`; the caller
    checks shapes and dtypes.
    """
    n = len(plans)
    if len(kv_caches) != n:
        raise ValueError(f"decoder_stack: {n} layers but {len(kv_caches)} KV pools")
    first = plans[0].struct
    m = x.shape[0]
    cos, sin = _rope_rows(cos, sin, m, first.D)
    out = torch.empty_like(x)
    keep = {i: torch.empty_like(x) for i in saved if 0 <= i < n}
    ptrs = ctypes.c_void_p * n
    layers = ptrs(*(p.address for p in plans))
    caches = ptrs(*(c.data_ptr() for c in kv_caches))
    outs = ptrs(*(keep[i].data_ptr() if i in keep else None for i in range(n))) if keep else None
    if (_lib or _require()).mtp_decoder_stack_f32(
            layers, n, caches, outs, x.data_ptr(), out.data_ptr(), m, cos.data_ptr(), sin.data_ptr(),
            kv_caches[0].shape[2], *_layer_step_args(step, m, max(p.struct.Hq for p in plans), first.D),
            int(use512), torch.get_num_threads() if _threads_ok else 1):
        raise MemoryError(f"decoder_stack: no memory for the scratch of {m} rows")
    return out, keep


class _Head(ctypes.Structure):
    """csrc/cpu_kernels.c's `mtp_head`: a chain head's step (embedding rows, norms, fc, layer, lm rows)."""

    _fields_ = [("embed", ctypes.c_void_p), ("enorm", ctypes.c_void_p), ("hnorm", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("fc", ctypes.c_void_p), ("lm", ctypes.c_void_p),
                ("fc_bias", ctypes.c_void_p), ("layer", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("wkinds", ctypes.c_int), ("H", ctypes.c_int), ("V", ctypes.c_int), ("vocab", ctypes.c_int),
                ("raw_out", ctypes.c_int)]


@dataclass(frozen=True)
class HeadWeights:
    """What `HeadPlan` reads of a chain head (`MTPHead`, `Eagle3Head`): all float32 CPU contiguous, except fc and lm,
    each float32, bfloat16 or an `int8_copy`; None = absent.

    Attributes:
        embed: (vocab, H) the target's frozen embedding. enorm, hnorm, norm: (H,) RMSNorm weights, or None.
        fc: (H, 2H) over [embedding ; features], or None (EAGLE-3: [embedding ; features] is what its layer's q/k/v
            read, the features its residual); fc_bias: (H,) or None. lm: (V, H) the head's lm_head rows.
    """

    embed: torch.Tensor
    enorm: torch.Tensor | None
    hnorm: torch.Tensor | None
    norm: torch.Tensor | None
    fc: torch.Tensor | None
    fc_bias: torch.Tensor | None
    lm: torch.Tensor


class HeadPlan:
    """A chain head's step as `head_step` runs it: its weights' addresses and its layer's `LayerPlan`, made once per
    set of weights and kept by the head (the plan holds the tensors it points to, and the layer plan).

    raw_out: the step returns its layer's output before the final norm, the logits reading its norm (EAGLE-3's
    features); else the normed output, which the logits read (mtp, and EAGLE-3.1's `norm_output`)."""

    __slots__ = ("weights", "layer", "struct", "address")

    def __init__(self, w: HeadWeights, layer: LayerPlan, eps: float, raw_out: bool = False) -> None:
        h = layer.struct.H
        v = w.lm.shape[0]
        qkv_in = h if w.fc is not None else 2 * h  # without an fc the layer's q/k/v read [e ; h]
        if layer.qkv_in != qkv_in or (w.fc is None and layer.weights.ln1 is not None):
            raise ValueError(f"head_step: a head {'with' if w.fc is not None else 'without'} an fc needs a layer "
                             f"whose q/k/v read {qkv_in} columns{'' if w.fc is not None else ' and no input norm'}")
        for name, shape in (("fc", (h, 2 * h)), ("lm", (v, h)), ("embed", (w.embed.shape[0], h))):
            t = getattr(w, name)
            if t is None and name == "fc":
                continue
            ok = (torch.float32,) if name == "embed" else (torch.float32, torch.bfloat16, torch.int8)
            if tuple(t.shape) != shape or t.dtype not in ok or not t.is_contiguous():
                raise ValueError(f"head_step: {name} {tuple(t.shape)} {t.dtype} must be {shape}, contiguous, "
                                 + ("float32" if name == "embed" else "float32, bfloat16 or int8"))
            if t.dtype == torch.int8:
                _check_int8(f"head_step: {name}", t)
        self.weights, self.layer = w, layer  # kept alive for the addresses below

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        kinds = _weight_kinds((w.lm if w.fc is None else w.fc, w.lm))  # bit 0 unread without an fc
        self.struct = _Head(ptr(w.embed), ptr(w.enorm), ptr(w.hnorm), ptr(w.norm), ptr(w.fc), ptr(w.lm),
                            ptr(w.fc_bias), layer.address, eps, kinds, h, v, w.embed.shape[0], int(raw_out))
        self.address = ctypes.addressof(self.struct)


def head_step(plan: HeadPlan, hidden: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor | None,
              cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, step: PagedAttentionStep,
              use512: bool, lm512: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chain head's step over the few rows of a draft or catch-up step, in one native call: the features of
    `MTPHead.features` (embedding and features through their norms, the fc, the head's layer writing its K/V into
    the pool, the final norm) or of `Eagle3Head.features` (the layer over [norm(embedding) ; norm(features)] with
    the features as its residual), and the logits of its lm_head rows at `rows`.

    Args:
        plan: the head (`HeadPlan`).
        hidden: (M, H) float32 with unit inner stride, the target's features or the head's own output.
        ids: (M,) int64 contiguous, the token after each row.
        rows: (N,) int64 contiguous, the rows whose logits are wanted, or None (no logits).
        cos, sin: (M, D) or (M, 1, D) float32, the rows' RoPE.
        kv_cache: the head's pool (num_pages, 2, page_size, Hkv, D) float32 contiguous.
        step: the step's attention arguments (`paged_attention_args`, with slots).
        use512, lm512: the AVX-512 gemv body for the M-row products, for the N-row lm_head.
    Returns ((M, H) features, (N, V) logits or None). Call only when `available()`; the caller checks shapes and
    dtypes (kept lean: once per draft step).
    """
    lay = plan.layer.struct
    m, h = hidden.shape
    n = 0 if rows is None else rows.shape[0]
    cos, sin = _rope_rows(cos, sin, m, lay.D)
    out = torch.empty(m, h, dtype=torch.float32)
    logits = None if rows is None else torch.empty(n, plan.struct.V, dtype=torch.float32)
    err = (_lib or _require()).mtp_head_step_f32(
        plan.address, hidden.data_ptr(), hidden.stride(0), ids.data_ptr(), m, None if not n else rows.data_ptr(), n,
        out.data_ptr(), None if not n else logits.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(),
        kv_cache.shape[2], *_layer_step_args(step, m, lay.Hq, lay.D), int(use512), int(lm512),
        torch.get_num_threads() if _threads_ok else 1)
    if err == -2:
        raise IndexError(f"head_step: a token id outside the embedding's {plan.struct.vocab} rows, or a logits row "
                         f"outside the step's {m}")
    if err:
        raise MemoryError(f"head_step: no memory for the scratch of {m} rows")
    return out, logits


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the first `heads` heads of each row of x (T, ≥ heads·head_dim).

    x: float32 with unit inner stride (e.g. the fused q|k|v projection output, whose q and k heads are
    adjacent); cos, sin: (T, 1, head_dim) or (T, head_dim) float32. Call only when `available()`.
    """
    if x.stride(-1) != 1 or x.shape[-1] < heads * head_dim:
        raise ValueError(f"rope_: x {tuple(x.shape)} needs unit inner stride and {heads} heads of {head_dim}")
    cos, sin = cos.reshape(-1, head_dim).contiguous(), sin.reshape(-1, head_dim).contiguous()
    lib = _lib or _require()
    lib.mtp_rope_f32(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(), sin.data_ptr())


def soft_ce_(z: torch.Tensor, t: torch.Tensor,
             isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row soft cross-entropy of z against t, with its gradient written over z (training's fused loss).

    z: (C, V) the head's logits, t: (C, V) the target's, both float32 CPU contiguous, both overwritten:
    z becomes softmax(z) - softmax(t) (d CE / d z) and t scratch. Returns (ce (C,) float32 =
    logsumexp(z) - Σ softmax(t)·z, best (C,) int64 = argmax t, rank (C,) int64 = how many of z exceed z[best],
    alpha (C,) float32 = Σ min(softmax(z), softmax(t)), the acceptance a draft sampled from the head would get).
    One read of each row from memory instead of torch's ~8 passes over the chunk. Call only when `available()`.
    isa: None (the instruction set in use, `isa()`), or "avx2" / "avx512" to run that body (to compare them);
    "avx512" on a CPU without it raises RuntimeError.
    """
    if not (z.is_contiguous() and t.is_contiguous()) or z.shape != t.shape or z.dim() != 2:
        raise ValueError(f"soft_ce_: needs two contiguous (C, V) tensors, got {tuple(z.shape)}, {tuple(t.shape)}")
    c, v = z.shape
    ce = torch.empty(c, dtype=torch.float32)
    best = torch.empty(c, dtype=torch.int64)
    rank = torch.empty(c, dtype=torch.int64)
    alpha = torch.empty(c, dtype=torch.float32)
    lib = _lib or _require()
    fn = _soft_ce_fn if isa is None else _by_isa(isa, lib.mtp_soft_ce_f32, lib.mtp_soft_ce_f32_avx512)
    if fn(z.data_ptr(), t.data_ptr(), c, v, ce.data_ptr(), best.data_ptr(), rank.data_ptr(), alpha.data_ptr(),
          torch.get_num_threads() if _threads_ok else 1):
        raise RuntimeError("soft_ce_: this CPU does not run the AVX-512 body (AVX-512F/VL/DQ)")
    return ce, best, rank, alpha
