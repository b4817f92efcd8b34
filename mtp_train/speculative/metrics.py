"""Speculative decoding metrics as vLLM defines them, for chains of variable length.

acceptance rate = accepted draft tokens / drafted tokens;
mean acceptance length τ = 1 + accepted draft tokens / speculative steps (tokens emitted per target step);
per-position acceptance j (0-based) = share of speculative steps that accepted at least j+1 tokens.

With first-draft alternatives (a tree step: `HeadProposer(draft_width=w)`), the verified draft tokens are the chain's
and the alternatives'; a step whose accepted first token was an alternative accepted one token.

A step counts once per sequence per verification, also when its proposer drafted nothing (prompt lookup without
a match, or a dynamic chain stopped before its first token): such a step still costs a target forward and emits
one token, so τ stays the number of tokens per target step, the figure a speed-up is made of.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Counters over many verification steps with at most k draft tokens each."""

    k: int
    num_drafts: int = 0  # speculative steps (one per sequence per verification), with or without drafts
    num_draft_tokens: int = 0  # verified draft tokens: the chains' and the first-draft alternatives'
    num_accepted: int = 0
    num_alt_tokens: int = 0  # of num_draft_tokens, the first-draft alternatives
    num_alt_accepted: int = 0  # steps that accepted an alternative (one token each)
    num_empty: int = 0  # steps whose proposer drafted no token (verified the last token alone)
    accepted_per_pos: list[int] = field(default_factory=list)  # steps with >= j+1 accepted, j = 0..k-1

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def add(self, num_accepted: int, num_drafted: int | None = None, num_alternatives: int = 0,
            alternative_accepted: bool = False) -> None:
        """Record one step that drafted a chain of `num_drafted` (default k) tokens, plus `num_alternatives` other
        first tokens, and accepted `num_accepted` tokens (1 when `alternative_accepted`)."""
        drafted = self.k if num_drafted is None else num_drafted
        if not 0 <= drafted <= self.k:
            raise ValueError(f"drafted {drafted} tokens with at most k={self.k}")
        if not 0 <= num_accepted <= drafted:
            raise ValueError(f"accepted {num_accepted} of {drafted} draft tokens")
        if num_alternatives < 0 or (alternative_accepted and (num_alternatives == 0 or num_accepted != 1)):
            raise ValueError(f"an accepted alternative is one token of {num_alternatives} alternatives, "
                             f"got {num_accepted} accepted")
        self.num_drafts += 1
        self.num_draft_tokens += drafted + num_alternatives
        self.num_alt_tokens += num_alternatives
        self.num_alt_accepted += alternative_accepted
        self.num_accepted += num_accepted
        self.num_empty += drafted == 0
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def merge(self, other: SpecMetrics) -> None:
        """Add another run's counters (same k) to these."""
        if other.k != self.k:
            raise ValueError(f"cannot merge metrics of k={other.k} into k={self.k}")
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        self.num_empty += other.num_empty
        self.num_alt_tokens += other.num_alt_tokens
        self.num_alt_accepted += other.num_alt_accepted
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_draft_length(self) -> float:
        """Draft tokens verified per step (k for a fixed chain; less with a threshold or prompt lookup)."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_pos]

    def as_dict(self) -> dict:
        return {"k": self.k, "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted": self.num_accepted, "num_empty": self.num_empty,
                "num_alt_tokens": self.num_alt_tokens, "num_alt_accepted": self.num_alt_accepted,
                "acceptance_rate": self.acceptance_rate, "tau": self.mean_acceptance_length,
                "mean_draft_len": self.mean_draft_length, "per_position": self.per_position}
