"""The native-or-torch choice: measured once per configuration, cached beside the build, never trusted when stale or
damaged, and forced by the settings. No test asserts which path is faster: that is the machine's to say."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mtp_train.layers import cpu_kernels, kernel_choice
from mtp_train.layers.cpu_kernels import KernelSettings
from mtp_train.layers.kernel_choice import Probe, Timing
from mtp_train.layers.linear import GEMV_M_MAX, Linear, takes_small_m

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")

OP = "test_gemv_8x40"  # a probe of the tests' own, registered like the layers' (real work on both paths)


class CountingSetup:
    """A probe set-up that counts how often it ran, i.e. how often the op was measured."""

    def __init__(self) -> None:
        self.calls = 0
        self.x, self.w = torch.randn(3, 40), torch.randn(8, 40)

    def __call__(self):
        self.calls += 1
        return lambda cls: (lambda: cpu_kernels.gemv(self.x, self.w), lambda: F.linear(self.x, self.w))


@pytest.fixture
def probe():
    setup = CountingSetup()
    kernel_choice.register(Probe(OP, ("a", "b"), setup, budget_s=60.0))  # microseconds of work: never cut short
    yield setup
    kernel_choice.PROBES.pop(OP)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """One kernel folder for the module's tests (one build)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def measured(kernel_dir, monkeypatch):
    """The kernels in the module's folder with no choice cached yet, the choice measured: the folder.

    No deadline a real probe meets (a probe of budget 0 still passes it): on a loaded machine a measurement past it
    is cut short and not cached, and what these tests check must not depend on how busy the machine is."""
    monkeypatch.setattr(kernel_choice, "DEADLINE", 1e9)
    for old in _choice_files(kernel_dir):
        old.unlink()
    before = cpu_kernels.settings()
    cpu_kernels.configure(KernelSettings(cache_dir=kernel_dir, choice="measure"))
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    yield kernel_dir
    cpu_kernels.configure(before)


def _again() -> None:
    """What a new process with the same settings sees: nothing decided in memory, the folder as it is."""
    cpu_kernels.configure(cpu_kernels.settings())


def _choice_files(folder) -> list:
    return sorted(p for p in folder.iterdir() if ".choice-" in p.name)


def test_a_measurement_is_cached_atomically_and_reread(probe, measured):
    first = kernel_choice.timings(OP)
    assert set(first) == {"a", "b"} and probe.calls == 1
    assert all(0 < t.native_s < math.inf and 0 < t.torch_s < math.inf for t in first.values())
    assert kernel_choice.prefers_native(OP, "a") == first["a"].native
    [cache] = _choice_files(measured)
    assert cache == kernel_choice.cache_path() and cache.parent == cpu_kernels.loaded_library().parent
    assert not [p for p in measured.iterdir() if p.name.startswith(".tmp")]  # written through a renamed temporary
    data = json.loads(cache.read_text())
    assert data["key"] == kernel_choice.cache_key()
    assert data["key"]["torch"] == torch.__version__ and data["key"]["isa"] == cpu_kernels.isa()
    _again()
    assert kernel_choice.timings(OP) == first and probe.calls == 1  # reread, not measured
    assert [kernel_choice.prefers_native(OP, c) for c in "ab"] == [first[c].native for c in "ab"]


def test_the_cache_is_keyed_by_build_cpu_torch_and_threads(probe, measured, monkeypatch):
    kernel_choice.timings(OP)
    key = kernel_choice.cache_key()
    lib = cpu_kernels.loaded_library()
    names = {kernel_choice.cache_file(lib, {**key, field: "other"}).name
             for field in ("library_sha256", "cpu", "cpu_flags", "torch", "threads", "isa")}
    assert len(names) == 6 and kernel_choice.cache_file(lib, key).name not in names
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")  # another torch: another file, measured again
    _again()
    kernel_choice.timings(OP)
    assert probe.calls == 2 and len(_choice_files(measured)) == 2


@pytest.mark.parametrize("field", ["library_sha256", "cpu", "torch"])
def test_a_file_of_another_configuration_under_this_name_is_remeasured(probe, measured, field):
    kernel_choice.timings(OP)
    cache = kernel_choice.cache_path()
    data = json.loads(cache.read_text())
    data["key"][field] = "another"
    cache.write_text(json.dumps(data))
    _again()
    kernel_choice.timings(OP)
    assert probe.calls == 2 and json.loads(cache.read_text())["key"] == kernel_choice.cache_key()  # rewritten


