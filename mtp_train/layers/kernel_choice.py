"""Which path each hot CPU op takes, native kernel or torch's, measured on this machine and cached with the build.

A kernel tuned on one processor can lose on the next (MKL's GEMM uses AVX-512 where the native gemv once had only
AVX2), so no op's choice is written into the code. Each op that has a native kernel registers a `Probe`: its shape
classes (the linears by row count 1..16, attention for decode and for verify rows, the fused loss's chunk) and, per
class, a native and a torch callable doing the same work. The first time a caller asks `prefers_native(op, cls)`,
every class of that op is timed, both paths alternately (the fastest of at least two runs each; all classes of an
op within its `budget_s`, every op together well under a second on a quiet machine), and the faster path is kept
for the process, the native kernel unless torch's path wins by more than NATIVE_MARGIN (a probe times the op
alone; a whole step pays the torch paths' allocations and copies too). On a loaded machine a measurement stops
at DEADLINE times its budget: the classes it did not reach take the last measured class's path for this process,
and nothing is cached (the next process measures again).

The times are cached in the kernel folder, beside the library they measured
(`mtp_cpu_kernels_<tag>.choice-<key>.json`, written atomically), under a key of everything that decides them: the
library's sha256 from its build record, the CPU's model name and flags, torch's version, torch's thread count and
the gemv's instruction set. A file whose key, format or values are not what this process would write (stale,
truncated, edited) is measured again and rewritten, never trusted; one measurement at a time per folder (the
folder's build lock), so a second process finds the first one's times.

The same measurement picks between two native bodies where a CPU runs both: the gemv's AVX-512 and AVX2 bodies per
row count (op "gemv_isa", `Probe.paths`), since a CPU that splits 512-bit operations in two halves (AMD Zen 4)
streams one row faster with AVX2.

`KernelSettings.choice` (`MTP_TRAIN_KERNEL_CHOICE`) overrides the measurement: `native` always, `torch` never;
`measure` (the default) as above. `summary()` and `lines()` say which path each op took and the measured ratio
(`bench.engine`, `bench.train` print them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_train.fileio import atomic_write_text
from mtp_train.layers import cpu_kernels

log = logging.getLogger(__name__)

CHOICE_FORMAT = "mtp_train.kernel_choice/1"
MIN_RUNS = 2  # timed runs of each path per class at least (the fastest counts: other load only slows a run)
MAX_RUNS = 5  # and at most, within the op's budget
DEADLINE = 4.0  # an op's measurement stops at this many times its budget (a loaded machine): see `measure`
NATIVE_MARGIN = 1.1  # the native kernel (the first path) is kept unless the other is faster by more than 10%

Work = Callable[[], object]


@dataclass(frozen=True)
class Probe:
    """How to time one op's two paths.

    Args:
        op: the op's name (`prefers_native(op, ...)`).
        classes: its shape classes, in the order they are timed.
        setup: builds the inputs once and returns, for a class, (native work, torch work): two callables doing the
            same computation through each path.
        budget_s: the time all its classes may take together (more runs while within it, up to MAX_RUNS).
        version: bumped when the probe's work changes, so that times cached from the old one are measured again.
        paths: the names of its two paths, in `setup`'s order (native and torch; or, for a choice between two
            native bodies, their names): `prefers_native` is True where the first is the faster.
        after: ops decided before this one is measured (its work asks their choice, e.g. the gemv body per row
            count inside the linears' native path), where they apply.
        applies: whether the op has a choice to make here (e.g. two gemv bodies only on a CPU that runs both);
            an op that does not apply is never measured.
    """

    op: str
    classes: tuple[str, ...]
    setup: Callable[[], Callable[[str], tuple[Work, Work]]]
    budget_s: float
    version: int = 1
    paths: tuple[str, str] = ("native", "torch")
    after: tuple[str, ...] = ()
    applies: Callable[[], bool] = lambda: True

    def path(self, first: bool) -> str:
        """The name of the path taken: the first where `first`, else the second."""
        return self.paths[0] if first else self.paths[1]


@dataclass(frozen=True)
class Timing:
    """One class's measured times (seconds per run of its work, the fastest run of each path).

    as_class: None when this class was timed; else the class whose times it took (a measurement cut short)."""

    native_s: float
    torch_s: float
    as_class: str | None = None

    @property
    def native(self) -> bool:
        """Whether the native kernel is kept: unless torch's path is faster by more than NATIVE_MARGIN. A probe
        times the op alone; in a whole step the native kernels also spare the allocations and copies the torch
        paths make (measured: a verify-attention probe at 0.97–0.98 in torch's favour chose the gather path, and
        the demo's k = 1 step then cost 1.48 plain steps against 1.20 on the native kernel)."""
        return self.native_s <= self.torch_s * NATIVE_MARGIN

    @property
    def ratio(self) -> float:
        """torch's time over the native kernel's: > 1 where the native kernel is faster."""
        return self.torch_s / self.native_s


PROBES: dict[str, Probe] = {}
_lock = threading.RLock()
_decided: dict[str, tuple[int, dict[str, bool]]] = {}  # op → (cpu_kernels.generation(), class → native?)
_timings: dict[str, tuple[int, dict[str, Timing]]] = {}  # op → (generation, class → measured times)
_measuring = threading.local()  # set while a probe runs: callers asked meanwhile take the native path


def register(probe: Probe) -> Probe:
    """Add an op's probe (its module does, at import); a second registration of the same op replaces the first."""
    PROBES[probe.op] = probe
    return probe


def prefers_native(op: str, cls: str) -> bool:
    """Whether `op` on shape class `cls` takes the native kernel (call only where the kernels are available).

    The first call for an op measures all its classes (or reads them from the cache); later calls are one look-up.
    """
    hit = _decided.get(op)
    if hit is not None and hit[0] == cpu_kernels.generation():
        return hit[1][cls]
    return _decide(op)[cls]


def _decide(op: str) -> dict[str, bool]:
    mode = cpu_kernels.settings().choice
    probe = PROBES[op]
    if mode != "measure":
        decided = {c: mode == "native" for c in probe.classes}
    elif getattr(_measuring, "on", False):
        return {c: True for c in probe.classes}  # a probe's own set-up asking: it sets the path itself
    else:
        decided = {c: t.native for c, t in timings(op).items()}
    _decided[op] = cpu_kernels.generation(), decided
    return decided


def timings(op: str) -> dict[str, Timing]:
    """The measured times of each of op's classes on this machine: from the cache when it is this configuration's,
    else measured now (and cached). Call only where the kernels are available."""
    with _lock:
        gen = cpu_kernels.generation()
        hit = _timings.get(op)
        if hit is not None and hit[0] == gen:
            return hit[1]
        for dep in PROBES[op].after:  # decided first, outside this op's measurement (which takes their paths)
            if dep in PROBES and PROBES[dep].applies():
                prefers_native(dep, PROBES[dep].classes[0])
        path = cache_path()
        if path is None:
            raise RuntimeError(f"kernel_choice: the native kernels are not available "
                               f"({cpu_kernels.unavailable_reason()})")
        with cpu_kernels.folder_lock(path.parent):
            ops, why = read_cache(path, cache_key())
            found = ops.get(op)
            if found is None:
                log.info("native CPU kernels: measuring %s's path choice (%s: %s)", op, path.name,
                         why or f"{op} not in it yet")
                found, complete = measure(PROBES[op])
                if complete:
                    ops[op] = found
                    write_cache(path, cache_key(), ops, keep=_unregistered_entries(path, cache_key()))
        _timings[op] = gen, found
        _decided[op] = gen, {c: t.native for c, t in found.items()}
        return found


def measure(probe: Probe) -> tuple[dict[str, Timing], bool]:
    """Time each class of `probe`, both paths alternately, within its budget: (class → Timing, complete).

    Past DEADLINE times the budget the remaining classes are not timed: each takes the times of the last class
    that was (complete is then False, and the caller does not cache them)."""
    start = time.perf_counter()
    _measuring.on = True
    try:
        with torch.inference_mode():
            work = probe.setup()
            per_class = probe.budget_s / max(1, len(probe.classes))
            out: dict[str, Timing] = {}
            for i, cls in enumerate(probe.classes):
                if out and time.perf_counter() - start > DEADLINE * probe.budget_s:
                    break
                native, reference = work(cls)
                if i == 0:  # the first use of each path pays its lazy set-up: not counted
                    native(), reference()
                out[cls] = _time_pair(native, reference, per_class)
    finally:
        _measuring.on = False
    complete = len(out) == len(probe.classes)
    log.info("native CPU kernels: %s measured in %.2f s%s: %s", probe.op, time.perf_counter() - start,
             "" if complete else f" (cut short after {len(out)} of {len(probe.classes)} classes: not cached)",
             ", ".join(f"{c} {probe.path(t.native)} {t.ratio:.2f}x" for c, t in out.items()))
    last_cls, last = next(reversed(out.items()))
    return {c: out.get(c) or Timing(last.native_s, last.torch_s, last_cls) for c in probe.classes}, complete


def _time_pair(native: Work, reference: Work, budget_s: float) -> Timing:
    """The fastest of MIN_RUNS..MAX_RUNS alternate runs of each callable (more runs while within budget_s)."""
    best_n = best_t = math.inf
    spent = 0.0
    for run in range(MAX_RUNS):
        if run >= MIN_RUNS and spent + (best_n + best_t) > budget_s:
            break
        t0 = time.perf_counter()
        native()
        t1 = time.perf_counter()
        reference()
        t2 = time.perf_counter()
        best_n, best_t = min(best_n, t1 - t0), min(best_t, t2 - t1)
        spent += t2 - t0
    # a path too fast for the clock still has a time: the ratio stays finite
    return Timing(max(best_n, 1e-9), max(best_t, 1e-9))


# ---- the cache ---------------------------------------------------------------------------------------------------

def cpu_identity() -> dict[str, str]:
    """The CPU's model name and a hash of its feature flags (Linux's /proc/cpuinfo; platform's names elsewhere)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = fields.get("flags") or fields.get("Features") or ""
    return {"cpu": model, "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def cache_key() -> dict[str, object]:
    """Everything a cached choice depends on (see the module docstring); needs the kernels available."""
    lib = cpu_kernels.loaded_library()
    if lib is None:
        raise RuntimeError("kernel_choice: the native kernels are not available")
    record = json.loads(cpu_kernels.record_path(lib).read_text(encoding="utf-8"))
    return {"format": CHOICE_FORMAT, "library_sha256": record.get("sha256"), **cpu_identity(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "isa": cpu_kernels.isa()}


def cache_path() -> Path | None:
    """The cache file of the current configuration, beside the kernel library; None when the kernels are off."""
    lib = cpu_kernels.loaded_library()
    return None if lib is None else cache_file(lib, cache_key())


def cache_file(library: Path, key: dict[str, object]) -> Path:
    """The cache file of `key` beside `library`: `<library stem>.choice-<hash of key>.json`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return library.with_name(f"{library.stem}.choice-{digest}.json")


def read_cache(path: Path, key: dict[str, object]) -> tuple[dict[str, dict[str, Timing]], str]:
    """(op → class → Timing) of the ops `path` holds validly for `key`, and why anything was left out ('' if not).

    A missing file, another key, another format, or an op whose probe version, classes or times are not the
    probe's (a number that is not a positive finite time) gives nothing for that op: it is measured again."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, "no cache yet"
    except (OSError, ValueError) as exc:
        return {}, f"unreadable ({exc})"
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("ops"), dict):
        return {}, "of another build, CPU, torch or thread count"
    ops: dict[str, dict[str, Timing]] = {}
    why = ""
    for op, entry in data["ops"].items():
        probe = PROBES.get(op)
        if probe is None:
            continue  # an op this process has not registered: dropped at the next write, measured where used
        try:
            if entry["version"] != probe.version:
                why = f"{op}'s probe has changed"
                continue
            classes = entry["classes"]
            got = {c: Timing(float(classes[c]["native_s"]), float(classes[c]["torch_s"])) for c in probe.classes}
        except (KeyError, TypeError, ValueError):
            why = f"{op}'s entry is damaged"
            continue
        if all(0 < t.native_s < math.inf and 0 < t.torch_s < math.inf for t in got.values()):
            ops[op] = got
        else:
            why = f"{op}'s times are not times"
    return ops, why


def _unregistered_entries(path: Path, key: dict[str, object]) -> dict[str, object]:
    """The entries of `path` (when it holds `key`) for ops this process has not registered (e.g. the fused loss in
    an inference process): kept as they are when the file is rewritten, for the processes that use them."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("ops"), dict):
            return {op: entry for op, entry in data["ops"].items() if op not in PROBES}
    except (OSError, ValueError):
        pass
    return {}


def write_cache(path: Path, key: dict[str, object], ops: dict[str, dict[str, Timing]],
                keep: dict[str, object] | None = None) -> None:
    """Write `ops` (and the raw entries `keep` of ops not registered here) under `key` to `path` atomically; a folder
    that refuses it costs only the reuse (logged)."""
    data = {"key": key, "ops": {**(keep or {}), **{op: {"version": PROBES[op].version, "classes": {
        c: {"native_s": t.native_s, "torch_s": t.torch_s, "ratio": round(t.ratio, 4),
            "path": PROBES[op].path(t.native)} for c, t in classes.items()}}
        for op, classes in ops.items()}}}
    try:
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        log.warning("native CPU kernels: the native-or-torch choice could not be cached at %s (%s); it is measured "
                    "again by the next process", path, exc)


# ---- what the benchmarks print ---------------------------------------------------------------------------------

def summary() -> dict[str, object]:
    """Which path each registered op took in this process: the settings, the cache file and, per op and class,
    the path and the measured ratio (torch time / native time); ops not used so far are marked so."""
    if not cpu_kernels.available():
        return {"native": False, "reason": cpu_kernels.unavailable_reason(), "ops": {}}
    mode = cpu_kernels.settings().choice
    ops: dict[str, object] = {}
    for op, probe in sorted(PROBES.items()):
        hit = _decided.get(op)
        if hit is None or hit[0] != cpu_kernels.generation():
            ops[op] = "not used"
            continue
        t = _timings[op][1] if mode == "measure" and op in _timings else None
        ops[op] = {c: {"path": probe.path(hit[1][c]),
                       "ratio": None if t is None else round(t[c].ratio, 3),
                       **({"as_class": t[c].as_class} if t is not None and t[c].as_class else {})}
                   for c in probe.classes}
    path = cache_path()
    return {"native": True, "isa": cpu_kernels.isa(), "choice": mode, "cache": str(path) if path else None,
            "ops": ops}


def lines() -> list[str]:
    """`summary()` as printable lines: one per op, `class: path (ratio×)` per class."""
    s = summary()
    if not s["native"]:
        return [f"native CPU kernels off ({s['reason']}): every op on torch's paths"]
    out = [f"native CPU kernels: gemv on {s['isa']}, choice {s['choice']}, cache {s['cache']}"]
    for op, classes in s["ops"].items():  # type: ignore[union-attr]
        if isinstance(classes, str):
            out.append(f"  {op}: {classes}")
            continue
        parts = [f"{c} {v['path']}" + (f" {v['ratio']:.2f}x" if v["ratio"] is not None else " (forced)")
                 + (f" (not timed: as {v['as_class']})" if "as_class" in v else "") for c, v in classes.items()]
        first, second = PROBES[op].paths
        out.append(f"  {op} (ratio = {second} time / {first} time): " + ", ".join(parts))
    return out
