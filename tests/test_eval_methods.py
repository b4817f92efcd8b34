"""`mtp-eval`'s method registry and its grid without running a model: unknown methods refused, only the axes of a
method multiply its runs, every run labelled by what varies, and the report's rows and plot lines keep apart the
points that differ (draft_width 1 and 2)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from mtp_train.cli.eval import eval_main
from mtp_train.config import EvalConfig, HeadConfig, NgramConfig
from mtp_train.eval.acceptance import RunResult
from mtp_train.eval.methods import METHODS, K, MethodSet, MethodSpec, grid_methods, method_spec
from mtp_train.eval.options import EvalPoint, expand_grid
from mtp_train.eval.report import plot_series, vs_k_figure
from mtp_train.eval.rows import overall_rows, result_row
from mtp_train.head_types.chain import HeadProposer
from mtp_train.heads import build_head, save_head
from mtp_train.speculative.metrics import SpecMetrics
from mtp_train.speculative.proposers import NgramProposer
from tests.conftest import compose_config, make_chat_target, topic_conversations


def _count(points: list[EvalPoint]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in points:
        counts[p.method] = counts.get(p.method, 0) + 1
    return counts


def test_the_four_methods_are_registered_and_an_unknown_one_is_refused_naming_them():
    assert list(METHODS) == ["none", "head", "draft", "ngram"]
    with pytest.raises(ValueError, match="unknown eval method 'medusa'; choose one of none, head, draft, ngram"):
        method_spec("medusa")
    with pytest.raises(ValueError, match="choose one of none, head, draft, ngram"):
        expand_grid(EvalConfig(method="medusa"))  # the grid refuses it before anything loads
    with pytest.raises(ValueError, match="registered twice"):
        METHODS.add(MethodSpec("ngram", "again", axes=(K,)))
    assert list(METHODS) == ["none", "head", "draft", "ngram"]


def test_axes_that_do_not_apply_to_a_method_do_not_multiply_its_runs():
    # plain decoding: one run per temperature whatever k, the threshold or the width say
    none = expand_grid(EvalConfig(method="none", k=[1, 2, 3], draft_width=[1, 2], draft_threshold=[0.0, 0.5]))
    assert none == [EvalPoint("none")]
    assert [p.temperature for p in expand_grid(EvalConfig(method="none", k=[1, 2], temperature=[0, 1]))] == [0, 1]
    # prompt lookup and a draft model: k × temperature only; the head's axes are not theirs
    for method in ("ngram", "draft"):
        points = expand_grid(EvalConfig(method=method, k=[1, 2], draft_width=[1, 2, 3], catch_up=["target", "own"],
                                        ngram=NgramConfig(compare=False)))
        assert _count(points) == {"none": 1, method: 2}
        assert all(p.options == {} and p.value("draft_width") is None for p in points)
    # the head: every axis of it, prompt lookup beside it at every k (ngram.compare), the baseline once
    cfg = EvalConfig(k=[1, 2, 3], draft_width=[1, 2], catch_up=["target", "own"], temperature=[0, 1])
    points = expand_grid(cfg)
    assert _count(points) == {"none": 2, "head": 3 * 2 * 2 * 2, "ngram": 3 * 2}
    assert len(set(points)) == len(points)
    assert [s.name for s in grid_methods(cfg)] == ["none", "head", "ngram"]
    head = next(p for p in points if p.method == "head")
    assert head.options == {"draft_threshold": 0.0, "catch_up": "target", "draft_width": 1, "tree": "none"}
    assert [s.name for s in grid_methods(EvalConfig(ngram=NgramConfig(compare=False)))] == ["none", "head"]


def test_labels_carry_every_axis_that_varies_and_no_other():
    points = expand_grid(EvalConfig(k=[1, 2], draft_width=[1, 2]))
    labels = [p.label for p in points]
    assert labels == ["plain", "head k=1 width=1", "head k=2 width=1", "head k=1 width=2",
                      "head k=2 width=2", "prompt lookup k=1", "prompt lookup k=2"]
    # a series is a label without k: one line per width, one for prompt lookup
    assert sorted({p.series for p in points if p.method != "none"}) == [
        "head width=1", "head width=2", "prompt lookup"]
    # one value everywhere: nothing but the method; a threshold grid and a temperature grid name theirs
    assert [p.label for p in expand_grid(EvalConfig(k=3, ngram=NgramConfig(compare=False)))] == ["plain", "head"]
    thr = expand_grid(EvalConfig(k=3, draft_threshold=[0, 0.4], temperature=[0, 1], ngram=NgramConfig(compare=False)))
    assert {p.label for p in thr} == {"plain T=0", "plain T=1", "head thr=0 T=0", "head thr=0.4 T=0",
                                      "head thr=0 T=1", "head thr=0.4 T=1"}


def test_each_method_builds_its_own_proposer(tiny_checkpoints):
    cfg = EvalConfig(k=2, draft_width=[1, 2], ngram=NgramConfig(n_max=4, n_min=2))
    head = build_head(HeadConfig(type="mtp"), tiny_checkpoints["llama"][0])
    methods = MethodSet(cfg, {"head": head})
    built = {p: methods.proposer(p) for p in expand_grid(cfg)}
    kinds = {p.label: type(b).__name__ for p, b in built.items()}
    assert kinds == {"plain": "NoneType", "head width=1": "HeadProposer", "head width=2": "HeadProposer",
                     "prompt lookup": "NgramProposer"}
    for p, b in built.items():
        if isinstance(b, HeadProposer):
            assert b.draft_width == p.value("draft_width") and b.head is head
        if isinstance(b, NgramProposer):
            assert (b.n_max, b.n_min) == (4, 2)
    with pytest.raises(ValueError, match="draft_width"):
        methods.proposer(EvalPoint.of("head", k=2, draft_threshold=0.0, catch_up="target", draft_width=0))
    with pytest.raises(ValueError, match="head_ckpt"):
        MethodSet.load(cfg, None, None, tiny_checkpoints["llama"][0])  # type: ignore[arg-type]


def _run(point: EvalPoint, tau_steps: list[int], seconds: float) -> RunResult:
    """A finished run without a model: `tau_steps` accepted tokens per step, 10 tokens in `seconds` per chunk."""
    m = None
    if point.k:
        m = SpecMetrics(point.k)
        for a in tau_steps:
            m.add(a)
    return RunResult("tiny", point, generated_tokens=20, seconds=2 * seconds, metrics=m,
                     chunks=[(10, seconds), (10, seconds)])


def test_report_labels_and_plot_series_keep_draft_width_1_and_2_apart():
    points = expand_grid(EvalConfig(k=[1, 2], draft_width=[1, 2], ngram=NgramConfig(compare=False)))
    base = _run(points[0], [], 1.0)
    pairs = [(_run(p, [1, p.value("draft_width") - 1], 1.0 / p.value("draft_width")), base) for p in points[1:]]
    rows = [result_row(r, b) for r, b in pairs] + overall_rows(pairs)
    over = [r for r in rows if r["dataset"] == "overall"]
    assert len(over) == 4 and len({r["label"] for r in over}) == 4
    assert {r["label"] for r in over if r["draft_width"] == 2} == {"head k=1 width=2", "head k=2 width=2"}
    series = plot_series(rows)
    assert list(series) == ["head width=1", "head width=2"]
    assert [[r["k"] for r in rs] for rs in series.values()] == [[1, 2], [1, 2]]
    assert {r["draft_width"] for r in series["head width=2"]} == {2}
    assert [r["speedup"] for r in series["head width=2"]] == [pytest.approx(2.0)] * 2
    fig = vs_k_figure(rows)
    for ax in fig.axes:  # τ and speed-up: one entry per width (the step costs and the break-even line unlabelled)
        assert ax.get_legend_handles_labels()[1] == list(series)
        assert all(float(t).is_integer() for t in ax.get_xticks())  # k on whole numbers
    tau_ax, speed_ax = fig.axes
    costs = [ln for ln in tau_ax.get_lines() if ln.get_label() == "_cost"]
    assert len(costs) == 2 and list(costs[0].get_ydata()) == [r["step_cost"] for r in series["head width=1"]]
    assert len(speed_ax.containers) == 2  # each speed-up series drawn with its interval as error bars
    fig.clf()


def _said(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "method=" in str(w.message)]


def test_method_mtp_is_a_deprecated_name_of_head_said_once():
    """`method=mtp` (the name of one head type) warns, naming method=head, and then is `head`: the same config,
    grid and labels."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = EvalConfig(method="mtp", k=[1, 2], draft_width=[1, 2])
    said = _said(caught)
    assert len(said) == 1 and "method=mtp is deprecated: use method=head" in said[0]
    new = EvalConfig(method="head", k=[1, 2], draft_width=[1, 2])
    assert old == new and old.method == "head"
    assert expand_grid(old) == expand_grid(new) and {p.method for p in expand_grid(old)} == {"none", "head", "ngram"}


