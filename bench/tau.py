"""τ of several trained heads on the same held-out prompts, untimed, each against the first, paired by request.

Greedy speculative decoding through the engine (`bench.curve.measure.Evaluator`, as the learning curve measures
its points): for every head τ, its standard error over requests and the per-position acceptance; for every head
after the first, τ − τ_first over the requests both answered with its paired standard error
(`mtp_train.speculative.metrics.paired_tau_difference`: a request both heads find easy adds nothing to it). No
timing, so the machine's load does not enter the figures: it says which head drafts better on these prompts, and
the eval's `step_cost` then says what that is worth in time.

Usage: python -m bench.tau runs/demo/train/heads/step-1000 runs/other/train/heads/step-1000 [--k 3]
       [--prompts demo-heldout] [--limit N] [--max-new-tokens 96]
The last line printed is one JSON object.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.common import DEFAULT_MODEL, parser, report


def versus_first(points: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Every head after the first (in `points`' order) against the first: τ − τ_first over the requests both
    answered (`requests`: {request: [steps, accepted]}, as `Evaluator.measure` gives them) and its paired SE."""
    from mtp_train.speculative.metrics import paired_tau_difference

    (first, base), *rest = points.items()
    rows = {}
    for head, p in rest:
        diff, se = paired_tau_difference(p["requests"], base["requests"])
        rows[head] = {"tau_minus_first": diff, "paired_se": se}
    return rows


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
    from bench.curve.measure import Evaluator
    from mtp_train.heads import read_head_config
    from mtp_train.models.config import ModelConfigError

    try:  # every head folder checked before the target loads (minutes on a slow machine)
        for head in args.heads:
            read_head_config(head)
    except ModelConfigError as e:
        raise SystemExit(f"bench.tau: {e}") from None

    ev = SimpleNamespace(prompts=args.prompts.split(","), limit=args.limit, k=args.k,
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    evaluator = Evaluator(args.model, ev)
    points = {}
    for head in args.heads:
        p = evaluator.head_point(Path(head))
        points[head] = p
        print(f"{head}: τ {p['tau']:.4f} ± {p['tau_se']:.4f} (k = {args.k}, {len(p['requests'])} requests); "
              f"per position {' / '.join(f'{a:.3f}' for a in p['pos'])}", flush=True)
    rows = versus_first(points)
    for head, row in rows.items():
        se = row["paired_se"]
        print(f"{head} − {args.heads[0]}: Δτ {row['tau_minus_first']:+.4f} ± "
              f"{se if se is not None else float('nan'):.4f} (paired)", flush=True)
    report({"k": args.k, "prompts": ev.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
            "heads": {h: {k: v for k, v in p.items() if k != "requests"} for h, p in points.items()},
            "versus_first": rows})


if __name__ == "__main__":
    main()
