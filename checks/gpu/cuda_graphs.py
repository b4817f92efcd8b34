"""Per model: CUDA graphs leave greedy decoding and speculative decoding (mtp, k = 3: verify, the head's catch-up
over the verify rows and its draft steps replayed) unchanged, and batch-1 decode tokens/s with and without them
(goal on SmolLM2: >= 520, 10x its eager 52)."""

from __future__ import annotations

import time

import torch

from checks.gpu.common import DT, Checks, Target, agreement
from mtp_train.config import HeadConfig, head_type
from mtp_train.engine import LLMEngine, SamplingParams
from mtp_train.heads import build_head
from mtp_train.speculative.engine import SpecEngine

# batch-1 decode tokens/s the default model must reach with CUDA graphs: 10x the 52 tok/s it made eagerly
BATCH1_GOAL = 520.0


def decode_tokens_per_s(engine: LLMEngine, prompt: list[int], n: int) -> float:
    """Batch-1 greedy decode tokens/s over n new tokens (after a warm-up that also captures the graphs)."""
    engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def cuda_graph_checks(check: Checks, target: Target, goal: float | None) -> None:
    """Greedy output unchanged by graphs (plain and speculative), and batch-1 decode tokens/s with and without
    (checked against `goal` when given, else printed)."""
    tag, model, seqs = target.tag, target.flashinfer_model, target.seqs
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    eager = LLMEngine(model, kv_cache_gb=1, max_batch_size=8, cuda_graphs=False).generate(seqs, params)
    graphed = LLMEngine(model, kv_cache_gb=1, max_batch_size=8, cuda_graphs=True)
    out = graphed.generate(seqs, params)
    agree, ties = agreement(model, seqs, eager, out)
    g = graphed.runner.graphs[(1, ())]
    check(f"{tag} cuda graphs: greedy decode unchanged", agree + ties == len(seqs) and g.replays > 0,
          f"{agree}/{len(seqs)} identical, {ties} at near-ties; {g.captures} captures, {g.replays} replays")
    head = build_head(HeadConfig(type="mtp", init="last_layer"), target.path, device="cuda", dtype=DT,
                      backend="flashinfer")
    proposer = head_type(head.cfg.type).drafter(head, {})
    spec = SpecEngine(model, proposer, 3, kv_cache_gb=1, max_batch_size=8, cuda_graphs=True)
    out = spec.generate(seqs, params)
    agree, ties = agreement(model, seqs, eager, out)
    verify = spec.runner.graphs[(4, ())]
    drafts = proposer.graphs.replays if proposer.graphs is not None else 0
    # the head's catch-up over the verify rows (and its next first draft) replays the verify's fixed shape too
    catch_up = proposer.verify_graphs.replays if proposer.verify_graphs is not None else 0
    check(f"{tag} cuda graphs: speculative mtp k=3 greedy = plain greedy",
          agree + ties == len(seqs) and verify.replays > 0 and drafts > 0 and catch_up == verify.replays,
          f"{agree}/{len(seqs)} identical, {ties} at near-ties; verify replays {verify.replays}, draft replays "
          f"{drafts}, catch-up replays {catch_up}, tau {spec.stats.metrics.mean_acceptance_length:.2f}")
    n = 256
    plain = decode_tokens_per_s(LLMEngine(model, kv_cache_gb=1, max_batch_size=1, cuda_graphs=False), seqs[0], n)
    fast = decode_tokens_per_s(LLMEngine(model, kv_cache_gb=1, max_batch_size=1, cuda_graphs=True), seqs[0], n)
    spec1 = SpecEngine(model, head_type(head.cfg.type).drafter(head, {}), 3, kv_cache_gb=1, max_batch_size=1,
                       cuda_graphs=True)
    spec_tps = decode_tokens_per_s(spec1, seqs[0], n)
    detail = (f"batch-1 decode {fast:.0f} tok/s with graphs, {plain:.0f} without ({fast / plain:.2f}x); "
              f"speculative mtp k=3 with graphs {spec_tps:.0f} tok/s (untrained head, tau "
              f"{spec1.stats.metrics.mean_acceptance_length:.2f})")
    if goal is None:
        print(f"INFO  {tag} cuda graphs: {detail}", flush=True)
    else:
        check(f"{tag} cuda graphs: batch-1 decode >= {goal:.0f} tok/s", fast >= goal, detail)
