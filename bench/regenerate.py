"""Self-distillation throughput: our engine's batched greedy decoding against transformers' batched `generate`.

Both answer the same chat prompts (the first --prompts of data/demo_prompts.jsonl, the target's chat template) greedily
with at most --max-new-tokens each, in the same process run: ours through `LLMEngine` with continuous batching
(--batch-size sequences at most), transformers in left-padded batches of --batch-size with `generate` (a batch ends
when its last sequence stops). Tokens are the useful ones: each answer up to and including its end-of-turn token.

Reported: tokens/s of both, `speedup_vs_hf` (ours / transformers), and `peak_share`, our useful FLOP/s over the peak
fp32 matmul FLOP/s measured in the same run (2048² matmul, `bench.common.peak_matmul_gflops`). Useful FLOPs, counted
from the model's shapes: every generated token 2·(P_body + V·H) (the body's matmul weights and the lm_head) plus
4·L·(n_heads·head_dim)·ctx for attention over its context; every prompt token 2·P_body plus its causal attention
(prompts need prefilling but only their last row goes through the lm_head). Padding, recomputation and rejected
work are not useful FLOPs, so peak_share is what the hardware did for the answers.

Usage: python -m bench.regenerate --model models/smollm2-135m-instruct [--prompts 64] [--batch-size 64]
The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from bench.common import ROOT, parser, peak_matmul_gflops, report
from mtp_train.engine import LLMEngine, SamplingParams
from mtp_train.models import load_model


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n demo prompts as chat-template token ids with the assistant's header."""
    rows = [json.loads(line) for line in (ROOT / "data" / "demo_prompts.jsonl").read_text().splitlines()[:n]]
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for r in rows]


def useful_flops(model, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """FLOPs the answers need (see the module docstring for the count)."""
    a = model.args
    body = sum(p.numel() for n, p in model.named_parameters()
               if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    head_width = a.num_heads * a.head_dim
    total = 0.0
    for p, ans in zip(prompts, answers):
        n_p = len(p)
        total += 2.0 * body * n_p + 4.0 * a.num_layers * head_width * n_p * (n_p + 1) / 2
        for j in range(len(ans)):
            total += 2.0 * (body + a.vocab_size * a.hidden_size) + 4.0 * a.num_layers * head_width * (n_p + j + 1)
    return total


def useful(ids: list[int], stop: set[int]) -> list[int]:
    """An answer up to and including its first stop token (transformers pads after it)."""
    for i, t in enumerate(ids):
        if t in stop:
            return ids[: i + 1]
    return ids


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="ours and the peak only")
    args = ap.parse_args(argv)
    from mtp_train.cli.common import configure_from_env

    configure_from_env()  # MTP_TRAIN_CPU_KERNELS, MTP_TRAIN_KERNEL_DIR, CC, as the commands read them

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    ours = load_model(args.model, dtype="float32")
    stop = set(ours.args.eos_token_ids)
    prompts = chat_prompts(tok, args.prompts)
    res: dict = {"model": Path(args.model).name, "prompts": len(prompts), "batch_size": args.batch_size,
                 "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                 "machine": platform.machine()}
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=sorted(stop))

    engine = LLMEngine(ours, max_batch_size=args.batch_size, kv_cache_gb=2.0)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up (allocations)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    t_ours = time.perf_counter() - t0
    answers = [useful(o.output_ids, stop) for o in out]
    n_tok = sum(len(a) for a in answers)
    flops = useful_flops(ours, prompts, answers)
    res.update(tok_s_ours=n_tok / t_ours, generated_tokens=n_tok, gflops_useful=flops / t_ours / 1e9)

    if not args.no_hf:
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        tok.padding_side = "left"
        pad = tok.pad_token_id if tok.pad_token_id is not None else sorted(stop)[0]
        hf_answers: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), args.batch_size):
            batch = prompts[i:i + args.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                gen = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=args.max_new_tokens, eos_token_id=sorted(stop), pad_token_id=pad)
            hf_answers += [useful(row[width:].tolist(), stop) for row in gen]
        t_hf = time.perf_counter() - t0
        n_hf = sum(len(a) for a in hf_answers)
        same = sum(a == b for a, b in zip(answers, hf_answers)) / len(answers)
        res.update(tok_s_hf=n_hf / t_hf, speedup_vs_hf=(n_tok / t_ours) / (n_hf / t_hf), same_answers=same)
        del hf

    peak = peak_matmul_gflops(torch.device("cpu"), torch.float32)
    res.update(gflops_peak=peak, peak_share=res["gflops_useful"] / peak)
    print(f"ours {res['tok_s_ours']:.1f} tok/s ({res['gflops_useful']:.1f} useful GFLOP/s, {res['peak_share']:.2f} "
          f"of the {peak:.1f} GFLOP/s peak)" + (f"; transformers {res['tok_s_hf']:.1f} tok/s → "
                                               f"{res['speedup_vs_hf']:.2f}×" if "tok_s_hf" in res else ""),
          flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
