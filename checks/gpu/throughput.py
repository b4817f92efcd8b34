"""Per model: prefill and decode tokens/s on both attention backends (printed, not checked): prefill of 8 × 1024
tokens, batch-1 decode and batch-32 decode of 64 tokens (FlashInfer with CUDA graphs, its default)."""

from __future__ import annotations

import time

import torch

from checks.gpu.common import Target
from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden


def throughput(target: Target) -> None:
    """One INFO line per backend: prefill tok/s, decode batch 1 and batch 32 tok/s."""
    vocab, seq = target.vocab, target.seqs[0]
    for name, m in (("torch", target.torch_model), ("flashinfer", target.flashinfer_model)):
        big = [torch.randint(0, vocab, (1024,), generator=target.generator).tolist() for _ in range(8)]
        prefill_hidden(m, big)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            prefill_hidden(m, big)
        torch.cuda.synchronize()
        pf = 3 * 8 * 1024 / (time.perf_counter() - t0)
        eng = LLMEngine(m, kv_cache_gb=2, max_batch_size=64)  # flashinfer: CUDA graphs (the default there)
        p = SamplingParams(max_new_tokens=64, ignore_eos=True)
        eng.generate([seq], SamplingParams(max_new_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        eng.generate([seq], p)
        d1 = 64 / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        eng.generate([seq] * 32, p)
        d32 = 32 * 64 / (time.perf_counter() - t0)
        print(f"INFO  {target.tag} {name}: prefill {pf:,.0f} tok/s, decode batch 1 {d1:.1f} tok/s, "
              f"batch 32 {d32:,.0f} tok/s", flush=True)
