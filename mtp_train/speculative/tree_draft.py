"""Building draft trees: the shape a proposer drafts (`TreeSpec`) and the pure steps that grow and prune one.

Two kinds of tree, as the serving engines take them:

    dynamic  EAGLE-2's (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees"),
             with SGLang's three flags: `steps` levels (speculative_num_steps), each expanding the `topk` most
             likely children of every frontier node (speculative_eagle_topk) and keeping the `topk` best of them by
             cumulative draft log-probability as the next frontier; at the end all drafted nodes are reranked by
             that score and the best `tokens - 1` kept (speculative_num_draft_tokens counts the root, the
             sequence's last token, as SGLang does), a kept node's ancestors always with it.
    static   vLLM's `speculative_token_tree`: a list of paths of child ranks, e.g. [(0,), (1,), (0, 0), (0, 1)] =
             the root's two best children and the best two children of the first; every path's prefix is a path.

A chain of k is TreeSpec(k, 1, k + 1); the head's first-draft width w over a chain of k is the static tree
`TreeSpec.first_width(k, w)`. Trees leave here in depth-first preorder, best child first, so a path along the best
children is the tree's first nodes (its K/V already at its positions, see `tree.VerifyRows.moves`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mtp_train.speculative.tree import ROOT, node_depths

MAX_TREE_TOKENS = 64  # verify rows per sequence (root included): the attention's visibility bits are 64 wide


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the tree a head drafts each step: dynamic (steps, topk, tokens) or static (choices)."""

    steps: int = 1  # levels drafted (the tree's depth)
    topk: int = 1  # children expanded per frontier node, and the frontier's width
    tokens: int = 2  # verified rows per step, the root included (so tokens - 1 draft nodes at most)
    choices: tuple[tuple[int, ...], ...] | None = None  # a static tree (vLLM's format); steps/topk/tokens follow it

    def __post_init__(self) -> None:
        if self.choices is not None:
            choices = tuple(tuple(int(i) for i in c) for c in self.choices)
            static_parents(choices)  # validates
            object.__setattr__(self, "choices", choices)
            object.__setattr__(self, "steps", max(map(len, choices)))
            object.__setattr__(self, "topk", 1 + max(c[-1] for c in choices))
            object.__setattr__(self, "tokens", len(choices) + 1)
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"a draft tree needs steps >= 1 and topk >= 1, got steps={self.steps}, topk={self.topk}")
        if not 2 <= self.tokens <= MAX_TREE_TOKENS:
            raise ValueError(f"tree tokens (verified rows, the root included) must be in 2..{MAX_TREE_TOKENS}, got "
                             f"{self.tokens}")
        if self.choices is None and self.tokens - 1 > self.max_drafted:
            raise ValueError(f"tokens={self.tokens} keeps more nodes than steps={self.steps} × topk={self.topk} "
                             f"drafts ({self.max_drafted})")

    @classmethod
    def chain(cls, k: int) -> TreeSpec:
        return cls(k, 1, k + 1)

    @classmethod
    def first_width(cls, k: int, width: int) -> TreeSpec:
        """A chain of k whose first draft has width - 1 siblings (the head's runners-up): a static tree."""
        return cls(choices=tuple((0,) * d for d in range(1, k + 1)) + tuple((i,) for i in range(1, width)))

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """`3x4x8` → TreeSpec(steps=3, topk=4, tokens=8) (how mtp-eval's `tree` axis names a shape)."""
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*", str(text))
        if m is None:
            raise ValueError(f"a tree shape is STEPSxTOPKxTOKENS, e.g. 3x4x8; got {text!r}")
        return cls(*map(int, m.groups()))

    @property
    def is_chain(self) -> bool:
        return self.topk == 1 and self.tokens == self.steps + 1

    @property
    def max_drafted(self) -> int:
        """Nodes drafted before the rerank: topk at level 1, topk² at every later one (dynamic)."""
        return self.tokens - 1 if self.choices is not None else self.topk + (self.steps - 1) * self.topk ** 2

    @property
    def max_head_rows(self) -> int:
        """Head rows a step forwards (the frontier of every level but the last): what its cache holds beyond L-1."""
        if self.choices is not None:
            return len({c[:-1] for c in self.choices if len(c) > 1})
        return (self.steps - 1) * self.topk

    @property
    def name(self) -> str:
        return f"{self.steps}x{self.topk}x{self.tokens}" if self.choices is None else f"static{self.tokens - 1}"


