"""Stage one against the way existing trainers store hidden states, in one process run.

Ours: `mtp_train.precompute` (packed prefill through our engine, no lm_head, bf16 safetensors shards
with a manifest). Baseline: a `transformers` forward per sample with output_hidden_states=True, then
one `torch.save` file per sample holding input_ids, loss_mask and the last hidden state (stored in
bf16 like ours, which only flatters the baseline's size). Both get the same tokenized samples.

Prints throughput_ratio (ours tokens/s ÷ baseline's), bytes_per_token of both (goal for ours:
≤ 2·H + 8), bytes_per_token_ours_fp8 (the same samples with `hidden_dtype=float8_e4m3`; goal ≤ H + 12) and
read_ratio (random-access samples/s of our reader ÷ torch.load of per-sample files).

Usage: python -m bench.precompute [--model DIR] [--data FILE] [--limit 200] [--max-seq-len 512]
The last line printed is one JSON object.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import DEFAULT_MODEL, REGEN_DATA, parser, report
from mtp_train.config import DataConfig, PrecomputeConfig
from mtp_train.data.samples import build_samples
from mtp_train.precompute import PrecomputedDataset, precompute


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--data", default=str(REGEN_DATA), help="conversations with assistant turns")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--reads", type=int, default=2000, help="random sample reads for the read benchmark")
    args = ap.parse_args(argv)
    from mtp_train.cli.common import configure_from_env

    configure_from_env()  # MTP_TRAIN_CPU_KERNELS, MTP_TRAIN_KERNEL_DIR, CC, as the commands read them
    if not Path(args.data).is_file():
        print(f"skipped: {args.data} not found (pass --data with conversations that have assistant turns)")
        return {}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint
    from mtp_train.models import load_model

    tok = AutoTokenizer.from_pretrained(args.model)
    # No validation split: every sample is read back. `out` is set to a temporary folder below.
    cfg = PrecomputeConfig(data=DataConfig(paths=[args.data]), max_seq_len=args.max_seq_len, limit=args.limit,
                           val_fraction=0.0, progress=False)
    samples, info = build_samples(tok, cfg)
    n_tok = sum(len(s.input_ids) for s in samples)
    print(f"{len(samples)} samples, {n_tok} tokens", flush=True)
    ours_model = load_model(args.model, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    hidden = ours_model.args.hidden_size
    res: dict = {"samples": len(samples), "tokens": n_tok, "hidden_size": hidden}

    with tempfile.TemporaryDirectory() as tmp:
        ours_dir, base_dir = Path(tmp) / "ours", Path(tmp) / "baseline"
        cfg.out = str(ours_dir)
        t0 = time.perf_counter()
        precompute(ours_model, samples, cfg, tokenizer_fingerprint=tokenizer_fingerprint(tok),
                   chat_template_fingerprint=chat_template_fingerprint(tok), model_dir=args.model, data_info=info)
        t_ours = time.perf_counter() - t0
        print(f"ours: {n_tok / t_ours:.0f} tok/s", flush=True)

        base_dir.mkdir()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i, s in enumerate(samples):
                out = hf(torch.tensor([s.input_ids]), output_hidden_states=True)
                torch.save({"input_ids": torch.tensor(s.input_ids), "loss_mask": torch.tensor(s.loss_mask),
                            "hidden_state": out.hidden_states[-1][0].to(torch.bfloat16)},
                           base_dir / f"data_{i}.ckpt")
        t_base = time.perf_counter() - t0
        print(f"baseline: {n_tok / t_base:.0f} tok/s", flush=True)

        res.update(throughput_ours_tok_s=n_tok / t_ours, throughput_baseline_tok_s=n_tok / t_base,
                   throughput_ratio=t_base / t_ours,
                   bytes_per_token_ours=dir_bytes(ours_dir) / n_tok,
                   bytes_per_token_baseline=dir_bytes(base_dir) / n_tok,
                   bytes_per_token_goal=2 * hidden + 8)

        # reads: the same random order for both, after one warm pass so the page cache is equal
        ds = PrecomputedDataset(ours_dir, split="all", verify="never")
        order = [random.Random(0).randrange(len(samples)) for _ in range(args.reads)]
        files = sorted(base_dir.glob("*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
        for i in range(len(samples)):
            ds[i]
            torch.load(files[i])
        t0 = time.perf_counter()
        for i in order:
            ds[i]
        t_read_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in order:
            torch.load(files[i])
        t_read_base = time.perf_counter() - t0
        res.update(read_samples_s_ours=args.reads / t_read_ours, read_samples_s_baseline=args.reads / t_read_base,
                   read_ratio=t_read_base / t_read_ours)
        shutil.rmtree(ours_dir)

        # The same samples stored in fp8 (values + a float32 scale per token): bytes only, and the dequantised
        # rows' error against the bf16 folder is the tests' business (tests/test_quant.py).
        fp8_dir = Path(tmp) / "ours-fp8"
        cfg.out, cfg.hidden_dtype = str(fp8_dir), "float8_e4m3"
        precompute(ours_model, samples, cfg, tokenizer_fingerprint=tokenizer_fingerprint(tok),
                   chat_template_fingerprint=chat_template_fingerprint(tok), model_dir=args.model, data_info=info)
        res.update(bytes_per_token_ours_fp8=dir_bytes(fp8_dir) / n_tok, bytes_per_token_goal_fp8=hidden + 12)
    print(f"throughput ×{res['throughput_ratio']:.2f}, bytes/token ours {res['bytes_per_token_ours']:.0f} vs "
          f"baseline {res['bytes_per_token_baseline']:.0f} (goal ≤ {2 * hidden + 8}), fp8 "
          f"{res['bytes_per_token_ours_fp8']:.0f} (goal ≤ {hidden + 12}), read ×{res['read_ratio']:.2f}")
    report(res)
    return res


if __name__ == "__main__":
    main()
