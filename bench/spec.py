"""Speculative decoding with a trained head against plain decoding (ours) and `transformers` (HF `generate`).

On SmolLM2 (CPU, fp32, batch 1), for k = 1..6 at temperature 0: τ, acceptance rate, the draft / verify time
split and the speed-up of `mtp` over `none` (our plain engine) on the same prompts in the same process run.
Prompts: MT-bench (both turns, answered turn by turn) from ../shared/data/dev when present, else the project's
held-out demo prompts. `speedup_vs_hf`: tokens/s of `mtp` at the best k against HF greedy `generate` on exactly
the prompts (all turns) the plain run answered, with the same max_new_tokens. `step_cost` per k: one speculative
step in plain decode steps (τ / speed-up, the break-even τ); `speedup_at_tau_3_by_k`: 3 / step_cost, what the same
engine would give a head reaching the goal's τ of 3 at that k (a prediction from measured costs, not a measurement).

Usage: python -m bench.spec --head runs/demo/train/heads/step-N [--limit 5] [--max-new-tokens 96]
The head defaults to the newest export under runs/ (runs/*/heads/step-* or runs/**/heads/step-*).
The last line printed is one JSON object.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from bench.common import MT_BENCH, ROOT, load_head_run, parser, report
from mtp_train.config import EvalConfig, NgramConfig
from mtp_train.eval.acceptance import evaluate
from mtp_train.eval.methods import MethodSet
from mtp_train.eval.options import expand_grid
from mtp_train.eval.rows import best_row, overall_rows, result_row


def newest_head(root: Path = ROOT / "runs") -> Path | None:
    """The most recently written head export under `root` (a folder with config.json + model.safetensors)."""
    heads = [p.parent for p in root.glob("**/heads/step-*/model.safetensors")]
    return max(heads, key=lambda p: p.stat().st_mtime) if heads else None


def hf_tokens_per_s(model_dir: str, prompts: list[list[int]], max_new_tokens: int, stops: list[int]) -> float:
    """Greedy HF `generate`, batch 1, over `prompts` (token ids); generated tokens per second."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, secs = 0, 0.0
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        for p in prompts:
            t0 = time.perf_counter()
            out = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=stops, pad_token_id=stops[0])
            secs += time.perf_counter() - t0
            tokens += out.shape[1] - len(p)
    return tokens / secs if secs else 0.0


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--head", default=None, help="head folder (default: the newest export under runs/)")
    ap.add_argument("--prompts", default=None, help="prompt set (conf/data name or file); default mt-bench if "
                                                    "present, else demo-heldout")
    ap.add_argument("--limit", type=int, default=5, help="conversations (MT-bench: 2 turns each)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,4,5,6")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args(argv)

    head_dir = Path(args.head) if args.head else newest_head()
    if head_dir is None:
        raise SystemExit("no trained head found under runs/: pass --head DIR (e.g. after `make demo`)")
    prompts = args.prompts or ("mt-bench" if MT_BENCH.is_file() else "demo-heldout")
    ks = [int(k) for k in args.ks.split(",")]
    args.head, args.prompts = head_dir, prompts
    model, tokenizer, head, sets, stops = load_head_run(args)
    settings = EvalConfig(method="head", k=ks, temperature=[0.0], max_new_tokens=args.max_new_tokens, progress=False,
                          ngram=NgramConfig(compare=False))

    def show(run, base) -> None:
        r = result_row(run, base)
        print(f"k={r['k']}: tau {r['tau']:.2f}  acceptance {r['acceptance_rate']:.2f}  {r['tokens_per_s']:.1f} vs "
              f"{r['baseline_tokens_per_s']:.1f} tok/s  speed-up {r['speedup']:.2f}  step cost "
              f"{r['step_cost']:.2f}  (draft {r['draft_seconds']:.1f}s, verify {r['verify_seconds']:.1f}s, update "
              f"{r['update_seconds']:.1f}s)", flush=True)

    # The head loaded here (fp32 on the CPU) stands in for the one mtp-eval would load from head_ckpt.
    pairs, baselines = evaluate(model, tokenizer, sets, expand_grid(settings), MethodSet(settings, {"head": head}),
                                settings, stop_ids=stops, on_result=show)
    rows = overall_rows(pairs)
    best = best_row(rows)
    assert best is not None
    result = {
        "target": Path(args.model).name, "head": str(head_dir), "prompts": prompts,
        "conversations": sum(len(s.convs) for s in sets), "max_new_tokens": args.max_new_tokens,
        "draft_vocab": head.vocab_size, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "best_k": best["k"], "tau": round(best["tau"], 3), "acceptance_rate": round(best["acceptance_rate"], 3),
        "speedup": round(best["speedup"], 3), "exact_match": best.get("exact_match"),
        "tokens_per_s": round(best["tokens_per_s"], 2), "none_tokens_per_s": round(best["baseline_tokens_per_s"], 2),
        "per_k": {r["k"]: {"tau": round(r["tau"], 3), "speedup": round(r["speedup"], 3),
                           "step_cost": round(r["step_cost"], 3),
                           "per_position": [round(a, 3) for a in r["per_position"]]} for r in rows},
    }
    # What the engine would give a head that reaches the goal's τ, from each k's measured step cost (τ / step cost)
    goal_tau = 3.0
    result["speedup_at_tau_3_by_k"] = {r["k"]: round(goal_tau / r["step_cost"], 3) for r in rows
                                       if r["k"] + 1 >= goal_tau and r["step_cost"]}
    if not args.no_hf:
        turn_prompts = [o.prompt_ids for conv in baselines[0].answers for o in conv]
        hf_tps = hf_tokens_per_s(args.model, turn_prompts, args.max_new_tokens, stops)
        result["hf_tokens_per_s"] = round(hf_tps, 2)
        result["speedup_vs_hf"] = round(best["tokens_per_s"] / hf_tps, 3) if hf_tps else None
    report(result)
    return result


if __name__ == "__main__":
    main()
