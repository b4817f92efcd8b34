"""Speculative decoding metrics as vLLM defines them.

acceptance rate = accepted draft tokens / drafted tokens;
mean acceptance length τ = 1 + accepted draft tokens / drafting steps (tokens emitted per target step);
per-position acceptance j (0-based) = share of drafting steps that accepted at least j+1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Counters over many verification steps with a fixed number k of draft tokens."""

    k: int
    num_drafts: int = 0  # drafting steps (one per sequence per verification)
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # steps with >= j+1 accepted, j = 0..k-1

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def add(self, num_accepted: int) -> None:
        """Record one drafting step that accepted `num_accepted` of its k tokens."""
        if not 0 <= num_accepted <= self.k:
            raise ValueError(f"accepted {num_accepted} of {self.k} draft tokens")
        self.num_drafts += 1
        self.num_draft_tokens += self.k
        self.num_accepted += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_pos]

    def as_dict(self) -> dict:
        return {"k": self.k, "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted": self.num_accepted, "acceptance_rate": self.acceptance_rate,
                "tau": self.mean_acceptance_length, "per_position": self.per_position}
