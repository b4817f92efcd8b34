"""GPU check: FlashInfer against the torch attention backend, plus tokens/s, on a CUDA machine.

Checks, each printed as PASS/FAIL with its measured error:
  - packed prefill (3 sequences, no cache): hidden states
  - decode through the paged cache (4 sequences of different lengths, 24 steps, small pages): logits
  - verify (4 new tokens per sequence on cached prefixes): logits
  - greedy generation: tokens agree between backends
  - parity of our model (flashinfer) with transformers in bf16
  - speculative decoding (self-draft and an untrained mtp head) = plain greedy; fused chain sampling runs
  - CUDA graphs: greedy decoding and speculative decoding (mtp, k = 3: verify and draft steps replayed) unchanged
    by them; batch-1 decode tokens/s with and without (goal on SmolLM2: >= 520, 10x its eager 52)
on a small random Llama and on SmolLM2 (the converted folder when present, else a random model of
SmolLM2's exact shape), all in bf16. Then prefill and decode tokens/s for both backends. Also:
  - DeepSeek-V2 (MLA over the latent-only paged cache, MoE) at FlashInfer's MLA widths (kv_lora 512, rope 64):
    FlashInfer's MLA kernels against the torch MLA backend (prefill, decode over pages of 4, verify), the torch
    backend against transformers, paged greedy decoding = HF generate and speculative decoding with an mtp head on
    the FlashInfer backend (near-ties aside);
  - with two or more GPUs: tensor parallelism over 2 GPUs (NCCL) = one GPU (hidden states, logits, tokens);
  - claim (c): SmolLM2's verify time by rows 1-64 with the tree mask (FlashInfer's custom mask) against a chain of
    the same rows, batch 1 and 8, one table each and a `TREE_COST {json}` line (launch/tree_cost.py);
  - the heads' chained training attention (EAGLE-3's training-time test, 7 steps) in bf16: the `diagonal` mode
    against `masked` (outputs and gradients), and each one's forward + backward time and peak memory on
    SmolLM2's head shape and on Llama-3-8B's, two sequences of 2048 tokens (a `CHAIN_ATTENTION {json}` line).

Usage: python launch/gpu_check.py [--model models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp_train.engine import LLMEngine, ModelRunner, SamplingParams, Sequence, prefill_hidden  # noqa: E402
from mtp_train.models import load_model  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []
DT = torch.bfloat16
# bf16 kernels accumulate in different orders: compare with a tolerance scaled to the values
TOL = 3e-2
# batch-1 decode tokens/s the default model must reach with CUDA graphs: 10x the 52 tok/s it made eagerly
BATCH1_GOAL = 520.0


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def random_checkpoint(out: Path, **shape) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DT)
    model.save_pretrained(out, safe_serialization=True)
    return out


def teacher_forced(model, vocab: int, steps: int = 24, page_size: int = 4) -> list[torch.Tensor]:
    """The same teacher-forced tokens through the model's paged cache: `steps` decode logits (4, V), then the
    logits (16, V) of a verify step of 4 new tokens per sequence."""
    runner = ModelRunner.create(model, num_pages=256, page_size=page_size)
    ss = [Sequence.new(i, torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(i)).tolist())
          for i, n in enumerate((3, 17, 40, 65))]
    runner.run(ss)
    out = []
    for step in range(steps):
        for i, s in enumerate(ss):
            s.token_ids.append((step * 31 + i * 7) % vocab)
        out.append(runner.run(ss).logits)
    for i, s in enumerate(ss):
        s.token_ids.extend([(i + j) % vocab for j in range(4)])
    out.append(runner.run(ss, logits="all").logits)
    return out


def agreement(ref, seqs, a_out, b_out) -> tuple[int, int]:
    """(identical outputs, outputs that diverge where `ref`'s logits are a near-tie between the two tokens).

    bf16 kernels differ in summation order, so a divergence is accepted only at such a near-tie (random weights
    have many)."""
    agree = ties = 0
    for s, a, b in zip(seqs, a_out, b_out):
        i = next((j for j, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), None)
        if i is None:
            agree += 1
            continue
        ctx = s + a.output_ids[:i]
        logits = ref.compute_logits(prefill_hidden(ref, [ctx]).hidden[-1:])[0].float()
        gap = (logits[a.output_ids[i]] - logits[b.output_ids[i]]).abs().item()
        ties += gap <= TOL * logits.abs().max().item()
    return agree, ties


def decode_tokens_per_s(engine: LLMEngine, prompt: list[int], n: int) -> float:
    """Batch-1 greedy decode tokens/s over n new tokens (after a warm-up that also captures the graphs)."""
    engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def cuda_graph_checks(tag: str, path: Path, model, seqs: list[list[int]], goal: float | None) -> None:
    """CUDA graphs: greedy output unchanged (plain and speculative), and batch-1 decode tokens/s with and without."""
    from mtp_train.config import HeadConfig
    from mtp_train.heads import build_head
    from mtp_train.speculative.engine import SpecEngine
    from mtp_train.speculative.proposers import HeadProposer

    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    eager = LLMEngine(model, kv_cache_gb=1, max_batch_size=8, cuda_graphs=False).generate(seqs, params)
    graphed = LLMEngine(model, kv_cache_gb=1, max_batch_size=8, cuda_graphs=True)
    out = graphed.generate(seqs, params)
    agree, ties = agreement(model, seqs, eager, out)
    g = graphed.runner.graphs[(1, ())]
    check(f"{tag} cuda graphs: greedy decode unchanged", agree + ties == len(seqs) and g.replays > 0,
          f"{agree}/{len(seqs)} identical, {ties} at near-ties; {g.captures} captures, {g.replays} replays")
    head = build_head(HeadConfig(type="mtp", init="last_layer"), path, device="cuda", dtype=DT, backend="flashinfer")
    proposer = HeadProposer(head)
    spec = SpecEngine(model, proposer, 3, kv_cache_gb=1, max_batch_size=8, cuda_graphs=True)
    out = spec.generate(seqs, params)
    agree, ties = agreement(model, seqs, eager, out)
    verify = spec.runner.graphs[(4, ())]
    drafts = proposer.graphs.replays if proposer.graphs is not None else 0
    check(f"{tag} cuda graphs: speculative mtp k=3 greedy = plain greedy",
          agree + ties == len(seqs) and verify.replays > 0 and drafts > 0,
          f"{agree}/{len(seqs)} identical, {ties} at near-ties; verify replays {verify.replays}, draft replays "
          f"{drafts}, tau {spec.stats.metrics.mean_acceptance_length:.2f}")
    n = 256
    plain = decode_tokens_per_s(LLMEngine(model, kv_cache_gb=1, max_batch_size=1, cuda_graphs=False), seqs[0], n)
    fast = decode_tokens_per_s(LLMEngine(model, kv_cache_gb=1, max_batch_size=1, cuda_graphs=True), seqs[0], n)
    spec1 = SpecEngine(model, HeadProposer(head), 3, kv_cache_gb=1, max_batch_size=1, cuda_graphs=True)
    spec_tps = decode_tokens_per_s(spec1, seqs[0], n)
    detail = (f"batch-1 decode {fast:.0f} tok/s with graphs, {plain:.0f} without ({fast / plain:.2f}x); "
              f"speculative mtp k=3 with graphs {spec_tps:.0f} tok/s (untrained head, tau "
              f"{spec1.stats.metrics.mean_acceptance_length:.2f})")
    if goal is None:
        print(f"INFO  {tag} cuda graphs: {detail}", flush=True)
    else:
        check(f"{tag} cuda graphs: batch-1 decode >= {goal:.0f} tok/s", fast >= goal, detail)


def run_checks(tag: str, path: Path, hf_parity: bool) -> None:
    ours_t = load_model(path, dtype=DT, device="cuda", backend="torch")
    ours_f = load_model(path, dtype=DT, device="cuda", backend="flashinfer")
    vocab = ours_t.args.vocab_size
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 130, 33)]

    # prefill
    ht = prefill_hidden(ours_t, seqs).hidden
    hf_ = prefill_hidden(ours_f, seqs).hidden
    e = rel_err(hf_, ht)
    check(f"{tag} prefill (3 seqs, no cache)", e < TOL, f"max rel err {e:.2e}")

    # decode and verify: the same teacher-forced tokens through both backends' paged caches
    dt_, df_ = teacher_forced(ours_t, vocab), teacher_forced(ours_f, vocab)
    e = max(rel_err(a, b) for a, b in zip(df_[:-1], dt_[:-1]))
    check(f"{tag} decode (4 seqs, 24 steps, page_size 4)", e < TOL, f"max rel err {e:.2e}")
    e = rel_err(df_[-1], dt_[-1])
    check(f"{tag} verify (4 new tokens per seq)", e < TOL, f"max rel err {e:.2e}")

    # greedy generation: bf16 kernels differ in summation order, so a divergence is accepted only where
    # the reference logits are a near-tie between the two chosen tokens (random weights have many)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    gt = LLMEngine(ours_t, kv_cache_gb=1, cuda_graphs=False).generate(seqs, params)
    gf = LLMEngine(ours_f, kv_cache_gb=1).generate(seqs, params)
    agree, ties = agreement(ours_t, seqs, gt, gf)
    check(f"{tag} greedy generate (32 tokens)", agree + ties == len(seqs),
          f"{agree}/{len(seqs)} identical, {ties} diverge at a near-tie of the reference logits")

    # speculative decoding on the flashinfer backend: greedy output = plain greedy output (near-ties aside as above),
    # the target drafting for itself accepts everything, and fused chain sampling runs for unseeded requests
    from mtp_train.config import HeadConfig
    from mtp_train.heads import build_head
    from mtp_train.speculative.engine import SpecEngine
    from mtp_train.speculative.proposers import DraftModelProposer, HeadProposer

    head = build_head(HeadConfig(type="mtp", init="last_layer"), path, device="cuda", dtype=DT, backend="flashinfer")
    for pname, prop, k in (("self-draft", DraftModelProposer(ours_f), 3), ("mtp head", HeadProposer(head), 4)):
        eng = SpecEngine(ours_f, prop, k, kv_cache_gb=1)
        out = eng.generate(seqs, params)
        same = sum(a.output_ids == b.output_ids for a, b in zip(out, gf))
        tau = eng.stats.metrics.mean_acceptance_length
        ok = same >= len(seqs) - ties and (pname != "self-draft" or tau > k)
        check(f"{tag} speculative {pname} k={k} greedy = plain greedy", ok,
              f"{same}/{len(seqs)} identical, tau {tau:.2f}, draft {eng.stats.draft_seconds:.2f}s verify "
              f"{eng.stats.verify_seconds:.2f}s")
    # first-draft alternatives: every verify step is a tree (FlashInfer's custom mask), output still plain greedy's
    eng = SpecEngine(ours_f, HeadProposer(head, draft_width=4), 2, kv_cache_gb=1)
    out = eng.generate(seqs, params)
    same = sum(a.output_ids == b.output_ids for a, b in zip(out, gf))
    m = eng.stats.metrics
    check(f"{tag} speculative mtp head k=2 draft_width=4 (tree verify) greedy = plain greedy",
          same >= len(seqs) - ties and m.num_alt_tokens == 3 * m.num_drafts,
          f"{same}/{len(seqs)} identical, tau {m.mean_acceptance_length:.2f}, {m.num_alt_accepted} alternatives "
          "accepted")
    eng = SpecEngine(ours_f, DraftModelProposer(ours_f), 3, kv_cache_gb=1)
    sampled = eng.generate(seqs, SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=32, ignore_eos=True))
    check(f"{tag} speculative sampling (flashinfer chain_speculative_sampling)",
          all(len(o.output_ids) == 32 for o in sampled) and eng.stats.metrics.acceptance_rate > 0.5,
          f"acceptance {eng.stats.metrics.acceptance_rate:.2f} (self-draft: ~1 up to bf16 rounding of p vs q)")

    cuda_graph_checks(tag, path, ours_f, seqs, BATCH1_GOAL if tag.startswith("smollm2") else None)

    if hf_parity:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=DT).cuda().eval()
        with torch.inference_mode():
            ref = hf(torch.tensor([seqs[1]], device="cuda"), output_hidden_states=True).hidden_states[-1][0]
        e = rel_err(prefill_hidden(ours_f, [seqs[1]]).hidden, ref)
        check(f"{tag} flashinfer vs transformers (hidden)", e < TOL, f"max rel err {e:.2e}")
        del hf

    # throughput
    for name, m in (("torch", ours_t), ("flashinfer", ours_f)):
        big = [torch.randint(0, vocab, (1024,), generator=g).tolist() for _ in range(8)]
        prefill_hidden(m, big)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            prefill_hidden(m, big)
        torch.cuda.synchronize()
        pf = 3 * 8 * 1024 / (time.perf_counter() - t0)
        eng = LLMEngine(m, kv_cache_gb=2, max_batch_size=64)  # flashinfer: CUDA graphs (the default there)
        p = SamplingParams(max_new_tokens=64, ignore_eos=True)
        eng.generate([seqs[0]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        eng.generate([seqs[0]], p)
        d1 = 64 / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        eng.generate([seqs[0]] * 32, p)
        d32 = 32 * 64 / (time.perf_counter() - t0)
        print(f"INFO  {tag} {name}: prefill {pf:,.0f} tok/s, decode batch 1 {d1:.1f} tok/s, "
              f"batch 32 {d32:,.0f} tok/s", flush=True)


def deepseek_checks(tmp: Path, device: str = "cuda") -> None:
    """MLA + MoE on the GPU in bf16, at FlashInfer's MLA widths: FlashInfer's MLA kernels against the torch MLA
    backend (prefill, decode, verify), torch against transformers, the engine on FlashInfer against HF generate.

    `device` is for a dry run of the plumbing on CPU (there `auto` is torch and the first check reports it).
    """
    import transformers

    from mtp_train.config import HeadConfig
    from mtp_train.heads import build_head
    from mtp_train.speculative.engine import SpecEngine
    from mtp_train.speculative.proposers import HeadProposer

    vocab = 1024
    cfg = transformers.DeepseekV2Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(DT)
    hf.save_pretrained(tmp / "ds", safe_serialization=True)
    hf = hf.to(device).eval()
    ours_t = load_model(tmp / "ds", dtype=DT, device=device, backend="torch")
    ours_f = load_model(tmp / "ds", dtype=DT, device=device, backend="auto")
    kind = type(ours_f.attn).__name__
    check("deepseek-v2 backend=auto picks FlashInfer's MLA kernels", kind == "FlashInferMLA", kind)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (17, 5, 40)]

    with torch.inference_mode():
        ref = hf(torch.tensor([seqs[2]], device=device), output_hidden_states=True).hidden_states[-1][0]
    e = rel_err(prefill_hidden(ours_t, [seqs[2]]).hidden, ref)
    check("deepseek-v2 (MLA + MoE, torch) vs transformers (hidden)", e < TOL, f"max rel err {e:.2e}")
    e = rel_err(prefill_hidden(ours_f, seqs).hidden, prefill_hidden(ours_t, seqs).hidden)
    check("deepseek-v2 MLA flashinfer vs torch: prefill (3 seqs, no cache)", e < TOL, f"max rel err {e:.2e}")
    dt_, df_ = teacher_forced(ours_t, vocab), teacher_forced(ours_f, vocab)
    e = max(rel_err(a, b) for a, b in zip(df_[:-1], dt_[:-1]))
    check("deepseek-v2 MLA flashinfer vs torch: decode (4 seqs, 24 steps, page_size 4)", e < TOL,
          f"max rel err {e:.2e}")
    e = rel_err(df_[-1], dt_[-1])
    check("deepseek-v2 MLA flashinfer vs torch: verify (4 new tokens per seq)", e < TOL, f"max rel err {e:.2e}")

    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    out = LLMEngine(ours_f, kv_cache_gb=1).generate(seqs, params)
    same = 0
    for s, o in zip(seqs, out):
        with torch.inference_mode():
            r = hf.generate(torch.tensor([s], device=device), max_new_tokens=16, do_sample=False)[0, len(s):].tolist()
        same += r == o.output_ids
    check("deepseek-v2 paged greedy decode (flashinfer MLA) = HF generate", same >= len(seqs) - 1,
          f"{same}/{len(seqs)} identical (bf16: one divergence at a near-tie is tolerated)")
    head = build_head(HeadConfig(type="mtp", moe=True, init="last_layer"), tmp / "ds", device=device, dtype=DT,
                      backend="auto")
    spec = SpecEngine(ours_f, HeadProposer(head), 3, kv_cache_gb=1).generate(seqs, params)
    same = sum(a.output_ids == b.output_ids for a, b in zip(spec, out))
    check("deepseek-v2 speculative (mtp head, flashinfer MLA pools) = plain greedy", same >= len(seqs) - 1,
          f"{same}/{len(seqs)} identical")


def tensor_parallel_check(tmp: Path, path: Path) -> None:
    """TP over 2 GPUs (torchrun, NCCL) against one GPU."""
    import subprocess

    worker = Path(__file__).resolve().parent / "gpu_tp_worker.py"
    out = tmp / "tp.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker), str(path), str(out)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        check("tensor parallel tp=2 (NCCL)", False, proc.stderr[-800:])
        return
    got = torch.load(out)
    one = load_model(path, dtype=DT, device="cuda", backend="torch")
    ref = prefill_hidden(one, got["prompts"])
    e = rel_err(got["hidden"].cuda(), ref.hidden)
    el = rel_err(got["logits"].cuda(), one.compute_logits(ref.hidden))
    check("tensor parallel tp=2 (NCCL) vs one GPU", e < TOL and el < TOL,
          f"hidden max rel err {e:.2e}, logits {el:.2e}")


def tree_mask_cost(tag: str, path: Path, device: str = "cuda", backend: str = "flashinfer", rounds: int = 20) -> None:
    """Claim (c): the target's verify time by rows (1-64) with the tree mask against a chain of the same rows, on
    the FlashInfer backend (its custom mask), batch 1 and 8, one table each (`tree_cost`); before that, the chain
    passed as a tree mask must give the causal chain's logits. `device` / `backend` / `rounds` are for a dry run of
    the plumbing on CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tree_cost import ROWS, chain_parents, cost_table, format_table, verify_times

    model = load_model(path, dtype=DT, device=device, backend=backend)
    runner = ModelRunner.create(model, kv_cache_gb=1)
    prefix = [(7 * i) % model.args.vocab_size for i in range(300)]
    worst = 0.0
    for r in (16, 64):
        logits = []
        for tree in (None, [chain_parents(r)]):
            s = Sequence.new(0, prefix, device=device)
            runner.run([s])  # the prefix cached, then r new rows verified over it
            s.token_ids.extend(range(100, 100 + r))
            logits.append(runner.run([s], logits="all", tree=tree).logits)
            runner.free(s)
        worst = max(worst, rel_err(logits[1], logits[0]))
    check(f"{tag} tree mask: a chain as a tree mask = the causal chain (16 and 64 rows)", worst < TOL,
          f"max rel err {worst:.2e}")
    for batch in (1, 8):
        table = cost_table(verify_times(model, ROWS, batch=batch, rounds=rounds))
        print(f"INFO  {tag} verify time by rows, batch {batch}, 512 cached tokens (claim (c): tree mask vs chain):\n"
              f"{format_table(table)}", flush=True)
        print(f"TREE_COST {json.dumps({'model': tag, 'batch': batch, 'table': table})}", flush=True)


def chain_attention_check(device: str = "cuda", dtype: torch.dtype = DT, lens: tuple[int, ...] = (2048, 2048),
                          steps: int = 7, shapes: tuple[tuple[str, int, int, int], ...] = (
                              ("smollm2", 9, 3, 64), ("llama3-8b", 32, 8, 128)), rounds: int = 5) -> None:
    """The chained training attention's `diagonal` mode against `masked` on `device`: outputs and gradients agree,
    and each mode's forward + backward time and peak memory for a `steps`-step unroll over packed `lens`.
    `device` / `lens` / `shapes` / `rounds` are for a dry run of the plumbing on CPU."""
    from mtp_train.heads.chain_attention import ChainTrainAttention, attend_chain

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("FAIL  cuda: no CUDA device")
        return 1
    import flashinfer

    print(f"INFO  torch {torch.__version__}, flashinfer {flashinfer.__version__}, {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory() as tmp:
        small = random_checkpoint(Path(tmp) / "small", vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                  max_position_embeddings=2048, tie_word_embeddings=False)
        smol = Path(args.model)
        tag = "smollm2"
        if not (smol / "config.json").is_file():
            tag = "smollm2-shape(random)"
            smol = random_checkpoint(Path(tmp) / "smol", vocab_size=49152, hidden_size=576,
                                     intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                     num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                                     rms_norm_eps=1e-5, tie_word_embeddings=True)
        jobs = [(t, lambda p=p, t=t: run_checks(t, p, True)) for t, p in (("small", small), (tag, smol))]
        jobs.append(("deepseek-v2", lambda: deepseek_checks(Path(tmp))))
        jobs.append(("tree mask cost", lambda: tree_mask_cost(tag, smol)))
        jobs.append(("chain attention", chain_attention_check))
        if torch.cuda.device_count() > 1:
            jobs.append(("tensor parallel", lambda: tensor_parallel_check(Path(tmp), small)))
        else:
            print("INFO  one GPU: tensor parallelism is checked on machines with two or more")
        for t, job in jobs:
            try:
                job()
            except Exception as e:  # report and continue with the next check
                traceback.print_exc()
                check(f"{t} (crashed)", False, f"{type(e).__name__}: {e}")
    n_ok = sum(ok for _, ok, _ in RESULTS)
    print(json.dumps({"passed": n_ok, "failed": len(RESULTS) - n_ok}))
    return 0 if n_ok == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
