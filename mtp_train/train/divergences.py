"""Per-row token losses between the head's distribution q = softmax(z) and the target's p = softmax(t).

Each kind maps one chunk of logits (C, V) to (C,) row losses, differentiable in z; `chunked_token_loss` in
`mtp_train.train.losses` runs them over the vocabulary-chunked rows. With α = Σ_v min(p_v, q_v) — the probability
that a token drafted from q is accepted against p (Leviathan et al. 2023, the expected acceptance of one draft):

    soft_ce    −Σ p log q                 forward KL(p ‖ q) up to the target's entropy (EAGLE's token loss)
    rkl        Σ q (log q − log p)        reverse KL(q ‖ p): mode-seeking
    jsd        ½ KL(p ‖ m) + ½ KL(q ‖ m), m = (p + q) / 2
    tv         ½ Σ |p − q| = 1 − α        total variation: the acceptance rate itself
    nla        −log α                     the negative log acceptance
    lk_hybrid  λ · KL(p ‖ q) + (1 − λ)(1 − α), λ = exp(−3α) held constant per row ("LK losses", arXiv 2602.23881):
               KL's dense gradient while α is low, TV's direct push on acceptance once it is high
    argmax_ce  −log q[argmax p]           hard cross-entropy on the target's greedy token: what greedy acceptance
               (draft argmax = target argmax) rewards, and nothing of the rest of p

All arithmetic runs in the logits' dtype (float32 at least, see `losses._logits`); log-probabilities come from
log_softmax, so no log of an underflowed zero appears (m's log is a logaddexp of the two).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mtp_train.config.loss import LOSS_KINDS

LK_HYBRID_RATE = 3.0  # λ = exp(−rate · α), the LK paper's adaptive blend
NLA_FLOOR = 1e-6  # α is clamped here before the log: a head with no overlap at all still gets a finite gradient


def acceptance(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """α = Σ_v min(p_v, q_v) per row: (C, V), (C, V) log-probabilities → (C,)."""
    return torch.minimum(log_q, log_p).exp().sum(-1)


def _soft_ce(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    return -(log_p.exp() * log_q).sum(-1)


def _rkl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def _jsd(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    log_m = torch.logaddexp(log_q, log_p) - math.log(2.0)
    return 0.5 * ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))


def _tv(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    return 1.0 - acceptance(log_q, log_p)


def _nla(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    return -acceptance(log_q, log_p).clamp_min(NLA_FLOOR).log()


def _lk_hybrid(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    alpha = acceptance(log_q, log_p)
    lam = torch.exp(-LK_HYBRID_RATE * alpha.detach())
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return lam * kl + (1.0 - lam) * (1.0 - alpha)


def _argmax_ce(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    return -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)


ROW_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "soft_ce": _soft_ce, "rkl": _rkl, "jsd": _jsd, "tv": _tv, "nla": _nla, "lk_hybrid": _lk_hybrid,
    "argmax_ce": _argmax_ce,
}
assert tuple(ROW_LOSSES) == LOSS_KINDS, "every configurable loss kind has its row loss"


def row_loss(kind: str, z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row losses (C,) (differentiable in z) and α (C,) (no grad) of head logits z and target logits t, (C, V)."""
    if kind not in ROW_LOSSES:
        raise ValueError(f"unknown loss kind {kind!r}; choose one of {', '.join(LOSS_KINDS)}")
    log_q, log_p = z.log_softmax(-1), t.detach().log_softmax(-1)
    rows = ROW_LOSSES[kind](log_q, log_p)
    with torch.no_grad():
        alpha = acceptance(log_q.detach(), log_p)
    return rows, alpha
