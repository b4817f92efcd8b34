"""The connector's request bookkeeping, without vLLM: which request is which sample, what to save when it ends.

The scheduler side of the connector calls `admit` for each newly scheduled request (with the `sample_id` its
`kv_transfer_params` carry, and the `tag` they may carry), `finish` when vLLM reports it finished (its prompt ids
and the block ids of the hidden-states cache group, held until saved), and `take` when it builds the step's
metadata: the saves travel to the worker with it. The worker turns a save's blocks into cache slots (`slots`) and
writes the file. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Save:
    """One finished request to save: its sample id, the token ids it ran, its blocks in the capture cache and the
    tag its request named (None: the connector's own)."""

    req_id: str
    sample_id: str
    token_ids: list[int]
    block_ids: list[int]
    tag: str | None = None


@dataclass
class RequestBook:
    """Scheduler-side state: admitted requests (req id → sample id and tag) and the saves not yet sent to the
    worker."""

    samples: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    pending: list[Save] = field(default_factory=list)

    def admit(self, req_id: str, kv_params: dict | None) -> None:
        """A request scheduled for the first time; kv_params: its `kv_transfer_params` (`sample_id`, else the
        request id names the capture; `tag`, else the connector's: a client of a running server names its run)."""
        params = kv_params or {}
        sample_id, tag = params.get("sample_id"), params.get("tag")
        self.samples[req_id] = (str(sample_id) if sample_id is not None else req_id,
                                str(tag) if tag is not None else None)

    def finish(self, req_id: str, token_ids: Sequence[int], block_ids: Sequence[int]) -> Save | None:
        """A request finished: queue its save (None when it was never scheduled: nothing was computed, so
        nothing is saved and its blocks are not held)."""
        admitted = self.samples.pop(req_id, None)
        if admitted is None:
            return None
        save = Save(req_id, admitted[0], [int(t) for t in token_ids], [int(b) for b in block_ids], admitted[1])
        self.pending.append(save)
        return save

    def take(self) -> list[Save]:
        """The saves queued since the last call (they go to the worker with this step's metadata)."""
        out, self.pending = self.pending, []
        return out


def slots(block_ids: Sequence[int], block_size: int, num_tokens: int) -> list[int]:
    """The cache slots of a request's first `num_tokens` tokens: token t lies in block_ids[t // block_size] at
    offset t % block_size. Raises ValueError when the blocks hold fewer tokens."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_size}")
    return [block_ids[t // block_size] * block_size + t % block_size for t in range(num_tokens)]
