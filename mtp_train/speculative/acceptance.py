"""Acceptance of a chain of k draft tokens against the target's distributions.

Greedy: a draft token is accepted while it equals the target's argmax; the target's argmax at the
first mismatch (or after the last draft token) is the extra token. The output therefore equals plain
greedy decoding token for token.

Stochastic (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"): draft token
x_j ~ q_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the extra
token is drawn from norm(max(0, p_j − q_j)) and the chain stops; if all k are accepted the extra token
is drawn from p_k. Every emitted token is then distributed exactly as the target would sample it.
p and q must come from the same temperature/top-k/top-p processing (`engine.sampling.filtered_probs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class AcceptResult:
    """Outcome of one verification step for B sequences."""

    num_accepted: list[int]  # (B,) accepted draft tokens per sequence, 0..k
    tokens: list[list[int]]  # (B,) emitted tokens: the accepted drafts plus one target token


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> AcceptResult:
    """draft_tokens: (B, k) int; target_logits: (B, k+1, V) at the k draft positions and the one after."""
    target = target_logits.argmax(-1)  # (B, k+1)
    k = draft_tokens.shape[1]
    match = (draft_tokens == target[:, :k]).int()
    # accepted = length of the all-match prefix
    n = match.cumprod(1).sum(1).tolist()
    tokens = [draft_tokens[b, : n[b]].tolist() + [int(target[b, n[b]])] for b in range(len(n))]
    return AcceptResult(n, tokens)


def accept_stochastic(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                      generators: Sequence[torch.Generator | None] | None = None) -> AcceptResult:
    """The Leviathan/Chen rule for B chains.

    draft_tokens: (B, k) int, drawn from draft_probs; draft_probs q: (B, k, V); target_probs p:
    (B, k+1, V). generators: one per sequence (seeded requests), or None for torch's global RNG.
    """
    b_size, k = draft_tokens.shape
    gens = list(generators) if generators is not None else [None] * b_size
    idx = draft_tokens.long().unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, idx).squeeze(-1).float()  # (B, k)
    q_x = draft_probs.gather(-1, idx).squeeze(-1).float()
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.zeros_like(p_x))
    num_accepted, tokens = [], []
    for b in range(b_size):
        u = torch.rand(k, generator=gens[b], device=draft_tokens.device)
        accepted = (u < ratio[b]).int().cumprod(0)
        n = int(accepted.sum())
        if n < k:
            residual = (target_probs[b, n].float() - draft_probs[b, n].float()).clamp_min(0)
            # p == q at this position makes the residual empty; the rejection itself then had probability 0
            dist = residual if residual.sum() > 0 else target_probs[b, n].float()
        else:
            dist = target_probs[b, k].float()
        extra = int(torch.multinomial(dist / dist.sum(), 1, generator=gens[b]))
        num_accepted.append(n)
        tokens.append(draft_tokens[b, :n].tolist() + [extra])
    return AcceptResult(num_accepted, tokens)


def accept_stochastic_flashinfer(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                                 target_probs: torch.Tensor) -> AcceptResult:
    """The same rule with FlashInfer's fused `chain_speculative_sampling` (CUDA, torch's default generator).

    Shapes as in `accept_stochastic`. The kernel marks positions after the first rejection with -1.
    """
    from flashinfer.sampling import chain_speculative_sampling  # lazy: GPU only

    res = chain_speculative_sampling(draft_probs.float().contiguous(), draft_tokens.int().contiguous(),
                                     target_probs.float().contiguous())
    # 0.5.x returns (output_token_ids (B, k+1), accepted_num, emitted_num); older releases the ids alone
    out = res[0] if isinstance(res, tuple) else res
    rows = out.tolist()
    tokens = [[t for t in row if t >= 0] for row in rows]
    return AcceptResult([len(t) - 1 for t in tokens], tokens)