def static_parents(choices: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """vLLM's `speculative_token_tree` paths → (parents (N,), ranks (N,)): node i is choices[i], its parent the node
    of its path without the last rank (ROOT for a depth-1 path), its rank that last entry (0 = the parent's most
    likely child). Every path's prefix must come earlier, and a parent's ranks must be 0..c-1 without gaps."""
    index: dict[tuple[int, ...], int] = {}
    parents, ranks = [], []
    children: dict[int, list[int]] = {}
    for i, c in enumerate(choices):
        c = tuple(c)
        if not c or any(r < 0 for r in c) or c in index:
            raise ValueError(f"tree choice {c} must be a new, non-empty path of ranks >= 0")
        if len(c) > 1 and c[:-1] not in index:
            raise ValueError(f"tree choice {c} comes before its parent {c[:-1]}")
        index[c] = i
        parent = index[c[:-1]] if len(c) > 1 else ROOT
        parents.append(parent)
        ranks.append(c[-1])
        children.setdefault(parent, []).append(c[-1])
    for parent, rs in children.items():
        if sorted(rs) != list(range(len(rs))):
            raise ValueError(f"the children of node {parent} have ranks {sorted(rs)}; a static tree takes ranks "
                             "0..c-1 (the parent's c most likely tokens)")
    return parents, ranks


def expand(logprobs: torch.Tensor, parent_scores: Sequence[float],
           widths: Sequence[int]) -> list[list[tuple[int, float]]]:
    """Each frontier node's most likely children: logprobs (F, V) the draft's log q after node f; parent_scores
    (F,) its cumulative log-probability; widths (F,) how many children it gets → per node [(token, cumulative
    score)] best first (children of probability 0, e.g. outside a top-k filter, are left out)."""
    most = max(widths, default=0)
    if most == 0:
        return [[] for _ in widths]
    top = logprobs.float().topk(min(most, logprobs.shape[-1]), dim=-1)
    vals, ids = top.values.tolist(), top.indices.tolist()
    return [[(t, s + v) for t, v in zip(ids[f][:w], vals[f][:w]) if v > -math.inf]
            for f, (s, w) in enumerate(zip(parent_scores, widths))]


def best(scores: Sequence[float], depths: Sequence[int], count: int) -> list[int]:
    """The `count` best candidates by score (ties: shallower first, then earlier), best first."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:count]


def rerank(parents: Sequence[int], scores: Sequence[float], keep: int) -> list[int]:
    """EAGLE-2's rerank: the `keep` best nodes by cumulative score, each with all its ancestors (a node whose
    missing ancestors do not fit is passed over) → the kept nodes, sorted."""
    kept: set[int] = set()
    for i in best(scores, node_depths(parents), len(scores)):
        need = []
        j = i
        while j != ROOT and j not in kept:
            need.append(j)
            j = parents[j]
        if len(kept) + len(need) <= keep:
            kept.update(need)
        if len(kept) == keep:
            break
    return sorted(kept)


def preorder(parents: Sequence[int], order: Sequence[float], nodes: Sequence[int]) -> list[int]:
    """The nodes (a set closed under parents) in depth-first preorder, children by `order` descending (a child's
    score or minus its rank): the path along the best children comes first."""
    kids: dict[int, list[int]] = {}
    for i in nodes:
        kids.setdefault(parents[i], []).append(i)
    out: list[int] = []
    stack = sorted(kids.get(ROOT, []), key=lambda i: (order[i], -i))
    while stack:
        i = stack.pop()
        out.append(i)
        stack.extend(sorted(kids.get(i, []), key=lambda j: (order[j], -j)))
    return out


def renumber(parents: Sequence[int], nodes: Sequence[int]) -> list[int]:
    """Parents of `nodes` (in their new order, a parent before its children) as indices into that order."""
    at = {n: i for i, n in enumerate(nodes)}
    return [at[parents[n]] if parents[n] != ROOT else ROOT for n in nodes]
