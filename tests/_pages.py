"""Page tables for attention tests: scattered, never shared between sequences."""

from __future__ import annotations

import torch


def random_block_tables(kv_lens: list[int], page_size: int, num_pages: int,
                        gen: torch.Generator) -> list[list[int]]:
    """Random, non-contiguous page ids for each sequence (enough for its kv_len), none used twice."""
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, at = [], 0
    for n in kv_lens:
        need = -(-n // page_size)
        tables.append(perm[at: at + need])
        at += need
    assert at <= num_pages, f"{at} pages needed, the pool has {num_pages}"
    return tables
