"""The DSpark block drafter (vLLM's `qwen3_dspark`): DFlash's block, every slot a draft, plus a low-rank Markov head.

    out = DFlashHead.block([t_a, m, ..., m])              positions a..a+B-1 over the context < a (dflash/head.py)
    e_j = W1[x_{j-1}]                                      (r,) x_{-1} = t_a (the anchor), x_j = the j-th draft
    logits_j = lm_head(out_j) + W2 · e_j                   slot j drafts t_{a+j+1}, j = 0..B-1
    confidence_j = sigmoid(proj(out_j))  or  sigmoid(proj([out_j ; e_j]))   (optional; P(draft j is accepted))

The block is DFlash's with vLLM's `sample_from_anchor` reading: B queries [anchor, mask × (B-1)] draft B tokens, slot
j (position a+j) predicting the token after it (DFlash's slot s drafts the token AT position a+s, B-1 of them). So
in the unroll contract (row i of step j estimates h_{i+j+1}), the block of anchor a = i+1 gives step j from slot j.
The Markov bias makes the block left-to-right: draft j's logits depend on the token before it, the anchor for j = 0.
In training that token is the target's own (teacher forcing: `slot_outputs` reads t_{a+j} from the batch); in
drafting it is the previous draft (`drafter.py`), the same token wherever the earlier drafts are accepted.

The loss sees the bias through the lm_head: a step's prediction is [out_j ; e_j] (T, H + r) and the head's side of
the lm_head is [W_lm | W2] (Vd, H + r), so [out_j ; e_j] · [W_lm | W2]ᵀ = lm_head(out_j) + W2 · e_j and every
loss.kind, ce_impl and position weight applies unchanged (the feature loss compares the first H columns).

State dict (vLLM's names after its `model.` prefix): DFlash's (dflash/head.py), `markov_head.markov_w1.weight`
(V, r) (the target's vocabulary: it embeds the previous token), `markov_head.markov_w2.weight` (Vd, r), and with
head.confidence_head `confidence_head.proj.weight` (1, H or H + r) and `confidence_head.proj.bias` (1,), float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.config import HeadConfig
from mtp_train.head_types.dflash.head import DFlashHead, spread_slots
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.layers.linear import Linear, linear
from mtp_train.models.config import ModelArgs

CONF_CHUNK = 256  # rows of (·, Vd) logits the confidence loss computes at a time


class MarkovHead(nn.Module):
    """W1: the previous token's r-dim embedding (target vocabulary); W2: its bias over the head's vocabulary."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, draft_vocab_size, bias=False)  # drafting: the few-row paths
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # a new head's bias starts at zero: DFlash's block as it is


