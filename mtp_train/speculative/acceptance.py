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


def accept_tree_stochastic(tokens: Sequence[int], parents: Sequence[int], target_probs: torch.Tensor,
                           draft_probs: torch.Tensor | None = None,
                           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Multi-candidate (recursive) rejection sampling down one draft tree: the accepted path and the token after it.

    tokens: (N,) the nodes' tokens; parents: (N,) each node's parent, -1 for a child of the root, parents[i] < i;
    target_probs p: (1+N, V) the target's processed distribution after the root (row 0) and after node i (row
    1+i); draft_probs q: (N, V), row i the distribution node i was drawn from *given its earlier siblings*, or None
    when every node is deterministic (q_i = δ(x_i), e.g. a head's top-k children). Siblings are tried in node order.

    The rule, at a node whose target distribution is p, for its children x_1, x_2, .. in order:

        accept x_i with probability min(1, p(x_i) / q_i(x_i));
        on rejection p ← norm(max(p − q_i, 0)) and try x_{i+1};
        when every child is rejected (or the node is a leaf) the bonus token is drawn from p;

    after an acceptance the walk goes on from x_i with the target's distribution there. This is SpecInfer's
    multi-step speculative sampling (Miao et al. 2024, "SpecInfer", Algorithm 2) with per-sibling q_i: for
    children drawn i.i.d. from q, q_i = q (SpecInfer's case); drawn without replacement from q, q_i = q with the
    earlier siblings removed and renormalised (Jeon et al. 2024, "Recursive Speculative Decoding"); deterministic
    top-k children, q_i = δ(x_i), make it accept x_i with probability p(x_i) and otherwise remove x_i from p and
    renormalise (EAGLE's `evaluate_posterior`, SGLang's `tree_speculative_sampling_target_only`). Every emitted
    token then follows the target exactly, provided which children a node has does not depend on the values drawn
    for them (a deterministic tree, or a fixed number of samples). One generator draws every uniform and the
    bonus, so a seeded request replays exactly.
    """
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        children.setdefault(par, []).append(i)
    dev = target_probs.device
    path: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1].float()
        nxt = None
        for c in children.get(node, []):
            x = int(tokens[c])
            q = None if draft_probs is None else draft_probs[c].to(dev).float()
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand(1, generator=generator, device=dev))
            if qx > 0 and u * qx < float(p[x]):
                nxt = c
                break
            if q is None:  # max(p − δ(x), 0): p without x (p(x) <= 1)
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - q).clamp_min(0)
            mass = float(residual.sum())
            if mass > 0:  # an empty residual means p <= q_i everywhere: the rejection had probability 0
                p = residual / mass
        if nxt is None:
            return path, int(torch.multinomial(p / p.sum(), 1, generator=generator))
        path.append(nxt)
        node = nxt