def _damage(kind: str, text: str) -> str:
    data = json.loads(text)
    classes = data["ops"][OP]["classes"]
    if kind == "truncated":
        return text[: len(text) // 2]
    if kind == "not-json":
        return "\x00\xff garbage"
    if kind == "list":
        return "[1, 2]"
    if kind == "negative":
        classes["a"]["native_s"] = -1.0
    elif kind == "nan":
        classes["b"]["torch_s"] = float("nan")
    elif kind == "string":
        classes["a"]["torch_s"] = "fast"
    elif kind == "missing-class":
        del classes["b"]
    elif kind == "old-probe":
        data["ops"][OP]["version"] = 0
    elif kind == "ops-not-a-dict":
        data["ops"][OP] = [1]
    return json.dumps(data)


@pytest.mark.parametrize("kind", ["truncated", "not-json", "list", "negative", "nan", "string", "missing-class",
                                  "old-probe", "ops-not-a-dict"])
def test_a_damaged_cache_is_remeasured_without_a_crash(probe, measured, kind):
    kernel_choice.timings(OP)
    cache = kernel_choice.cache_path()
    cache.write_text(_damage(kind, cache.read_text()))
    _again()
    got = kernel_choice.timings(OP)
    assert probe.calls == 2 and set(got) == {"a", "b"}
    assert kernel_choice.read_cache(cache, kernel_choice.cache_key())[0][OP] == got  # a valid file again


def test_an_op_this_process_does_not_register_keeps_its_entry(probe, measured):
    """A process that never registers an op (an inference one: no fused loss) leaves that op's times in the file."""
    kernel_choice.timings(OP)
    cache = kernel_choice.cache_path()
    data = json.loads(cache.read_text())
    data["ops"]["other_op"] = {"version": 1, "classes": {"x": {"native_s": 1.0, "torch_s": 2.0}}}
    cache.write_text(json.dumps(data))
    kernel_choice.register(Probe(OP + "_2", ("a",), CountingSetup(), budget_s=60.0))
    try:
        kernel_choice.timings(OP + "_2")  # measured and written beside the others
    finally:
        kernel_choice.PROBES.pop(OP + "_2")
    ops = json.loads(cache.read_text())["ops"]
    assert set(ops) == {OP, OP + "_2", "other_op"} and ops["other_op"] == data["ops"]["other_op"]


def test_forcing_a_path_measures_nothing(probe, measured):
    for mode, native in (("native", True), ("torch", False)):
        cpu_kernels.configure(KernelSettings(cache_dir=measured, choice=mode))
        assert [kernel_choice.prefers_native(OP, c) for c in "ab"] == [native, native]
        assert kernel_choice.summary()["ops"][OP] == {c: {"path": mode, "ratio": None} for c in "ab"}
    assert probe.calls == 0 and not _choice_files(measured)


def test_forcing_steers_the_linears(measured):
    torch.manual_seed(0)
    lin = Linear(40, 24)
    for mode in ("native", "torch"):
        cpu_kernels.configure(KernelSettings(cache_dir=measured, choice=mode))
        lin.prepack()
        for m in range(1, GEMV_M_MAX + 1):
            x = torch.randn(m, 40)
            with torch.inference_mode():
                assert takes_small_m(x, lin.weight) == (mode == "torch" and m > 1)
                out = lin(x)
            if mode == "native":
                assert torch.equal(out, cpu_kernels.gemv(x, lin.weight, lin.bias))
            torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        # one-row products on the torch path are MKL's pre-packed GEMM, where this torch has it
        assert (lin._packed is not None) == (mode == "torch" and torch.backends.mkl.is_available()
                                             and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
    assert not _choice_files(measured)


def test_a_measurement_cut_short_is_used_but_not_cached(measured):
    setup = CountingSetup()
    kernel_choice.register(Probe(OP, ("a", "b", "c"), setup, budget_s=0.0))  # past its deadline after one class
    try:
        got, complete = kernel_choice.measure(kernel_choice.PROBES[OP])
        assert not complete and got["a"].as_class is None
        assert got["b"] == got["c"] == Timing(got["a"].native_s, got["a"].torch_s, as_class="a")
        kernel_choice.timings(OP)
        assert not _choice_files(measured)  # nothing cached: the next process measures again
        assert kernel_choice.summary()["ops"][OP]["c"]["as_class"] == "a"
        assert "c native" in "".join(kernel_choice.lines()) or "c torch" in "".join(kernel_choice.lines())
        assert "(not timed: as a)" in "".join(kernel_choice.lines())
        _again()
        kernel_choice.timings(OP)
        assert setup.calls == 3
    finally:
        kernel_choice.PROBES.pop(OP)


def test_the_layers_probes_measure_and_the_summary_reports_them(measured):
    """The real probes (linears by row count, attention, the fused loss): every class timed, cached, reported."""
    import mtp_train.layers.attention.torch_backend  # noqa: F401  (registers "attention")
    import mtp_train.train.divergences  # noqa: F401  (registers "soft_ce")

    for op in ("linear", "attention", "soft_ce"):
        got = kernel_choice.timings(op)
        assert set(got) == set(kernel_choice.PROBES[op].classes)
    assert set(kernel_choice.PROBES["linear"].classes) == {str(m) for m in range(1, GEMV_M_MAX + 1)}
    s = kernel_choice.summary()
    assert s["isa"] == cpu_kernels.isa() and s["cache"] == str(kernel_choice.cache_path())
    for op in ("linear", "attention", "soft_ce"):
        for cls, entry in s["ops"][op].items():
            t = kernel_choice.timings(op)[cls]
            assert entry == {"path": "native" if t.native else "torch", "ratio": round(t.ratio, 3),
                             **({"as_class": t.as_class} if t.as_class else {})}  # (a loaded machine cuts short)
    lines = kernel_choice.lines()
    assert any(line.strip().startswith("linear") for line in lines)


def test_an_op_not_used_is_reported_so(probe, measured):
    assert kernel_choice.summary()["ops"][OP] == "not used"


def test_timing_ratio_and_tie():
    assert Timing(1.0, 2.0).ratio == 2.0 and Timing(1.0, 2.0).native
    assert Timing(2.0, 1.0).ratio == 0.5 and not Timing(2.0, 1.0).native
    assert Timing(1.0, 1.0).native  # a tie keeps the native kernel
    assert Timing(1.05, 1.0).native and not Timing(1.15, 1.0).native  # and so does a loss within the margin


@pytest.mark.skipif(not cpu_kernels.available() or cpu_kernels.isa() != "avx512", reason="needs an AVX-512 CPU")
def test_the_gemv_body_is_measured_per_row_count_where_both_run(measured):
    """On a CPU with AVX-512 the linears' native path takes, per row count, the faster of the two gemv bodies
    (measured before the linears' own choice, cached beside it); forcing an ISA or a path leaves nothing to choose."""
    from mtp_train.layers import linear as linear_mod

    torch.manual_seed(0)
    lin = Linear(40, 24)
    with torch.inference_mode():
        x = torch.randn(1, 40)
        out = lin(x)
    bodies = kernel_choice.timings("gemv_isa")
    assert set(bodies) == set(kernel_choice.PROBES["linear"].classes)
    cached = json.loads(_choice_files(measured)[0].read_text())["ops"]
    assert {"gemv_isa", "linear"} <= cached.keys()
    assert {e["path"] for e in cached["gemv_isa"]["classes"].values()} <= {"avx512", "avx2"}
    chosen = "avx512" if bodies["1"].native else "avx2"
    assert linear_mod._gemv_isa(1) == chosen
    if kernel_choice.prefers_native("linear", "1"):
        assert torch.equal(out, cpu_kernels.gemv(x, lin.weight, lin.bias, isa=chosen))
    assert "gemv_isa (ratio = avx2 time / avx512 time)" in "".join(kernel_choice.lines())
    for forced in (KernelSettings(cache_dir=measured, choice="measure", isa="avx512"),
                   KernelSettings(cache_dir=measured, choice="native")):
        cpu_kernels.configure(forced)
        assert linear_mod._gemv_isa(1) is None
