"""Draft trees grown and pruned (`tree_draft` on hand-made logits), and lossless multi-candidate rejection sampling:
a χ² test of the first two emitted tokens against the target's exact joint, for trees of width 3 and depth 3.

The χ² harness is pure torch around `tree.accept`: a tiny vocabulary, a target and a draft that are fixed tables
over the last two tokens of the context (so every tree row has its own distribution), one tree per draw.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtp_train.engine.sampling import SamplingBatch, SamplingParams, filtered_probs
from mtp_train.speculative.tree import ROOT, DraftTree, accept
from mtp_train.speculative.tree_draft import TreeSpec, expand, preorder, renumber, rerank, static_parents

pytestmark = pytest.mark.usefixtures("one_thread")

V = 6
WIDTH, DEPTH = 3, 3


def test_a_static_tree_reads_vllm_choices():
    parents, ranks = static_parents([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    assert parents == [ROOT, ROOT, 0, 0, 1] and ranks == [0, 1, 0, 1, 0]
    spec = TreeSpec(choices=[(0,), (1,), (0, 0), (0, 1)])
    assert (spec.steps, spec.topk, spec.tokens, spec.max_head_rows) == (2, 2, 5, 1)
    for bad in ([(0, 0)], [(1,)], [(0,), (0,)], [(0,), (2,), (1,)][:2]):
        with pytest.raises(ValueError, match="tree choice|ranks"):
            static_parents(bad)
    assert TreeSpec.first_width(3, 2).choices == ((0,), (0, 0), (0, 0, 0), (1,))
    assert TreeSpec.parse("3x4x8") == TreeSpec(3, 4, 8) and TreeSpec.chain(4) == TreeSpec(4, 1, 5)
    assert TreeSpec.chain(4).is_chain and not TreeSpec(4, 1, 3).is_chain
    for steps, topk, tokens in ((0, 1, 2), (1, 0, 2), (2, 2, 1), (2, 2, 65), (2, 1, 4)):
        with pytest.raises(ValueError, match="tree|tokens"):
            TreeSpec(steps, topk, tokens)
    with pytest.raises(ValueError, match="STEPSxTOPKxTOKENS"):
        TreeSpec.parse("3,4,8")


def test_expand_takes_each_nodes_best_children_with_cumulative_scores():
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.15, 0.1, 0.05, 0.7]]))
    kids = expand(lp, [0.0, -1.0], [3, 2])
    assert [t for t, _ in kids[0]] == [0, 1, 2] and [t for t, _ in kids[1]] == [3, 0]
    assert kids[1][0][1] == pytest.approx(-1.0 + math.log(0.7))
    assert [t for t, _ in expand(lp, [0.0, 0.0], [4, 0])[0]] == [0, 1, 2]  # probability 0: no child
    assert expand(lp, [0.0, 0.0], [4, 0])[1] == []


def test_rerank_keeps_the_best_nodes_with_their_ancestors_and_preorder_puts_the_best_path_first():
    # root → a (-0.1), b (-0.5); a → c (-0.3), d (-2.0); b → e (-0.6): the best 3 are a, c, b
    parents = [ROOT, ROOT, 0, 0, 1]
    scores = [-0.1, -0.5, -0.3, -2.0, -0.6]
    assert rerank(parents, scores, 3) == [0, 1, 2]
    assert rerank(parents, scores, 4) == [0, 1, 2, 4]
    # a node scored above its parent (impossible for cumulative log-probs, but the rule holds): it comes with its
    # parent, or is passed over when both do not fit
    assert rerank([ROOT, 0], [-2.0, -0.1], 1) == [0]
    assert rerank([ROOT, 0], [-2.0, -0.1], 2) == [0, 1]
    order = preorder(parents, scores, [0, 1, 2, 4])
    assert order == [0, 2, 1, 4] and renumber(parents, order) == [ROOT, 0, ROOT, 2]


# ---------------------------------------------------------------------------------------------------------------
# χ² harness

def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5


TARGET = _tables(1)
DRAFT = tuple(t + 0.8 * n for t, n in zip(TARGET, _tables(2)))  # a draft near the target, as a trained head is
ROOT_CTX = (2, 4)


def _logits(tables: tuple[torch.Tensor, torch.Tensor], ctx: tuple[int, ...]) -> torch.Tensor:
    """(V,) logits after a context: a table of the last token plus one of the token before."""
    return tables[0][ctx[-1]] + tables[1][ctx[-2]]


def _draw_trees(count: int, sampled: bool, g: torch.Generator,
                q_after: torch.Tensor) -> tuple[list[DraftTree], torch.Tensor]:
    """`count` full trees of width 3, depth 3 (39 nodes, breadth first, parents the same in all) → the trees and
    each one's target rows (count, 40): the index of the last two tokens of the root's and every node's context.

    sampled: every node's children are drawn without replacement from the draft's q (node i then carries q_i = q
    with its earlier siblings removed, renormalised); else they are q's 3 most likely tokens (deterministic, q
    one-hot). q_after: (V², V) the draft's processed q by the context's last two tokens."""
    root = ROOT_CTX[-2] * V + ROOT_CTX[-1]
    ctx = torch.full((count, 1), root)  # (count, nodes of the level) context row of each node to expand
    tokens, rows, probs, parents = [], [torch.full((count, 1), root)], [], []
    first = 0  # index of the level's first node
    level_parents = [ROOT]
    for _ in range(DEPTH):
        q = q_after[ctx.reshape(-1)]  # (count · F, V)
        if sampled:
            x = torch.multinomial(q, WIDTH, replacement=False, generator=g)  # (count · F, 3), in draw order
            taken = torch.zeros_like(q)
            qi = []
            for i in range(WIDTH):
                rest = q * (1 - taken)
                qi.append(rest / rest.sum(-1, keepdim=True))
                taken.scatter_(1, x[:, i:i + 1], 1.0)
            probs.append(torch.stack(qi, 1).reshape(count, -1, V))
        else:
            x = q.topk(WIDTH, dim=-1).indices
        x = x.reshape(count, -1)  # (count, 3F)
        tokens.append(x)
        last = (ctx % V).repeat_interleave(WIDTH, 1)  # the parent's token is the context's last
        ctx = last * V + x
        rows.append(ctx)
        parents += [p for p in level_parents for _ in range(WIDTH)]
        level_parents = list(range(first, first + x.shape[1]))
        first += x.shape[1]
    tok = torch.cat(tokens, 1).tolist()
    pr = torch.cat(probs, 1) if sampled else None
    trees = [DraftTree(tok[b], parents, None if pr is None else pr[b]) for b in range(count)]
    return trees, torch.cat(rows, 1)


def _chi2_limit(dof: int, z: float = 3.0902) -> float:
    """The 99.9% quantile of χ²(dof), Wilson–Hilferty's approximation (z: the normal's 99.9% quantile)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """χ² over cells, those expecting fewer than 5 merged into one → (statistic, degrees of freedom)."""
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if (~big).any():
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1


