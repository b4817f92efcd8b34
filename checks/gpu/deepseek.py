"""DeepSeek-V2 (MLA over the latent-only paged cache, MoE) at FlashInfer's MLA widths (kv_lora 512, rope 64), in
bf16: FlashInfer's MLA kernels against the torch MLA backend (prefill, decode over pages of 4, verify), the torch
backend against transformers, paged greedy decoding = HF generate, and speculative decoding with an mtp head on the
FlashInfer backend (near-ties aside)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from checks.gpu.common import DT, TOL, Checks, rel_err, teacher_forced
from mtp_train.config import HeadConfig, head_type
from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.heads import build_head
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine


def deepseek_checks(check: Checks, tmp: Path, device: str = "cuda") -> None:
    """MLA + MoE on the GPU in bf16, at FlashInfer's MLA widths: FlashInfer's MLA kernels against the torch MLA
    backend (prefill, decode, verify), torch against transformers, the engine on FlashInfer against HF generate.

    `device` is for a dry run of the plumbing on CPU (there `auto` is torch and the first check reports it).
    """
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
    proposer = head_type(head.cfg.type).drafter(head, {})
    spec = SpecEngine(ours_f, proposer, 3, kv_cache_gb=1).generate(seqs, params)
    same = sum(a.output_ids == b.output_ids for a, b in zip(spec, out))
    check("deepseek-v2 speculative (mtp head, flashinfer MLA pools) = plain greedy", same >= len(seqs) - 1,
          f"{same}/{len(seqs)} identical")
