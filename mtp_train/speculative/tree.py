"""Draft trees: what a proposer drafts, how a verify step lays it out, and what verification accepts.

A proposal is one `DraftTree` per sequence: draft tokens (its nodes) and each node's parent, -1 for a child of the
root, the sequence's last token t_{L-1}. Nodes come in topological order (a parent before its children), so node i
is verified in row 1 + i, after the root's row 0. A chain d_1..d_k is the degenerate tree (parents -1, 0, .., k-2);
`draft_width` w > 1 gives its first draft w-1 siblings (a tree of width w at depth 1, laid after the chain, so the
chain keeps the first slots). Trees of any shape are EAGLE-2's (Li et al. 2024, "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees"); the functions below take them all.

    layout   the trees of a batch → the verify step's rows: row r of sequence b writes its K/V in slot L-1+r of
             the sequence's pages, sits at position L-1+depth and sees its ancestors only (`VerifyRows.tree`, the
             parents `AttentionMetadata.set_tree` takes; None when every tree is a chain: causal is the tree)
    accept   the target's logits over those rows → per tree the accepted path (nodes, root to leaf) and the target's
             token after it (`Accepted`)
    commit   (the engine) `VerifyRows.moves` are the K/V copies that put a path's nodes at their positions — none
             for a path along the first nodes, e.g. an accepted chain prefix

`VerifyRows.step_rows` is the runner's input (`StepRows`): the rows are built here, explicitly, and the sequences
are never extended with drafts (gpt-fast's `speculative_decode` builds its verify input the same way).

The greedy rule follows, from the root, the child whose token is the target's argmax while there is one: the output
equals plain greedy decoding. The sampled rule is Leviathan/Chen's over a chain (`acceptance.accept_stochastic`,
batched, FlashInfer's fused kernel on CUDA) and multi-candidate rejection sampling over a tree with siblings
(`acceptance.accept_tree_stochastic`: children tried in order, each accepted with min(1, p/q_i), p replaced by the
normalised residual max(p − q_i, 0) after each rejection): every emitted token follows the target either way.
How trees are drafted (EAGLE-2's dynamic trees, vLLM's static ones) is `mtp_train.speculative.tree_draft`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mtp_train.engine.runner import StepRows
from mtp_train.engine.sampling import SamplingBatch, filtered_probs, greedy_ids
from mtp_train.speculative.acceptance import accept_stochastic, accept_stochastic_flashinfer, accept_tree_stochastic

ROOT = -1  # the parent of the root's children: the sequence's last token, verify row 0


def row_of(node: int) -> int:
    """The verify row of a node among its sequence's rows (row 0 is the root)."""
    return node + 1


def node_depths(parents: Sequence[int]) -> list[int]:
    """(N,) the depth of each node of a tree given by its parents (a parent before its children): 1 under the root."""
    out: list[int] = []
    for p in parents:
        out.append(out[p] + 1 if p != ROOT else 1)
    return out


