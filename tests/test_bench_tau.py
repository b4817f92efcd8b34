"""bench/tau.py: each head against the first, paired by request; a folder that is not a head is refused by name
before the target loads. No timing is asserted."""

from __future__ import annotations

import sys

import pytest

from bench import tau as bench_tau


def test_each_head_is_compared_with_the_first_over_the_requests_both_answered():
    base = {"requests": {"0": [10, 4], "1": [10, 6], "2": [5, 1]}}
    same = {"requests": dict(base["requests"])}
    better = {"requests": {"0": [10, 6], "1": [10, 7], "2": [5, 2], "9": [3, 3]}}  # request 9: the first lacks it
    rows = bench_tau.versus_first({"a": base, "b": same, "c": better})
    assert list(rows) == ["b", "c"]
    assert rows["b"] == {"tau_minus_first": 0.0, "paired_se": 0.0}
    # over requests 0-2 only: 15/25 − 11/25
    assert rows["c"]["tau_minus_first"] == pytest.approx(4 / 25) and rows["c"]["paired_se"] > 0
    assert bench_tau.versus_first({"a": base}) == {}


def test_a_folder_that_is_not_a_head_is_refused_by_name(tmp_path, monkeypatch):
    (tmp_path / "head").mkdir()
    monkeypatch.setattr(sys, "argv", ["bench.tau", str(tmp_path / "head"), "--model", str(tmp_path / "no-model")])
    with pytest.raises(SystemExit, match=r"bench\.tau: .*head/config\.json is missing"):
        bench_tau.main()
