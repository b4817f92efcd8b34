"""Speculative metrics on hand-made traces (vLLM definitions)."""

from __future__ import annotations

import pytest

from mtp_train.spec import SpecMetrics


def test_metrics_on_a_hand_made_trace():
    m = SpecMetrics(k=3)
    for n in (3, 0, 1, 2):
        m.add(n)
    assert m.num_drafts == 4 and m.num_draft_tokens == 12 and m.num_accepted == 6
    assert m.acceptance_rate == pytest.approx(0.5)
    assert m.mean_acceptance_length == pytest.approx(2.5)
    assert m.per_position == pytest.approx([0.75, 0.5, 0.25])
    assert m.as_dict()["tau"] == pytest.approx(2.5)


def test_empty_and_invalid():
    m = SpecMetrics(k=2)
    assert m.acceptance_rate == 0.0 and m.mean_acceptance_length == 0.0 and m.per_position == [0.0, 0.0]
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        m.add(3)
