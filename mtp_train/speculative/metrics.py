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

Steps are also counted per request (`by_request`: steps and accepted tokens), so τ has a standard error over
requests (`tau_standard_error`; steps of one answer are not independent, answers are) and two drafters measured on
the same requests have a paired one for their difference (`paired_tau_difference`): with greedy decoding both
answer every request with the same tokens, so their per-request counts pair exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
    by_request: dict[int, list[int]] = field(default_factory=dict)  # request id → [steps, accepted tokens]

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def add(self, num_accepted: int, num_drafted: int | None = None, num_branch_tokens: int = 0,
            branch_accepted: bool = False, request: int | None = None) -> None:
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
        if request is not None:
            counts = self.by_request.setdefault(request, [0, 0])
            counts[0] += 1
            counts[1] += num_accepted

    def record(self, tree: DraftTree, path: Sequence[int], request: int | None = None) -> None:
        """Record one verified tree and its accepted path (nodes, root to leaf), of request `request`."""
        chain = tree.chain_length
        self.add(len(path), chain, len(tree) - chain, tree.chain_prefix(path) < len(path), request)

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
        for r, (steps, acc) in other.by_request.items():
            counts = self.by_request.setdefault(r, [0, 0])
            counts[0] += steps
            counts[1] += acc

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


def tau_standard_error(by_request: Mapping[object, Sequence[int]]) -> float | None:
    """The standard error of τ = 1 + ΣA / ΣS over requests (A accepted tokens and S steps per request), by the
    ratio estimator's linearisation: sqrt(n/(n−1) · Σ (A_i − R·S_i)²) / ΣS with R = ΣA / ΣS. None below 2 requests."""
    counts = [(int(s), int(a)) for s, a in by_request.values() if s > 0]
    n, total = len(counts), sum(s for s, _ in counts)
    if n < 2 or total == 0:
        return None
    r = sum(a for _, a in counts) / total
    return math.sqrt(n / (n - 1) * sum((a - r * s) ** 2 for s, a in counts)) / total


def paired_tau_difference(a: Mapping[object, Sequence[int]], b: Mapping[object, Sequence[int]],
                          ) -> tuple[float, float | None]:
    """τ_a − τ_b over the requests both measured, and its paired standard error (None below 2 shared requests).

    Each request's linearised contribution to τ_a minus its contribution to τ_b, summed in quadrature, so a request
    both drafters find easy adds nothing to the difference's error."""
    keys = [k for k in a if k in b and a[k][0] > 0 and b[k][0] > 0]
    if not keys:
        raise ValueError("the two runs share no request: measure them on the same prompts")
    sa, sb = sum(a[k][0] for k in keys), sum(b[k][0] for k in keys)
    ra, rb = sum(a[k][1] for k in keys) / sa, sum(b[k][1] for k in keys) / sb
    diff = ra - rb
    n = len(keys)
    if n < 2:
        return diff, None
    e = [(a[k][1] - ra * a[k][0]) / sa - (b[k][1] - rb * b[k][0]) / sb for k in keys]
    return diff, math.sqrt(n / (n - 1) * sum(x * x for x in e))


def paired_tau_ratio(a: Mapping[object, Sequence[int]], b: Mapping[object, Sequence[int]],
                     ) -> tuple[float, float | None]:
    """τ_a / τ_b over the requests both measured, and its paired standard error (delta method; None below 2)."""
    keys = [k for k in a if k in b and a[k][0] > 0 and b[k][0] > 0]
    if not keys:
        raise ValueError("the two runs share no request: measure them on the same prompts")
    sa, sb = sum(a[k][0] for k in keys), sum(b[k][0] for k in keys)
    ta, tb = 1 + sum(a[k][1] for k in keys) / sa, 1 + sum(b[k][1] for k in keys) / sb
    n = len(keys)
    if n < 2:
        return ta / tb, None
    # τ = 1 + ΣA/ΣS linearises per request to (A_i − (τ − 1)·S_i)/ΣS; the ratio's to (e_a − (τ_a/τ_b)·e_b)/τ_b
    e = [((a[k][1] - (ta - 1) * a[k][0]) / sa - ta / tb * (b[k][1] - (tb - 1) * b[k][0]) / sb) / tb for k in keys]
    return ta / tb, math.sqrt(n / (n - 1) * sum(x * x for x in e))