@pytest.mark.parametrize(("temperature", "top_k", "sampled"), [(0.7, 0, False), (1.0, 0, False), (0.7, 0, True),
                                                               (1.0, 4, True)])
def test_tree_acceptance_emits_the_targets_distribution(temperature, top_k, sampled):
    """20 000 draws, each a fresh tree of width 3 and depth 3 verified by `tree.accept`: the first two emitted
    tokens (the second from the next step's target when the tree stopped at one) follow the target's joint
    p(t1) p(t2 | t1) over the 36 cells (small cells merged), χ² below its 99.9% quantile. More than one draft
    is accepted per tree on average, so the deeper levels' rows are exercised too."""
    params = SamplingParams(temperature=temperature, top_k=top_k)
    n = 20000
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(V, V, dtype=torch.float64)
    accepted = 0
    pairs = [(a, b) for a in range(V) for b in range(V)]
    q_after = torch.stack([filtered_probs(_logits(DRAFT, c), temperature, top_k) for c in pairs])
    target = torch.stack([_logits(TARGET, c) for c in pairs])  # (V², V) by the context's last two tokens
    batch = 1000
    for _ in range(n // batch):
        trees, rows = _draw_trees(batch, sampled, g, q_after)
        res = accept(trees, target[rows.reshape(-1)], SamplingBatch([params] * batch))
        for a in res:
            accepted += len(a.path)
            t1 = a.tokens[0]
            if len(a.tokens) > 1:
                t2 = a.tokens[1]
            else:
                p2 = filtered_probs(_logits(TARGET, ROOT_CTX + (t1,)), temperature, top_k)
                t2 = int(torch.multinomial(p2, 1))
            counts[t1, t2] += 1
    p1 = filtered_probs(_logits(TARGET, ROOT_CTX), temperature, top_k).double()
    p2 = torch.stack([filtered_probs(_logits(TARGET, ROOT_CTX + (t,)), temperature, top_k) for t in range(V)])
    expected = (p1[:, None] * p2.double()) * n
    chi2, dof = _chi2(counts.flatten(), expected.flatten())
    limit = _chi2_limit(dof)
    print(f"T={temperature} top_k={top_k} sampled={sampled}: chi2={chi2:.2f} dof={dof} limit={limit:.2f}")
    assert chi2 < limit, (chi2, dof, limit)
    assert accepted / n > 1.0  # more than one draft per tree on average: deeper levels are reached
