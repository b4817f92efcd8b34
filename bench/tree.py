"""What draft trees buy on this machine: a head's τ over EAGLE-2's dynamic-tree grid, beside its chains.

Part 1 (timed, ratios only): one target forward over r new rows (r = 1..16) on top of a 300-token cached prefix,
batch 1, through our runner; the rounds interleave every r, and the medians are printed as ratios to the 1-row
decode step (`rows_cost`). A tree of `tokens` verifies `tokens` rows, a chain of k verifies k + 1.
Part 2 (untimed, greedy, deterministic): τ of a head on held-out prompts through the engine's `spec_metrics`
(the training validation's path), batch 8, for every shape steps × topk × tokens of the grid (SGLang's
speculative_num_steps / speculative_eagle_topk / speculative_num_draft_tokens, the root counted) and for the plain
chains k = 1..4. A shape is run only when it can exist and every level it drafts can be verified:
tokens − 1 ≤ topk + (steps − 1)·topk² (the rerank keeps no more nodes than were drafted) and tokens − 1 ≥ steps (a
tree of fewer nodes than levels never verifies its last levels: the τ of a shallower tree at more draft cost).
So topk = 1 leaves exactly the chains steps × 1 × (steps + 1), run through the tree code; their τ equals the
plain chain's (`chain_agrees`).
Part 3 (`--timed`, interleaved through `mtp_train.eval.evaluate`): the speed-up over plain decoding with its 95%
bootstrap interval for the `--timed-top` best trees by τ at tokens ≤ `--headline-tokens` and the best chain.

The headline: `best_tree` is the tree (topk ≥ 2) of highest τ with tokens ≤ `--headline-tokens` (8), `best_chain`
the plain chain of highest τ (ties: fewer verified rows, then fewer levels); `tau_ratio` = best_tree.tau /
best_chain.tau, the goal 1.25 (τ, not time: the gain a GPU user sees, where 8 rows cost about one).

Usage: python -m bench.tree [--head runs/demo/train/heads/step-1000] [--limit 16] [--steps 1,2,3,4]
       [--topk 1,2,4] [--tokens 2,4,8,16] [--chains 1,2,3,4] [--max-new-tokens 96] [--no-rows] [--timed]
The last line printed is one JSON object.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from bench.common import head_proposer, head_run_args, ints, load_head_run, parse_head_run, report
from mtp_train.cli.common import configure_from_env
from mtp_train.config import EvalConfig, NgramConfig
from mtp_train.data.prompts import PromptSet
from mtp_train.engine import ModelRunner
from mtp_train.engine import Sequence as EngineSeq
from mtp_train.engine.timing import verify_seconds
from mtp_train.eval.acceptance import evaluate
from mtp_train.eval.methods import MethodSet
from mtp_train.eval.options import expand_grid
from mtp_train.eval.rows import overall_rows
from mtp_train.models import load_model
from mtp_train.speculative.metrics import SpecMetrics, paired_tau_ratio, tau_standard_error
from mtp_train.speculative.tree_draft import TreeSpec
from mtp_train.speculative.validator import spec_metrics

TAU_GOAL = 1.25  # best_tree.tau / best_chain.tau at tokens <= 8 (issue's goal)


@torch.inference_mode()
def rows_cost(model, rows: list[int], rounds: int = 30, prefix: int = 300) -> dict[int, float]:
    """Median time of an r-row forward over a cached prefix, as a ratio to the 1-row forward."""
    runner = ModelRunner.create(model, kv_cache_gb=0.1)
    vocab = model.args.vocab_size
    seq = EngineSeq.new(0, [(100 + i % 1000) % vocab for i in range(prefix)], device=model.device)
    runner.run([seq], logits="last")
    times: dict[int, list[float]] = {r: [] for r in rows}
    for i in range(rounds + 2):
        for r in rows:
            seconds = verify_seconds(runner, [seq], [(500 + j) % vocab for j in range(r)], prefix)
            if i >= 2:  # two warm-up rounds
                times[r].append(seconds)
    one = statistics.median(times[1])
    return {r: round(statistics.median(t) / one, 3) for r, t in times.items()}


def grid_shapes(steps: Iterable[int], topks: Iterable[int], tokens: Iterable[int]) -> list[TreeSpec]:
    """The dynamic trees of steps × topk × tokens that exist and verify every level they draft (module docstring:
    tokens − 1 between steps and the nodes drafted), in steps, topk, tokens order."""
    out = []
    for s in steps:
        for k in topks:
            for t in tokens:
                if s >= 1 and k >= 1 and s <= t - 1 <= k + (s - 1) * k * k and t <= 64:
                    out.append(TreeSpec(s, k, t))
    return out


def tau_entry(m: SpecMetrics, steps: int) -> dict[str, Any]:
    """A run's counters → {"tau", "tau_se", "acceptance_rate", "per_position", "requests"} (rounded; requests: the
    per-request [steps, accepted] that pair two entries, dropped from the printed result)."""
    se = tau_standard_error(m.by_request)
    return {"tau": round(m.mean_acceptance_length, 4), "tau_se": None if se is None else round(se, 4),
            "acceptance_rate": round(m.acceptance_rate, 4),
            "per_position": [round(a, 4) for a in m.per_position[:steps]], "requests": dict(m.by_request)}


def _run(model, tokenizer, proposer, convs, k: int, max_new_tokens: int, stops, batch_size: int) -> SpecMetrics:
    return spec_metrics(model, tokenizer, proposer, convs, k, max_new_tokens, batch_size=batch_size,
                        stop_token_ids=stops)[0]


def tree_grid(model, tokenizer, head, convs: Sequence, shapes: Sequence[TreeSpec], chains: Sequence[int],
              max_new_tokens: int, *, stops: list[int] | None = None, batch_size: int = 8,
              verbose: bool = True) -> dict[str, Any]:
    """τ (greedy, untimed) of `head` on `convs` for every tree of `shapes` and every plain chain k of `chains`.

    Returns {"grid": {name: {"steps", "topk", "tokens", "tau", "acceptance_rate", "per_position"}},
    "chains": {k: {"k", "tokens", "tau", ...}}, "chain_agrees": bool | None} where name is `STEPSxTOPKxTOKENS` and
    chain_agrees says whether every chain-shaped tree of the grid (topk 1) has its plain chain's τ (None: no pair).
    """
    grid: dict[str, dict[str, Any]] = {}
    for spec in shapes:
        r = _run(model, tokenizer, lambda spec=spec: head_proposer(head, tree=spec), convs, spec.steps,
                 max_new_tokens, stops, batch_size)
        grid[spec.name] = {"steps": spec.steps, "topk": spec.topk, "tokens": spec.tokens, **tau_entry(r, spec.steps)}
        if verbose:
            print(f"tree {spec.name}: tau {grid[spec.name]['tau']:.3f}  per depth {grid[spec.name]['per_position']}",
                  flush=True)
    chain: dict[int, dict[str, Any]] = {}
    for k in chains:
        r = _run(model, tokenizer, lambda: head_proposer(head), convs, k, max_new_tokens, stops, batch_size)
        chain[k] = {"k": k, "tokens": k + 1, **tau_entry(r, k)}
        if verbose:
            print(f"chain k={k}: tau {chain[k]['tau']:.3f}  per position {chain[k]['per_position']}", flush=True)
    pairs = [(g["tau"], chain[g["steps"]]["tau"]) for g in grid.values()
             if g["topk"] == 1 and g["steps"] in chain]
    return {"grid": grid, "chains": chain, "chain_agrees": all(a == b for a, b in pairs) if pairs else None}


def _best(entries: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """Highest τ; ties go to fewer verified rows, then fewer levels (the cheaper step)."""
    return max(entries, key=lambda e: (e["tau"], -e["tokens"], -e.get("steps", e.get("k", 0))), default=None)


def headline(result: Mapping[str, Any], max_tokens: int = 8) -> dict[str, Any]:
    """`best_tree` (a tree of topk ≥ 2 with tokens ≤ max_tokens) and `best_chain` (a plain chain of at most
    max_tokens rows) by τ, their `tau_ratio` and whether it reaches TAU_GOAL (`goal_met`); None where a side is
    missing."""
    trees = [{"shape": name, **g} for name, g in result["grid"].items()
             if g["topk"] >= 2 and g["tokens"] <= max_tokens]
    chains = [c for c in result["chains"].values() if c["tokens"] <= max_tokens]
    bt, bc = _best(trees), _best(chains)
    out: dict[str, Any] = {"headline_tokens": max_tokens, "best_tree": None if bt is None else dict(bt),
                           "best_chain": None if bc is None else dict(bc), "tau_ratio": None, "goal_met": None}
    if bt is not None and bc is not None and bc["tau"] > 0:
        out["tau_ratio"] = round(bt["tau"] / bc["tau"], 4)
        out["goal_met"] = out["tau_ratio"] >= TAU_GOAL
        if bt.get("requests") and bc.get("requests"):  # paired: both answered the same requests, token for token
            se = paired_tau_ratio(bt["requests"], bc["requests"])[1]
            out["tau_ratio_se"] = None if se is None else round(se, 4)
    return out


def without_requests(value: Any) -> Any:
    """`value` with every "requests" entry dropped (the per-request counts stay out of the printed result)."""
    if isinstance(value, Mapping):
        return {k: without_requests(v) for k, v in value.items() if k != "requests"}
    return value


def timed_shapes(result: Mapping[str, Any], top: int, max_tokens: int = 8) -> list[str]:
    """The `top` trees (topk ≥ 2, tokens ≤ max_tokens) of highest τ, best first: what `--timed` measures."""
    trees = [(name, g) for name, g in result["grid"].items() if g["topk"] >= 2 and g["tokens"] <= max_tokens]
    trees.sort(key=lambda e: (-e[1]["tau"], e[1]["tokens"], e[1]["steps"]))
    return [name for name, _ in trees[:top]]


def timed(model, tokenizer, head, sets: Sequence[PromptSet], trees: Sequence[str], chain_k: int,
          max_new_tokens: int, stops: list[int] | None, repeats: int = 1) -> dict[str, dict[str, Any]]:
    """Speed-up over plain decoding (interleaved, batch 1, `evaluate`) of each tree and the chain of chain_k →
    {tree name or "chain k=K": {"speedup", "speedup_lo", "speedup_hi", "tau", "step_cost"}}."""
    cfg = EvalConfig(method="head", k=chain_k, tree=["none", *trees], temperature=0.0, max_new_tokens=max_new_tokens,
                     repeats=repeats, progress=False, ngram=NgramConfig(compare=False))
    # The head loaded here stands in for the one mtp-eval would load from head_ckpt.
    pairs, _ = evaluate(model, tokenizer, sets, expand_grid(cfg), MethodSet(cfg, {"head": head}), cfg,
                        stop_ids=stops)
    out = {}
    for row in overall_rows(pairs):
        name = f"chain k={row['k']}" if row["tree"] in (None, "none") else row["tree"]
        out[name] = {key: round(row[key], 4) for key in ("speedup", "speedup_lo", "speedup_hi", "tau", "step_cost")
                     if row.get(key) is not None}
        print(f"timed {name}: speed-up {row['speedup']:.3f} [{row.get('speedup_lo', 0):.3f}, "
              f"{row.get('speedup_hi', 0):.3f}]  tau {row['tau']:.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = head_run_args(__doc__)
    ap.add_argument("--steps", default="1,2,3,4", help="tree.steps values")
    ap.add_argument("--topk", default="1,2,4", help="tree.topk values")
    ap.add_argument("--tokens", default="2,4,8,16", help="tree.tokens values (verified rows, the root counted)")
    ap.add_argument("--chains", default="1,2,3,4", help="plain chains k")
    ap.add_argument("--headline-tokens", type=int, default=8, help="best_tree / best_chain: tokens at most this")
    ap.add_argument("--no-rows", action="store_true", help="skip the timed verify cost by rows")
    ap.add_argument("--timed", action="store_true", help="measure the speed-up of the best trees and chain")
    ap.add_argument("--timed-top", type=int, default=3, help="trees --timed measures (best τ first)")
    ap.add_argument("--repeats", type=int, default=1, help="--timed: answer the prompts this many times over")
    args = parse_head_run(ap, argv)
    configure_from_env()
    model = load_model(args.model, dtype="float32")
    result: dict[str, Any] = {"head": args.head, "prompts": args.prompts, "limit": args.limit,
                              "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads()}
    if not args.no_rows:
        result["rows_cost"] = rows_cost(model, [1, 2, 3, 4, 5, 6, 8, 12, 16])
        print("verify rows → cost in 1-row decode steps:", result["rows_cost"], flush=True)
    model, tokenizer, head, sets, stops = load_head_run(args, model)
    convs = [c for ps in sets for c in ps.convs]
    shapes = grid_shapes(ints(args.steps), ints(args.topk), ints(args.tokens))
    print(f"{len(shapes)} tree shapes: {' '.join(s.name for s in shapes)}", flush=True)
    result.update(tree_grid(model, tokenizer, head, convs, shapes, ints(args.chains), args.max_new_tokens,
                            stops=stops, batch_size=args.batch_size))
    result.update(headline(result, args.headline_tokens))
    if args.timed and result["best_chain"] is not None:
        names = timed_shapes(result, args.timed_top, args.headline_tokens)
        speed = timed(model, tokenizer, head, sets, names, result["best_chain"]["k"], args.max_new_tokens, stops,
                      args.repeats)
        result["timed"] = speed
        fields = ("speedup", "speedup_lo", "speedup_hi", "step_cost")
        if result["best_tree"] is not None:
            result["best_tree"].update({f: v for f, v in speed.get(result["best_tree"]["shape"], {}).items()
                                        if f in fields})
        result["best_chain"].update({f: v for f, v in speed.get(f"chain k={result['best_chain']['k']}", {}).items()
                                     if f in fields})
    result = without_requests(result)
    report(result)
    return result


if __name__ == "__main__":
    main()