@dataclass(frozen=True)
class DraftTree:
    """The draft tokens of one sequence for one step, as a tree over its last token."""

    tokens: list[int]  # (N,) target token ids of the nodes
    parents: list[int]  # (N,) each node's parent node, ROOT (-1) for a child of the root; parents[i] < i
    probs: torch.Tensor | None = None  # (N, V) float32 q each node was drawn from (given its earlier siblings);
    # None when the sequence is greedy or every node deterministic (q is then one-hot at each node)
    scores: list[float] | None = None  # (N,) each node's cumulative draft log-probability (the rerank's score, a
    # head's tree only; what bench.tree_rules reads to compare node-selection rules)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not ROOT <= p < i:
                raise ValueError(f"node {i} has parent {p}: a parent is the root (-1) or an earlier node")
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"{self.probs.shape[0]} draft distributions for {len(self.tokens)} nodes")
        if self.scores is not None and len(self.scores) != len(self.tokens):
            raise ValueError(f"{len(self.scores)} draft scores for {len(self.tokens)} nodes")

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: torch.Tensor | None = None,
              siblings: Sequence[int] = ()) -> DraftTree:
        """A chain d_1..d_k and, optionally, siblings of d_1 (other candidates for the first draft, greedy only)."""
        if siblings and (not tokens or probs is not None):
            raise ValueError("siblings of the first draft need a chain, and a greedy one (no draft distributions)")
        return cls([*tokens, *siblings], [*range(ROOT, len(tokens) - 1), *[ROOT] * len(siblings)], probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """(N,) each node's depth: 1 for the root's children."""
        return node_depths(self.parents)

    @property
    def chain_length(self) -> int:
        """The nodes 0..c-1 that form a chain from the root (each the child of the one before): the whole tree of a
        chain, the chain of a widened first draft."""
        c = 0
        while c < len(self.parents) and self.parents[c] == c - 1:
            c += 1
        return c

    @property
    def is_chain(self) -> bool:
        return self.chain_length == len(self)

    def chain_prefix(self, path: Sequence[int]) -> int:
        """How many of a path's first nodes are the tree's first nodes (0, 1, ..): those already in the slots of
        their positions, and for a chained drafter the ones its own chain drafted."""
        n = 0
        while n < len(path) and path[n] == n:
            n += 1
        return n

    def draft_probs(self, vocab_size: int, device: torch.device | str) -> torch.Tensor:
        """q (N, V): the distributions the nodes were drawn from, or one-hot at each node (a deterministic draft)."""
        if self.probs is not None:
            return self.probs.to(device)
        d = torch.tensor(self.tokens, dtype=torch.long, device=device)
        return torch.zeros(len(d), vocab_size, device=device).scatter_(1, d.view(-1, 1), 1.0)


@dataclass(frozen=True)
class VerifyRows:
    """The verify step's rows for the trees of a batch: per sequence 1 + N_b rows, root first, packed in order."""

    tokens: list[list[int]]  # (B,) each (1+N_b,): t_{L-1}, then the nodes' tokens
    parents: list[list[int]]  # (B,) each (1+N_b,): each row's parent row, -1 for the root's
    depths: list[list[int]]  # (B,) each (1+N_b,): 0 for the root
    positions: list[list[int]]  # (B,) each (1+N_b,): the position a row's token is at, L-1 + depth
    slots: list[list[int]]  # (B,) each (1+N_b,): the slot (token index in the sequence's pages) a row writes, L-1 + r
    tree: list[list[int]] | None  # `AttentionMetadata.set_tree`'s parents (each row sees its ancestors), or None
    # when every tree is a chain (causal attention is then the tree's visibility, and the step may replay graphs)

    @property
    def rows(self) -> list[int]:
        """(B,) rows per sequence."""
        return [len(t) for t in self.tokens]

    def path_rows(self, path: Sequence[int]) -> slice | list[int]:
        """The rows of the root and of a path's nodes, in order (what a proposer catches up on): a slice when the
        path is the first nodes, so that indexing a sequence's rows with it copies nothing."""
        rows = [0, *map(row_of, path)]
        return slice(0, len(rows)) if rows[-1] == len(path) else rows

    def step_rows(self, pages: Sequence[Sequence[int]]) -> StepRows:
        """The runner's input for these rows, the sequences' pages (B,) given: row r of sequence b in slot
        slots[b][r], rotated to positions[b][r] (the tree's visibility when `tree` is set)."""
        return StepRows(self.tokens, [s[0] for s in self.slots], [list(p) for p in pages], self.tree)

    def moves(self, b: int, path: Sequence[int]) -> list[tuple[int, int]]:
        """(source slot, destination slot) K/V copies that leave sequence b's accepted path at its positions, in an
        order where no copy overwrites a later source (rows come in topological order, so slot >= position)."""
        rows = map(row_of, path)
        return [(self.slots[b][r], self.positions[b][r]) for r in rows if self.slots[b][r] != self.positions[b][r]]


def layout(trees: Sequence[DraftTree], last_tokens: Sequence[int], seq_lens: Sequence[int]) -> VerifyRows:
    """Lay the trees of a batch into the verify step's rows.

    trees: (B,) one per sequence; last_tokens: (B,) t_{L-1} of each (the root, uncached); seq_lens: (B,) L.
    """
    tokens, parents, depths, positions, slots = [], [], [], [], []
    for tree, last, n in zip(trees, last_tokens, seq_lens, strict=True):
        tokens.append([last, *tree.tokens])
        parents.append([-1, *map(row_of, tree.parents)])
        depth = [0, *tree.depths]
        depths.append(depth)
        positions.append([n - 1 + d for d in depth])
        slots.append(list(range(n - 1, n + len(tree))))
    tree_step = not all(t.is_chain for t in trees)
    return VerifyRows(tokens, parents, depths, positions, slots, parents if tree_step else None)


@dataclass(frozen=True)
class Accepted:
    """What verification kept of one tree."""

    path: list[int]  # (n,) the accepted nodes, root to leaf
    tokens: list[int]  # (n+1,) their tokens, then the target's token after the path (the bonus)


def accept(trees: Sequence[DraftTree], logits: torch.Tensor, sampling: SamplingBatch, *,
           fused: bool = False, argmax: torch.Tensor | None = None) -> list[Accepted]:
    """Accept the trees of a batch against the target.

    logits: (Σ_b 1+N_b, V) the target's logits over the verify rows as `layout` lays them; sampling: each
    sequence's parameters and generator. Greedy sequences take the longest path whose every node is the target's
    argmax after its parent; sampled chains take the Leviathan/Chen rule, in groups of equal length (fused:
    FlashInfer's kernel for groups of unseeded sequences, CUDA only), and sampled trees with siblings
    multi-candidate rejection sampling (`accept_tree_stochastic`), each with its sequence's generator. argmax: the
    logits' (rows,) argmax where the caller has it already (one pass over the logits fewer).
    """
    starts = [0]
    for t in trees:
        starts.append(starts[-1] + row_of(len(t)))
    if starts[-1] != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} verify rows for trees of {starts[-1]} rows")
    out: list[Accepted | None] = [None] * len(trees)
    params = sampling.params
    gens = sampling.generators or [None] * len(trees)
    if any(p.greedy for p in params):
        target = (greedy_ids(logits) if argmax is None else argmax).tolist()  # one transfer for the batch
        for b, t in enumerate(trees):
            if params[b].greedy:
                out[b] = _greedy_path(t, target[starts[b]:starts[b + 1]])
    groups: dict[int, list[int]] = {}
    for b, t in enumerate(trees):
        if not params[b].greedy:
            if t.is_chain:
                groups.setdefault(len(t), []).append(b)
                continue
            pr = params[b]
            p = filtered_probs(logits[starts[b]:starts[b + 1]], pr.temperature, pr.top_k, pr.top_p)
            path, bonus = accept_tree_stochastic(t.tokens, t.parents, p, t.probs, gens[b])
            out[b] = Accepted(path, [t.tokens[j] for j in path] + [bonus])
    for d, group in groups.items():
        p = torch.stack([filtered_probs(logits[starts[b]:starts[b + 1]], params[b].temperature, params[b].top_k,
                                        params[b].top_p) for b in group])  # (G, d+1, V)
        q = torch.stack([trees[b].draft_probs(p.shape[-1], p.device) for b in group])  # (G, d, V)
        drafts = torch.tensor([trees[b].tokens for b in group], dtype=torch.long, device=p.device).view(len(group), d)
        g = [gens[b] for b in group]
        res = (accept_stochastic_flashinfer(drafts, q, p) if fused and d > 0 and all(x is None for x in g)
               else accept_stochastic(drafts, q, p, g))
        for b, n, toks in zip(group, res.num_accepted, res.tokens):
            out[b] = Accepted(list(range(n)), toks)
    return out  # type: ignore[return-value]


def _greedy_path(tree: DraftTree, target: list[int]) -> Accepted:
    """Follow from the root the child equal to the target's argmax (target: (1+N,) per row) while there is one."""
    path: list[int] = []
    node = ROOT
    while True:
        tok = target[row_of(node)]
        nxt = next((j for j in range(node + 1, len(tree)) if tree.parents[j] == node and tree.tokens[j] == tok), None)
        if nxt is None:
            return Accepted(path, [tree.tokens[j] for j in path] + [tok])
        path.append(nxt)
        node = nxt
