"""Is EAGLE-2's node choice what limits a head's draft tree? Its rerank against other rules and the candidates' ceiling.

A dynamic tree drafts more candidates than it verifies (3×4: 36 candidates for 7 nodes of a 3×4×8 tree) and keeps
the `tokens - 1` best by cumulative draft log-probability (EAGLE-2's rerank). This measures how much τ another
choice among the same candidates could give, so that "trees gain too little" can be told apart into "the rule picks
badly" and "the head's candidates hold too little":

1. record (untimed, greedy): the head drafts `steps × topk` trees on held-out prompts with every drafted node
   verified (tokens = drafted + 1, at most 64), and each step's candidates (their parents, cumulative log q, depth
   and rank among siblings) and accepted path are kept. Under greedy verification the accepted path is the target's
   own continuation, so any subset of a step's candidates closed under parents accepts exactly the path's nodes
   it holds, in order: every rule below is evaluated on the same steps without re-running the target.
2. rules, for `keep` ∈ `--keep` nodes (= tokens - 1):
   - `eagle2`: the `keep` best by cumulative log q (what TreeSpec(steps, topk, keep + 1) verifies);
   - `calibrated`: by the product along the path of each node's measured acceptance given its parent's, per
     (depth, q decile) — cross-fitted: the tables of odd requests score the even ones and vice versa;
   - `depth_rank`: the same per (depth, rank among siblings);
   - `pool`: every candidate, the ceiling of any rule choosing among them.
   τ_rule = 1 + the mean over steps of the path's nodes in the kept set (the steps are the big tree's, so this
   estimates the smaller tree's τ rather than replaying it: `--check` also runs the real `eagle2` tree at the largest
   keep ≤ 7 for comparison).

Usage: python -m bench.tree_rules [--head runs/demo/train/heads/step-1000] [--steps 3] [--topk 4] [--keep 3,7,15]
       [--limit 16] [--max-new-tokens 96] [--no-check]
The last line printed is one JSON object.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from bench.common import head_proposer, head_run_args, ints, load_head_run, parse_head_run, report
from mtp_train.cli.common import configure_from_env
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import answer
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.metrics import SpecMetrics
from mtp_train.speculative.tree import ROOT, DraftTree, node_depths
from mtp_train.speculative.tree_draft import MAX_TREE_TOKENS, TreeSpec, rerank


@dataclass(frozen=True)
class Step:
    """One verified step of the big tree: its candidates and what the target accepted of them."""

    request: int
    parents: list[int]  # (N,) ROOT for a child of the root
    scores: list[float]  # (N,) cumulative draft log-probability
    path: list[int]  # the accepted nodes, root to leaf

    # Derived once per step (the rules read them node by node): cached_property writes the instance's __dict__,
    # which a frozen dataclass leaves open.
    @cached_property
    def depths(self) -> list[int]:
        return node_depths(self.parents)

    @cached_property
    def logq(self) -> list[float]:
        """(N,) each node's own log q (its score less its parent's)."""
        return [s - (self.scores[p] if p != ROOT else 0.0) for s, p in zip(self.scores, self.parents)]

    @cached_property
    def ranks(self) -> list[int]:
        """(N,) each node's rank among its siblings by score, 0 = the parent's most likely child."""
        kids: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(self.parents):
            kids[p].append(i)
        out = [0] * len(self.parents)
        for sib in kids.values():
            for r, i in enumerate(sorted(sib, key=lambda j: (-self.scores[j], j))):
                out[i] = r
        return out


class _Recorder(SpecMetrics):
    """SpecMetrics that also keeps every step's tree (with its scores) and accepted path."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.steps: list[Step] = []

    def record(self, tree: DraftTree, path: Sequence[int], request: int | None = None) -> None:
        super().record(tree, path, request)
        if tree.scores is None:
            raise ValueError("bench/tree_rules.py needs a head's dynamic tree (its nodes' scores)")
        self.steps.append(Step(-1 if request is None else request, list(tree.parents), list(tree.scores),
                               list(path)))


def pool_spec(steps: int, topk: int) -> TreeSpec:
    """The dynamic tree steps × topk that verifies every node it drafts (up to the 64-row limit)."""
    drafted = TreeSpec(steps, topk, 2).max_drafted
    return TreeSpec(steps, topk, min(drafted + 1, MAX_TREE_TOKENS))


@torch.inference_mode()
def record(model, tokenizer, head, convs: Sequence, spec: TreeSpec, max_new_tokens: int, *,
           stops: list[int] | None = None, batch_size: int = 8) -> tuple[list[Step], float]:
    """Greedy speculative decoding of `convs` with `head` drafting `spec` → every step, and τ of the run."""
    engine = SpecEngine(model, head_proposer(head, tree=spec), spec.steps, max_batch_size=batch_size,
                        kv_cache_gb=0.25)
    metrics = _Recorder(spec.steps)
    engine.scheduler.stats.metrics = metrics  # type: ignore[attr-defined]
    answer(engine, tokenizer, convs, SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stops))
    return metrics.steps, metrics.mean_acceptance_length


def accepted(step: Step, kept: set[int]) -> int:
    """The accepted path's nodes a parent-closed subset holds (greedy: the path's prefix inside it)."""
    n = 0
    while n < len(step.path) and step.path[n] in kept:
        n += 1
    return n


