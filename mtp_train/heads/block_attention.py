"""The attention of a block drafter (DFlash): blocks of query rows over their sequence's context and themselves.

Each block (one per anchor) has B query rows. A block sees the context rows of its own sequence before its anchor
(K/V computed from the target's features) and all B rows of its own block, with no causal mask inside the block;
it never sees another block or another sequence. Training packs many anchors of many sequences, drafting packs
one anchor per running sequence; both call `packed_block_attention`.

The structure is never a dense (rows × keys) mask over the packed batch: per sequence, each anchor's scores
against the context are (B, n_s) and against its own block (B, B), so the memory is anchors × B × sequence, and
anchors are processed in chunks of at most `SCORE_BUDGET` score entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORE_BUDGET = 1 << 24  # score entries (anchors × heads × B × context) computed at once


@dataclass(frozen=True)
class BlockLayout:
    """Which context each block reads.

    groups: per sequence, (its anchors' rows [a0, a1) of the blocks, its context rows [c0, c1) of the context):
    the anchors of one sequence are consecutive and read that sequence's context only.
    ctx_len: (A,) long, anchor a sees the first ctx_len[a] rows of its group's context (its anchor position).
    """

    groups: tuple[tuple[int, int, int, int], ...]
    ctx_len: torch.Tensor


def block_attend(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                 v_ctx: torch.Tensor, ctx_len: torch.Tensor) -> torch.Tensor:
    """Blocks of one sequence over its context and themselves (scores and softmax in float32).

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


def packed_block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                           v_ctx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """`block_attend` over the sequences of a packed batch, each group's anchors in chunks of `SCORE_BUDGET`.

    Args:
        q, k_blk, v_blk: (A, B, H·, D) every block's queries, keys and values (anchors grouped by sequence).
        k_ctx, v_ctx: (N, Hkv, D) every sequence's context rows, packed.
        layout: the groups and each anchor's visible context length.
    Returns (A, B, Hq, D).
    """
    a, b, hq, _ = q.shape
    parts: list[torch.Tensor] = []
    for a0, a1, c0, c1 in layout.groups:
        n = max(c1 - c0, 1)
        chunk = max(1, SCORE_BUDGET // (hq * b * (n + b)))
        for s in range(a0, a1, chunk):
            e = min(s + chunk, a1)
            parts.append(block_attend(q[s:e], k_blk[s:e], v_blk[s:e], k_ctx[c0:c1], v_ctx[c0:c1],
                                      layout.ctx_len[s:e]))
    if sum(p.shape[0] for p in parts) != a:
        raise ValueError(f"the layout's groups cover {sum(p.shape[0] for p in parts)} of {a} blocks")
    return torch.cat(parts) if parts else q.new_zeros(q.shape)
