"""τ of several trained heads on the same held-out prompts, untimed, each against the first, paired by request.

Greedy speculative decoding through the engine (`bench.curve.measure.Evaluator`, as the learning curve measures
its points): for every head τ, its standard error over requests and the per-position acceptance; for every head
after the first, τ − τ_first over the requests both answered with its paired standard error
(`mtp_train.speculative.metrics.paired_tau_difference`: a request both heads find easy adds nothing to it). No
timing, so the machine's load does not enter the figures: it says which head drafts better on these prompts, and
the eval's `step_cost` then says what that is worth in time.

Usage: python -m bench.tau runs/demo/train/heads/step-600 runs/other/train/heads/step-600 [--k 3]
       [--prompts demo-heldout] [--limit N] [--max-new-tokens 96]
The last line printed is one JSON object.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from bench.common import DEFAULT_MODEL, parser, report


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("heads", nargs="+", help="head folders (heads/step-N of a training run, or an export)")
    ap.add_argument("--k", type=int, default=3, help="chain length (per-position acceptance up to k)")
    ap.add_argument("--prompts", default="demo-heldout", help="prompt sets, comma-separated (conf/data names)")
    ap.add_argument("--limit", type=int, default=None, help="first N conversations of each set (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    args = ap.parse_args()
    missing = [h for h in args.heads if not (Path(h) / "config.json").is_file()]
    if missing:
        raise SystemExit(f"bench.tau: no head at {', '.join(missing)} (a heads/step-N folder with its config.json)")

    from bench.curve.measure import Evaluator
    from mtp_train.speculative.metrics import paired_tau_difference

    ev = SimpleNamespace(prompts=args.prompts.split(","), limit=args.limit, k=args.k,
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    evaluator = Evaluator(args.model, ev)
    points = {}
    for head in args.heads:
        p = evaluator.head_point(Path(head))
        points[head] = p
        print(f"{head}: τ {p['tau']:.4f} ± {p['tau_se']:.4f} (k = {args.k}, {len(p['requests'])} requests); "
              f"per position {' / '.join(f'{a:.3f}' for a in p['pos'])}", flush=True)
    first = args.heads[0]
    rows = {}
    for head in args.heads[1:]:
        diff, se = paired_tau_difference(points[head]["requests"], points[first]["requests"])
        rows[head] = {"tau_minus_first": diff, "paired_se": se}
        print(f"{head} − {first}: Δτ {diff:+.4f} ± {se if se is not None else float('nan'):.4f} (paired)", flush=True)
    report({"k": args.k, "prompts": ev.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
            "heads": {h: {k: v for k, v in p.items() if k != "requests"} for h, p in points.items()},
            "versus_first": rows})


if __name__ == "__main__":
    main()