def _head_folder(kind: str, target: Path, out: Path, **settings: object) -> Path:
    save_head(build_head(HeadConfig(type=kind, **settings), target), out)  # type: ignore[arg-type]
    return out


def test_the_head_methods_axes_are_its_head_types_drafter_options(tmp_path):
    """The grid of `method=head` multiplies k, temperature and only the options the saved head's type's drafter
    takes (`HeadType.draft_options`, read from the folder's config.json before anything loads); an option it does
    not take is refused unless at its default."""
    from mtp_train.config import head_type

    target = make_chat_target(tmp_path / "target")
    chain = _head_folder("mtp", target, tmp_path / "chain")
    block = _head_folder("dflash", target, tmp_path / "block")
    assert "draft_width" not in head_type("dflash").draft_options  # what this test relies on
    points = expand_grid(EvalConfig(head_ckpt=str(chain), k=2, draft_width=[1, 2], ngram=NgramConfig(compare=False)))
    assert [p.label for p in points] == ["plain", "head width=1", "head width=2"]
    assert set(points[1].options) == set(head_type("mtp").draft_options)
    points = expand_grid(EvalConfig(head_ckpt=str(block), k=[2, 3], draft_threshold=[0.0, 0.5],
                                    ngram=NgramConfig(compare=False)))
    heads = [p for p in points if p.method == "head"]
    assert len(heads) == 4 and all(set(p.options) == set(head_type("dflash").draft_options) for p in heads)
    assert "head k=2 thr=0.5" in [p.label for p in heads]
    with pytest.raises(ValueError, match="dflash heads draft with their own drafter, which takes no draft_width=2"):
        expand_grid(EvalConfig(head_ckpt=str(block), draft_width=[1, 2]))


