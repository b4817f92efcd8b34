"""A head drafting a tree (`TreeSpec`) level by level over its own paged cache, for a batch of sequences at once.

Level 1 is the root's children, from the logits the head's catch-up left (after ĥ_{L-1}). Every later level is one
head forward over the frontier of the level before (the `topk` best new nodes of a dynamic tree, the nodes with
children of a static one): a node at depth d is a head row at position L-2+d reading its parent's output feature
(ĥ_{L-1} for a first draft) and its own token, and seeing the cached prefix, its ancestors' rows and itself — tree
attention (`AttentionMetadata.set_tree`, a forest over the prefix). The rows are written to slots L-1, L, .. in the
order they are first forwarded; every forward re-feeds the rows of the levels before (same inputs, same K/V) so that
the tree's visibility lies among one step's new tokens, as the attention backends take it. A node's children are
its draft's most likely tokens (EAGLE-2's expansion, deterministic: q one-hot), or, for a sampled sequence at a
node that gets a single child, one token drawn from q (a sampled chain, Leviathan/Chen's rule then applies).
Greedy sequences rank by the head's log-softmax, sampled ones by log q after the request's temperature, top-k and
top-p, the target's processing. Then the rerank (dynamic) or the static shape decides the kept nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.sampling import filtered_probs
from mtp_train.engine.sequence import Sequence
from mtp_train.heads.base import DraftHead
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.speculative.tree import ROOT, DraftTree
from mtp_train.speculative.tree_draft import TreeSpec, best, expand, preorder, renumber, rerank, static_parents


@dataclass
class _Pool:
    """One sequence's drafted nodes so far (candidates of the rerank)."""

    tokens: list[int] = field(default_factory=list)  # target ids
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability
    depths: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # among its siblings, 0 = most likely
    shape: list[int] = field(default_factory=list)  # the static tree's node, -1 for a dynamic tree
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # sampled nodes: q (V,) over the target vocab
    rows: list[int] = field(default_factory=list)  # node of each head row, in slot order
    row_of: dict[int, int] = field(default_factory=dict)  # node → its head row

    def add(self, token: int, parent: int, score: float, rank: int, shape: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(self.depths[parent] + 1 if parent != ROOT else 1)
        self.ranks.append(rank)
        self.shape.append(shape)
        return len(self.tokens) - 1


class TreeDrafter:
    """Drafts `spec`'s tree with `head` over `kv` (the head's pool, the target's page ids)."""

    def __init__(self, head: DraftHead, kv: KVCache, spec: TreeSpec, vocab_size: int) -> None:
        self.head, self.kv, self.spec, self.vocab_size = head, kv, spec, vocab_size
        self.static = None
        if spec.choices is not None:
            parents, _ = static_parents(spec.choices)
            kids: dict[int, list[int]] = {}
            for i, par in enumerate(parents):
                kids.setdefault(par, []).append(i)
            # static node → its children, by rank
            self.static = {n: sorted(cs, key=lambda i: spec.choices[i][-1]) for n, cs in kids.items()}

    def _children(self, pool: _Pool, node: int) -> list[int]:
        """The static nodes under `node` (a pool node, or ROOT), [] for a dynamic tree."""
        assert self.static is not None
        return self.static.get(ROOT if node == ROOT else pool.shape[node], [])

    def _widths(self, pool: _Pool, frontier: Seq[int]) -> list[int]:
        if self.static is None:
            return [self.spec.topk] * len(frontier)
        return [len(self._children(pool, f)) for f in frontier]

    def _level(self, seq: Sequence, pool: _Pool, frontier: Seq[int], logits: torch.Tensor) -> list[int]:
        """Expand `frontier` (nodes, ROOT for the root) from their draft logits (F, Vd) → the new nodes."""
        p = seq.params
        lp = torch.log_softmax(logits.float(), -1) if p.greedy else \
            filtered_probs(logits, p.temperature, p.top_k, p.top_p).log()
        widths = self._widths(pool, frontier)
        scores = [0.0 if f == ROOT else pool.scores[f] for f in frontier]
        new: list[int] = []
        for f, (kids, w, row) in enumerate(zip(expand(lp, scores, widths), widths, lp)):
            shapes = self._children(pool, frontier[f]) if self.static is not None else [-1] * w
            if w == 1 and not p.greedy:  # one child: a sample from q
                q = row.exp()
                d = int(torch.multinomial(q, 1, generator=seq.generator))
                kids = [(d, scores[f] + float(row[d]))]
                if self.head.draft_vocab is not None:
                    q = torch.zeros(self.vocab_size, dtype=q.dtype, device=q.device).index_copy_(
                        0, self.head.draft_vocab.to(q.device), q)
            ids = self.head.to_target_ids(torch.tensor([t for t, _ in kids], dtype=torch.long)).tolist()
            for r, ((_, s), t) in enumerate(zip(kids, ids)):
                n = pool.add(int(t), frontier[f], s, r, shapes[r])
                if w == 1 and not p.greedy:
                    pool.probs[n] = q
                new.append(n)
        return new

    def _frontier(self, pool: _Pool, new: Seq[int]) -> list[int]:
        """The new nodes the next level expands, in the order their rows are written."""
        if self.static is not None:
            return [n for n in new if self._children(pool, n)]
        top = best([pool.scores[n] for n in new], [pool.depths[n] for n in new], self.spec.topk)
        return [new[i] for i in top if pool.scores[new[i]] > -math.inf]

    def _forward(self, seqs: Seq[Sequence], pools: Seq[_Pool], lens: Seq[int], root_feat: torch.Tensor,
                 feats: list[torch.Tensor | None], fronts: Seq[Seq[int]]) -> list[torch.Tensor | None]:
        """One head forward over every sequence's rows (those of earlier levels and the frontier's) → the logits
        (F_b, Vd) after each frontier node, None for a sequence without a frontier; feats[b] becomes its rows'
        output features (R_b, H)."""
        dev = self.head.device
        live = [b for b, f in enumerate(fronts) if f]
        hidden, tokens, parents, want = [], [], [], []
        for b in live:
            pool = pools[b]
            for n in fronts[b]:
                pool.row_of[n] = len(pool.rows)
                pool.rows.append(n)
            par = [pool.parents[n] for n in pool.rows]
            parents.append([ROOT if q == ROOT else pool.row_of[q] for q in par])
            for n, q in zip(pool.rows, par):
                prev = feats[b]
                hidden.append(root_feat[b] if q == ROOT else prev[pool.row_of[q]])  # type: ignore[index]
                tokens.append(pool.tokens[n])
            base = len(tokens) - len(pool.rows)
            want += [base + pool.row_of[n] for n in fronts[b]]
        qo = [len(pools[b].rows) for b in live]
        meta = AttentionMetadata.build(qo, [lens[b] - 1 + q for b, q in zip(live, qo)], [seqs[b].pages for b in live],
                                       self.kv.page_size, dev)
        meta.set_tree(parents)
        out = self.head(torch.stack(hidden).to(dev), torch.tensor(tokens, dtype=torch.long, device=dev), meta,
                        self.kv.layers[0], from_target=False,  # every row reads a head output
                        logits_indices=torch.tensor(want, dtype=torch.long, device=dev))
        assert out.logits is not None
        logits: list[torch.Tensor | None] = [None] * len(seqs)
        rows = out.hidden.split(qo)
        lg = out.logits.split([len(fronts[b]) for b in live])
        for b, h, g in zip(live, rows, lg):
            feats[b], logits[b] = h, g
        return logits

    @torch.inference_mode()
    def draft(self, seqs: Seq[Sequence], root_feat: torch.Tensor,
              root_logits: torch.Tensor) -> tuple[list[DraftTree], list[list[int]]]:
        """root_feat: (B, H) ĥ_{L-1}; root_logits: (B, Vd) the first draft's logits → per sequence its tree and each
        node's head row (-1 for a node never forwarded: a leaf)."""
        spec = self.spec
        pools = [_Pool() for _ in seqs]
        lens = [len(s) for s in seqs]
        fronts: list[list[int]] = [[ROOT] for _ in seqs]
        logits: list[torch.Tensor | None] = [root_logits[b:b + 1] for b in range(len(seqs))]
        feats: list[torch.Tensor | None] = [None] * len(seqs)
        for level in range(spec.steps):
            new = [self._level(s, pool, f, lg) if f and lg is not None else []
                   for s, pool, f, lg in zip(seqs, pools, fronts, logits)]
            if level == spec.steps - 1:
                break
            fronts = [self._frontier(pool, n) for pool, n in zip(pools, new)]
            if not any(fronts):
                break
            logits = self._forward(seqs, pools, lens, root_feat, feats, fronts)
        return self._trees(pools)

    def _trees(self, pools: Seq[_Pool]) -> tuple[list[DraftTree], list[list[int]]]:
        trees, rows = [], []
        for pool in pools:
            if self.static is None:
                kept = rerank(pool.parents, pool.scores, self.spec.tokens - 1)
                order = preorder(pool.parents, pool.scores, kept)
            else:
                order = preorder(pool.parents, [-r for r in pool.ranks], range(len(pool.tokens)))
            probs = None
            if any(n in pool.probs for n in order):
                probs = torch.stack([pool.probs[n] if n in pool.probs else self._one_hot(pool.tokens[n], pool)
                                     for n in order])
            trees.append(DraftTree([pool.tokens[n] for n in order], renumber(pool.parents, order), probs,
                                   [pool.scores[n] for n in order]))
            rows.append([pool.row_of.get(n, -1) for n in order])
        return trees, rows

    def _one_hot(self, token: int, pool: _Pool) -> torch.Tensor:
        like = next(iter(pool.probs.values()))
        return torch.zeros(self.vocab_size, dtype=like.dtype, device=like.device).index_fill_(0, torch.tensor(
            [token], device=like.device), 1.0)
