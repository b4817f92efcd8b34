"""bench/tree_rules.py: the offline node-selection rules on hand-built steps (where each rule's τ is known), and the
recording on a tiny target, where the big tree's offline τ equals the measured one and EAGLE-2's rule at the big
tree's size keeps every candidate."""

from __future__ import annotations

import pytest

from bench import tree_rules as rules
from mtp_train.data.readers import Conversation
from mtp_train.speculative.tree import ROOT, DraftTree
from mtp_train.speculative.tree_draft import TreeSpec
from tests.conftest import TOPICS, predictable_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")


def _step(path, request=0):
    """Root → a (q 0.6) → c (0.9 of a), root → b (q 0.3) → d (0.5 of b): scores are cumulative log q."""
    import math
    lq = [math.log(0.6), math.log(0.3), math.log(0.9), math.log(0.5)]
    parents = [ROOT, ROOT, 0, 1]
    scores = [lq[0], lq[1], lq[0] + lq[2], lq[1] + lq[3]]
    return rules.Step(request, parents, scores, path)


def test_a_step_knows_its_depths_ranks_and_own_q():
    s = _step([0, 2])
    assert s.depths == [1, 1, 2, 2] and s.ranks == [0, 1, 0, 0]
    assert s.logq == pytest.approx([-0.5108, -1.2040, -0.1054, -0.6931], abs=1e-4)


def test_kept_nodes_accept_the_paths_prefix_they_hold():
    s = _step([1, 3])  # the target took b, then d
    assert rules.accepted(s, {0, 1, 2, 3}) == 2 and rules.accepted(s, {0, 2}) == 0
    assert rules.accepted(s, {1}) == 1
    # EAGLE-2's rerank by score keeps a (0.6), c (0.54), b (0.3), then d (0.15): 1 node accepted from 3 kept
    steps = [s]
    assert rules.tau(steps, lambda x: x.scores, 2) == 1.0  # a and c: none on the path
    assert rules.tau(steps, lambda x: x.scores, 3) == 2.0  # b joins
    assert rules.tau(steps, lambda x: x.scores, 4) == 3.0
    # the pool (everything kept) is the ceiling of every rule
    both = [s, _step([0, 2], request=1)]
    assert rules.tau(both, lambda x: x.scores, 10 ** 6) == 3.0


def test_calibration_learns_which_children_are_accepted():
    """When the target always takes the second child, the measured table ranks it first, where q does not."""
    steps = [_step([1, 3], request=r) for r in range(6)]
    table = rules.fit(steps, rules.by_depth_rank)
    assert table[(1, 1)] > 0.9 > 0.1 > table[(1, 0)]
    assert rules.tau(steps, rules.calibrated(table, rules.by_depth_rank), 2) == 3.0
    assert rules.tau(steps, lambda x: x.scores, 2) == 1.0
    assert rules.cross_fitted(steps, rules.by_depth_rank, 2) == 3.0  # the other half's table says the same
    out = rules.rules(steps, [1, 2])
    assert out["steps"] == 6 and out["pool"] == 3.0 and out["2"]["eagle2"] == 1.0 and out["1"]["depth_rank"] == 2.0
    assert out["acceptance"]["1"] == pytest.approx([0.5 / 7, 6.5 / 7], abs=1e-4)  # by rank, smoothed


def test_recording_a_tiny_targets_tree(tmp_path):
    model, tok, head, _ = predictable_chat_target(tmp_path / "target")
    convs = [Conversation(f"c{i}", [{"role": "user", "content": f"Tell me about {TOPICS[i]}."}], "test", i + 1)
             for i in range(3)]
    spec = rules.pool_spec(2, 2)
    assert spec == TreeSpec(2, 2, 7)  # 2 + 4 drafted, the root counted
    steps, tau = rules.record(model, tok, head, convs, spec, 10, batch_size=2)
    assert steps and all(len(s.scores) == len(s.parents) <= 6 for s in steps)
    assert {s.request for s in steps} == {0, 1, 2}
    # every candidate verified: the offline pool τ is the measured τ, step for step
    assert rules.tau(steps, lambda x: x.scores, 10 ** 6) == pytest.approx(tau)
    assert rules.tau(steps, lambda x: x.scores, 6) == pytest.approx(tau)
    assert all(b <= a + 1e-12 for s in steps for a, b in
               ((s.scores[p], s.scores[i]) for i, p in enumerate(s.parents) if p != ROOT))
    with pytest.raises(ValueError, match="scores"):
        rules._Recorder(1).record(DraftTree([5], [ROOT]), [0], 0)
