"""Draft trees: the verify rows `layout` gives (chain, depth-1 tree, mixed batch) and the paths `accept` takes (greedy
chain, greedy tree through a sibling, sampled chain, sampled tree)."""

from __future__ import annotations

import pytest
import torch

from mtp_train.engine.sampling import SamplingBatch, SamplingParams
from mtp_train.layers import AttentionMetadata
from mtp_train.speculative.acceptance import accept_stochastic
from mtp_train.speculative.tree import DraftTree, accept, layout

V = 16
GREEDY = SamplingParams()


def _logits(argmax_rows: list[int]) -> torch.Tensor:
    """(R, V) logits whose row r has its argmax at argmax_rows[r]."""
    out = torch.zeros(len(argmax_rows), V)
    out[torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 5.0
    return out


def test_a_chain_is_laid_out_causally_after_the_last_token():
    rows = layout([DraftTree.chain([5, 6, 7])], [9], [4])
    assert rows.tokens == [[9, 5, 6, 7]] and rows.rows == [4]
    assert rows.parents == [[-1, 0, 1, 2]] and rows.depths == [[0, 1, 2, 3]]
    assert rows.positions == [[3, 4, 5, 6]] and rows.slots == [[3, 4, 5, 6]]
    assert rows.tree is None  # causal attention is a chain's visibility (and keeps graphed steps possible)
    assert rows.moves(0, [0, 1]) == []  # an accepted chain prefix already sits at its positions
    assert rows.path_rows([0, 1]) == slice(0, 3)


def test_a_depth_one_tree_puts_siblings_after_the_chain_at_depth_one():
    tree = DraftTree.chain([5, 6], siblings=[7, 8])
    assert tree.parents == [-1, 0, -1, -1] and tree.chain_length == 2 and not tree.is_chain
    rows = layout([tree], [9], [4])
    assert rows.tokens == [[9, 5, 6, 7, 8]]
    assert rows.parents == [[-1, 0, 1, 0, 0]] and rows.depths == [[0, 1, 2, 1, 1]]
    assert rows.positions == [[3, 4, 5, 4, 4]] and rows.slots == [[3, 4, 5, 6, 7]]
    assert rows.tree == rows.parents
    # the attention sees exactly the ancestors of each row, at the layout's positions
    meta = AttentionMetadata.build(rows.rows, [4 - 1 + 5], [[0, 1]], 4)
    meta.set_tree(rows.tree)
    assert meta.tree_bits.tolist() == [0b1, 0b11, 0b111, 0b1001, 0b10001]
    assert meta.rope_positions.tolist() == rows.positions[0]
    assert rows.path_rows([3]) == [0, 4] and rows.moves(0, [3]) == [(7, 4)]  # sibling 8's K/V to position L


def test_a_mixed_batch_packs_each_sequence_with_its_own_offsets():
    trees = [DraftTree.chain([1, 2]), DraftTree.chain([3], siblings=[4]), DraftTree.chain([])]
    rows = layout(trees, [10, 11, 12], [5, 2, 7])
    assert rows.rows == [3, 3, 1]
    assert rows.tokens == [[10, 1, 2], [11, 3, 4], [12]]
    assert rows.parents == [[-1, 0, 1], [-1, 0, 0], [-1]]
    assert rows.depths == [[0, 1, 2], [0, 1, 1], [0]]
    assert rows.positions == [[4, 5, 6], [1, 2, 2], [6]] and rows.slots == [[4, 5, 6], [1, 2, 3], [6]]
    assert rows.tree == rows.parents  # one tree in the batch makes the whole step a tree step
    meta = AttentionMetadata.build(rows.rows, [5 + 2, 2 + 2, 7], [[0, 1], [2], [3, 4]], 4)
    meta.set_tree(rows.tree)
    assert meta.tree_bits.tolist() == [0b1, 0b11, 0b111, 0b1, 0b11, 0b101, 0b1]
    assert meta.rope_positions.tolist() == [p for ps in rows.positions for p in ps]


def test_trees_are_checked():
    for tokens, parents in (([1, 2], [-1]), ([1, 2], [-1, 1]), ([1], [0])):
        with pytest.raises(ValueError):
            DraftTree(tokens, parents)
    with pytest.raises(ValueError, match="siblings"):
        DraftTree.chain([], siblings=[3])
    with pytest.raises(ValueError, match="siblings"):
        DraftTree.chain([1], torch.full((1, V), 1 / V), siblings=[3])
    with pytest.raises(ValueError, match="2 draft scores for 1 nodes"):
        DraftTree([1], [-1], scores=[0.0, -1.0])


def test_greedy_chain_accepts_the_matching_prefix_and_the_targets_next_token():
    trees = [DraftTree.chain([5, 6, 7]), DraftTree.chain([1, 2]), DraftTree.chain([])]
    logits = torch.cat([_logits([5, 6, 9, 0]), _logits([1, 2, 3]), _logits([4])])
    a, b, c = accept(trees, logits, SamplingBatch([GREEDY] * 3))
    assert (a.path, a.tokens) == ([0, 1], [5, 6, 9])  # d_3 = 7 missed: the target's 9 instead
    assert (b.path, b.tokens) == ([0, 1], [1, 2, 3])  # all accepted, the bonus after the last draft
    assert (c.path, c.tokens) == ([], [4])


def test_greedy_tree_takes_a_sibling_and_the_token_after_it():
    tree = DraftTree.chain([5, 6], siblings=[7, 8])
    # the root's argmax is 8 (the second sibling, node 3, row 4); after 8 the target says 2
    (a,) = accept([tree], _logits([8, 6, 1, 0, 2]), SamplingBatch([GREEDY]))
    assert (a.path, a.tokens) == ([3], [8, 2])
    assert tree.chain_prefix(a.path) == 0  # off the first slots: its K/V moves
    (b,) = accept([tree], _logits([5, 6, 1, 0, 2]), SamplingBatch([GREEDY]))
    assert (b.path, b.tokens) == ([0, 1], [5, 6, 1]) and tree.chain_prefix(b.path) == 2


def test_sampled_chain_follows_leviathan_chen():
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(4, V, generator=g)
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(p_logits, -1)
    # q = p at every position: min(1, p/q) = 1, so every draft is accepted and the bonus comes from p_k
    q = p[:3].clone()
    drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(3)]
    (a,) = accept([DraftTree.chain(drafts, q)], p_logits, SamplingBatch([params], [torch.Generator().manual_seed(1)]))
    assert a.path == [0, 1, 2] and a.tokens[:3] == drafts
    # a draft the target never samples (p = 0 there) is always rejected, and the residual replaces it
    masked = p_logits.clone()
    masked[0, drafts[0]] = float("-inf")
    (b,) = accept([DraftTree.chain(drafts, q)], masked, SamplingBatch([params], [torch.Generator().manual_seed(1)]))
    assert b.path == [] and b.tokens[0] != drafts[0]
    # the same draws as the chain rule itself, generator for generator
    ref = accept_stochastic(torch.tensor([drafts]), q[None], torch.softmax(masked, -1)[None],
                            [torch.Generator().manual_seed(1)])
    assert b.tokens == ref.tokens[0]


def test_a_sampled_tree_with_siblings_takes_the_multi_candidate_rule():
    """Deterministic siblings (q one-hot): the target puts all its mass on sibling 7, so the first child (5) is
    rejected (p(5) = 0), p loses nothing, and 7 is accepted with probability p(7) = 1; a seeded request replays."""
    tree = DraftTree.chain([5, 6], siblings=[7])
    logits = torch.full((4, V), -30.0)
    logits[0, 7] = logits[1, 2] = logits[2, 3] = logits[3, 4] = 0.0  # rows: root, 5, 6, 7
    params = SamplingBatch([SamplingParams(temperature=0.8, seed=5)], [torch.Generator().manual_seed(5)])
    (a,) = accept([tree], logits, params)
    assert a.path == [2] and a.tokens == [7, 4]
    with pytest.raises(ValueError, match="verify rows"):
        accept([tree], _logits([5, 6, 1]), SamplingBatch([GREEDY]))
