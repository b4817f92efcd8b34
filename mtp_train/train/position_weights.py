"""Per-row weights of the unrolled draft steps: D-PACE.

A row i of the unrolled loss is an anchor: draft step j at row i predicts the token i + j + 1, from the context the
inference chain would have after j accepted drafts. Whether step j's draft is worth learning depends on whether the
drafts before it are accepted, so D-PACE (the per-position weighting of vLLM's speculators, "dpace") weighs it by
the expected accepted drafts that need it:

    s_j = (1 − a)·q_j + a                (q_j: the head's detached probability of the target's argmax at step j;
                                          a: smoothing, `loss.dpace_alpha`; s_j = 1 where row i is not counted)
    P_j = Π_{l ≤ j} s_l                  (the chance that drafts 0..j all stand, smoothed)
    w_j = m_j · Σ_{l ≥ j} m_l · P_l      (m_j: step j counts row i; the accepted drafts from j on)

so a row whose early drafts already fail weighs little at every step, and the first step weighs most. The
weights are constants of the batch (no gradient flows through them); each step's loss stays normalised by its
counted rows, as with the per-step decay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpace_weights(confidence: torch.Tensor, counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """confidence: (S, T) the head's probability of the target's argmax per step and row; counted: (S, T) bool.

    Returns (S, T) float32 weights w_j (zero where a row is not counted), by the formula of the module docstring.
    """
    if confidence.shape != counted.shape or confidence.dim() != 2:
        raise ValueError(f"confidence {tuple(confidence.shape)} and counted {tuple(counted.shape)} must be (S, T)")
    with torch.no_grad():
        m = counted.to(torch.float32)
        smooth = torch.where(counted, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(m))
        prefix = torch.cumprod(smooth, dim=0)
        return (prefix * m).flip(0).cumsum(0).flip(0) * m


def target_argmax_probability(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                              target_weight: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """(N,) float32: softmax(pred · weightᵀ) at argmax(target · target_weightᵀ), `chunk_size` rows at a time.

    pred: (N, H) the head's logit input; target: (N, H) the target's hidden; weight: (V, H) the head's side of the
    lm_head; target_weight: (V, H) the target's (the same rows: the draft vocabulary when one is set). No grad.
    """
    out = torch.empty(pred.shape[0], dtype=torch.float32, device=pred.device)
    with torch.no_grad():
        for s in range(0, pred.shape[0], chunk_size):
            z = F.linear(pred[s:s + chunk_size].to(weight.dtype), weight).float()
            best = F.linear(target[s:s + chunk_size].to(target_weight.dtype), target_weight).argmax(-1)
            out[s:s + chunk_size] = (z.gather(1, best[:, None]).squeeze(1) - torch.logsumexp(z, -1)).exp()
    return out
