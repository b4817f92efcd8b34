"""The head's draft chain from every position at once, through its inference `forward` and a paged KV cache.

What speculative decoding does one position at a time (`HeadProposer`), done for every position of packed
sequences in a few forwards: the training run's validation measures the head on exactly the path that serves
it (see `mtp_train.train.evaluation`), and tests compare it with the training-time unroll.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mtp_train.engine.kv_cache import KVCache
from mtp_train.heads import DraftHead, packed_shift
from mtp_train.layers.attention import AttentionMetadata

CHAIN_KV_SLOTS = 1 << 18  # padded (chain, cached token) pairs per decode call


def _chunks(kv_lens: Sequence[int], budget: int) -> list[range]:
    """Consecutive runs of chains whose padded gather (count · longest kv) stays within `budget` slots."""
    out: list[range] = []
    start, longest = 0, 0
    for i, n in enumerate(kv_lens):
        if i > start and (i - start + 1) * max(longest, n) > budget:
            out.append(range(start, i))
            start, longest = i, 0
        longest = max(longest, n)
    if len(kv_lens) > start:
        out.append(range(start, len(kv_lens)))
    return out


@torch.no_grad()
def inference_chain(head: DraftHead, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int],
                    steps: int, kv_slots: int = CHAIN_KV_SLOTS) -> list[torch.Tensor]:
    """The head's draft features for every position and step, through its inference `forward` and paged cache.

    hidden: (T, `head.input_width`) the target's features at i (h_i, or an aux head's aux layers) of packed
    sequences; input_ids: (T,) tokens t_i; seq_lens: (B,).
    Step 0 is one engine-style prefill over the target's hidden states (tokens t_{i+1}), which also fills the
    head's KV cache, one page (page_size 1) per row. Step j > 0 continues a chain from every row i at once:
    chain i reads the prefix pages of rows 0..i of its sequence and its own pages of steps 1..j, feeds its
    previous output with token t_{i+j+1} at position i+j, and writes its new entry to a page of its own, so
    chains never see each other. Returns one (T, H) tensor per step, row i of step j estimating h_{i+j+1}
    (rows past the end of their sequence are computed with token 0 and are not meaningful).
    """
    lens = [int(n) for n in seq_lens]
    total = hidden.shape[0]
    device = hidden.device
    layers, layout = head.kv_shape
    cache = KVCache(layers, num_pages=total * steps, page_size=1, layout=layout, dtype=head.dtype, device=device)
    starts = np.cumsum([0] + lens[:-1]).tolist()
    # Page r holds row r's step-0 entry; page total·j + r holds chain r's step-j entry.
    meta = AttentionMetadata.build(lens, lens, [list(range(s, s + n)) for s, n in zip(starts, lens)], 1, device)
    x = head(hidden, packed_shift(input_ids, lens, 1), meta, cache.layers[0], from_target=True).hidden  # (T, H)
    outs = [x]
    rows = [(s, i) for s, n in zip(starts, lens) for i in range(n)]  # (sequence start, index within) per row
    for j in range(1, steps):
        tokens = packed_shift(input_ids, lens, j + 1)  # t_{i+j+1}
        kv_lens = [i + 1 + j for _, i in rows]
        nxt = torch.empty_like(x)
        for part in _chunks(kv_lens, kv_slots):
            tables = [list(range(rows[r][0], rows[r][0] + rows[r][1] + 1)) + [total * m + r for m in range(1, j + 1)]
                      for r in part]
            meta = AttentionMetadata.build([1] * len(part), [kv_lens[r] for r in part], tables, 1, device)
            sl = slice(part.start, part.stop)
            nxt[sl] = head(x[sl], tokens[sl], meta, cache.layers[0], from_target=False).hidden
        x = nxt
        outs.append(x)
    return outs
