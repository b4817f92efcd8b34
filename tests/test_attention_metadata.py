"""A step's attention metadata: every tensor `AttentionMetadata.build` makes, against a reference spelled out token by
token."""

from __future__ import annotations

import random

import pytest
import torch

from mtp_train.layers.attention import AttentionMetadata
from mtp_train.layers.attention.metadata import ForwardMode


def _reference(qo: list[int], kv: list[int], tables: list[list[int]], ps: int) -> dict[str, list]:
    """The layout the kernels read, one token and one sequence at a time."""
    ref: dict[str, list] = {"qo_indptr": [0], "positions": [], "slot_pages": [], "slot_offsets": [],
                            "kv_indptr": [0], "kv_indices": [], "kv_last_page_len": []}
    width = max(-(-n // ps) for n in kv)
    ref["block_tables"] = []
    for q, n, pages in zip(qo, kv, tables):
        used = pages[:-(-n // ps)]
        ref["block_tables"].append(used + [0] * (width - len(used)))
        ref["qo_indptr"].append(ref["qo_indptr"][-1] + q)
        for i in range(q):
            pos = n - q + i
            ref["positions"].append(pos)
            ref["slot_pages"].append(used[pos // ps])
            ref["slot_offsets"].append(pos % ps)
        ref["kv_indptr"].append(ref["kv_indptr"][-1] + len(used))
        ref["kv_indices"] += used
        ref["kv_last_page_len"].append((n - 1) % ps + 1)
    return ref


@pytest.mark.parametrize("seed", range(6))
def test_build_lays_out_every_token_and_page(seed):
    rng = random.Random(seed)
    for _ in range(40):
        b, ps = rng.randint(1, 5), rng.choice([1, 3, 16])
        qo = [rng.randint(1, 6) for _ in range(b)]
        kv = [q + rng.randint(0, 40) for q in qo]
        tables = [rng.sample(range(300), -(-n // ps) + rng.randint(0, 2)) for n in kv]  # spare pages beyond
        meta = AttentionMetadata.build(qo, kv, tables, ps)
        want = _reference(qo, kv, tables, ps)
        dtypes = {"positions": torch.int64, "slot_pages": torch.int64, "slot_offsets": torch.int64}
        for name, values in want.items():
            got = getattr(meta, name)
            assert got.dtype == dtypes.get(name, torch.int32), name
            assert got.tolist() == values, name
        mode = (ForwardMode.PREFILL if kv == qo else ForwardMode.DECODE if all(q == 1 for q in qo)
                else ForwardMode.VERIFY)
        assert meta.mode is mode
        assert (meta.qo_lens, meta.kv_lens, meta.page_size) == (qo, kv, ps)


def test_a_prefill_without_pages_has_positions_only():
    meta = AttentionMetadata.build([3, 2])
    assert meta.mode is ForwardMode.PREFILL and meta.positions.tolist() == [0, 1, 2, 0, 1]
    assert meta.qo_indptr.tolist() == [0, 3, 5] and meta.block_tables is None and meta.slot_pages is None
