"""Per model, our numbers against a reference.

`backend_checks`: FlashInfer against the torch attention backend on packed prefill (3 sequences, no cache: hidden
states), decode through the paged cache (4 sequences of different lengths, 24 steps, pages of 4: logits), verify (4
new tokens per sequence on cached prefixes: logits) and greedy generation (the tokens agree).
`hf_parity_check`: our model on the FlashInfer backend against transformers in bf16 (hidden states).
"""

from __future__ import annotations

import torch

from checks.gpu.common import DT, TOL, Checks, Target, rel_err, teacher_forced
from mtp_train.engine import prefill_hidden


def backend_checks(check: Checks, target: Target) -> None:
    """FlashInfer against torch: prefill, decode, verify, greedy generation."""
    tag, ours_t, ours_f = target.tag, target.torch_model, target.flashinfer_model
    seqs = target.seqs
    e = rel_err(prefill_hidden(ours_f, seqs).hidden, prefill_hidden(ours_t, seqs).hidden)
    check(f"{tag} prefill (3 seqs, no cache)", e < TOL, f"max rel err {e:.2e}")

    # decode and verify: the same teacher-forced tokens through both backends' paged caches
    dt_, df_ = teacher_forced(ours_t, target.vocab), teacher_forced(ours_f, target.vocab)
    e = max(rel_err(a, b) for a, b in zip(df_[:-1], dt_[:-1]))
    check(f"{tag} decode (4 seqs, 24 steps, page_size 4)", e < TOL, f"max rel err {e:.2e}")
    e = rel_err(df_[-1], dt_[-1])
    check(f"{tag} verify (4 new tokens per seq)", e < TOL, f"max rel err {e:.2e}")

    # greedy generation: bf16 kernels differ in summation order, so a divergence is accepted only where
    # the reference logits are a near-tie between the two chosen tokens (random weights have many)
    _, _, agree, ties = target.greedy
    check(f"{tag} greedy generate (32 tokens)", agree + ties == len(seqs),
          f"{agree}/{len(seqs)} identical, {ties} diverge at a near-tie of the reference logits")


def hf_parity_check(check: Checks, target: Target) -> None:
    """Our model (FlashInfer) against transformers: the hidden states of the 130-token prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=DT).cuda().eval()
    seq = target.seqs[1]
    with torch.inference_mode():
        ref = hf(torch.tensor([seq], device="cuda"), output_hidden_states=True).hidden_states[-1][0]
    e = rel_err(prefill_hidden(target.flashinfer_model, [seq]).hidden, ref)
    check(f"{target.tag} flashinfer vs transformers (hidden)", e < TOL, f"max rel err {e:.2e}")