def tau(steps: Sequence[Step], scorer: Callable[[Step], Sequence[float]], keep: int) -> float:
    """1 + mean accepted nodes per step when each step keeps its `keep` best candidates by `scorer` (with their
    ancestors: EAGLE-2's rerank)."""
    if not steps:
        return float("nan")
    total = sum(accepted(s, set(rerank(s.parents, list(scorer(s)), keep))) for s in steps)
    return 1.0 + total / len(steps)


Key = Callable[[Step, int], Hashable]


def by_depth_decile(step: Step, i: int) -> Hashable:
    return step.depths[i], min(int(math.exp(step.logq[i]) * 10), 9)


def by_depth_rank(step: Step, i: int) -> Hashable:
    return step.depths[i], min(step.ranks[i], 7)


def fit(steps: Sequence[Step], key: Key) -> dict[Hashable, float]:
    """P(node accepted | its parent accepted) per key, with half a success of smoothing."""
    hit: dict[Hashable, float] = defaultdict(float)
    seen: dict[Hashable, float] = defaultdict(float)
    for s in steps:
        on = set(s.path)
        for i, p in enumerate(s.parents):
            if p == ROOT or p in on:
                k = key(s, i)
                seen[k] += 1
                hit[k] += i in on
    return {k: (hit[k] + 0.5) / (seen[k] + 1.0) for k in seen}


def calibrated(table: dict[Hashable, float], key: Key) -> Callable[[Step], list[float]]:
    """Scorer: the log of the product along each node's path of its table value (q itself where unseen)."""
    def score(s: Step) -> list[float]:
        lq = s.logq
        out: list[float] = []
        for i, p in enumerate(s.parents):
            v = math.log(max(table.get(key(s, i), math.exp(lq[i])), 1e-12))
            out.append(v + (out[p] if p != ROOT else 0.0))
        return out
    return score


def cross_fitted(steps: Sequence[Step], key: Key, keep: int) -> float:
    """τ of the `key` calibration, each half of the requests scored by the other half's table."""
    reqs = sorted({s.request for s in steps})
    half = {r: n % 2 for n, r in enumerate(reqs)}
    parts = [[s for s in steps if half[s.request] == h] for h in (0, 1)]
    if not all(parts):
        return tau(steps, calibrated(fit(steps, key), key), keep)
    total = 0.0
    for h in (0, 1):
        total += (tau(parts[h], calibrated(fit(parts[1 - h], key), key), keep) - 1.0) * len(parts[h])
    return 1.0 + total / len(steps)


def rules(steps: Sequence[Step], keeps: Sequence[int]) -> dict[str, Any]:
    """{keep: {rule: τ}} for the rules of the module docstring, the pool's ceiling and `acceptance`: per depth,
    P(node accepted | parent accepted) by sibling rank (0 = the parent's most likely child)."""
    table = fit(steps, by_depth_rank)
    out: dict[str, Any] = {"steps": len(steps), "pool": round(tau(steps, lambda s: s.scores, 10 ** 6), 4),
                           "acceptance": {str(d): [round(table[(d, r)], 4) for r in range(8) if (d, r) in table]
                                          for d in sorted({d for d, _ in table})}}
    for keep in keeps:
        out[str(keep)] = {"eagle2": round(tau(steps, lambda s: s.scores, keep), 4),
                          "calibrated": round(cross_fitted(steps, by_depth_decile, keep), 4),
                          "depth_rank": round(cross_fitted(steps, by_depth_rank, keep), 4)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = head_run_args(__doc__)
    ap.add_argument("--steps", type=int, default=3, help="the candidate tree's levels")
    ap.add_argument("--topk", type=int, default=4, help="the candidate tree's children per node")
    ap.add_argument("--keep", default="3,7,15", help="verified nodes (tokens - 1) each rule keeps")
    ap.add_argument("--no-check", action="store_true", help="skip the real eagle2 tree at the largest keep <= 7")
    args = parse_head_run(ap, argv)
    configure_from_env()
    model, tokenizer, head, sets, stops = load_head_run(args)
    convs = [c for ps in sets for c in ps.convs]
    spec = pool_spec(args.steps, args.topk)
    steps, pool_tau = record(model, tokenizer, head, convs, spec, args.max_new_tokens, stops=stops,
                             batch_size=args.batch_size)
    keeps = [k for k in ints(args.keep) if 1 <= k <= spec.tokens - 1]
    result: dict[str, Any] = {"head": args.head, "prompts": args.prompts, "limit": args.limit, "pool_tree": spec.name,
                              "pool_tau_measured": round(pool_tau, 4), **rules(steps, keeps)}
    small = [k for k in keeps if k <= 7 and k >= args.steps]
    if not args.no_check and small:
        real = TreeSpec(args.steps, args.topk, max(small) + 1)
        result["check"] = {"tree": real.name, "tau_measured": round(record(
            model, tokenizer, head, convs, real, args.max_new_tokens, stops=stops, batch_size=args.batch_size)[1], 4),
            "tau_offline": result[str(max(small))]["eagle2"]}
    for keep in keeps:
        print(f"keep {keep}: " + "  ".join(f"{k} {v:.3f}" for k, v in result[str(keep)].items()), flush=True)
    report(result)
    return result


if __name__ == "__main__":
    main()
