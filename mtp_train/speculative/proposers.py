"""Draft proposers: who guesses the next k tokens of every running sequence, as a draft tree.

Every proposer returns one `DraftTree` per sequence (`mtp_train.speculative.tree`): a chain, a tree, or whatever
shape its drafter makes. A trained head's proposer is its head type's drafter (`HeadType.drafter`, e.g. the chain
drafter `mtp_train.head_types.chain.HeadProposer`), built on `Proposer` and `Drafts` from here.

Proposers with a model keep their own paged KV pool with the same page ids as the target (one allocation, owned by
the target's allocator): a sequence's page list serves the target, the head and the draft model alike.

Notation (see `mtp_train.heads.base`): a sequence of length L has tokens t_0..t_{L-1}; the target has cached
positions 0..L-2 and t_{L-1} (the last emitted token) is uncached. A step drafts d_1..d_k for positions
L..L+k-1, the target verifies [t_{L-1}, d_1..d_k] in one forward, n drafts are accepted plus one token of the
target's, and the sequence becomes L' = L + n + 1 long.

`draft` (`DraftModelProposer`): a small Llama-family model with the target's tokenizer; it feeds its uncached
tokens (the whole prompt the first time, then t_{L-1}, or d_k and t_{L-1} after a fully accepted step) and then
one token at a time; after verification its cache is cut back to the accepted prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq

import torch

from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.runner import StepRows
from mtp_train.engine.sampling import filtered_probs, greedy_ids
from mtp_train.engine.sequence import Sequence
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.models.base import CausalLM
from mtp_train.speculative.tree import Accepted, DraftTree, VerifyRows


def pick(logits: torch.Tensor, seqs: Seq[Sequence], to_ids: torch.Tensor | None,
         vocab_size: int) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per sequence from draft logits (B, Vd): argmax when greedy, else a sample from q.

    to_ids maps logit columns to target ids (a draft vocabulary) or is None. Returns (tokens (B,), q per
    sequence over the target vocabulary (V,), None when greedy). q is processed exactly as the target's p.
    """
    idx = greedy_ids(logits).tolist()
    qs: list[torch.Tensor | None] = [None] * len(seqs)
    for b, s in enumerate(seqs):
        p = s.params
        if p.greedy:
            continue
        q = filtered_probs(logits[b], p.temperature, p.top_k, p.top_p)
        idx[b] = int(torch.multinomial(q, 1, generator=s.generator))
        if to_ids is not None:
            q = torch.zeros(vocab_size, dtype=q.dtype, device=q.device).index_copy_(0, to_ids.to(q.device), q)
        qs[b] = q
    tokens = idx if to_ids is None else to_ids[torch.tensor(idx, device=to_ids.device)].tolist()
    return tokens, qs


class Drafts:
    """The draft tokens of a step and, for sampled sequences, the distributions they came from."""

    def __init__(self, seqs: Seq[Sequence], to_ids: torch.Tensor | None, vocab_size: int) -> None:
        self.seqs, self.to_ids, self.vocab_size = seqs, to_ids, vocab_size
        self.tokens: list[list[int]] = [[] for _ in seqs]
        self.probs: list[list[torch.Tensor | None]] = [[] for _ in seqs]

    def add(self, logits: torch.Tensor, rows: Seq[int] | None = None) -> list[int]:
        """Pick the next draft token of the sequences `rows` (default all) from their logits (R, Vd)."""
        rows = range(len(self.seqs)) if rows is None else rows
        picked, qs = pick(logits, [self.seqs[b] for b in rows], self.to_ids, self.vocab_size)
        for b, t, q in zip(rows, picked, qs):
            self.tokens[b].append(t)
            self.probs[b].append(q)
        return picked

    def trees(self) -> list[DraftTree]:
        """One chain per sequence."""
        probs = [None if not q or q[0] is None else torch.stack(q) for q in self.probs]  # type: ignore[misc]
        return [DraftTree.chain(t, q) for t, q in zip(self.tokens, probs)]


