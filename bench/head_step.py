"""A chain head's engine step, in one native call against op by op, for each chain head type on the default target.

For an untrained head of each type (the demo's 8k draft vocabulary; the aux heads on the target's layers 2 / 15 /
27; bfloat16 weight copies, as the eval streams them), two steps as the speculative engine runs them:

- catch-up: the verify's rows from the target (`--rows`, 2 = a k = 1 chain), the head's K/V written, logits at
  every row (the seed system's MTP step, `Proposer.catch_up_greedy`);
- draft: one chained draft step from the head's own output (one row, its logits).

Each is timed in one native call (`ChainHead.native_step` → `cpu_kernels.head_step`) and op by op (the same head
with its native step switched off), alternately in one process, over a context of `--context` cached tokens. Before
every call the caches are flushed by a pass over a buffer larger than the target's weights, as the target's verify
flushes them in the engine, so the times are those of a cold step. The fastest of `--rounds` rounds counts (this
machine's speed varies with its neighbours' load; the fastest round is the least disturbed one); the median is
printed beside it. Each round takes the heads in another order and the two paths in turn. Prints ms per step and
ratio = native / op by op (< 1: the one call is faster). The last line printed is one JSON object.

Usage: python -m bench.head_step [--model models/smollm2-135m-instruct] [--rounds 40] [--rows 2] [--context 200]
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import parser, report

HEADS = {  # name → HeadConfig fields
    "mtp": {"type": "mtp", "draft_vocab_size": 8192},
    "mtp-aux": {"type": "mtp", "draft_vocab_size": 8192, "features": "aux", "aux_layers": [2, 15, 27]},
    "eagle1": {"type": "eagle1"},
    "eagle3": {"type": "eagle3", "draft_vocab_size": 8192, "aux_layers": [2, 15, 27]},
}


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--heads", default=",".join(HEADS), help="comma-separated, of " + ", ".join(HEADS))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--rows", type=int, default=2, help="catch-up rows (k + 1 for a k-token chain)")
    ap.add_argument("--context", type=int, default=200, help="tokens cached before the step")
    ap.add_argument("--weights", default="bf16", choices=("fp32", "bf16", "int8"))
    args = ap.parse_args(argv)

    from mtp_train.config import HeadConfig
    from mtp_train.engine.kv_cache import KVCache
    from mtp_train.heads import build_head
    from mtp_train.layers.attention import AttentionMetadata

    names = [n for n in args.heads.split(",") if n]
    unknown = [n for n in names if n not in HEADS]
    if unknown:
        raise SystemExit(f"unknown heads {unknown}; choose among {', '.join(HEADS)}")
    heads = {}
    for name in names:
        head = build_head(HeadConfig.of(**HEADS[name]), args.model, dtype="float32").eval()
        head.stream_weights(None if args.weights == "fp32" else args.weights)
        heads[name] = head
    page = 16
    pages = list(range(-(-(args.context + args.rows) // page)))
    flush = torch.ones(160_000_000)  # 640 MB: more than the target's weights, as a verify streams them
    gen = torch.Generator().manual_seed(0)
    times: dict[tuple[str, str, str], list[float]] = {}
    real = {name: type(h).native_step for name, h in heads.items()}
    with torch.inference_mode():
        kvs = {}
        for name, h in heads.items():
            layers, layout = h.kv_shape
            kvs[name] = KVCache(layers, len(pages), page, layout, dtype=torch.float32)
        order = list(heads)
        for r in range(args.rounds):
            # every round in another order (heads rotated, the two paths swapped), so that a call's place in the
            # round, right after a flush or after another head, falls on every head and path alike
            for name in order[r % len(order):] + order[:r % len(order)]:
                h = heads[name]
                for step in ("catch-up", "draft"):
                    rows = args.rows if step == "catch-up" else 1
                    width = h.input_width if step == "catch-up" else h.args.hidden_size
                    hidden = torch.randn(rows, width, generator=gen)
                    ids = torch.randint(0, h.args.vocab_size, (rows,), generator=gen)
                    for path in ("native", "op-by-op") if r % 2 == 0 else ("op-by-op", "native"):
                        # the instance's own attribute shadows the type's method for the op-by-op path
                        h.native_step = real[name].__get__(h) if path == "native" else (lambda *a: None)
                        flush.add_(1.0)
                        meta = AttentionMetadata.build([rows], [args.context + rows], [pages], page)
                        t0 = time.perf_counter()
                        h(hidden, ids, meta, kvs[name].layers[0], from_target=step == "catch-up",
                          logits_indices=torch.arange(rows))
                        times.setdefault((name, step, path), []).append(time.perf_counter() - t0)
    results: dict = {"rounds": args.rounds, "rows": args.rows, "context": args.context, "weights": args.weights}
    print(f"{'head':8s} {'step':9s} {'native ms':>10s} {'op-by-op ms':>12s} {'ratio':>6s}   (fastest of "
          f"{args.rounds}; medians in brackets)")
    for name in heads:
        for step in ("catch-up", "draft"):
            nat, op = times[(name, step, "native")], times[(name, step, "op-by-op")]
            ratio = min(nat) / min(op)
            print(f"{name:8s} {step:9s} {min(nat) * 1e3:10.3f} {min(op) * 1e3:12.3f} {ratio:6.2f}   "
                  f"[{statistics.median(nat) * 1e3:.3f} / {statistics.median(op) * 1e3:.3f}]")
            results[f"{name}_{step}_native_ms"] = min(nat) * 1e3
            results[f"{name}_{step}_op_by_op_ms"] = min(op) * 1e3
            results[f"{name}_{step}_ratio"] = ratio
    report(results)
    return results


if __name__ == "__main__":
    main()
