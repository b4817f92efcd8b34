"""Speculative metrics on hand-made traces (vLLM definitions)."""

from __future__ import annotations

import pytest

from mtp_train.speculative import SpecMetrics
from mtp_train.speculative.tree import DraftTree


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


def test_variable_draft_lengths_count_every_step():
    m = SpecMetrics(k=3)
    m.add(2, 3)  # a full chain, two accepted
    m.add(0, 0)  # no draft at all: the step still emitted one token
    m.add(1, 1)  # a chain stopped after one draft, accepted
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted, m.num_empty) == (3, 4, 3, 1)
    assert m.mean_acceptance_length == 2.0  # 6 tokens in 3 target steps
    assert m.acceptance_rate == 0.75 and m.mean_draft_length == 4 / 3
    assert m.per_position == [2 / 3, 1 / 3, 0.0]
    with pytest.raises(ValueError, match="accepted 2 of 1"):
        m.add(2, 1)
    with pytest.raises(ValueError, match="at most k=3"):
        m.add(0, 4)
    other = SpecMetrics(k=3)
    other.add(3)
    m.merge(other)
    assert (m.num_drafts, m.num_accepted, m.accepted_per_pos) == (4, 6, [3, 2, 1])
    with pytest.raises(ValueError, match="merge"):
        m.merge(SpecMetrics(k=2))


def test_first_draft_siblings_count_as_verified_branch_tokens():
    m = SpecMetrics(3)
    m.add(1, 3, num_branch_tokens=2, branch_accepted=True)  # the chain's first draft missed, a sibling hit
    m.add(3, 3, num_branch_tokens=2)
    m.add(0, 3, num_branch_tokens=2)
    assert (m.num_draft_tokens, m.num_branch_tokens, m.num_branch_accepted) == (15, 6, 1)
    assert m.mean_acceptance_length == 1 + 4 / 3 and m.mean_draft_length == 5.0
    assert m.per_position == [2 / 3, 1 / 3, 1 / 3]
    other = SpecMetrics(3)
    other.add(1, 1, num_branch_tokens=1, branch_accepted=True)
    m.merge(other)
    assert (m.num_branch_tokens, m.num_branch_accepted) == (7, 2)
    # the report's columns keep their names
    assert (m.as_dict()["num_alt_tokens"], m.as_dict()["num_alt_accepted"], m.num_alt_accepted) == (7, 2, 2)
    with pytest.raises(ValueError, match="branch"):
        m.add(0, 3, num_branch_tokens=2, branch_accepted=True)  # an accepted branch holds a token
    with pytest.raises(ValueError, match="branch"):
        m.add(1, 3, branch_accepted=True)  # and needs nodes off the chain


def test_record_reads_a_tree_and_its_path():
    m = SpecMetrics(3)
    m.record(DraftTree.chain([5, 6, 7], siblings=[8, 9]), [3])  # a sibling of the first draft was the target's
    m.record(DraftTree.chain([5, 6, 7], siblings=[8, 9]), [0, 1])  # along the chain
    m.record(DraftTree.chain([]), [])  # nothing drafted
    assert (m.num_drafts, m.num_draft_tokens, m.num_branch_tokens, m.num_branch_accepted) == (3, 10, 4, 1)
    assert (m.num_accepted, m.num_empty, m.accepted_per_pos) == (3, 1, [2, 1, 0])