class Proposer(ABC):
    """The drafting side of speculative decoding, driven by `SpecEngine`."""

    name: str = "base"
    draft_width: int = 1  # candidates at the tree's first level (1 = chains)
    # Target layers (hidden_states numbering) whose states, concatenated (T, k·H), the engine passes as
    # `target_hidden` to prefill / update; () = the target's final hidden (T, H). An EAGLE-3 head sets its aux layers.
    hidden_layers: tuple[int, ...] = ()

    @abstractmethod
    def bind(self, target_kv: KVCache) -> None:
        """Create the proposer's KV pool with the target's page count and size (pages are shared by id)."""

    @abstractmethod
    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        """After the target's prompt prefill: seqs hold prompt + the first sampled token (uncached).

        target_hidden: (Σ prompt lens, H) the target's final hidden states over the prompts, packed in order
        (or (·, k·H), the `hidden_layers` concatenated).
        """

    def max_nodes(self, k: int) -> int:
        """The most nodes a tree of this proposer holds when drafting k deep: a chain, and the first level's other
        draft_width - 1 candidates."""
        return k + self.draft_width - 1

    def draft_slots(self, k: int) -> int:
        """KV slots from L-1 on that drafting writes in the proposer's own cache beyond the tree's (a head's tree
        rows, when its frontiers hold more rows than the tree keeps nodes); 0 = none beyond the tree's."""
        return 0

    @property
    def drafts_trees(self) -> bool:
        """Whether a step may verify siblings (a tree step, which needs the target's tree attention)."""
        return self.draft_width > 1

    @abstractmethod
    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        """A tree of depth <= k and at most max_nodes(k) nodes for every sequence (pages already hold that many
        tokens beyond len(seq))."""

    @abstractmethod
    def update(self, seqs: Seq[Sequence], old_lens: Seq[int], trees: Seq[DraftTree], paths: Seq[Seq[int]],
               target_hidden: Seq[torch.Tensor]) -> None:
        """After verification of the surviving sequences: catch up along the accepted path.

        old_lens: (B,) lengths L before the step; trees: (B,) what was drafted; paths: (B,) each the n accepted
        nodes, root to leaf; seqs now hold L + n + 1 tokens. target_hidden: (B,) each (n+1, H), the target's hidden
        states at the root and along the path, positions L-1..L-1+n (each (n+1, k·H) with `hidden_layers`).
        """

    def after_verify(self, seqs: Seq[Sequence], rows: VerifyRows, step: StepRows, meta: AttentionMetadata | None,
                     features: torch.Tensor, accepted: Seq[Accepted]) -> bool:
        """Catch up right after acceptance, over the verify step's own rows (the seed system's MTP step), instead
        of `update` after the scheduler appended the tokens; returns whether it did (False: `update` follows).

        Args:
            seqs: (B,) the batch, not yet extended (finished ones included: their rows are computed, then released).
            rows: the verify rows (per sequence 1 + N_b: the root t_{L-1}, then the tree's nodes).
            step: the runner's input for those rows (tokens, slots, pages; the tree's parents).
            meta: the verify forward's attention metadata when it ran eagerly (its batch information to share),
                else None.
            features: (Σ_b 1+N_b, W) the target's features over every verify row (`hidden_layers`, or the final
                hidden), packed as `rows`.
            accepted: (B,) each tree's accepted path and the target's tokens along it, then its bonus token.
        """
        return False

    def catch_up_greedy(self, seqs: Seq[Sequence], rows: VerifyRows, step: StepRows, meta: AttentionMetadata | None,
                        features: torch.Tensor, target: torch.Tensor) -> bool:
        """`after_verify` for a batch of greedy sequences, launched before acceptance is read on the host.

        A greedy step's accepted path and every token the catch-up reads follow from the target's argmax alone, so
        a proposer that can work from device tensors catches up here, with no host synchronisation between the
        verify forward and its own (on a GPU the host prepares the step's bookkeeping while both run); returns
        whether it did (False: `after_verify` follows acceptance as usual).

        Args:
            seqs, rows, step, meta, features: as `after_verify`.
            target: (Σ_b 1+N_b,) long, the target's argmax at every verify row, on the model's device.
        """
        return False

    @abstractmethod
    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence."""

    def enable_graphs(self, max_batch: int, scratch_pages: Seq[int], capture: bool, verify_rows: int = 0) -> None:
        """Replay the proposer's fixed-shape steps as CUDA graphs (`StepGraphs`); proposers without any ignore it.

        scratch_pages: the page ids the padded rows write, kept out of the target's allocator (enough for
        verify_rows tokens); verify_rows: rows per sequence of the step's fixed-shape verify (k + 1), which
        `after_verify` may replay too (0: none).
        """
        return None


class NgramProposer(Proposer):
    """Prompt lookup (training-free n-gram drafting, as serving engines ship it).

    For every sequence: the longest suffix of n_max..n_min tokens that also occurs earlier in the sequence so
    far (prompt and output); the k tokens that followed its most recent earlier occurrence are the drafts
    (fewer near the end of the sequence, none without a match: that step verifies the last token alone).
    Deterministic, so q is one-hot at every draft and no cache is kept.
    """

    name = "ngram"

    def __init__(self, n_max: int = 3, n_min: int = 1) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"prompt lookup needs 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min

    def bind(self, target_kv: KVCache) -> None:
        pass  # no cache of its own

    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        pass

    def lookup(self, tokens: Seq[int], k: int) -> list[int]:
        """The ≤ k tokens after the most recent earlier occurrence of the longest matching suffix, or []."""
        size = len(tokens)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            suffix = list(tokens[size - n:])
            first = suffix[0]
            # Scan backwards for the most recent start i < size - n with tokens[i:i+n] == suffix.
            for i in range(size - n - 1, -1, -1):
                if tokens[i] == first and list(tokens[i:i + n]) == suffix:
                    return list(tokens[i + n:i + n + k])
        return []

    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        return [DraftTree.chain(self.lookup(s.token_ids, k)) for s in seqs]

    def update(self, seqs: Seq[Sequence], old_lens: Seq[int], trees: Seq[DraftTree], paths: Seq[Seq[int]],
               target_hidden: Seq[torch.Tensor]) -> None:
        pass  # it reads the sequence itself

    def release(self, seq: Sequence) -> None:
        pass


class DraftModelProposer(Proposer):
    """A small target-family model with the same tokenizer, drafting with its own KV pool."""

    name = "draft"

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.kv: KVCache | None = None
        self._cached: dict[int, int] = {}  # seq_id → tokens in the draft model's cache

    def bind(self, target_kv: KVCache) -> None:
        a = self.model.args
        self.kv = KVCache(a.num_layers, target_kv.num_pages, target_kv.page_size, a.kv_layout,
                          dtype=self.model.dtype, device=self.model.device)

    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        for s in seqs:  # the prompt is fed with the first drafting forward
            self._cached[s.seq_id] = 0

    def _forward(self, seqs: Seq[Sequence], tokens: list[list[int]], kv_lens: list[int]) -> torch.Tensor:
        """Feed `tokens` per sequence (ending at kv_lens) → last-row logits (B, V)."""
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        dev = self.model.device
        meta = AttentionMetadata.build([len(t) for t in tokens], kv_lens, [s.pages for s in seqs],
                                       self.kv.page_size, dev)
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=dev)
        out = self.model(ids, meta, self.kv.layers, logits_indices=meta.qo_indptr[1:].long() - 1)
        return out.logits

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        drafts = Drafts(seqs, None, self.model.args.vocab_size)
        lens = [len(s) for s in seqs]
        tokens = [s.token_ids[self._cached[s.seq_id]:] for s in seqs]
        for j in range(k):
            tokens = [[t] for t in drafts.add(self._forward(seqs, tokens, [n + j for n in lens]))]
        for s, n in zip(seqs, lens):
            self._cached[s.seq_id] = n + k - 1  # fed up to d_{k-1}
        return drafts.trees()

    def update(self, seqs: Seq[Sequence], old_lens: Seq[int], trees: Seq[DraftTree], paths: Seq[Seq[int]],
               target_hidden: Seq[torch.Tensor]) -> None:
        # Entries up to the last accepted draft are valid; the new token (and a rejected tail) are not.
        for s in seqs:
            self._cached[s.seq_id] = min(self._cached[s.seq_id], len(s) - 1)

    def release(self, seq: Sequence) -> None:
        self._cached.pop(seq.seq_id, None)
