"""Packed-batch alignment: rows of several whole sequences back to back, (T, ...) with T = Σ lengths, no padding.

A head row at position i reads h_i and the token t_{i+1}; `packed_shift` builds such shifted buffers inside each
sequence, and `packed_valid` says which rows have a row `shift` ahead in their own sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _lens_list(seq_lens: Sequence[int] | torch.Tensor) -> list[int]:
    return [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]


def resolve_seq_lens(num_rows: int, seq_lens: Sequence[int] | torch.Tensor | None = None,
                     cu_seqlens: Sequence[int] | torch.Tensor | None = None) -> list[int]:
    """Sequence lengths from either `seq_lens` (B,) or `cu_seqlens` (B+1,) offsets; they must cover `num_rows`."""
    if (seq_lens is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of seq_lens and cu_seqlens")
    if seq_lens is None:
        cu = _lens_list(cu_seqlens)
        if not cu or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[:3]}...")
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    else:
        lens = _lens_list(seq_lens)
    if sum(lens) != num_rows:
        raise ValueError(f"sequence lengths sum to {sum(lens)} but the packed batch has {num_rows} rows")
    return lens


def packed_valid(seq_lens: Sequence[int] | torch.Tensor, shift: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """(T,) bool: row i has a row i + shift in its own sequence (i.e. its index within the sequence < n - shift)."""
    lens = torch.as_tensor(_lens_list(seq_lens), dtype=torch.long, device=device)
    starts = torch.cumsum(lens, 0) - lens
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
    within = torch.arange(int(lens.sum()), device=device) - starts[seq]
    return within + shift < lens[seq]


def packed_shift(x: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor, shift: int,
                 fill: float | int = 0) -> torch.Tensor:
    """Shift a packed (T, ...) buffer `shift` rows to the left inside each sequence.

    out[i] = x[i + shift] when row i + shift belongs to the same sequence as row i, else `fill`
    (e.g. tokens t_{i+1} against hidden states h_i for shift 1). Differentiable in x.
    """
    valid = packed_valid(seq_lens, shift, x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    src = torch.where(valid, rows + shift, rows)
    out = x[src]
    mask = valid.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, out, torch.full_like(out, fill))


def step_rows(rows: torch.Tensor | None, step: int) -> torch.Tensor | None:
    """A head's `loss_rows` → (T,) bool, the rows draft step `step` (0-based) trains, or None (every row).

    rows: None; (T,) bool, the same rows at every step (a block drafter's anchors); or (T,) integer, row i trained
    at the steps j < rows[i] (fewer rows at deeper steps: P-EAGLE's COD sampling)."""
    if rows is None or rows.dtype == torch.bool:
        return rows
    return rows > step
