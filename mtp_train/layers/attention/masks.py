"""What several backends build from one step's metadata: the causal (and tree) mask, and int32 offsets.

Shared here so that no backend imports another's internals: the torch backend, torch MLA and FlashInfer's tree
steps all mask with `causal_mask`, both FlashInfer backends plan with `indptr`.
"""

from __future__ import annotations

import torch


def causal_mask(q_pos: torch.Tensor, kv_len: int, window: int | None,
                tree_bits: torch.Tensor | None = None, tree_pos: torch.Tensor | None = None) -> torch.Tensor:
    """q_pos: (..., Q) absolute positions (slots) → bool (..., Q, kv_len), True = attend.

    Args:
        q_pos: (..., Q) the slots of the queries, a sequence's new tokens in order.
        kv_len: slots of keys.
        window: a sliding window (tokens, the query itself included), or None.
        tree_bits: (..., Q) of a tree step (`AttentionMetadata.set_tree`): a query sees the step's new token i of its
            sequence (slot q_pos[..., 0] + i) only when its bit i is set.
        tree_pos: (..., Q) in a tree step, the positions the new tokens stand at (their depths after the cached
            prefix, `AttentionMetadata.rope_positions`); a window counts those, not slots: a query at tree position
            p sees the cached slots > p - window and the ancestors whose tree position is > p - window.
    """
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    mask = kv_pos <= q_pos[..., None]
    at = q_pos if tree_bits is None or tree_pos is None else tree_pos  # (..., Q) where the window is counted from
    key_at = kv_pos  # (S,) or (..., S) the position each key stands at
    if tree_bits is not None:
        rel = kv_pos - q_pos[..., :1]  # (..., S) slot relative to the sequence's first new token
        new = (rel >= 0) & (rel < 64)
        # an arithmetic shift keeps bit 63 (the sign bit) readable: (x >> 63) & 1 is that bit
        seen = (tree_bits[..., None] >> rel.clamp(0, 63)[..., None, :]) & 1  # (..., Q, S)
        mask &= ~new[..., None, :] | seen.bool()
        if window is not None and tree_pos is not None:
            q = tree_pos.shape[-1]
            mine = (rel >= 0) & (rel < q)  # this step's new tokens: their tree positions
            key_at = torch.where(mine, tree_pos.gather(-1, rel.clamp(0, q - 1)), kv_pos)
    if window is not None:
        mask &= key_at[..., None, :] > at[..., None] - window
    return mask


def indptr(lengths: list[int]) -> torch.Tensor:
    """(B,) lengths → (B+1,) int32 host offsets (FlashInfer's indptr arrays)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out
