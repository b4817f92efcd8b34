"""Our engine against `transformers` on the same model, machine and process run.

Measures (all ratios ours / baseline, higher = ours faster, except verify_cost):
- prefill: hidden states of 4×512 tokens. Ours: packed prefill, no lm_head. Baseline: HF forward
  with output_hidden_states=True (what existing trainers run to dump hidden states).
- decode: batch-1 greedy generation of N tokens after a chat prompt. Baseline: HF `generate`. Then ours
  against ours with the native CPU kernels switched off (`decode_native_kernels_speedup`).
- verify_cost: forward time for 1, 2, 4, 8, 16 new tokens on a context of 256, relative to 1
  (what a speculative verify step costs against a decode step on this machine).
- kernel_paths: which path each hot CPU op took, native kernel or torch's (the linears by row count, attention for
  decode and verify rows), with the ratio measured on this machine at first use (`mtp_train.layers.kernel_choice`).

Usage: python -m bench.engine --model models/smollm2-135m-instruct [--dtype float32]
Ours and transformers are timed alternately and each ratio is the median of per-round ratios.
The last line printed is one JSON object.
"""

from __future__ import annotations

import platform
import statistics
from pathlib import Path

import torch

from bench.common import compare, parser, report
from mtp_train.engine import LLMEngine, ModelRunner, SamplingParams, Sequence, prefill_hidden
from mtp_train.engine.timing import verify_seconds
from mtp_train.layers import cpu_kernels, kernel_choice
from mtp_train.models import load_model, resolve_dtype

PROMPT = "Write a short story about a robot who learns to paint. Make it warm and vivid."


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", help="dtype of both implementations")
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--verify-context", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    from mtp_train.cli.common import configure_from_env

    configure_from_env()  # MTP_TRAIN_CPU_KERNELS, MTP_TRAIN_KERNEL_DIR, CC, as the commands read them

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(args.dtype)
    torch.manual_seed(0)
    ours = load_model(args.model, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    vocab = ours.args.vocab_size
    res: dict = {"model": Path(args.model).name, "dtype": str(dtype).replace("torch.", ""),
                 "threads": torch.get_num_threads(), "machine": platform.machine()}

    # -- prefill ------------------------------------------------------------------------------
    seqs = torch.randint(0, vocab, (args.prefill_batch, args.prefill_len))
    n_tok = seqs.numel()
    with torch.inference_mode():
        t_ours, t_hf, ratio = compare(lambda: prefill_hidden(ours, seqs.tolist()),
                                      lambda: hf(seqs, output_hidden_states=True), repeat=args.repeat)
    res.update(prefill_tok_s_ours=n_tok / t_ours, prefill_tok_s_hf=n_tok / t_hf, prefill_speedup_vs_hf=ratio)
    print(f"prefill {args.prefill_batch}x{args.prefill_len}: ours {n_tok / t_ours:.0f} tok/s, "
          f"transformers {n_tok / t_hf:.0f} tok/s", flush=True)

    # -- batch-1 greedy decode ----------------------------------------------------------------
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    n_new = args.decode_tokens
    engine = LLMEngine(ours, kv_cache_gb=0.25)
    params = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    out_ours: list = []
    x = torch.tensor([prompt])
    out_hf: list = []
    with torch.inference_mode():
        t_ours, t_hf, ratio = compare(
            lambda: out_ours.append(engine.generate([prompt], params)[0]),
            lambda: out_hf.append(hf.generate(x, do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                                              pad_token_id=tok.eos_token_id)),
            repeat=args.repeat)
    same = out_ours[-1].output_ids == out_hf[-1][0, len(prompt):].tolist()
    res.update(decode_tok_s_ours=n_new / t_ours, decode_tok_s_hf=n_new / t_hf, decode_speedup_vs_hf=ratio,
               decode_same_tokens=same)
    print(f"decode batch 1, {n_new} tokens: ours {n_new / t_ours:.1f} tok/s, transformers {n_new / t_hf:.1f} tok/s, "
          f"same tokens: {same}", flush=True)

    # -- what the native CPU kernels buy: ours with them against ours on torch's paths ------------
    if cpu_kernels.available():
        out_off: list = []

        def torch_paths() -> None:
            with cpu_kernels.disabled():
                out_off.append(engine.generate([prompt], params)[0])

        with torch.inference_mode():
            t_on, t_off, ratio = compare(lambda: engine.generate([prompt], params), torch_paths, repeat=args.repeat)
        res.update(decode_tok_s_torch_paths=n_new / t_off, decode_native_kernels_speedup=ratio,
                   decode_torch_paths_same_tokens=out_off[-1].output_ids == out_ours[-1].output_ids)
        print(f"decode on torch's paths (native CPU kernels off): {n_new / t_off:.1f} tok/s; "
              f"the kernels give {ratio:.2f}x", flush=True)
    else:
        print(f"native CPU kernels unavailable ({cpu_kernels.unavailable_reason()}): decode ran on torch's paths")

    # -- verify cost ----------------------------------------------------------------------------
    runner = ModelRunner.create(ours, num_pages=64, page_size=16)
    ctx = torch.randint(0, vocab, (args.verify_context,)).tolist()
    seq = Sequence.new(0, ctx)
    runner.run([seq])

    def verify(k: int) -> float:
        return verify_seconds(runner, [seq], ctx[:k], len(ctx))

    # rounds over all k, each k's cost relative to k=1 of the same round (robust to changing load)
    ks = (1, 2, 4, 8, 16)
    for k in ks:
        verify(k)
    rounds = []
    for _ in range(max(5, args.repeat)):
        t = {k: verify(k) for k in ks}
        rounds.append(t)
    costs = {k: statistics.median(r[k] / r[1] for r in rounds) for k in ks}
    res["verify_cost"] = {str(k): costs[k] for k in ks}
    res["verify_ms_1"] = statistics.median(r[1] for r in rounds) * 1000
    print("verify cost at context", args.verify_context, {k: round(v, 2) for k, v in res["verify_cost"].items()})
    res["kernel_paths"] = kernel_choice.summary()
    print("\n".join(kernel_choice.lines()), flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