class ConfidenceHead(nn.Module):
    """proj: (in → 1) with bias, kept and computed in float32 as vLLM's `DSparkConfidenceHead`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, in) → (N,) float32 logits of P(accepted)."""
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkHead(DFlashHead):
    """DFlash's block drafting B tokens (`sample_from_anchor`), a Markov bias per slot, an optional confidence head."""

    type_name = "dspark"

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        c, h = self.cfg.settings, self.args.hidden_size
        rank = c.markov_rank
        assert rank is not None, "HeadConfig.resolved() sets a Markov head's rank"
        self.markov_head = MarkovHead(self.args.vocab_size, self.vocab_size, rank)
        self.confidence_head = (ConfidenceHead(h + rank if c.confidence_with_markov else h)
                                if c.confidence_head else None)

    @property
    def drafts(self) -> int:
        """Every slot drafts: B tokens per block."""
        return self.block_size

    def slot_outputs(self, out: torch.Tensor, row_idx: torch.Tensor, input_ids: torch.Tensor,
                     steps: int, span: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """out (A, B, H) of rows row_idx (A,) → per step j, (R, H + r): [slot j ; W1[t_{a+j}]] at its row, the
        previous token teacher-forced from the batch (a row past the batch's end takes its last token: such a
        step is never counted); over the batch's rows span = [lo, hi) (default all), R = hi - lo."""
        total = input_ids.shape[0]
        lo, hi = (0, total) if span is None else span
        prev_at = (row_idx[:, None] + 1 + torch.arange(steps, device=row_idx.device)).clamp_max(total - 1)
        e = self.markov_head.markov_w1(input_ids[prev_at]).to(out.dtype)  # (A, steps, r)
        return spread_slots(torch.cat([out[:, :steps], e], dim=-1), row_idx - lo, hi - lo)

    # -- logits: the Markov bias as r more columns of the lm_head --

    def draft_lm_head(self) -> torch.Tensor:
        """(Vd, H + r) [W_lm | W2]: the frozen lm_head rows beside the trained Markov projection."""
        w = self.lm_head_weight()
        return torch.cat([w.detach(), self.markov_head.markov_w2.weight.to(w.dtype)], dim=1)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: (N, H) slot outputs → (N, Vd) lm_head(h) without the bias."""
        w = self.lm_head_weight()
        # CPU fast paths serve a draft step's few rows, as DraftHead.compute_logits
        return linear(h.to(w.dtype), w, w16=self.lm_rows_copy(w))

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: (N,) target token ids → (N, r) W1[prev]."""
        return self.markov_head.markov_w1(prev)

    def markov_bias(self, e: torch.Tensor) -> torch.Tensor:
        """e: (N, r) → (N, Vd) W2 · e."""
        return self.markov_head.markov_w2(e)

    def confidence_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, H + r) [slot output ; W1[prev]] → (N,) float32 logits of each draft's acceptance."""
        if self.confidence_head is None:
            raise ValueError("this dspark head has no confidence head (head.confidence_head=false)")
        h = x[:, :self.args.hidden_size] if not self.cfg.settings.confidence_with_markov else x
        return self.confidence_head(h)

    def probe_features(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """(T, k·H), (T,) one sequence → every slot's [output ; W1[prev]], its Markov bias and (with a confidence
        head) its confidence logit, side by side: every weight of the head shows in it."""
        parts = []
        for x in self.unroll(hidden, token_ids, [hidden.shape[0]], self.drafts):
            parts += [x, self.markov_bias(x[:, self.args.hidden_size:])]
            if self.confidence_head is not None:
                parts.append(self.confidence_logits(x)[:, None].to(x.dtype))
        return torch.cat(parts, dim=-1)

    # -- training: the confidence head's loss --

    def step_extra_loss(self, pred: torch.Tensor, target: torch.Tensor,
                        counted: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The confidence head's loss of one step (None without a confidence head): binary cross-entropy of its
        logit against whether the step's greedy draft equals the target's greedy token (the draft's acceptance at
        T = 0, its earlier drafts accepted: teacher forcing), summed over the counted rows.

        pred: (T, H + r) the step's prediction; target: (T, H) the target's hidden of the predicted position;
        counted: (T,) bool. The inputs are detached: the confidence head learns to read the drafter, never moves it.
        Returns (loss sum, {"conf_loss": sum, "conf_accept": the labels' sum}) for the caller to normalise.
        """
        if self.confidence_head is None:
            return None
        idx = counted.nonzero().squeeze(1)
        x = pred[idx].detach()
        labels = []
        with torch.no_grad():
            w_draft, w_target = self.draft_lm_head(), self.lm_head_weight()
            for s in range(0, idx.numel(), CONF_CHUNK):
                mine = F.linear(x[s:s + CONF_CHUNK].to(w_draft.dtype), w_draft).argmax(-1)
                theirs = F.linear(target[idx[s:s + CONF_CHUNK]].to(w_target.dtype), w_target).argmax(-1)
                labels.append((mine == theirs).float())
        y = torch.cat(labels) if labels else x.new_zeros(0, dtype=torch.float32)
        loss = F.binary_cross_entropy_with_logits(self.confidence_logits(x), y, reduction="sum")
        return loss, {"conf_loss": loss.detach(), "conf_accept": y.sum()}
