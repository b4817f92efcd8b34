"""Speculative decoding metrics as vLLM defines them, for draft trees of variable size.

acceptance rate = accepted draft tokens / drafted tokens;
mean acceptance length τ = 1 + accepted draft tokens / speculative steps (tokens emitted per target step);
per-position acceptance j (0-based) = share of speculative steps that accepted at least j+1 tokens.

A step's drafted tokens are all the nodes of its tree (`mtp_train.speculative.tree`): the chain's and, with
`draft_width` w > 1, the w-1 siblings of its first draft, counted apart as branch tokens; a step whose accepted path
left the chain (a sibling was the target's token) counts as a branch step. The report keeps their original column
names, `num_alt_tokens` and `num_alt_accepted`.

A step counts once per sequence per verification, also when its proposer drafted nothing (prompt lookup without
a match, or a dynamic chain stopped before its first token): such a step still costs a target forward and emits
one token, so τ stays the number of tokens per target step, the figure a speed-up is made of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mtp_train.speculative.tree import DraftTree


@dataclass
class SpecMetrics:
    """Counters over many verification steps with at most k draft tokens each."""

    k: int
    num_drafts: int = 0  # speculative steps (one per sequence per verification), with or without drafts
    num_draft_tokens: int = 0  # verified draft tokens: every node of every tree
    num_accepted: int = 0
    num_branch_tokens: int = 0  # of num_draft_tokens, the nodes off the trees' chains (siblings of a first draft)
    num_branch_accepted: int = 0  # steps whose accepted path left the chain
    num_empty: int = 0  # steps whose proposer drafted no token (verified the last token alone)
    accepted_per_pos: list[int] = field(default_factory=list)  # steps with >= j+1 accepted, j = 0..k-1

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def add(self, num_accepted: int, num_drafted: int | None = None, num_branch_tokens: int = 0,
            branch_accepted: bool = False) -> None:
        """Record one step whose tree had a chain of `num_drafted` (default k) tokens and `num_branch_tokens` nodes
        off it, and accepted `num_accepted` tokens (along a branch when `branch_accepted`)."""
        drafted = self.k if num_drafted is None else num_drafted
        if not 0 <= drafted <= self.k:
            raise ValueError(f"drafted {drafted} tokens with at most k={self.k}")
        if not 0 <= num_accepted <= (self.k if branch_accepted else drafted):
            raise ValueError(f"accepted {num_accepted} of {drafted} draft tokens")
        if num_branch_tokens < 0 or (branch_accepted and (num_branch_tokens == 0 or num_accepted == 0)):
            raise ValueError(f"an accepted branch is at least one token of the {num_branch_tokens} off the chain, "
                             f"got {num_accepted} accepted")
        self.num_drafts += 1
        self.num_draft_tokens += drafted + num_branch_tokens
        self.num_branch_tokens += num_branch_tokens
        self.num_branch_accepted += branch_accepted
        self.num_accepted += num_accepted
        self.num_empty += drafted == 0
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def record(self, tree: DraftTree, path: Sequence[int]) -> None:
        """Record one verified tree and its accepted path (nodes, root to leaf)."""
        chain = tree.chain_length
        self.add(len(path), chain, len(tree) - chain, tree.chain_prefix(path) < len(path))

    def merge(self, other: SpecMetrics) -> None:
        """Add another run's counters (same k) to these."""
        if other.k != self.k:
            raise ValueError(f"cannot merge metrics of k={other.k} into k={self.k}")
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        self.num_empty += other.num_empty
        self.num_branch_tokens += other.num_branch_tokens
        self.num_branch_accepted += other.num_branch_accepted
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]

    @property
    def num_alt_accepted(self) -> int:
        """`num_branch_accepted` under the report's column name."""
        return self.num_branch_accepted

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
                "num_branch_tokens": self.num_branch_tokens, "num_branch_accepted": self.num_branch_accepted,
                "num_alt_tokens": self.num_branch_tokens, "num_alt_accepted": self.num_branch_accepted,
                "acceptance_rate": self.acceptance_rate, "tau": self.mean_acceptance_length,
                "mean_draft_len": self.mean_draft_length, "per_position": self.per_position}
