"""The chained-training attention of `DraftHead.unroll` (EAGLE-3's "training-time test"), one instance per call.

Step j of a chain drafts at position i + j from row i; at inference the head's KV cache then holds entries computed
from the target's hidden states up to position i and the chain's own entries after it. `ChainTrainAttention`
reproduces exactly that in a cache-free packed batch; `chain_attention` adapts it to the target family's block
(MLA: the latent row as the one KV head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, MLABackend
from mtp_train.models.config import ModelArgs
from mtp_train.models.families import family_of


class ChainTrainAttention(AttentionBackend):
    """Training attention of an unrolled chain, one instance per `unroll` call (EAGLE-3's training-time test).

    Call j (step j) of the instance keeps that step's keys/values (T, Hkv, D); row i of step j attends to the
    step-0 keys of rows 0..i of its sequence and to its own keys of steps 1..j, one each. That is what draft
    step j at position i+j attends to at inference, when the head's KV cache holds the entries computed from
    the target's hidden states up to position i and the chain's own entries after it. Step 0 is the plain
    causal prefill. The caller gives step j the positions i + j (keys carry RoPE at their own positions).
    """

    name = "chain-train"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, sliding_window)
        self.keys: list[torch.Tensor] = []  # per step (T, Hkv, D)
        self.values: list[torch.Tensor] = []

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to plan: masks depend on the step, built in `forward`."""

    def _mask(self, q_pos: torch.Tensor, step: int) -> torch.Tensor | None:
        """q_pos: (n,) positions i + step of one sequence's queries → bool (n, (step+1)·n), True = attend."""
        n = q_pos.shape[0]
        rows = torch.arange(n, device=q_pos.device)
        if step == 0 and self.sliding_window is None:
            return None  # plain causal
        base = q_pos - step  # the chain's start positions i
        parts = [rows[None, :] <= rows[:, None]] + [torch.eye(n, dtype=torch.bool, device=q_pos.device)] * step
        mask = torch.cat(parts, 1)
        if self.sliding_window is not None:
            k_pos = torch.cat([base + s for s in range(step + 1)])  # ((step+1)·n,)
            mask &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
        return mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D) of this step → (T, Hq, D); no KV cache."""
        if kv_cache is not None:
            raise ValueError("training attention takes no KV cache")
        self.keys.append(k)
        self.values.append(v)
        step = len(self.keys) - 1
        outs = []
        for b, n in enumerate(meta.qo_lens):
            lo = int(meta.qo_indptr[b])
            sl = slice(lo, lo + n)
            keys = torch.cat([x[sl] for x in self.keys], 0)  # ((step+1)·n, Hkv, D)
            values = torch.cat([x[sl] for x in self.values], 0)
            mask = self._mask(meta.positions[sl], step)
            out = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=self.num_q_heads != self.num_kv_heads,
            )  # (1, Hq, n, D)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs, 0)


def chain_attention(args: ModelArgs) -> AttentionBackend | MLABackend:
    """A fresh chain over the head block's attention shape (args: the head's one-layer args), as its family's
    block calls attention."""
    chain = ChainTrainAttention(args.num_heads, args.num_kv_heads, args.head_dim, args.sliding_window)
    return family_of(args).adapt_attention(chain, args)
