"""mtp-eval's `tree` axis: a dynamic draft tree per point (at k = its steps), named in labels, rows and series,
built into the head's proposer as a TreeSpec; bad shapes refused before anything loads."""

from __future__ import annotations

import pytest

from mtp_train.config import EvalConfig, HeadConfig, NgramConfig
from mtp_train.config.errors import ConfigError
from mtp_train.eval.methods import MethodSet
from mtp_train.eval.options import expand_grid
from mtp_train.head_types.chain import HeadProposer
from mtp_train.heads import build_head
from mtp_train.speculative.tree_draft import TreeSpec


def test_the_tree_axis_gives_one_point_per_tree_at_its_depth():
    cfg = EvalConfig(k=[2, 4], tree=["none", "3x2x6", "2x4x8"], ngram=NgramConfig(compare=False))
    heads = [p for p in expand_grid(cfg) if p.method == "head"]
    assert [(p.k, p.value("tree")) for p in heads] == [(2, "none"), (4, "none"), (3, "3x2x6"), (2, "2x4x8")]
    assert [p.label for p in heads] == ["head k=2 tree=none", "head k=4 tree=none",
                                        "head k=3 tree=3x2x6", "head k=2 tree=2x4x8"]
    assert {p.series for p in heads} == {"head tree=none", "head tree=3x2x6", "head tree=2x4x8"}
    assert all(p.row_fields()["tree"] == p.value("tree") for p in heads)
    plain = [p for p in expand_grid(cfg) if p.method == "none"]
    assert len(plain) == 1 and plain[0].value("tree") is None


def test_a_tree_point_is_run_once_whatever_the_draft_widths():
    cfg = EvalConfig(k=[1, 2], draft_width=[1, 2], tree=["none", "2x2x4"], ngram=NgramConfig(compare=False))
    heads = [(p.k, p.value("draft_width"), p.value("tree")) for p in expand_grid(cfg) if p.method == "head"]
    assert heads == [(1, 1, "none"), (2, 1, "none"), (2, 1, "2x2x4"), (1, 2, "none"), (2, 2, "none")]


def test_a_tree_point_builds_the_heads_tree(tiny_checkpoints):
    cfg = EvalConfig(k=2, tree=["none", "3x2x6"], ngram=NgramConfig(compare=False))
    head = build_head(HeadConfig(type="mtp"), tiny_checkpoints["llama"][0])
    methods = MethodSet(cfg, {"head": head})
    built = {p.value("tree"): methods.proposer(p) for p in expand_grid(cfg) if p.method == "head"}
    assert isinstance(built["3x2x6"], HeadProposer) and built["3x2x6"].tree == TreeSpec(3, 2, 6)
    assert built["none"].tree is None


@pytest.mark.parametrize("bad", ["3x2", "three", "3x2x6x1"])
def test_a_bad_tree_shape_is_refused(bad):
    with pytest.raises(ConfigError, match="STEPSxTOPKxTOKENS"):
        EvalConfig(tree=bad)
