"""The `peagle` head type's drafter: P-EAGLE (`head.py` `PEagleHead`), EAGLE-3's layer drafting k tokens in ONE
forward, as vLLM runs it with `parallel_drafting`.

Its drafter, `ParallelProposer`, runs each step as vLLM's parallel drafting does: one head forward per sequence over
the rows its cache lacks, i.e. the positions the last verification accepted (the whole prompt after prefill), each
reading the target's aux layers there and the token after it, followed by k-1 slots (mask_hidden and the
placeholder token) at the next positions. Causal attention over the head's paged cache gives every row what
vLLM's does: the last accepted row sees the context and drafts d_1, slot d sees the context and slots 1..d and
drafts d_{d+1}. The slots' K/V land beyond the accepted length; the next step's accepted rows overwrite them
before anything reads them. `prefill` and `update` only keep the target's rows for that forward.

A chain of k drafts, cut where a draft's top-1 probability falls under `draft_threshold` (0 = all k).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch

from mtp_train.engine.kv_cache import KVCache
from mtp_train.engine.sequence import Sequence
from mtp_train.head_types.peagle.head import PEagleHead
from mtp_train.heads import packed_shift
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.speculative.proposers import Drafts, Proposer
from mtp_train.speculative.tree import DraftTree

PARALLEL_OPTIONS = ("draft_threshold",)  # the eval grid axes the parallel drafter takes
PATH_ROWS = 1 << 16  # validation: slot rows per forward of `parallel_inference_path` (bounds its gathers)


class ParallelProposer(Proposer):
    """One head forward per step gives all k drafts: the accepted rows, then k-1 slots (module docstring)."""

    name = "peagle"

    def __init__(self, head: PEagleHead, draft_threshold: float = 0.0) -> None:
        if not 0.0 <= draft_threshold < 1.0:
            raise ValueError(f"draft_threshold must lie in [0, 1), got {draft_threshold}")
        self.head = head.eval()
        self.hidden_layers = tuple(head.aux_layers)  # the engine passes the target's aux layers, concatenated
        self.draft_threshold = draft_threshold
        self.kv: KVCache | None = None
        self.forwards = 0  # head forwards so far (one per drafting step)
        # seq_id → (position of the first row, (n, k·H) the target's rows the cache lacks, positions first..L-2)
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}

    def max_nodes(self, k: int) -> int:
        return k

    def bind(self, target_kv: KVCache) -> None:
        layers, layout = self.head.kv_shape
        self.kv = KVCache(layers, target_kv.num_pages, target_kv.page_size, layout, dtype=self.head.dtype,
                          device=self.head.device)

    def _keep(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """Queue the target's rows at positions start.. for the next forward (after any still queued)."""
        prev = self._pending.get(seq.seq_id)
        if prev is not None:  # never drafted since: the rows must continue the queued ones
            first, held = prev
            if first + held.shape[0] != start:
                raise RuntimeError(f"sequence {seq.seq_id}: rows from position {start} do not follow the queued "
                                   f"ones ({first}..{first + held.shape[0] - 1})")
            start, rows = first, torch.cat([held, rows])
        self._pending[seq.seq_id] = (start, rows)

    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        lens = [s.num_prompt_tokens for s in seqs]
        for s, rows in zip(seqs, target_hidden.split(lens)):
            self._keep(s, 0, rows)

    def update(self, seqs: Seq[Sequence], old_lens: Seq[int], trees: Seq[DraftTree], paths: Seq[Seq[int]],
               target_hidden: Seq[torch.Tensor]) -> None:
        for s, n, rows in zip(seqs, old_lens, target_hidden):  # the accepted positions L-1..L-1+n
            self._keep(s, n - 1, rows)

    @torch.inference_mode()
    def draft_forward(self, seqs: Seq[Sequence], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's one head forward → (features (S, k, H), logits (S, k, Vd)): per sequence of length L, row
        j = 0 is position L-2 (the last accepted row, reading t_{L-1}: it drafts d_1) and row j >= 1 slot j at
        position L-2+j (it drafts d_{j+1})."""
        assert self.kv is not None, "bind() the proposer to the target's KV cache first"
        head, dev = self.head, self.head.device
        hidden, tokens, qo, kv = [], [], [], []
        slot_h, slot_t = head.slot_inputs(k - 1, dev)
        for s in seqs:
            start, rows = self._pending.pop(s.seq_id)
            n = len(s)
            if start + rows.shape[0] != n - 1:
                raise RuntimeError(f"sequence {s.seq_id} of length {n}: the head's rows run to position "
                                   f"{start + rows.shape[0] - 1}, not {n - 2}")
            hidden += [rows.to(dev, head.dtype), slot_h]
            tokens += [torch.tensor(s.token_ids[start + 1:n], dtype=torch.long, device=dev), slot_t]
            qo.append(rows.shape[0] + k - 1)
            kv.append(n - 1 + k - 1)  # the context 0..L-2 and the slots at L-1..L+k-3
        meta = AttentionMetadata.build(qo, kv, [s.pages for s in seqs], self.kv.page_size, dev)
        ends = torch.tensor(qo, device=dev).cumsum(0)
        idx = (ends[:, None] - k + torch.arange(k, device=dev)).reshape(-1)  # (S·k,) each sequence's last k rows
        out = head(torch.cat(hidden), torch.cat(tokens), meta, self.kv.layers[0], from_target=True,
                   logits_indices=idx)
        assert out.logits is not None
        self.forwards += 1
        return out.hidden[idx].view(len(seqs), k, -1), out.logits.view(len(seqs), k, -1)

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        _, logits = self.draft_forward(seqs, k)
        drafts = Drafts(seqs, self.head.draft_vocab, self.head.args.vocab_size)
        rows = list(range(len(seqs)))  # sequences whose chain goes on
        for j in range(k):
            step = logits[rows, j]
            if self.draft_threshold > 0.0:
                keep = (torch.softmax(step.float(), -1).amax(-1) >= self.draft_threshold).tolist()
                rows = [r for r, ok in zip(rows, keep) if ok]
                step = step[[i for i, ok in enumerate(keep) if ok]]
            if not rows:
                break
            drafts.add(step, rows)
        return drafts.trees()

    def release(self, seq: Sequence) -> None:
        self._pending.pop(seq.seq_id, None)


def parallel_drafter(head: PEagleHead, options: Mapping[str, Any]) -> ParallelProposer:
    """The peagle type's `HeadType.drafter`: a fresh `ParallelProposer` for one eval grid point."""
    unknown = sorted(set(options) - set(PARALLEL_OPTIONS))
    if unknown:
        raise ValueError(f"the peagle head's parallel drafter takes {', '.join(PARALLEL_OPTIONS)}; not "
                         f"{', '.join(unknown)}")
    return ParallelProposer(head, **dict(options))


@torch.no_grad()
def parallel_inference_path(head: PEagleHead, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Seq[int],
                            steps: int) -> list[torch.Tensor]:
    """The drafts from every position through the head's inference `forward` and a paged cache, as the drafter
    computes them: one prefill over the target's rows (step 0, which fills the cache, one page of size 1 per row),
    then for every anchor i its slots 1..steps-1 at positions i+1.. in one forward over the pages of rows 0..i of
    its sequence and pages of its own. Returns one (T, H) tensor per step, row i of step j estimating h_{i+j+1}."""
    lens = [int(n) for n in seq_lens]
    total, dev = hidden.shape[0], hidden.device
    slots = steps - 1
    layers, layout = head.kv_shape
    cache = KVCache(layers, num_pages=total * steps, page_size=1, layout=layout, dtype=head.dtype, device=dev)
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()
    meta = AttentionMetadata.build(lens, lens, [list(range(s, s + n)) for s, n in zip(starts, lens)], 1, dev)
    x = head(hidden, packed_shift(input_ids, lens, 1), meta, cache.layers[0], from_target=True).hidden  # (T, H)
    outs = [x] + [torch.empty_like(x) for _ in range(slots)]
    if not slots:
        return outs
    rows = [(s, i) for s, n in zip(starts, lens) for i in range(n)]  # (sequence start, index within) per anchor
    per = max(1, PATH_ROWS // slots)
    for lo in range(0, total, per):
        part = range(lo, min(lo + per, total))
        # anchor r's slot d (page total + r·slots + d - 1) at position i + d, over rows 0..i and its slots
        tables = [list(range(rows[r][0], rows[r][0] + rows[r][1] + 1))
                  + [total + r * slots + d for d in range(slots)] for r in part]
        m = AttentionMetadata.build([slots] * len(part), [rows[r][1] + 1 + slots for r in part], tables, 1, dev)
        h, t = head.slot_inputs(slots * len(part), dev)
        out = head(h, t, m, cache.layers[0], from_target=True).hidden.view(len(part), slots, -1)
        for d in range(slots):
            outs[d + 1][lo:part.stop] = out[:, d]
    return outs
