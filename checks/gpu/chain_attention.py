"""The heads' chained training attention (EAGLE-3's training-time test, 7 steps) in bf16: the `diagonal` mode against
`masked` (outputs and gradients), and each one's forward + backward time and peak memory on SmolLM2's head shape and
on Llama-3-8B's, two sequences of 2048 tokens (a `CHAIN_ATTENTION {json}` line)."""

from __future__ import annotations

import json
import time

import torch

from checks.gpu.common import DT, TOL, Checks, rel_err
from mtp_train.heads.chain_attention import ChainTrainAttention, attend_chain


def chain_attention_check(check: Checks, device: str = "cuda", dtype: torch.dtype = DT,
                          lens: tuple[int, ...] = (2048, 2048), steps: int = 7,
                          shapes: tuple[tuple[str, int, int, int], ...] = (
                              ("smollm2", 9, 3, 64), ("llama3-8b", 32, 8, 128)), rounds: int = 5) -> None:
    """The chained training attention's `diagonal` mode against `masked` on `device`: outputs and gradients agree,
    and each mode's forward + backward time and peak memory for a `steps`-step unroll over packed `lens`.
    `device` / `lens` / `shapes` / `rounds` are for a dry run of the plumbing on CPU."""
    record: dict = {"steps": steps, "lens": list(lens), "dtype": str(dtype).removeprefix("torch.")}
    for name, hq, hkv, d in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        t = sum(lens)
        qkv = [tuple(torch.randn(t, h, d, generator=g, device=device, dtype=dtype).requires_grad_()
                     for h in (hq, hkv, hkv)) for _ in range(steps)]
        weights = [torch.randn(t, hq, d, generator=g, device=device, dtype=dtype) for _ in range(steps)]
        got: dict[str, tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        row: dict = {}
        for mode in ("masked", "diagonal"):
            def once(mode: str = mode, qkv: list = qkv, weights: list = weights, heads: tuple = (hq, hkv, d)
                     ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
                outs = attend_chain(ChainTrainAttention(*heads, mode=mode), qkv, lens, device)
                loss = sum((o.float() * w.float()).sum() for o, w in zip(outs, weights))
                return [o.detach() for o in outs], torch.autograd.grad(loss, [x for step in qkv for x in step])

            got[mode] = once()  # also the warm-up
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            for _ in range(rounds):
                once()
            if device == "cuda":
                torch.cuda.synchronize()
                row[f"{mode}_peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            row[f"{mode}_ms"] = round((time.perf_counter() - t0) / rounds * 1e3, 2)
        out_err = max(rel_err(a, b) for a, b in zip(got["diagonal"][0], got["masked"][0]))
        grad_err = max(rel_err(a, b) for a, b in zip(got["diagonal"][1], got["masked"][1]))
        check(f"chain attention {name} ({hq}/{hkv} heads of {d}), {steps} steps: diagonal = masked",
              out_err < TOL and grad_err < TOL, f"outputs max rel err {out_err:.2e}, gradients {grad_err:.2e}")
        row["masked_over_diagonal"] = round(row["masked_ms"] / row["diagonal_ms"], 3)
        print(f"INFO  chain attention {name}, {steps} steps over {list(lens)}: {row}", flush=True)
        record[name] = row
    print(f"CHAIN_ATTENTION {json.dumps(record)}", flush=True)
