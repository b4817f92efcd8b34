"""What a wider first draft buys on this machine: verify cost by rows, and a head's τ by (k, draft_width).

Part 1 (timed, ratios only): one target forward over r new rows (r = 1..16) on top of a 300-token cached
prefix, batch 1, through our runner; the rounds interleave every r, and the medians are printed as ratios to the
1-row decode step (`rows_cost`). A speculative step at k drafts and width w verifies 1 + k + (w - 1) rows.
Part 2 (untimed, greedy, deterministic): τ of a head on held-out prompts for each (k, draft_width) through the
engine's `head_acceptance` (the training validation's path), batch 8. Dividing τ by the step's cost in plain
decode steps (its verify rows, plus the head's forwards) predicts the speed-up; `mtp-eval` measures it.

Usage: python bench/bench_tree.py --head runs/demo/train/heads/step-600 [--limit 16] [--grid 1x1,1x2,2x1,2x2]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report  # noqa: E402

from mtp_train.cli.common import configure_from_env  # noqa: E402
from mtp_train.data.chat import load_tokenizer  # noqa: E402
from mtp_train.data.prompts import load_prompt_sets  # noqa: E402
from mtp_train.engine import ModelRunner, Sequence  # noqa: E402
from mtp_train.engine.turns import stop_token_ids  # noqa: E402
from mtp_train.heads import load_head  # noqa: E402
from mtp_train.models import load_model  # noqa: E402
from mtp_train.speculative.proposers import HeadProposer  # noqa: E402
from mtp_train.speculative.validator import head_acceptance  # noqa: E402


@torch.inference_mode()
def rows_cost(model, rows: list[int], rounds: int = 30, prefix: int = 300) -> dict[int, float]:
    """Median time of an r-row forward over a cached prefix, as a ratio to the 1-row forward."""
    runner = ModelRunner.create(model, kv_cache_gb=0.1)
    seq = Sequence.new(0, [100 + i % 1000 for i in range(prefix)], device=model.device)
    runner.run([seq], logits="last")
    times: dict[int, list[float]] = {r: [] for r in rows}
    for i in range(rounds + 2):
        for r in rows:
            seq.token_ids.extend(range(500, 500 + r))
            t0 = time.perf_counter()
            runner.run([seq], logits="all")
            if i >= 2:  # two warm-up rounds
                times[r].append(time.perf_counter() - t0)
            del seq.token_ids[prefix:]
            seq.num_cached = prefix
    one = statistics.median(times[1])
    return {r: round(statistics.median(t) / one, 3) for r, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--head", required=True, help="head folder (mtp-train's heads/step-N)")
    ap.add_argument("--prompts", default="demo-heldout")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--grid", default="1x1,1x2,1x3,2x1,2x2,3x1", help="k x draft_width points")
    ap.add_argument("--no-rows", action="store_true", help="skip the timed part")
    args = ap.parse_args(argv)
    configure_from_env()
    model = load_model(args.model, dtype="float32")
    result: dict = {"head": args.head, "prompts": args.prompts, "limit": args.limit,
                    "threads": torch.get_num_threads()}
    if not args.no_rows:
        result["rows_cost"] = rows_cost(model, [1, 2, 3, 4, 5, 6, 8, 12, 16])
        print("verify rows → cost in 1-row decode steps:", result["rows_cost"], flush=True)
    tokenizer = load_tokenizer(args.model)
    head = load_head(args.head, args.model, dtype=torch.float32)
    convs = [c for ps in load_prompt_sets([args.prompts], args.limit) for c in ps.convs]
    stops = stop_token_ids(tokenizer, model.args.eos_token_ids)
    taus = {}
    for point in args.grid.split(","):
        k, w = (int(x) for x in point.split("x"))
        r = head_acceptance(model, tokenizer, lambda w=w: HeadProposer(head, draft_width=w), convs, k,
                            args.max_new_tokens, batch_size=8, stop_token_ids=stops)
        taus[point] = round(r["spec/tau"], 3)
        print(f"k={k} draft_width={w}: tau {r['spec/tau']:.3f}  per position "
              f"{[round(r[f'spec/pos{j}'], 3) for j in range(k)]}", flush=True)
    result["tau"] = taus
    report(result)
    return result


if __name__ == "__main__":
    main()
