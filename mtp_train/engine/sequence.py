"""A request being decoded: its tokens, its KV pages and how far its cache is filled."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from mtp_train.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Tokens of one request. The first `num_cached` tokens have their K/V in `pages`.

    Within an engine only its `Scheduler` changes a sequence (admission, pages, emitted tokens, the cache count);
    steps and the runner read it.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" (a stop token) or "length" (max_new_tokens)
    generator: torch.Generator | None = None

    @classmethod
    def new(cls, seq_id: int, prompt_ids: list[int], params: SamplingParams | None = None,
            device: torch.device | str = "cpu") -> Sequence:
        if not prompt_ids:
            raise ValueError(f"request {seq_id}: the prompt is empty")
        params = params or SamplingParams()
        return cls(seq_id=seq_id, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids),
                   params=params, generator=params.make_generator(device))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def max_len(self) -> int:
        """Longest this sequence can become (prompt + max_new_tokens)."""
        return self.num_prompt_tokens + self.params.max_new_tokens
