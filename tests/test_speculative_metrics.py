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


def test_tau_standard_errors_per_request_and_paired():
    """The per-request counters add up to the totals; the ratio estimator's SE matches a bootstrap over requests;
    a paired difference of two drafters is as exact as its requests allow (zero for identical runs)."""
    import random

    from mtp_train.speculative.metrics import paired_tau_difference, paired_tau_ratio, tau_standard_error

    rng = random.Random(0)
    a, b = SpecMetrics(k=3), SpecMetrics(k=3)
    for req in range(40):
        ease = rng.random()
        for _ in range(rng.randint(5, 30)):
            a.add(min(3, int(rng.random() * 4 * ease)), request=req)
            b.add(min(3, int(rng.random() * 3.2 * ease)), request=req)
    assert sum(s for s, _ in a.by_request.values()) == a.num_drafts
    assert sum(x for _, x in a.by_request.values()) == a.num_accepted
    se = tau_standard_error(a.by_request)
    reqs = list(a.by_request.values())
    boot = []
    for _ in range(2000):
        pick = [reqs[rng.randrange(len(reqs))] for _ in reqs]
        boot.append(1 + sum(x for _, x in pick) / sum(s for s, _ in pick))
    mean = sum(boot) / len(boot)
    sd = (sum((t - mean) ** 2 for t in boot) / (len(boot) - 1)) ** 0.5
    assert abs(se - sd) < 0.15 * sd, (se, sd)
    diff, dse = paired_tau_difference(a.by_request, b.by_request)
    assert abs(diff - (a.mean_acceptance_length - b.mean_acceptance_length)) < 1e-12
    assert 0 < dse < se + tau_standard_error(b.by_request)  # pairing removes the requests' shared difficulty
    assert paired_tau_difference(a.by_request, a.by_request) == (0.0, 0.0)
    ratio, rse = paired_tau_ratio(a.by_request, b.by_request)
    assert abs(ratio - a.mean_acceptance_length / b.mean_acceptance_length) < 1e-12 and 0 < rse < 1
    merged = SpecMetrics(k=3)
    merged.merge(a)
    merged.merge(a)
    assert merged.by_request[0] == [2 * a.by_request[0][0], 2 * a.by_request[0][1]]
    assert tau_standard_error({0: [10, 4]}) is None
    with pytest.raises(ValueError, match="share no request"):
        paired_tau_difference({0: [1, 1]}, {1: [1, 1]})
