"""The attention of a block drafter (DFlash): blocks of query rows over their sequence's context and themselves.

Each block (one per anchor) has B query rows. A block sees the context rows of its own sequence before its anchor
(K/V computed from the target's features) and all B rows of its own block, with no causal mask inside the block;
it never sees another block or another sequence. Training packs many anchors of many sequences, drafting packs
one anchor per running sequence; both call `packed_block_attention`.

Nothing of anchors × context (scores, masks or gradients) exists, forward or backward. Per sequence, the context
K/V are laid out once with a *sink* row (`context_keys`), and its anchors are cut into chunks of consecutive
anchors (`anchor_chunks`). A chunk whose anchors sit at a_1 <= ... <= a_C splits each row's keys in two:

* the common prefix [0, a_1), which every row of the chunk sees: one fused SDPA, no mask, the chunk's C·B rows
  as the query rows of one batch element over the prefix (a view of the sequence's K/V, so its backward writes
  one context's dK/dV, whatever C is);
* the explicit group: the ragged context [a_1, a_i) of anchor i's rows and their own block's B keys, scored in
  float32 (C · B · Hq · (a_C - a_1 + B) scores, at most `SCORE_BUDGET` per chunk, `_ExplicitGroup`: recomputed in
  the backward, as flash attention does, so none is kept). Its softmax joins the SDPA's as a single extra key,
  the sink, whose score is the group's logsumexp and whose value is an indicator column (`fold_query`,
  `sink_keys`, `unfold_sink`, shared with the chained training attention).

So autograd keeps q, the output and the logsumexps (anchors × B × Hq × (D + a few)) and the context once; the
backward's transient is one context's K/V gradient plus one chunk's explicit scores. Drafting (one anchor per
sequence, the whole context before it) is the SDPA and the own block. The explicit formula (`block_attend`, its
(A, H, B, N) probabilities) is the reference that tests and `bench/block_attention.py` compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

# float32 explicit scores (rows × query heads × keys: the ragged context and the own blocks) of one chunk of
# anchors: they bound the chunk's transient (its scores, and their gradients in the backward), not what is kept
SCORE_BUDGET = 1 << 22


@dataclass(frozen=True)
class BlockLayout:
    """Which context each block reads.

    groups: per sequence, (its anchors' rows [a0, a1) of the blocks, its context rows [c0, c1) of the context):
    the anchors of one sequence are consecutive and read that sequence's context only.
    ctx_len: (A,) long, anchor a sees the first ctx_len[a] rows of its group's context (its anchor position).
    """

    groups: tuple[tuple[int, int, int, int], ...]
    ctx_len: torch.Tensor

    @cached_property
    def host_ctx_len(self) -> list[int]:
        """ctx_len on the host, read once per layout (every draft layer's attention cuts its chunks by it)."""
        return self.ctx_len.tolist()


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
    `packed_block_attention` keeps a bounded share of them (`chunk_attend`).

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


class _ExplicitGroup(torch.autograd.Function):
    """A chunk's explicit group: each row over its ragged context and its own block's keys, one softmax, in
    float32, as flash attention does it: the forward keeps its inputs, the output and the logsumexp, and the
    backward recomputes the probabilities (one chunk's scores, within the budget), so that no probabilities are
    kept between the forward and the backward.

    forward(qg, k_blk, v_blk, k_rag, v_rag, hidden) → (own, lse):
        qg: (Hkv, G, C, B, D) the chunk's queries, scaled (query head k·G + g reads KV head k).
        k_blk, v_blk: (Hkv, C, B, D) the own blocks' keys and values.
        k_rag, v_rag: (Hkv, S, D) the ragged context (S rows, maybe none).
        hidden: (C, S) bool, the ragged rows an anchor does not see (at or after it).
        own: (Hkv, G, C, B, D) the softmax-weighted values; lse: (Hkv, G, C, B) the group's logsumexp.
    """

    @staticmethod
    def _probs(qg: torch.Tensor, k_blk: torch.Tensor, k_rag: torch.Tensor, hidden: torch.Tensor,
               lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scores, as probabilities when lse is given: (block (Hkv, G, C, B, B), ragged (Hkv, G, C, B, S),
        the logsumexp)."""
        hkv, g, c, b, d = qg.shape
        s_blk = qg @ k_blk[:, None].transpose(-1, -2)
        s_rag = (qg.view(hkv, g * c * b, d) @ k_rag.transpose(1, 2)).view(hkv, g, c, b, -1)
        s_rag.masked_fill_(hidden[:, None], float("-inf"))
        if lse is None:  # the own block is never hidden: lse is finite
            lse = torch.logaddexp(s_blk.logsumexp(-1), s_rag.logsumexp(-1))
        return s_blk.sub_(lse[..., None]).exp_(), s_rag.sub_(lse[..., None]).exp_(), lse

    @staticmethod
    def forward(ctx, qg: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_rag: torch.Tensor,
                v_rag: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hkv, g, c, b, d = qg.shape
        p_blk, p_rag, lse = _ExplicitGroup._probs(qg, k_blk, k_rag, hidden, None)
        own = p_blk @ v_blk[:, None] + (p_rag.view(hkv, g * c * b, -1) @ v_rag).view(hkv, g, c, b, -1)
        ctx.save_for_backward(qg, k_blk, v_blk, k_rag, v_rag, hidden, own, lse)
        return own, lse

    @staticmethod
    def backward(ctx, d_own: torch.Tensor, d_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qg, k_blk, v_blk, k_rag, v_rag, hidden, own, lse = ctx.saved_tensors
        hkv, g, c, b, d = qg.shape
        d_own = d_own.contiguous()  # the SDPA's side hands it as a permuted view
        p_blk, p_rag, _ = _ExplicitGroup._probs(qg, k_blk, k_rag, hidden, lse)
        # d/ds_j = p_j · (dO·v_j − dO·own + dlse): Σ_j p_j dO·v_j is dO·own (flash attention's delta)
        shift = (d_lse - (d_own * own).sum(-1))[..., None]
        rows_o = d_own.view(hkv, g * c * b, -1)
        ds_blk = (d_own @ v_blk[:, None].transpose(-1, -2)).add_(shift).mul_(p_blk)  # (Hkv, G, C, B, B)
        ds_rag = (rows_o @ v_rag.transpose(1, 2)).view(hkv, g, c, b, -1).add_(shift).mul_(p_rag)
        rows_s, rows_q = ds_rag.view(hkv, g * c * b, -1), qg.view(hkv, g * c * b, d)
        d_q = ds_blk @ k_blk[:, None] + (rows_s @ k_rag).view(hkv, g, c, b, d)
        d_k_blk = (ds_blk.transpose(-1, -2) @ qg).sum(1)  # GQA: the G query heads of a KV head summed
        d_v_blk = (p_blk.transpose(-1, -2) @ d_own).sum(1)
        d_k_rag = rows_s.transpose(1, 2) @ rows_q
        d_v_rag = p_rag.view(hkv, g * c * b, -1).transpose(1, 2) @ rows_o
        return d_q, d_k_blk, d_v_blk, d_k_rag, d_v_rag, None


def context_keys(k: torch.Tensor, v: torch.Tensor, width: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context with its sink, heads first: k, v (n, Hkv, D) → (Hkv, n+1, W+extra) each, contiguous
    (`sink_keys`' rows: the sink, then the rows zero-padded), so that a chunk's prefix [:, :P+1] is a view."""
    n, h = k.shape[:2]
    sink_k, sink_v = sink_keys(k[:0], v[:0], width, extra)  # (1, Hkv, W+e)
    k_ext, v_ext = k.new_zeros(h, n + 1, width + extra), v.new_zeros(h, n + 1, width + extra)
    k_ext[:, :1], v_ext[:, :1] = sink_k.transpose(0, 1), sink_v.transpose(0, 1)
    k_ext[:, 1:, :k.shape[-1]], v_ext[:, 1:, :v.shape[-1]] = k.transpose(0, 1), v.transpose(0, 1)
    return k_ext, v_ext


def anchor_chunks(ctx_len: list[int], block: int, heads: int, budget: int) -> list[tuple[int, int]]:
    """One sequence's anchors cut into chunks [s, e) of consecutive anchors whose explicit group fits `budget`.

    A chunk of C anchors scores C · block · heads · (span + block) entries explicitly, span = its longest context
    minus its shortest (the ragged part), block = its own keys. Greedy: a chunk takes the next anchor while that
    fits, and has one anchor at least. Anchors in ascending order (as a batch packs them) give the narrowest spans.
    """
    chunks: list[tuple[int, int]] = []
    s = 0
    while s < len(ctx_len):
        lo = hi = ctx_len[s]
        e = s + 1
        while e < len(ctx_len):
            lo_e, hi_e = min(lo, ctx_len[e]), max(hi, ctx_len[e])
            if (e + 1 - s) * block * heads * (hi_e - lo_e + block) > budget:
                break
            lo, hi, e = lo_e, hi_e, e + 1
        chunks.append((s, e))
        s = e
    return chunks


def chunk_attend(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                 v_ctx: torch.Tensor, k_ext: torch.Tensor, v_ext: torch.Tensor, ctx_len: torch.Tensor,
                 prefix: int, longest: int) -> torch.Tensor:
    """One chunk of a sequence's anchors: `block_attend`'s attention as a mask-free SDPA over their common prefix
    and an explicit group (the ragged context and the own blocks) folded in as its sink.

    Args:
        q: (C, B, Hq, D) the chunk's queries, rotated.
        k_blk, v_blk: (C, B, Hkv, D) their own blocks' keys (rotated) and values.
        k_ctx, v_ctx: (n, Hkv, D) the sequence's context keys (rotated at their positions) and values.
        k_ext, v_ext: (Hkv, n+1, D+e) `context_keys` of the same context.
        ctx_len: (C,) long, anchor i sees context rows [0, ctx_len[i]).
        prefix, longest: the chunk's shortest and longest ctx_len (host ints): rows [0, prefix) are every
            anchor's, rows [prefix, longest) the ragged part.
    Returns (C, B, Hq, D).
    """
    c, b, hq, d = q.shape
    hkv = k_blk.shape[2]
    g, scale = hq // hkv, d ** -0.5
    # the explicit group in float32, rows ordered (Hkv, G, C, B): query head k·G + g reads KV head k (GQA)
    qg = (q.float() * scale).view(c, b, hkv, g, d).permute(2, 3, 0, 1, 4).contiguous()  # (Hkv, G, C, B, D)
    hidden = torch.arange(prefix, longest, device=q.device) >= ctx_len[:, None]  # (C, S) at/after the anchor
    own, lse = _ExplicitGroup.apply(
        qg, k_blk.float().permute(2, 0, 1, 3), v_blk.float().permute(2, 0, 1, 3),
        k_ctx[prefix:longest].float().transpose(0, 1), v_ctx[prefix:longest].float().transpose(0, 1), hidden,
    )  # (Hkv, G, C, B, D), (Hkv, G, C, B)
    # the prefix: every row of the chunk over the sink and context rows [0, prefix), one batch element, no mask
    q_ext = fold_query(q.permute(2, 0, 1, 3).reshape(hq, c * b, d), lse.view(hq, c * b), scale, d,
                       k_ext.shape[-1] - d)  # (Hq, C·B, D+e)
    out = F.scaled_dot_product_attention(q_ext[None], k_ext[None, :, :prefix + 1], v_ext[None, :, :prefix + 1],
                                         scale=scale, enable_gqa=hkv != hq)[0]  # (Hq, C·B, D+e)
    res = unfold_sink(out, own.view(hq, c * b, d), d)  # (Hq, C·B, D) float32
    return res.view(hq, c, b, d).permute(1, 2, 0, 3).to(q.dtype)


def packed_block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                           v_ctx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The blocks of a packed batch over their sequences' contexts and themselves (`chunk_attend` per chunk of a
    sequence's anchors, `anchor_chunks` within `SCORE_BUDGET`).

    Args:
        q, k_blk, v_blk: (A, B, H·, D) every block's queries, keys and values (anchors grouped by sequence).
        k_ctx, v_ctx: (N, Hkv, D) every sequence's context rows, packed.
        layout: the groups and each anchor's visible context length.
    Returns (A, B, Hq, D).
    """
    a, b, hq, d = q.shape
    extra = sink_columns(q)
    ends = layout.host_ctx_len
    chunks: list[tuple[int, int, int]] = []  # (first anchor, end, the group's index)
    for i, (a0, a1, c0, c1) in enumerate(layout.groups):
        if a1 > a0 and not 0 <= min(ends[a0:a1]) <= max(ends[a0:a1]) <= c1 - c0:
            raise ValueError(f"anchors {a0}..{a1 - 1} see up to {max(ends[a0:a1])} context rows, but their "
                             f"sequence has {c1 - c0}")
        chunks += [(a0 + s, a0 + e, i) for s, e in anchor_chunks(ends[a0:a1], b, hq, SCORE_BUDGET)]
    spans = [(s, e) for s, e, _ in chunks]
    qs, ks, vs = (_pieces(x, spans) for x in (q, k_blk, v_blk))
    parts: list[torch.Tensor] = []
    ext: tuple[int, torch.Tensor, torch.Tensor] | None = None
    for (s, e, i), q_c, k_c, v_c in zip(chunks, qs, ks, vs):
        _, _, c0, c1 = layout.groups[i]
        if ext is None or ext[0] != i:  # the sequence's context with its sink, once: each chunk reads a prefix
            ext = (i, *context_keys(k_ctx[c0:c1], v_ctx[c0:c1], d, extra))  # (Hkv, n+1, D+e) each
        parts.append(chunk_attend(q_c, k_c, v_c, k_ctx[c0:c1], v_ctx[c0:c1], ext[1], ext[2], layout.ctx_len[s:e],
                                  min(ends[s:e]), max(ends[s:e])))
    _check_cover(parts, a)
    return torch.cat(parts) if parts else q.new_zeros(q.shape)


def _pieces(x: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """x's rows [s, e) for each span. Spans that tile x in order are one `split`, whose backward is one
    concatenation, where a slice per span gives each span's gradient a zero-filled copy of the whole of x (the
    anchors' rows are chunks × A·B·H values to fill and add in the backward)."""
    tiled = all(e0 == s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    if spans and tiled and spans[0][0] == 0 and spans[-1][1] == x.shape[0]:
        return list(x.split([e - s for s, e in spans]))
    return [x[s:e] for s, e in spans]


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
