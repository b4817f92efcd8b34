"""`mtp-chat`: greedy chat answers through our engine, with tokens/s next to transformers'.

Usage: mtp-chat [--model models/smollm2-135m-instruct] [--max-new-tokens 96] [--no-hf]
"""

from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtp-chat", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct", help="Hugging Face model folder")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from mtp_train.cli.common import configure_from_env
    from mtp_train.engine import LLMEngine, SamplingParams
    from mtp_train.models import ModelConfigError, load_model

    configure_from_env()  # the native CPU kernels' switch, folder and compiler (MTP_TRAIN_CPU_KERNELS, ...)
    try:
        model = load_model(args.model, dtype=args.dtype)
    except (ModelConfigError, ValueError) as e:
        print(f"mtp-chat: error: {e}", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"] for p in DEMO_PROMPTS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    # One request at a time: batch-1 latency is what speculative decoding is about.
    engine = LLMEngine(model, kv_cache_gb=0.25)
    engine.generate([prompts[0][:8]], SamplingParams(max_new_tokens=2))  # warm-up
    ours, n_ours, t_ours = [], 0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        out = engine.generate([p], params)[0]
        t_ours += time.perf_counter() - t0
        n_ours += len(out.output_ids)
        ours.append(out.output_ids)

    print(f"model: {args.model} ({args.dtype}), greedy, batch 1\n")
    for q, ids in zip(DEMO_PROMPTS, ours):
        print(f"> {q}\n{tok.decode(ids, skip_special_tokens=True).strip()}\n")
    print(f"mtp_train engine : {n_ours / t_ours:6.1f} tokens/s ({n_ours} tokens)")

    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=model.dtype).eval()
        n_hf, t_hf, same = 0, 0.0, 0
        with torch.inference_mode():
            for p, mine in zip(prompts, ours):
                t0 = time.perf_counter()
                g = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=args.max_new_tokens,
                                pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
                t_hf += time.perf_counter() - t0
                n_hf += len(g)
                same += g == mine
        print(f"transformers     : {n_hf / t_hf:6.1f} tokens/s ({n_hf} tokens)")
        print(f"speed-up         : {(n_ours / t_ours) / (n_hf / t_hf):6.2f}x; identical answers: {same}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
