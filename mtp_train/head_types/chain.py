"""The chain drafter of the chain head types (mtp, eagle1, eagle3): `HeadProposer` and the factory their plug-ins
name as `HeadType.drafter`.

The head's cache holds positions 0..L-2, computed from the target's hidden states; its
last output ĥ_{L-1} (and its logits, which give d_1) is kept per sequence. Drafting chains k-1 head decode steps
(row L-2+j reads ĥ and d_{j}, writes its KV at that position, gives d_{j+1}). After verification the head
*catches up* with the target's true hidden states, overwriting the chain's own entries, and the same forward
yields ĥ_{L'-1} and d_1 of the next step. It is the seed system's MTP step (`after_verify`): ONE head forward over
the verify step's rows, all of them, with the verify's batch information (its slots, positions, tree parents and
pages; for a chain at a fixed k a fixed shape, replayed as a CUDA graph): row r reads the target's h at that row
and the token after it on the accepted path (a path row: the next path token, the last one the target's bonus
token; any other row: its successor's, computed and discarded). The rows of rejected drafts lie at or beyond the
new length L' - 1 = L + n, which the cache does not count: every later read is bounded by a sequence's length and
the next step writes those slots before it reads them, so they are overwritten, never committed; a tree's path
off the first slots is moved to its positions as the target's is (`VerifyRows.moves`). `catch_up=own` keeps the
chain's rows instead, so it runs the separate pass over the rows the chain never wrote (`update`).

With `draft_width` w > 1 (the static tree of a chain whose first draft has w-1 siblings) or a `TreeSpec`
(`mtp_train.speculative.tree_draft`: EAGLE-2's dynamic trees by SGLang's steps / topk / tokens, or a static tree in
vLLM's format) the head drafts the tree `speculative.head_tree.TreeDrafter` builds, greedy and sampled alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

import torch

from mtp_train.engine.cuda_graphs import StepGraphs, supports_graphs
from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.runner import StepRows
from mtp_train.engine.sequence import Sequence
from mtp_train.heads.base import DraftHead
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.speculative.head_tree import TreeDrafter
from mtp_train.speculative.proposers import Drafts, Proposer
from mtp_train.speculative.tree import Accepted, DraftTree, VerifyRows, row_of
from mtp_train.speculative.tree_draft import TreeSpec

# The eval grid axes the chain drafter takes (besides k and temperature): `HeadType.draft_options`.
CHAIN_OPTIONS = ("draft_threshold", "catch_up", "draft_width", "tree")


CATCH_UP = ("target", "own")


class HeadProposer(Proposer):
    """The MTP / EAGLE head drafting a chain over its own one-layer paged KV cache.

    draft_threshold: stop a sequence's chain before a draft whose top-1 probability under the head (softmax of
    its logits) is below it, so tokens that would likely be rejected are not verified (0 = always k drafts;
    k is then the maximum). catch_up: after verification re-run every accepted row with the target's hidden
    states ("target", the seed system's rule, in one forward over the verify step's rows: `after_verify`), or keep
    the rows the chain wrote for accepted drafts and run only the rows it never wrote, from the target's hidden
    states ("own": fewer rows, the cache holds the head's own features; a separate pass after the step, `update`).
    draft_width: how many candidates the first draft position gets (1 = a chain): the head's top
    draft_width tokens there, the top one carrying the chain and the others verified beside it in the same target
    forward (a tree of that width at depth 1, the static tree `TreeSpec.first_width`), so a first guess that
    misses can still be saved by the runner-up. tree: a `TreeSpec` (EAGLE-2's dynamic tree by steps / topk /
    tokens, or a static `choices` tree), drafted by `TreeDrafter` and verified in one target forward; the engine
    then runs with k = tree.steps. Without either the head drafts a plain chain (CUDA graphs, draft_threshold).
    """

    name = "chain"  # the chain drafter of every chain head type (mtp, eagle1, eagle3)

    def __init__(self, head: DraftHead, draft_threshold: float = 0.0, catch_up: str = "target",
                 draft_width: int = 1, tree: TreeSpec | None = None) -> None:
        if not 0.0 <= draft_threshold < 1.0:
            raise ValueError(f"draft_threshold must be in [0, 1), got {draft_threshold}")
        if not 1 <= draft_width <= 32:
            raise ValueError(f"draft_width must be in 1..32, got {draft_width}")
        if draft_width > head.vocab_size:
            raise ValueError(f"draft_width {draft_width} exceeds the head's vocabulary of {head.vocab_size}")
        self.draft_width = draft_width
        if tree is not None and draft_width > 1:
            raise ValueError("give a tree or a draft_width, not both (draft_width w is TreeSpec.first_width(k, w))")
        if draft_threshold > 0.0 and (tree is not None or draft_width > 1):
            raise ValueError("draft_threshold stops a chain; a tree (tree or draft_width > 1) keeps its shape")
        self.tree = tree
        if catch_up not in CATCH_UP:
            raise ValueError(f"catch_up must be one of {', '.join(CATCH_UP)}, got {catch_up!r}")
        self.head = head.eval()
        self.hidden_layers = tuple(head.aux_layers)  # an aux head (eagle3) catches up on the target's aux layers
        self.draft_threshold = draft_threshold
        self.catch_up = catch_up
        self.kv: KVCache | None = None
        self.graphs: StepGraphs | None = None  # the chained draft steps (one row per sequence), when enabled
        self.verify_graphs: StepGraphs | None = None  # the catch-up over a fixed-k chain's verify rows, when enabled
        self._feat: dict[int, torch.Tensor] = {}  # seq_id → (H,) the head's last output ĥ_{L-1}
        self._logits: dict[int, torch.Tensor] = {}  # seq_id → (Vd,) logits of the first draft token
        self._rows: dict[int, list[int]] = {}  # seq_id → each node's head row of the last tree drafted (-1: none)

    def spec(self, k: int) -> TreeSpec | None:
        """The tree drafted at depth k, None for a plain chain."""
        if self.tree is not None:
            if k != self.tree.steps:
                raise ValueError(f"the tree {self.tree.name} drafts {self.tree.steps} levels; run the engine with "
                                 f"k={self.tree.steps}, not {k}")
            return self.tree
        return TreeSpec.first_width(k, self.draft_width) if self.draft_width > 1 else None

    def max_nodes(self, k: int) -> int:
        spec = self.spec(k)
        return k if spec is None else spec.tokens - 1

    def draft_slots(self, k: int) -> int:
        spec = self.spec(k)
        return 0 if spec is None else spec.max_head_rows

    @property
    def drafts_trees(self) -> bool:
        return self.draft_width > 1 or (self.tree is not None and not self.tree.is_chain)

    def bind(self, target_kv: KVCache) -> None:
        attn = self.head.attention_backend(self.head.device)
        if (self.tree is not None or self.draft_width > 1) and not attn.tree_steps:
            raise ValueError(f"a draft tree's head rows attend as a tree, which the head's {attn.name} attention "
                             "backend cannot (FlashInfer's MLA kernels take no custom mask); draft a chain")
        layers, layout = self.head.kv_shape  # a DeepSeek-block head caches MLA's latent rows
        self.kv = KVCache(layers, target_kv.num_pages, target_kv.page_size, layout,
                          dtype=self.head.dtype, device=self.head.device)

    def enable_graphs(self, max_batch: int, scratch_pages: Seq[int], capture: bool, verify_rows: int = 0) -> None:
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        kv, head = self.kv, self.head
        attn = head.attention_backend(head.device)
        if capture and not supports_graphs(attn):
            return  # e.g. a DeepSeek block's MLA backend: the draft steps stay eager

        def fn(ids: torch.Tensor, hidden: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            assert hidden is not None
            out = head(hidden, ids, meta, kv.layers[0], from_target=False,  # chained draft steps read ĥ
                       logits_indices=torch.arange(ids.shape[0], device=ids.device))
            assert out.logits is not None
            return out.hidden, out.logits

        self.graphs = StepGraphs(fn, attn, kv, scratch_pages, q=1, max_batch=max_batch,
                                 width=head.args.hidden_size, dtype=head.dtype, capture=capture, device=head.device,
                                 pool=torch.cuda.graph_pool_handle() if capture else None)
        if verify_rows < 1 or self.catch_up != "target":
            return

        def catch_up(ids: torch.Tensor, hidden: torch.Tensor | None,
                     meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            assert hidden is not None
            # Every row's logits: which row is a sequence's last accepted one is known only after acceptance, and
            # a captured graph's shape cannot depend on it (the rows are picked from the outputs).
            out = head(hidden, ids, meta, kv.layers[0], from_target=True,
                       logits_indices=torch.arange(ids.shape[0], device=ids.device))
            assert out.logits is not None
            return out.hidden, out.logits

        # A pool of its own: its replays interleave with the draft steps' in no fixed order.
        self.verify_graphs = StepGraphs(catch_up, attn, kv, scratch_pages, q=verify_rows, max_batch=max_batch,
                                        width=head.input_width, dtype=head.dtype, capture=capture,
                                        device=head.device, pool=torch.cuda.graph_pool_handle() if capture else None)

    def _draft_step(self, feat: torch.Tensor, tokens: list[int], kv_lens: list[int],
                    seqs: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained draft step, one row per sequence: (B, H) features, (B,) tokens → (B, H), (B, Vd)."""
        if self.graphs is None:
            return self._forward(feat, tokens, [1] * len(seqs), kv_lens, seqs, from_target=False)
        out, logits = self.graphs.run(tokens, kv_lens, [s.pages for s in seqs], hidden=feat)
        return out, logits

    def _forward(self, hidden: torch.Tensor, tokens: list[int], qo_lens: list[int], kv_lens: list[int],
                 seqs: Seq[Sequence], from_target: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over `seqs` → (last feature (B, H), last-row logits (B, Vd)) per sequence; `hidden` is the
        target's (prefill, catch-up) or the head's own output (a chained draft step), as `from_target` says."""
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        dev = self.head.device
        meta = AttentionMetadata.build(qo_lens, kv_lens, [s.pages for s in seqs], self.kv.page_size, dev)
        last = meta.qo_indptr[1:].long() - 1
        out = self.head(hidden.to(dev), torch.tensor(tokens, dtype=torch.long, device=dev), meta,
                        self.kv.layers[0], from_target=from_target, logits_indices=last)
        return out.hidden[last], out.logits

    def _store(self, seqs: Seq[Sequence], feat: torch.Tensor, logits: torch.Tensor) -> None:
        for b, s in enumerate(seqs):
            self._feat[s.seq_id] = feat[b]
            self._logits[s.seq_id] = logits[b]

    @torch.inference_mode()
    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        # Row i of a prompt reads (h_i, t_{i+1}); t_p is the token the target just sampled.
        lens = [s.num_prompt_tokens for s in seqs]
        tokens = [t for s in seqs for t in s.token_ids[1:s.num_prompt_tokens + 1]]
        feat, logits = self._forward(target_hidden, tokens, lens, lens, seqs)
        self._store(seqs, feat, logits)

    def _confident(self, logits: torch.Tensor) -> list[bool]:
        """(R, Vd) draft logits → whether each row's top-1 probability reaches the threshold."""
        if self.draft_threshold <= 0.0:
            return [True] * logits.shape[0]
        return (torch.softmax(logits.float(), -1).amax(-1) >= self.draft_threshold).tolist()

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        feat = torch.stack([self._feat[s.seq_id] for s in seqs])  # (B, H)
        logits = torch.stack([self._logits[s.seq_id] for s in seqs])  # (B, Vd)
        spec = self.spec(k)
        if spec is not None:
            assert self.kv is not None, "bind() the proposer to the target's KV cache first"
            trees, rows = TreeDrafter(self.head, self.kv, spec, self.head.args.vocab_size).draft(seqs, feat, logits)
            self._rows.update((s.seq_id, r) for s, r in zip(seqs, rows))
            return trees
        drafts = Drafts(seqs, self.head.draft_vocab, self.head.args.vocab_size)
        lens = [len(s) for s in seqs]
        rows = list(range(len(seqs)))  # sequences whose chain goes on
        for j in range(k):
            keep = self._confident(logits)
            if not all(keep):
                sel = [i for i, ok in enumerate(keep) if ok]
                rows = [rows[i] for i in sel]
                if not rows:
                    break
                idx = torch.tensor(sel, device=logits.device)
                feat, logits = feat[idx], logits[idx]
            picked = drafts.add(logits, rows)
            if j < k - 1:
                # Draft step j+2: row at position L-1+j reads ĥ and d_{j+1}.
                feat, logits = self._draft_step(feat, picked, [lens[b] + j for b in rows], [seqs[b] for b in rows])
        return drafts.trees()

    @torch.inference_mode()
    def after_verify(self, seqs: Seq[Sequence], rows: VerifyRows, step: StepRows, meta: AttentionMetadata | None,
                     features: torch.Tensor, accepted: Seq[Accepted]) -> bool:
        if self.catch_up != "target":
            return False  # own: the chain's rows stay, only the others run (`update`)
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        dev = self.head.device
        tokens: list[int] = []
        last: list[int] = []  # each sequence's last accepted row, in the packed rows
        for b, a in enumerate(accepted):
            # Row r reads the token after it: its successor's row token (a chain's next draft; for rows off the
            # path any token does, they are discarded), the path's rows the path's next token, then the bonus.
            toks = [*rows.tokens[b][1:], a.tokens[-1]]
            path = [0, *map(row_of, a.path)]
            for r, t in zip(path, a.tokens):
                toks[r] = t
            last.append(len(tokens) + path[-1])
            tokens += toks
        idx = torch.tensor(last, device=dev)
        graphs = self.verify_graphs
        if (graphs is not None and step.tree is None and len(seqs) <= graphs.max_batch
                and all(len(t) == graphs.q for t in step.tokens)):
            out, logits = graphs.run(tokens, step.kv_lens, step.pages, hidden=features)
            feat, logits = out[idx], logits[idx]
        else:
            # The verify's batch information, with a copy of the verify's per-step backend state: a head backend of
            # the kind and window that prepared it keeps it (`TorchBackend`: no second build of the kernel's
            # arguments), another prepares its own over it.
            meta = (step.metadata(self.kv.page_size, dev) if meta is None
                    else replace(meta, backend_state=dict(meta.backend_state)))
            res = self.head(features.to(dev), torch.tensor(tokens, dtype=torch.long, device=dev), meta,
                            self.kv.layers[0], from_target=True, logits_indices=idx)
            assert res.logits is not None
            feat, logits = res.hidden[idx], res.logits
        for b, (s, a) in enumerate(zip(seqs, accepted)):
            for src, dst in rows.moves(b, a.path):  # a tree's path off the first slots, as the target's
                self.kv.copy_token(s.pages, src, dst)
        self._store(seqs, feat, logits)
        return True

    @torch.inference_mode()
    def catch_up_greedy(self, seqs: Seq[Sequence], rows: VerifyRows, step: StepRows, meta: AttentionMetadata | None,
                        features: torch.Tensor, target: torch.Tensor) -> bool:
        """`after_verify` from the target's argmax alone, for chains of one length N (a fixed k; trees, whose path
        may need K/V moves, and the ragged chains of a draft threshold or prompt lookup take `after_verify`).

        Row r reads the token after it: for r < n (the accepted drafts) that is draft r+1, which equals the
        target's argmax at row r; at r = n it is the bonus token, the argmax at row n; rows after n are discarded.
        So every row reads the argmax at itself, and n = the matching prefix of drafts and argmax, on the device.
        """
        if self.catch_up != "target" or rows.tree is not None or len(set(rows.rows)) != 1:
            return False
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        dev = self.head.device
        b, q = len(seqs), rows.rows[0]
        tokens = target.to(dev)
        drafts = torch.tensor([r[1:] for r in rows.tokens], dtype=torch.long).to(dev, non_blocking=True)  # (B, N)
        n = (drafts == tokens.view(b, q)[:, :q - 1]).int().cumprod(1).sum(1)  # (B,) accepted drafts
        idx = torch.arange(b, device=dev) * q + n  # each sequence's last accepted row
        graphs = self.verify_graphs
        if graphs is not None and b <= graphs.max_batch and q == graphs.q:
            out, logits = graphs.run(tokens, step.kv_lens, step.pages, hidden=features)
            feat, logits = out[idx], logits[idx]
        else:
            meta = (step.metadata(self.kv.page_size, dev) if meta is None
                    else replace(meta, backend_state=dict(meta.backend_state)))  # as in after_verify
            res = self.head(features.to(dev), tokens, meta, self.kv.layers[0], from_target=True,
                            logits_indices=idx)
            assert res.logits is not None
            feat, logits = res.hidden[idx], res.logits
        self._store(seqs, feat, logits)
        return True

    @torch.inference_mode()
    def update(self, seqs: Seq[Sequence], old_lens: Seq[int], trees: Seq[DraftTree], paths: Seq[Seq[int]],
               target_hidden: Seq[torch.Tensor]) -> None:
        """The separate catch-up pass over the accepted rows alone: what `catch_up=own` runs (the engine takes
        `after_verify` for `target`); with `target` it gives the same cache and state as `after_verify`."""
        if not seqs:
            return
        num_accepted = [len(p) for p in paths]
        # Rows L-1+m..L-1+n read the target's h and the tokens after them (the path's tokens after the m-th, the
        # new token). With catch_up=target m = 0: every accepted row is re-run. With own, the chain's rows for
        # accepted drafts stay: it wrote rows L-1..L+c-3 for its chain of c (one per draft after the first), so
        # the path's first min(n, c-1) are kept while the path follows the chain. A tree keeps the path's first
        # nodes whose head rows sit at their positions (row d-1 for depth d: the first frontier node of each level).
        keep = [0 if self.catch_up == "target" else self._kept_rows(s, t, p) for s, t, p in zip(seqs, trees, paths)]
        hidden = torch.cat([h[m:] for h, m in zip(target_hidden, keep)])
        tokens = [t for s, L, m, n in zip(seqs, old_lens, keep, num_accepted) for t in s.token_ids[L + m:L + n + 1]]
        qo = [n - m + 1 for m, n in zip(keep, num_accepted)]
        kv = [L + n for L, n in zip(old_lens, num_accepted)]
        feat, logits = self._forward(hidden, tokens, qo, kv, seqs)
        self._store(seqs, feat, logits)

    def _kept_rows(self, seq: Sequence, tree: DraftTree, path: Seq[int]) -> int:
        """Catch-up `own`: how many of the path's first nodes have head rows already at their positions."""
        rows = self._rows.get(seq.seq_id)
        if rows is None:  # a chain of c wrote rows L-1..L+c-3
            return max(0, min(tree.chain_prefix(path), tree.chain_length - 1))
        m = 0
        while m < len(path) and rows[path[m]] == m:
            m += 1
        return m

    def release(self, seq: Sequence) -> None:
        self._feat.pop(seq.seq_id, None)
        self._logits.pop(seq.seq_id, None)
        self._rows.pop(seq.seq_id, None)


def chain_drafter(head: DraftHead, options: Mapping[str, Any]) -> HeadProposer:
    """The chain head types' `HeadType.drafter`: a fresh `HeadProposer` for one eval grid point.

    options: any of CHAIN_OPTIONS; `tree` is a `TreeSpec`, or its text (STEPSxTOPKxTOKENS, or none).
    """
    opts = dict(options)
    unknown = sorted(set(opts) - set(CHAIN_OPTIONS))
    if unknown:
        raise ValueError(f"the {head.type_name} head's chain drafter takes {', '.join(CHAIN_OPTIONS)}; not "
                         f"{', '.join(unknown)}")
    tree = opts.pop("tree", None)
    if isinstance(tree, str):
        tree = None if tree == "none" else TreeSpec.parse(tree)
    return HeadProposer(head, **opts, tree=tree)
