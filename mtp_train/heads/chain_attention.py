"""The chained-training attention of `DraftHead.unroll` (EAGLE-3's "training-time test"), one instance per call.

Step j of a chain drafts at position i + j from row i; at inference the head's KV cache then holds entries computed
from the target's hidden states up to position i and the chain's own entries after it. `ChainTrainAttention`
reproduces exactly that in a cache-free packed batch; `chain_attention` adapts it to the target family's block
(MLA: the latent row as the one KV head).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F

from mtp_train.heads.block_attention import fold_query, sink_columns, sink_keys, unfold_sink
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, MLABackend
from mtp_train.models.config import ModelArgs
from mtp_train.models.families import family_of

CHAIN_MODES = ("diagonal", "masked")  # how ChainTrainAttention computes a step (same result)
STEP_KEY = "chain_step"  # the step a forward ran, in its metadata's backend_state (a recomputation finds it)


class ChainTrainAttention(AttentionBackend):
    """Training attention of an unrolled chain, one instance per `unroll` call (EAGLE-3's training-time test).

    Step j of the instance keeps that step's keys/values (T, Hkv, D); row i of step j attends to the step-0 keys
    of rows 0..i of its sequence and to its own keys of steps 1..j, one each. That is what draft step j at
    position i+j attends to at inference, when the head's KV cache holds the entries computed from the target's
    hidden states up to position i and the chain's own entries after it. Step 0 is the plain causal prefill. The
    caller gives step j the positions i + j (keys carry RoPE at their own positions).

    `mode` says how a step is computed; both give the same attention. `diagonal` (the default) keeps nothing of
    size n × n, forward or backward: row i's own keys (its step-0 key k_0[i] and k_s[i], s = 1..j) are scored as
    j + 1 dot products, and their softmax group joins one causal SDPA over the earlier step-0 keys as a single
    extra key (the sink, `heads/block_attention.py`); with a sliding window the SDPA runs blocks of rows over
    their band only. A step costs about one causal attention whatever j is, and memory linear in n (O(n · W)
    with a window W). `masked` concatenates all (j+1)·n keys of the sequence under a dense mask: the quadratic
    reference (`python -m bench.chain_attention` times the two, `python -m bench.attention_memory` counts what
    each keeps; a test checks they agree).

    Recomputation (activation checkpointing): `begin_step(j)` before step j's forward says which step it is; the
    forward stores its K/V at index j (replacing what a recomputation finds there), attends keys of steps 0..j
    only and records j in its metadata's `backend_state`, so a recomputation of that forward with the same
    metadata is step j again, with or without another `begin_step`. Without either, forwards are steps 0, 1, ...
    in order.
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
        self._next_step: int | None = None  # set by begin_step, taken by the next forward

    def begin_step(self, step: int) -> None:
        """The next forward is step `step` (0-based): it stores its K/V at index `step` and attends steps 0..step.
        Steps before it must have run (a recomputation may come back to any of them)."""
        if not 0 <= step <= len(self.keys):
            raise ValueError(f"chain step {step} cannot run: steps 0..{len(self.keys) - 1} have run, so the next "
                             f"is at most {len(self.keys)}")
        self._next_step = step

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to plan: masks depend on the step, built in `forward`."""

    def _step(self, meta: AttentionMetadata) -> int:
        """This forward's step: `begin_step`'s, else the one its metadata records (a recomputation), else the
        next in order; recorded in the metadata."""
        if self._next_step is not None:
            step, self._next_step = self._next_step, None
        else:
            step = meta.backend_state.get(STEP_KEY, len(self.keys))
        meta.backend_state[STEP_KEY] = step
        return step

    # -- masked: the quadratic reference --

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
        keys = torch.cat([x[sl] for x in self.keys[:step + 1]], 0)  # ((step+1)·n, Hkv, D)
        values = torch.cat([x[sl] for x in self.values[:step + 1]], 0)
        mask = self._mask(q.shape[0], step, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=self.num_q_heads != self.num_kv_heads,
        )  # (1, Hq, n, Dv)
        return out[0].transpose(0, 1)

    # -- diagonal: linear memory --

    def _own(self, q: torch.Tensor, sl: slice, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's own group, explicit: its keys k_s[i] of steps s = 0..step (those the window keeps), scored
        as dot products. q (n, Hq, D) → (its softmax-weighted values (n, Hq, Dv), its logsumexp (n, Hq)),
        float32."""
        n, hkv, g = q.shape[0], self.num_kv_heads, self.num_q_heads // self.num_kv_heads
        qg = q.view(n, hkv, g, -1).float()
        # one product per step over views of its keys / values: nothing (n, step+1, ...) stacked and kept
        d = torch.stack([torch.einsum("nkgd,nkd->nkg", qg, k[sl].float()) for k in self.keys[:step + 1]], -1)
        d = d * self.scale  # (n, Hkv, g, step+1)
        if self.sliding_window is not None:  # key of step s sits at i + s, the query at i + step
            seen = torch.arange(step + 1, device=q.device) > step - self.sliding_window  # step's own: always
            d = d.masked_fill(~seen, float("-inf"))
        p = torch.softmax(d, -1)
        own = sum(torch.einsum("nkg,nkv->nkgv", p[..., s], v[sl].float()) for s, v in enumerate(self.values[:step + 1]))
        return own.reshape(n, self.num_q_heads, -1), torch.logsumexp(d, -1).reshape(n, self.num_q_heads)

    def _diagonal(self, q: torch.Tensor, sl: slice, step: int) -> torch.Tensor:
        """One sequence's rows `sl`: q (n, Hq, D) → (n, Hq, Dv).

        Step 0 is one causal SDPA. A later step folds row i's own group (`_own`) into one SDPA over the step-0
        keys it sees before itself as the sink (key t = 0): [sink, k_0[0], ..., k_0[n-2]] with `is_causal` (n
        keys for n queries, top-left: row i sees the sink and k_0[0..i-1]), no mask at all. The sink's value
        column gives the group's share u_i of the joint softmax: out = the SDPA's value part + u_i · own,
        exactly the attention over all the keys. Under a window that hides keys, `_banded` runs the SDPA part.
        """
        n = q.shape[0]
        k0, v0 = self.keys[0][sl], self.values[0][sl]
        windowed = self.sliding_window is not None and n - 1 + step >= self.sliding_window  # the widest reach
        if step == 0 and not windowed:
            return self._causal(q, k0, v0)
        width, extra = max(q.shape[-1], v0.shape[-1]), sink_columns(q)  # CPU's flash kernel: q, k, v equally wide
        own, lse = self._own(q, sl, step)
        q_ext = fold_query(q, lse, self.scale, width, extra)  # (n, Hq, W+e)
        if windowed:
            out = self._banded(q_ext, k0, v0, step, width, extra)
        else:
            k_ext, v_ext = sink_keys(k0[:n - 1], v0[:n - 1], width, extra)  # (n, Hkv, W+e)
            out = F.scaled_dot_product_attention(
                q_ext.transpose(0, 1)[None], k_ext.transpose(0, 1)[None], v_ext.transpose(0, 1)[None],
                is_causal=True, scale=self.scale, enable_gqa=self.num_q_heads != self.num_kv_heads,
            )[0].transpose(0, 1)  # (n, Hq, W+e)
        return unfold_sink(out, own, width).to(q.dtype)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Step 0 without a window: one causal SDPA, no mask. q (n, Hq, D), k (n, Hkv, D), v (n, Hkv, Dv) →
        (n, Hq, Dv); values narrower than the keys (MLA's latent) are zero-padded, which keeps CPU's flash
        kernel (it wants q, k, v equally wide) instead of a kernel that materialises the scores."""
        dv = v.shape[-1]
        if dv < k.shape[-1]:
            v = F.pad(v, (0, k.shape[-1] - dv))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
            scale=self.scale, enable_gqa=self.num_q_heads != self.num_kv_heads,
        )  # (1, Hq, n, ·)
        return out[0].transpose(0, 1)[..., :dv]

    def _banded(self, q_ext: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, step: int, width: int,
                extra: int) -> torch.Tensor:
        """The SDPA part under a sliding window: row i sees the sink and k_0[r] for i - w <= r <= i - 1, where
        w = window - step - 1 (the step-0 keys within the window before the row's own).

        Rows go in blocks of R, keys in segments of R + 1 (a sink, then the step-0 keys of the same R rows),
        laid out once. Block m reads its own segment and the S - 1 before it, a strided view, under one
        (R, S·(R+1)) mask shared by all blocks (its own segment's sink and the band); blocks m >= S - 1 run as
        one batch, the first S - 1 (fewer segments before them) one each under the mask's right-hand part. So
        the memory is the rows, the segments and one mask: O(n + R · w).

        Args:
            q_ext: (n, Hq, W+e) `fold_query`'s rows.
            k0, v0: (n, Hkv, ·) the sequence's step-0 keys and values.
            step: the step (w follows from it).
            width, extra: as `fold_query` took them.
        Returns (n, Hq, W+e), the SDPA's output over [sink ; band] per row.
        """
        n, hq, we = q_ext.shape
        band = self.sliding_window - step - 1
        if band <= 0:  # no step-0 key left before the row: all of its attention is its own group
            out = q_ext.new_zeros(n, hq, we)
            out[..., width] = 1
            return out
        seg = min(512, max(64, 1 << (band // 4 - 1).bit_length()))  # R + 1: a multiple of 16 (CUDA's masks)
        rows = seg - 1
        nseg = -(-band // rows) + 1  # S: the segments the band reaches, and the block's own
        blocks = -(-n // rows)
        hkv, dev = k0.shape[1], q_ext.device
        sink_k, sink_v = sink_keys(k0[:0], v0[:0], width, extra)  # (1, Hkv, W+e): the sink alone

        def segments(rows_kv: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
            """(n, Hkv, ·) → (blocks · (R+1), Hkv, W+e): per block, the sink then its rows (zeros past n)."""
            padded = F.pad(rows_kv, (0, we - rows_kv.shape[-1], 0, 0, 0, blocks * rows - n))
            return torch.cat([sink[None].expand(blocks, 1, hkv, we), padded.view(blocks, rows, hkv, we)], 1
                             ).view(blocks * seg, hkv, we)

        ks, vs = segments(k0, sink_k), segments(v0, sink_v)
        col = torch.arange(nseg * seg, device=dev)
        t, p = col // seg, col % seg  # each column's segment (S - 1: the block's own) and place in it
        row = torch.arange(rows, device=dev)[:, None]  # the query's place in its block
        ahead = (t - nseg + 1) * rows + p - 1 - row  # key row - query row
        seen = torch.where(p == 0, t == nseg - 1, (ahead < 0) & (ahead >= -band))  # (R, S·(R+1))
        mask = torch.zeros(seen.shape, dtype=q_ext.dtype, device=dev).masked_fill(~seen, float("-inf"))
        qb = F.pad(q_ext, (0, 0, 0, 0, 0, blocks * rows - n)).view(blocks, rows, hq, we).transpose(1, 2)
        gqa = hq != hkv
        outs = []
        for m in range(min(nseg - 1, blocks)):  # the first blocks: fewer segments before them
            keys = (ks[:(m + 1) * seg].transpose(0, 1)[None], vs[:(m + 1) * seg].transpose(0, 1)[None])
            outs.append(F.scaled_dot_product_attention(qb[m:m + 1], *keys, attn_mask=mask[:, (nseg - 1 - m) * seg:],
                                                       scale=self.scale, enable_gqa=gqa))
        if blocks >= nseg:  # the rest as one batch: block m reads segments m - S + 1 .. m, a strided view
            keys = tuple(kv.unfold(0, nseg * seg, seg).permute(0, 1, 3, 2) for kv in (ks, vs))  # (·, Hkv, S·seg, W+e)
            outs.append(F.scaled_dot_product_attention(qb[nseg - 1:], *keys, attn_mask=mask, scale=self.scale,
                                                       enable_gqa=gqa))
        out = torch.cat(outs).transpose(1, 2).reshape(blocks * rows, hq, we)
        return out[:n]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D) of this step → (T, Hq, Dv); no KV cache."""
        if kv_cache is not None:
            raise ValueError("training attention takes no KV cache")
        step = self._step(meta)
        if step < len(self.keys):  # a recomputation: the same step again
            self.keys[step], self.values[step] = k, v
        else:
            self.keys.append(k)
            self.values.append(v)
        outs = []
        for lo, n in zip(accumulate(meta.qo_lens, initial=0), meta.qo_lens):  # host offsets: no device sync
            sl = slice(lo, lo + n)
            if self.mode == "masked":
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
        attn.begin_step(j)
        outs.append(attn.forward(q, k, v, None, meta))
    return outs


def chain_attention(args: ModelArgs, mode: str = "diagonal") -> AttentionBackend | MLABackend:
    """A fresh chain over the head block's attention shape (args: the head's one-layer args), as its family's
    block calls attention; `mode` as in `ChainTrainAttention`."""
    chain = ChainTrainAttention(args.num_heads, args.num_kv_heads, args.head_dim, args.sliding_window, mode)
    return family_of(args).adapt_attention(chain, args)
