"""The `dflash` head type's drafter: up to B-1 drafts from ONE forward of the block drafter (`head.py` `DFlashHead`)
per step.

Its drafter, `BlockProposer`, keeps the head's context K/V in its own paged pool (one layer per draft layer, the
target's page ids): `prefill` writes the prompt's positions from the target's aux layers, `update` the accepted
positions after each verify, so the pool grows with accepted tokens only. `propose` runs the block
[t_{L-1}, mask × (B-1)] at positions L-1..L+B-2 over the context 0..L-2 and returns a chain of min(k, B-1) drafts
(each slot's own distribution: the slots are drafted in parallel), cut where a slot's top-1 probability falls
under `draft_threshold`; or, with `tree` (greedy sequences), a tree from the slots' top-k (`block_tree`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch

from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.sequence import Sequence
from mtp_train.head_types.dflash.head import DFlashHead
from mtp_train.heads.block_attention import BlockLayout
from mtp_train.speculative.proposers import Drafts, Proposer
from mtp_train.speculative.tree import ROOT, DraftTree
from mtp_train.speculative.tree_draft import TreeSpec, best, expand, preorder, renumber, rerank, static_parents

BLOCK_OPTIONS = ("draft_threshold", "tree")  # the eval grid axes the block drafter takes


def block_tree(logprobs: torch.Tensor, spec: TreeSpec) -> DraftTree:
    """A draft tree from one block's slots: logprobs (steps, Vd), row d the log q of slot d+1 (the slots are
    drafted in parallel, so a depth-d node's children are slot d+1's top tokens whatever the node).

    Dynamic (EAGLE-2's shape, `tree_draft`): each level expands the frontier's `topk` best nodes by `topk` children,
    a node's score is the sum of its path's log q; the best `tokens - 1` nodes, each with its ancestors, are kept.
    Static (vLLM's choices): the path (r_1, .., r_d) is the rank-r_d token of slot d. Token ids are head columns.
    """
    if spec.choices is not None:
        parents, ranks = static_parents(spec.choices)
        depth = [len(c) for c in spec.choices]
        top = logprobs.float().topk(spec.topk, dim=-1)
        toks = [int(top.indices[d - 1, r]) for d, r in zip(depth, ranks)]
        scores = [0.0] * len(toks)
        for i, (p, d, r) in enumerate(zip(parents, depth, ranks)):
            scores[i] = (scores[p] if p != ROOT else 0.0) + float(top.values[d - 1, r])
        return DraftTree(toks, parents, None, scores)
    parents, toks, scores = [], [], []
    frontier = [(ROOT, 0.0)]
    for d in range(spec.steps):
        kids = expand(logprobs[d:d + 1].expand(len(frontier), -1), [sc for _, sc in frontier],
                      [spec.topk] * len(frontier))
        new = []
        for (f, _), children in zip(frontier, kids):
            for t, sc in children:
                parents.append(f)
                toks.append(t)
                scores.append(sc)
                new.append(len(toks) - 1)
        frontier = [(new[i], scores[new[i]]) for i in best([scores[n] for n in new], [d] * len(new), spec.topk)]
    order = preorder(parents, scores, rerank(parents, scores, spec.tokens - 1))
    return DraftTree([toks[i] for i in order], renumber(parents, order), None, [scores[i] for i in order])


class BlockProposer(Proposer):
    """One head forward per step drafts a chain of up to min(k, B-1) tokens from the head's context cache."""

    name = "dflash"

    def __init__(self, head: DFlashHead, draft_threshold: float = 0.0, tree: TreeSpec | None = None) -> None:
        if not 0.0 <= draft_threshold < 1.0:
            raise ValueError(f"draft_threshold must lie in [0, 1), got {draft_threshold}")
        if tree is not None and (draft_threshold > 0.0 or tree.steps > head.block_size - 1):
            raise ValueError(f"a block tree keeps its shape (no draft_threshold) and is at most block_size - 1 = "
                             f"{head.block_size - 1} deep; got {tree.name} with draft_threshold={draft_threshold}")
        self.tree = None if tree is None or tree.is_chain else tree
        self.head = head.eval()
        self.hidden_layers = tuple(head.aux_layers)  # the engine passes the target's aux layers, concatenated
        self.draft_threshold = draft_threshold
        self.kv: KVCache | None = None
        self.forwards = 0  # block forwards so far (one per drafting step)

    def max_nodes(self, k: int) -> int:
        if self.tree is not None:
            if k != self.tree.steps:
                raise ValueError(f"the tree {self.tree.name} drafts {self.tree.steps} levels; run the engine with "
                                 f"k={self.tree.steps}, not {k}")
            return self.tree.tokens - 1
        return min(k, self.head.block_size - 1)

    @property
    def drafts_trees(self) -> bool:
        return self.tree is not None

    def bind(self, target_kv: KVCache) -> None:
        layers, layout = self.head.kv_shape
        self.kv = KVCache(layers, target_kv.num_pages, target_kv.page_size, layout, dtype=self.head.dtype,
                          device=self.head.device)

    def _slots(self, pages: Seq[int], positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, offsets) of `positions` in a sequence's `pages`, each (N,) long on the head's device.

        Tensor arithmetic over the page table, not a Python loop per position: drafting reads the whole context's
        slots every step."""
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        ps = self.kv.page_size
        dev = self.head.device
        pos = torch.arange(positions.start, positions.stop, dtype=torch.long, device=dev)
        table = torch.tensor(list(pages[:-(-positions.stop // ps)]), dtype=torch.long, device=dev)
        return table[pos // ps], pos % ps

    def _write(self, seqs: Seq[Sequence], starts: Seq[int], features: Seq[torch.Tensor]) -> None:
        """Write each sequence's context K/V at positions start.. from the target's aux features (n, k·H)."""
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        head, dev = self.head, self.head.device
        positions = [range(s, s + f.shape[0]) for s, f in zip(starts, features)]
        pos = torch.tensor([p for r in positions for p in r], dtype=torch.long, device=dev)
        kv = head.context_kv(head.context(torch.cat(list(features)).to(dev)), pos)
        page_ids, offsets = zip(*(self._slots(s.pages, r) for s, r in zip(seqs, positions)))
        page, off = torch.cat(page_ids), torch.cat(offsets)
        for layer, (k, v) in zip(self.kv.layers, kv):  # (num_pages, 2, page_size, Hkv, D)
            layer[page, 0, off] = k.to(layer.dtype)
            layer[page, 1, off] = v.to(layer.dtype)

    @torch.inference_mode()
    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        lens = [s.num_prompt_tokens for s in seqs]
        self._write(seqs, [0] * len(seqs), list(target_hidden.split(lens)))

    @torch.inference_mode()
    def update(self, seqs: Seq[Sequence], old_lens: Seq[int], trees: Seq[DraftTree], paths: Seq[Seq[int]],
               target_hidden: Seq[torch.Tensor]) -> None:
        if seqs:  # the accepted positions L-1..L-1+n join the context
            self._write(seqs, [n - 1 for n in old_lens], target_hidden)

    def block_features(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """(S, B, H) each sequence's block [t_{L-1}, mask, ...] at positions L-1.. over its context 0..L-2."""
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        head, dev = self.head, self.head.device
        ctx_lens = [len(s) - 1 for s in seqs]
        page_ids, offsets = zip(*(self._slots(s.pages, range(n)) for s, n in zip(seqs, ctx_lens)))
        page, off = torch.cat(page_ids), torch.cat(offsets)
        ctx_kv = [(layer[page, 0, off], layer[page, 1, off]) for layer in self.kv.layers]
        groups, c0 = [], 0
        for i, n in enumerate(ctx_lens):
            groups.append((i, i + 1, c0, c0 + n))
            c0 += n
        layout = BlockLayout(tuple(groups), torch.tensor(ctx_lens, dtype=torch.long, device=dev))
        first = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long, device=dev)
        positions = torch.tensor(ctx_lens, device=dev)[:, None] + torch.arange(head.block_size, device=dev)
        self.forwards += 1
        return head.block(head.block_tokens(first), positions, ctx_kv, layout)

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        n = min(k, self.head.block_size - 1)
        feats = self.block_features(seqs)  # (S, B, H)
        trees: dict[int, DraftTree] = {}
        if self.tree is not None:  # greedy sequences draft the tree; a sampled one its chain of sampled slots
            for b, s in enumerate(seqs):
                if s.params.greedy:
                    lp = torch.log_softmax(self.head.compute_logits(feats[b, 1:n + 1]).float(), -1)
                    t = block_tree(lp, self.tree)
                    trees[b] = DraftTree(self.head.to_target_ids(torch.tensor(t.tokens)).tolist(), t.parents,
                                         None, t.scores)
        drafts = Drafts(seqs, self.head.draft_vocab, self.head.args.vocab_size)
        rows = [b for b in range(len(seqs)) if b not in trees]  # sequences whose chain goes on
        for j in range(n):
            if not rows:
                break
            logits = self.head.compute_logits(feats[rows, j + 1])  # slot j+1 drafts d_{j+1}
            if self.draft_threshold > 0.0:
                keep = (torch.softmax(logits.float(), -1).amax(-1) >= self.draft_threshold).tolist()
                rows = [r for r, ok in zip(rows, keep) if ok]
                logits = logits[[i for i, ok in enumerate(keep) if ok]]
            if rows:
                drafts.add(logits, rows)
        return [trees.get(b, t) for b, t in enumerate(drafts.trees())]

    def release(self, seq: Sequence) -> None:
        pass  # the pool's pages are the sequence's, freed by the target's allocator


def block_drafter(head: DFlashHead, options: Mapping[str, Any]) -> BlockProposer:
    """The dflash type's `HeadType.drafter`: a fresh `BlockProposer` for one eval grid point (BLOCK_OPTIONS)."""
    opts = dict(options)
    unknown = sorted(set(opts) - set(BLOCK_OPTIONS))
    if unknown:
        raise ValueError(f"the dflash head's block drafter takes {', '.join(BLOCK_OPTIONS)}; not {', '.join(unknown)}")
    tree = opts.pop("tree", None)
    if isinstance(tree, str):
        tree = None if tree == "none" else TreeSpec.parse(tree)
    return BlockProposer(head, **opts, tree=tree)


@torch.no_grad()
def block_inference_path(head: DFlashHead, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Seq[int],
                         steps: int) -> list[torch.Tensor]:
    """The block drafted from every position (anchor a = row i+1), as the drafter computes it: the same context
    features and block forward (`DFlashHead.block`), with no anchor sampling."""
    return head.unroll(hidden, input_ids, list(seq_lens), steps)
