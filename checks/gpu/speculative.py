"""Per model: speculative decoding on the FlashInfer backend. Greedy output equals plain greedy output (near-ties
aside) with the target drafting for itself (which then accepts everything) and with an untrained `mtp` head; a
width-4 first draft makes every verify step a tree (FlashInfer's custom mask) and still gives plain greedy's output;
fused chain sampling (`chain_speculative_sampling`) runs for unseeded requests."""

from __future__ import annotations

from checks.gpu.common import DT, Checks, Target
from mtp_train.config import HeadConfig, head_type
from mtp_train.engine import SamplingParams
from mtp_train.heads import build_head
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import DraftModelProposer


def speculative_checks(check: Checks, target: Target) -> None:
    """Self-draft and mtp chains, a tree verify, and sampled speculative decoding on the FlashInfer backend."""
    tag, ours_f, seqs = target.tag, target.flashinfer_model, target.seqs
    _, gf, _, ties = target.greedy
    head = build_head(HeadConfig(type="mtp", init="last_layer"), target.path, device="cuda", dtype=DT,
                      backend="flashinfer")
    drafter = head_type(head.cfg.type).drafter  # (head, options) -> its proposer
    for pname, prop, k in (("self-draft", DraftModelProposer(ours_f), 3), ("mtp head", drafter(head, {}), 4)):
        eng = SpecEngine(ours_f, prop, k, kv_cache_gb=1)
        out = eng.generate(seqs, target.GREEDY)
        same = sum(a.output_ids == b.output_ids for a, b in zip(out, gf))
        tau = eng.stats.metrics.mean_acceptance_length
        ok = same >= len(seqs) - ties and (pname != "self-draft" or tau > k)
        check(f"{tag} speculative {pname} k={k} greedy = plain greedy", ok,
              f"{same}/{len(seqs)} identical, tau {tau:.2f}, draft {eng.stats.draft_seconds:.2f}s verify "
              f"{eng.stats.verify_seconds:.2f}s")
    # first-draft alternatives: every verify step is a tree (FlashInfer's custom mask), output still plain greedy's
    eng = SpecEngine(ours_f, drafter(head, {"draft_width": 4}), 2, kv_cache_gb=1)
    out = eng.generate(seqs, target.GREEDY)
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
