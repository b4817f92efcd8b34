"""The chained-training attention of `DraftHead.unroll` (EAGLE-3's "training-time test"), one instance per call.

Step j of a chain drafts at position i + j from row i; at inference the head's KV cache then holds entries computed
from the target's hidden states up to position i and the chain's own entries after it. `ChainTrainAttention`
reproduces exactly that in a cache-free packed batch; `chain_attention` adapts it to the target family's block
(MLA: the latent row as the one KV head).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, MLABackend
from mtp_train.models.config import ModelArgs
from mtp_train.models.families import family_of

CHAIN_MODES = ("diagonal", "masked")  # how ChainTrainAttention computes a step (same result)


class ChainTrainAttention(AttentionBackend):
    """Training attention of an unrolled chain, one instance per `unroll` call (EAGLE-3's training-time test).

    Call j (step j) of the instance keeps that step's keys/values (T, Hkv, D); row i of step j attends to the
    step-0 keys of rows 0..i of its sequence and to its own keys of steps 1..j, one each. That is what draft
    step j at position i+j attends to at inference, when the head's KV cache holds the entries computed from
    the target's hidden states up to position i and the chain's own entries after it. Step 0 is the plain
    causal prefill. The caller gives step j the positions i + j (keys carry RoPE at their own positions).

    `mode` says how a later step is computed; both give the same attention. `diagonal` (the default) scores the
    step-0 keys as one causal (n, n) block and the chain's own keys as j dot products per row (its keys of steps
    1..j at the same row: the only ones it may see), so a step costs about one causal attention whatever j is.
    `masked` concatenates all (j+1)·n keys of the sequence and masks all but those: a step costs j+1 of them,
    and a 7-step test ~4x its attention (`python -m bench.chain_attention` times the two; a test checks they agree).
    """

    name = "chain-train"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None, mode: str = "diagonal") -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, sliding_window)
        if mode not in CHAIN_MODES:
            raise ValueError(f"unknown chain attention mode {mode!r}; choose one of {', '.join(CHAIN_MODES)}")
        self.mode = mode
        self.keys: list[torch.Tensor] = []  # per step (T, Hkv, D)
        self.values: list[torch.Tensor] = []

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to plan: masks depend on the step, built in `forward`."""

    def _visible(self, n: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Which keys row i of step `step` sees, over one sequence of n rows with contiguous positions (step-0 key r
        at r, the row's own key of step s at i + s, its query at i + step): the step-0 block, bool (n, n), key row
        <= query row and within the window; its own keys of steps 1..step, bool (step,), the same for every row."""
        rows = torch.arange(n, device=device)
        block = rows[None, :] <= rows[:, None]
        own = torch.ones(step, dtype=torch.bool, device=device)
        if self.sliding_window is not None:
            block &= rows[None, :] > rows[:, None] + step - self.sliding_window
            own = torch.arange(1, step + 1, device=device) > step - self.sliding_window
        return block, own

    def _mask(self, n: int, step: int, device: torch.device) -> torch.Tensor | None:
        """The masked mode's bool (n, (step+1)·n), True = attend: `_visible`'s block, then per step s the diagonal
        where that step's own key is seen; None for the plain causal step 0."""
        if step == 0 and self.sliding_window is None:
            return None
        block, own = self._visible(n, step, device)
        eye = torch.eye(n, dtype=torch.bool, device=device)
        return torch.cat([block] + [eye & seen for seen in own], 1)

    def _masked(self, q: torch.Tensor, sl: slice, step: int) -> torch.Tensor:
        """One sequence's rows `sl` over all its (step+1)·n keys, masked: q (n, Hq, D) → (n, Hq, Dv)."""
        keys = torch.cat([x[sl] for x in self.keys], 0)  # ((step+1)·n, Hkv, D)
        values = torch.cat([x[sl] for x in self.values], 0)
        mask = self._mask(q.shape[0], step, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=self.num_q_heads != self.num_kv_heads,
        )  # (1, Hq, n, Dv)
        return out[0].transpose(0, 1)

    def _diagonal(self, q: torch.Tensor, sl: slice, step: int) -> torch.Tensor:
        """One sequence's rows `sl` at step >= 1: q (n, Hq, D) → (n, Hq, Dv).

        Row i's own keys k_s[i] (s = 1..step) are scored as dot products d_s; their softmax group enters the one
        SDPA over the causal step-0 block as a single extra key whose score is the group's logsumexp (an extra
        q/k dimension carries it) and whose value is an indicator column: that column's output is the group's
        share u_i of the joint softmax, and out = SDPA's value part + u_i · Σ_s softmax(d)_s v_s[i], exactly the
        attention over all the keys, at the cost of one causal attention over n + 1 keys.
        """
        n, hkv, g = q.shape[0], self.num_kv_heads, self.num_q_heads // self.num_kv_heads
        k0, v0 = self.keys[0][sl], self.values[0][sl]  # (n, Hkv, D), (n, Hkv, Dv)
        ks = torch.stack([x[sl] for x in self.keys[1:]], 1)  # (n, step, Hkv, D)
        vs = torch.stack([x[sl] for x in self.values[1:]], 1)  # (n, step, Hkv, Dv)
        block, own_seen = self._visible(n, step, q.device)
        d = torch.einsum("nkgd,nskd->nkgs", q.view(n, hkv, g, -1), ks) * self.scale  # (n, Hkv, g, step)
        d = d.masked_fill(~own_seen, float("-inf"))
        own = torch.einsum("nkgs,nskv->nkgv", torch.softmax(d, -1), vs).reshape(n, self.num_q_heads, -1)
        lse = torch.logsumexp(d, -1).reshape(n, self.num_q_heads, 1)  # the group's score
        # The extra columns: one on CPU; eight on CUDA, whose fused kernels want head dims in multiples of 8.
        extra = 8 if q.is_cuda else 1
        q_ext = torch.cat([q, F.pad(lse / self.scale, (0, extra - 1))], -1)  # (n, Hq, D+e): · the sink's 1 → lse
        sink_k = torch.zeros(1, hkv, k0.shape[-1] + extra, dtype=k0.dtype, device=k0.device)
        sink_k[..., k0.shape[-1]] = 1
        sink_v = torch.zeros(1, hkv, v0.shape[-1] + extra, dtype=v0.dtype, device=v0.device)
        sink_v[..., v0.shape[-1]] = 1
        k_ext = torch.cat([F.pad(k0, (0, extra)), sink_k], 0)  # (n+1, Hkv, D+e)
        v_ext = torch.cat([F.pad(v0, (0, extra)), sink_v], 0)  # (n+1, Hkv, Dv+e)
        mask = torch.cat([block, torch.ones(n, 1, dtype=torch.bool, device=q.device)], 1)  # (n, n+1): the sink seen
        out = F.scaled_dot_product_attention(
            q_ext.transpose(0, 1)[None], k_ext.transpose(0, 1)[None], v_ext.transpose(0, 1)[None],
            attn_mask=mask, scale=self.scale, enable_gqa=g > 1,
        )[0].transpose(0, 1)  # (n, Hq, Dv+e)
        dv = v0.shape[-1]
        return out[..., :dv] + out[..., dv:dv + 1] * own

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D) of this step → (T, Hq, Dv); no KV cache."""
        if kv_cache is not None:
            raise ValueError("training attention takes no KV cache")
        self.keys.append(k)
        self.values.append(v)
        step = len(self.keys) - 1
        outs = []
        for b, n in enumerate(meta.qo_lens):
            lo = int(meta.qo_indptr[b])
            sl = slice(lo, lo + n)
            if step == 0 or self.mode == "masked":
                outs.append(self._masked(q[sl], sl, step))
            else:
                outs.append(self._diagonal(q[sl], sl, step))
        return torch.cat(outs, 0)


def attend_chain(attn: ChainTrainAttention, qkv: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 lens: Sequence[int], device: torch.device | str | None = None) -> list[torch.Tensor]:
    """The attention alone of one unroll, step by step as `DraftHead.unroll` calls it: step j over the packed
    sequences `lens` at positions i + j. qkv: per step (q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv)); `attn` a fresh
    instance. Returns each step's (T, Hq, Dv) (for the benchmarks and checks that compare the modes)."""
    outs = []
    for j, (q, k, v) in enumerate(qkv):
        meta = AttentionMetadata.build(list(lens), device=device)
        meta.positions = meta.positions + j
        attn.prepare(meta)
        outs.append(attn.forward(q, k, v, None, meta))
    return outs


def chain_attention(args: ModelArgs, mode: str = "diagonal") -> AttentionBackend | MLABackend:
    """A fresh chain over the head block's attention shape (args: the head's one-layer args), as its family's
    block calls attention; `mode` as in `ChainTrainAttention`."""
    chain = ChainTrainAttention(args.num_heads, args.num_kv_heads, args.head_dim, args.sliding_window, mode)
    return family_of(args).adapt_attention(chain, args)