def test_mtp_eval_method_mtp_warns_once_and_equals_method_head(tmp_path):
    """`mtp-eval method=mtp` says once that it is method=head, then runs it: the same rows (greedy, so the same
    tokens, drafts and acceptance), labelled `head`."""
    target = make_chat_target(tmp_path / "target")
    _, prompts = topic_conversations(tmp_path)
    head = _head_folder("mtp", target, tmp_path / "mtp-head", init="last_layer")
    base = [f"model.path={target}", "model.device=cpu", f"head_ckpt={head}", f"prompts=[{prompts}]", "k=2",
            "max_new_tokens=8", "progress=false", "warmup=false", "plots=false", "ngram.compare=false",
            "verify_fingerprint=false"]
    reports = {}
    for method in ("mtp", "head"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports[method] = eval_main(compose_config("eval", [*base, f"method={method}",
                                                                f"out={tmp_path / f'eval-{method}'}"]))
        said = _said(caught)
        assert len(said) == (method == "mtp"), said
        assert all("use method=head" in m for m in said)
    measured = ("dataset", "method", "label", "k", "tau", "acceptance_rate", "per_position", "exact_match",
                "mean_draft_len")
    old, new = ([{k: r.get(k) for k in measured} for r in reports[m]["rows"]] for m in ("mtp", "head"))
    assert old == new and {r["method"] for r in new} == {"head"}
    assert (tmp_path / "eval-mtp" / "report.md").read_text().startswith("# mtp-eval: head")
