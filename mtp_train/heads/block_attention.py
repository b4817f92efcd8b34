"""The attention of a block drafter (DFlash): blocks of query rows over their sequence's context and themselves.

Each block (one per anchor) has B query rows. A block sees the context rows of its own sequence before its anchor
(K/V computed from the target's features) and all B rows of its own block, with no causal mask inside the block;
it never sees another block or another sequence. Training packs many anchors of many sequences, drafting packs
one anchor per running sequence; both call `packed_block_attention`.

No (rows × keys) scores are kept. The block's own (B, B) scores are explicit (small); their softmax group joins
one fused SDPA over the sequence's context as a single extra key, the *sink*, whose score is the group's logsumexp
and whose value is an indicator column (`fold_query`, `sink_keys`, `unfold_sink`, shared with the chained
training attention). The SDPA runs the anchors of a chunk as its batch over one copy of the context (a stride-0
view) with a (chunk, context) boolean mask for each anchor's prefix, at most `SCORE_BUDGET` mask entries at a
time, so autograd keeps q, K/V, the output and the kernel's logsumexp (anchors × B × (D + a few) and the context
once) and the masks (anchors × context, one byte or one float per entry), never the (A, H, B, N) probabilities of
the explicit formula (`block_attend`, the reference that tests and `bench/block_attention.py` compare against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCORE_BUDGET = 1 << 24  # mask entries (anchors × context keys) built at once: the size of one chunk of anchors


@dataclass(frozen=True)
class BlockLayout:
    """Which context each block reads.

    groups: per sequence, (its anchors' rows [a0, a1) of the blocks, its context rows [c0, c1) of the context):
    the anchors of one sequence are consecutive and read that sequence's context only.
    ctx_len: (A,) long, anchor a sees the first ctx_len[a] rows of its group's context (its anchor position).
    """

    groups: tuple[tuple[int, int, int, int], ...]
    ctx_len: torch.Tensor


# -- one softmax group folded into a fused SDPA as a single key (the sink) --

def sink_columns(x: torch.Tensor) -> int:
    """The extra q/k/v columns a folded group takes: 2 (its score split into a high and a low part, so that a
    bfloat16 row keeps it to ~2^-16); 8 on CUDA, whose fused kernels want head dims in multiples of 8."""
    return 8 if x.is_cuda else 2


def fold_query(q: torch.Tensor, lse: torch.Tensor, scale: float, width: int, extra: int) -> torch.Tensor:
    """The queries with their folded group's score.

    Args:
        q: (..., D) queries.
        lse: (...) float32, the group's logsumexp (already scaled, as a softmax over scale · q·k sees it).
        scale: the SDPA's softmax scale.
        width: the padded head width W >= D (the widest of the key and the value heads).
        extra: `sink_columns`.
    Returns (..., W + extra): q, zeros up to W, then lse / scale as a high and a low part in q's dtype (the sink
    key has a 1 in both columns, so the kernel's float32 accumulation gives back lse), then zeros.
    """
    t = lse / scale
    hi = t.to(q.dtype)
    lo = (t - hi.float()).to(q.dtype)  # no detach: d(hi + lo)/d lse stays 1 / scale
    return torch.cat([F.pad(q, (0, width - q.shape[-1])), hi[..., None], lo[..., None],
                      q.new_zeros(*q.shape[:-1], extra - 2)], -1)


def sink_keys(k: torch.Tensor, v: torch.Tensor, width: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k: (N, H, D), v: (N, H, Dv) → (N+1, H, W+extra) each: the sink first (key 1 in the two score columns of
    `fold_query`, value 1 in column W, the indicator of the group's share), then the rows zero-padded."""
    n, h = k.shape[:2]
    sink_k = k.new_zeros(1, h, width + extra)
    sink_k[..., width:width + 2] = 1
    sink_v = v.new_zeros(1, h, width + extra)
    sink_v[..., width] = 1
    return (torch.cat([sink_k, F.pad(k, (0, width + extra - k.shape[-1]))]),
            torch.cat([sink_v, F.pad(v, (0, width + extra - v.shape[-1]))]))


def unfold_sink(out: torch.Tensor, own: torch.Tensor, width: int) -> torch.Tensor:
    """The SDPA's output over [sink ; keys] out (..., W+extra) and the folded group's own output own (..., Dv)
    (its softmax-weighted values) → (..., Dv) the attention over all keys: the value part + the sink's share
    (column W) · own. In own's dtype."""
    dv = own.shape[-1]
    share = out[..., width:width + 1].to(own.dtype, copy=True)  # a copy: the product keeps it, not all of out
    return out[..., :dv].to(own.dtype) + share * own


# -- block attention --

def block_attend(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                 v_ctx: torch.Tensor, ctx_len: torch.Tensor) -> torch.Tensor:
    """Blocks of one sequence over its context and themselves, explicitly (scores and softmax in float32).

    The reference formula: its softmax keeps (A, Hq, B, N + B) float32 probabilities for the backward, so
    `packed_block_attention` folds the block into a fused SDPA instead (`sink_block_attend`).

    Args:
        q: (A, B, Hq, D) the blocks' queries, rotated.
        k_blk, v_blk: (A, B, Hkv, D) the blocks' own keys (rotated) and values.
        k_ctx, v_ctx: (N, Hkv, D) the sequence's context keys (rotated at their positions) and values.
        ctx_len: (A,) long, block a sees context rows [0, ctx_len[a]).
    Returns (A, B, Hq, D).
    """
    a, b, hq, d = q.shape
    hkv, n = k_blk.shape[2], k_ctx.shape[0]
    scale = d ** -0.5
    qg = q.reshape(a, b, hkv, hq // hkv, d).float()  # GQA: query heads in groups of their kv head
    s_ctx = torch.einsum("abkgd,nkd->akgbn", qg, k_ctx.float()) * scale  # (A, Hkv, G, B, N)
    hidden = torch.arange(n, device=q.device)[None, :] >= ctx_len[:, None]  # (A, N) after the anchor
    s_ctx = s_ctx.masked_fill(hidden[:, None, None, None, :], float("-inf"))
    s_blk = torch.einsum("abkgd,ackd->akgbc", qg, k_blk.float()) * scale  # (A, Hkv, G, B, B): no causal mask
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)  # a block always sees itself: no empty row
    out = (torch.einsum("akgbn,nkd->abkgd", p[..., :n], v_ctx.float())
           + torch.einsum("akgbc,ackd->abkgd", p[..., n:], v_blk.float()))
    return out.reshape(a, b, hq, d).to(q.dtype)


def sink_block_attend(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ext: torch.Tensor,
                      v_ext: torch.Tensor, ctx_len: torch.Tensor) -> torch.Tensor:
    """`block_attend`'s attention, the context through one fused SDPA (the blocks folded in as its sink).

    Args:
        q: (A, B, Hq, D) the blocks' queries, rotated.
        k_blk, v_blk: (A, B, Hkv, D) the blocks' own keys (rotated) and values.
        k_ext, v_ext: (N+1, Hkv, D+e) `sink_keys` of the sequence's context (the sink first).
        ctx_len: (A,) long, block a sees context rows [0, ctx_len[a]).
    Returns (A, B, Hq, D).
    """
    a, b, hq, d = q.shape
    hkv, n1, we = k_ext.shape[1], k_ext.shape[0], k_ext.shape[-1]
    scale = d ** -0.5
    # the block's own group, explicit (A·B·B scores per head: no context in it)
    qg = q.reshape(a, b, hkv, hq // hkv, d).float()
    s_blk = torch.einsum("abkgd,ackd->akgbc", qg, k_blk.float()) * scale  # (A, Hkv, G, B, B)
    own = torch.einsum("akgbc,ackd->akgbd", torch.softmax(s_blk, -1), v_blk.float())  # (A, Hkv, G, B, D)
    lse = torch.logsumexp(s_blk, -1).reshape(a, hq, b)  # (A, Hq, B)
    q_ext = fold_query(q.transpose(1, 2), lse, scale, d, we - d)  # (A, Hq, B, D+e)
    # the anchors as the batch over one copy of the context: key t (t = 0 the sink, t = r + 1 context row r)
    seen = torch.arange(n1, device=q.device)[None, :] <= ctx_len[:, None]  # (A, N+1)
    out = F.scaled_dot_product_attention(
        q_ext, k_ext.transpose(0, 1)[None].expand(a, -1, -1, -1), v_ext.transpose(0, 1)[None].expand(a, -1, -1, -1),
        attn_mask=seen[:, None, None, :], scale=scale, enable_gqa=hkv != hq,
    )  # (A, Hq, B, D+e)
    res = unfold_sink(out, own.reshape(a, hq, b, d), d)  # (A, Hq, B, D) float32
    return res.transpose(1, 2).to(q.dtype)


def packed_block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                           v_ctx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The blocks of a packed batch over their sequences' contexts and themselves (`sink_block_attend` per
    sequence, its anchors in chunks of at most `SCORE_BUDGET` mask entries).

    Args:
        q, k_blk, v_blk: (A, B, H·, D) every block's queries, keys and values (anchors grouped by sequence).
        k_ctx, v_ctx: (N, Hkv, D) every sequence's context rows, packed.
        layout: the groups and each anchor's visible context length.
    Returns (A, B, Hq, D).
    """
    a, d = q.shape[0], q.shape[-1]
    extra = sink_columns(q)
    parts: list[torch.Tensor] = []
    for a0, a1, c0, c1 in layout.groups:
        # the sequence's context with its sink, once: each chunk reads it as a view
        k_ext, v_ext = sink_keys(k_ctx[c0:c1], v_ctx[c0:c1], d, extra)  # (n+1, Hkv, D+e)
        chunk = max(1, SCORE_BUDGET // (c1 - c0 + 1))
        for s in range(a0, a1, chunk):
            e = min(s + chunk, a1)
            parts.append(sink_block_attend(q[s:e], k_blk[s:e], v_blk[s:e], k_ext, v_ext, layout.ctx_len[s:e]))
    _check_cover(parts, a)
    return torch.cat(parts) if parts else q.new_zeros(q.shape)


def explicit_block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                             v_ctx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """`packed_block_attention` by the explicit formula (`block_attend`, anchors in chunks of `SCORE_BUDGET`
    scores): the reference that tests and benchmarks compare against; its memory is anchors × Hq × B × context."""
    a, b, hq, _ = q.shape
    parts: list[torch.Tensor] = []
    for a0, a1, c0, c1 in layout.groups:
        chunk = max(1, SCORE_BUDGET // (hq * b * (max(c1 - c0, 1) + b)))
        for s in range(a0, a1, chunk):
            e = min(s + chunk, a1)
            parts.append(block_attend(q[s:e], k_blk[s:e], v_blk[s:e], k_ctx[c0:c1], v_ctx[c0:c1],
                                      layout.ctx_len[s:e]))
    _check_cover(parts, a)
    return torch.cat(parts) if parts else q.new_zeros(q.shape)


def _check_cover(parts: list[torch.Tensor], a: int) -> None:
    """ValueError unless the groups' chunks cover all `a` blocks."""
    if sum(p.shape[0] for p in parts) != a:
        raise ValueError(f"the layout's groups cover {sum(p.shape[0] for p in parts)} of {a} blocks")
