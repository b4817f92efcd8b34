"""The pair head's proposer: both drafts of a step from one head forward over (h_{L-2}, t_{L-1}), no cache."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch

from mtp_train.engine import KVCache, Sequence
from mtp_train.heads import packed_shift
from mtp_train.speculative.proposers import Drafts, Proposer
from mtp_train.speculative.tree import DraftTree

from .head import PairHead


class PairProposer(Proposer):
    """Both drafts of a step from one head forward; it keeps each sequence's last target row only."""

    name = "pair"

    def __init__(self, head: PairHead) -> None:
        self.head = head.eval()
        self.forwards = 0  # head forwards so far: one per step that drafts
        self._last: dict[int, torch.Tensor] = {}  # seq_id → (H,) the target's hidden state at position L-2

    def bind(self, target_kv: KVCache) -> None:
        pass  # no cache of its own

    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        ends = torch.tensor([s.num_prompt_tokens for s in seqs]).cumsum(0) - 1
        for s, e in zip(seqs, ends.tolist()):
            self._last[s.seq_id] = target_hidden[e]

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        hidden = torch.stack([self._last[s.seq_id] for s in seqs])
        tokens = torch.tensor([s.token_ids[-1] for s in seqs])
        first, second = self.head.pair(hidden, tokens)
        self.forwards += 1
        drafts = Drafts(seqs, self.head.draft_vocab, self.head.args.vocab_size)
        for feat in (first, second)[:min(k, 2)]:
            drafts.add(self.head.compute_logits(feat))
        return drafts.trees()

    def update(self, seqs, old_lens, trees, paths, target_hidden) -> None:
        for s, h in zip(seqs, target_hidden):
            self._last[s.seq_id] = h[-1]

    def release(self, seq: Sequence) -> None:
        self._last.pop(seq.seq_id, None)


def pair_drafter(head: PairHead, options: Mapping[str, Any]) -> PairProposer:
    """The proposer of one eval grid point; the type declares no draft options, so `options` is empty."""
    return PairProposer(head)


def pair_inference_path(head: PairHead, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Seq[int],
                        steps: int) -> list[torch.Tensor]:
    """The drafter's features from every position: the same one forward (it keeps no cache)."""
    return list(head.pair(hidden, packed_shift(input_ids, list(seq_lens), 1)))[:steps]
