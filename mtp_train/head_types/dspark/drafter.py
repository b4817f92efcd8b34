"""The `dspark` head type's drafter: DFlash's block with DSpark's Markov head (`head.py` `DSparkHead`), as vLLM
samples it for `method=dspark` (`qwen3_dspark.py`, `Qwen3DSparkModel`).

Its drafter, `MarkovBlockProposer`, is DFlash's `BlockProposer` (the same paged context cache, prefill and update)
with vLLM's DSpark sampling: ONE block forward per step gives B slot outputs, then the drafts are picked left to
right, draft j from lm_head(slot j) + W2·W1[x_{j-1}] where x_{-1} is the block's first token (the last token of the
sequence) and x_{j-1} the draft picked before (argmax when greedy, a sample from that distribution otherwise, which
is the q the acceptance test reads). A chain of min(k, B) drafts; no trees (a slot's distribution depends on the
token picked before it, so the slots' top-k do not make a tree of the block's distributions).

Dynamic length, `draft_threshold` > 0: with a confidence head, the chain stops before the first draft whose
survival, the running product of the confidence head's estimates up to it (vLLM's adaptive verification scores a
draft slot the same way), falls under the threshold; without one, before the first draft whose top-1 probability
does (as dflash). draft_threshold = 0 verifies the whole chain (vLLM without `enable_adaptive_verification`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch

from mtp_train.engine.sequence import Sequence
from mtp_train.head_types.dflash.drafter import BlockProposer
from mtp_train.head_types.dspark.head import DSparkHead
from mtp_train.speculative.proposers import Drafts
from mtp_train.speculative.tree import DraftTree

MARKOV_OPTIONS = ("draft_threshold",)  # the eval grid axes the Markov block drafter takes


class MarkovBlockProposer(BlockProposer):
    """One block forward per step, then a left-to-right chain of up to min(k, B) drafts through the Markov head."""

    name = "dspark"

    def __init__(self, head: DSparkHead, draft_threshold: float = 0.0) -> None:
        super().__init__(head, draft_threshold)
        self.head: DSparkHead = head

    def max_nodes(self, k: int) -> int:
        return min(k, self.head.block_size)

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        head = self.head
        n = min(k, head.block_size)
        feats = self.block_features(seqs)  # (S, B, H): slot j drafts the j-th token after the sequence
        dev = feats.device
        prev = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long, device=dev)  # x_{-1}: the anchor
        survival = torch.ones(len(seqs), dtype=torch.float32, device=dev)
        by_confidence = self.draft_threshold > 0.0 and head.confidence_head is not None
        drafts = Drafts(seqs, head.draft_vocab, head.args.vocab_size)
        rows = list(range(len(seqs)))  # sequences whose chain goes on
        for j in range(n):
            h, e = feats[rows, j], head.markov_embed(prev[rows])
            logits = head.base_logits(h) + head.markov_bias(e.to(h.dtype)).to(h.dtype)
            if self.draft_threshold > 0.0:
                if by_confidence:
                    survival[rows] *= torch.sigmoid(head.confidence_logits(torch.cat([h, e.to(h.dtype)], -1)))
                    keep = (survival[rows] >= self.draft_threshold).tolist()
                else:
                    keep = (torch.softmax(logits.float(), -1).amax(-1) >= self.draft_threshold).tolist()
                rows = [r for r, ok in zip(rows, keep) if ok]
                logits = logits[[i for i, ok in enumerate(keep) if ok]]
            if not rows:
                break
            picked = drafts.add(logits, rows)  # target ids: the next draft's Markov input
            prev[rows] = torch.tensor(picked, dtype=torch.long, device=dev)
        return drafts.trees()


def markov_drafter(head: DSparkHead, options: Mapping[str, Any]) -> MarkovBlockProposer:
    """The dspark type's `HeadType.drafter`: a fresh `MarkovBlockProposer` for one eval grid point."""
    unknown = sorted(set(options) - set(MARKOV_OPTIONS))
    if unknown:
        raise ValueError(f"the dspark head's drafter takes {', '.join(MARKOV_OPTIONS)}; not {', '.join(unknown)}")
    return MarkovBlockProposer(head, **dict(options))


@torch.no_grad()
def markov_inference_path(head: DSparkHead, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Seq[int],
                          steps: int) -> list[torch.Tensor]:
    """The block drafted from every position as the drafter computes it, each draft's Markov input the target's
    token: the drafter's own wherever the earlier drafts were accepted, the only drafts acceptance counts."""
    return head.unroll(hidden, input_ids, list(seq_lens), steps)
