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

Each kind is one `TokenLoss`, added to `TOKEN_LOSSES` (declared in `mtp_train.config.loss`) where it is defined: its
row losses, and how `chunked_token_loss` reduces a chunk with them, differentiably (`chunk_sums`, the checkpoint
path) or with the gradient computed in the forward (`chunk_grad`, the fused path). A kind without closed forms gets
both from its row losses and autograd; soft CE brings its own (logsumexp − Σ p·z, and d/dz = softmax(z) − p,
natively on fp32 CPU).

All arithmetic runs in the logits' dtype (float32 at least, see `losses._logits`); log-probabilities come from
log_softmax, so no log of an underflowed zero appears (m's log is a logaddexp of the two).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtp_train.config.loss import TOKEN_LOSSES
from mtp_train.layers import cpu_kernels, kernel_choice

LK_HYBRID_RATE = 3.0  # λ = exp(−rate · α), the LK paper's adaptive blend
TOPK = 3  # the second accuracy reported: target argmax within the head's top-3
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


def weighted_sum(rows: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor:
    """Σ rows (C,), each times its row_weight when given."""
    return rows.sum() if row_weight is None else (rows * row_weight.to(rows.dtype)).sum()


def accuracy_counts(z: torch.Tensor, best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose head argmax / top-TOPK of z (C, V) contains the target's argmax `best` (C,) (counts, no grad)."""
    with torch.no_grad():
        top = z.topk(min(TOPK, z.shape[-1]), dim=-1).indices  # (C, k)
        return (top[:, 0] == best).sum(), (top == best[:, None]).any(-1).sum()


def alpha_sum(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Σ over rows of α = Σ_v min(softmax(z), p): the acceptance a draft sampled from the head would get (no grad)."""
    with torch.no_grad():
        return torch.minimum(z.softmax(-1), p).sum()


# What one chunk of a token loss gives: (Σ rows' loss (each times its row weight), top-1 count, top-TOPK count, Σ α)
ChunkSums = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TokenLoss:
    """One `loss.kind`: its row losses, and how a chunk of logits is reduced with them (two ways).

    Args:
        name: the `loss.kind` value it is registered under (`TOKEN_LOSSES`).
        rows: (log q, log p) (C, V) each → (C,) row losses, differentiable in log q.
        chunk: (z, t, row_weight) → `ChunkSums`, differentiable in z (the `checkpoint` path); None = from `rows`.
        grad: (z, t, row_weight) → (`ChunkSums`, d Σ / d z (C, V)) without autograd (the `fused` path: z may be
            overwritten by its gradient and t used as scratch); None = autograd over `chunk` for the one chunk.
    """

    name: str
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    chunk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], ChunkSums] | None = None
    grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[ChunkSums, torch.Tensor]] | None = None

    def chunk_sums(self, z: torch.Tensor, t: torch.Tensor, row_weight: torch.Tensor | None) -> ChunkSums:
        """The chunk's sums, differentiable in the head logits z (C, V); t (C, V) the target's logits."""
        if self.chunk is not None:
            return self.chunk(z, t, row_weight)
        rows, alpha = row_loss(self.name, z, t)
        top1, topk = accuracy_counts(z, t.argmax(-1))
        return weighted_sum(rows, row_weight), top1, topk, alpha.sum()

    def chunk_grad(self, z: torch.Tensor, t: torch.Tensor,
                   row_weight: torch.Tensor | None) -> tuple[ChunkSums, torch.Tensor]:
        """The chunk's sums (no grad) and d(Σ loss)/dz (C, V): the kind's closed form when it has one, else autograd
        over this one chunk."""
        if self.grad is not None:
            return self.grad(z, t, row_weight)
        with torch.enable_grad():
            zg = z.detach().requires_grad_()
            rows, a_rows = row_loss(self.name, zg, t)
            (dz,) = torch.autograd.grad(weighted_sum(rows, row_weight), zg)
        top1, topk = accuracy_counts(z, t.argmax(-1))
        return (weighted_sum(rows.detach(), row_weight), top1, topk, a_rows.sum()), dz


def _soft_ce_chunk(z: torch.Tensor, t: torch.Tensor, row_weight: torch.Tensor | None) -> ChunkSums:
    # -Σ p·log_softmax(z) = logsumexp(z) - Σ p·z  (Σ p = 1): no (C, V) log-softmax tensor is kept
    with torch.no_grad():
        p = t.softmax(-1)
    ce = weighted_sum(torch.logsumexp(z, -1) - (p * z).sum(-1), row_weight)
    top1, topk = accuracy_counts(z, p.argmax(-1))
    return ce, top1, topk, alpha_sum(z, p)


def _soft_ce_grad(z: torch.Tensor, t: torch.Tensor, row_weight: torch.Tensor | None) -> tuple[ChunkSums, torch.Tensor]:
    """Soft CE's d/dz written out, softmax(z) − p: in one native pass per row on fp32 CPU (z becomes the gradient in
    place) where that is the faster path on this machine (`kernel_choice`, op "soft_ce"), else in torch."""
    if cpu_kernels.serves(z, t) and kernel_choice.prefers_native("soft_ce", "chunk"):
        # One pass per row in native code: CE, argmax, rank, α, and d CE / d z = softmax(z) - p over z.
        ce_rows, _, rank, alpha = cpu_kernels.soft_ce_(z, t)
        sums = (weighted_sum(ce_rows, row_weight), (rank == 0).sum(), (rank < min(TOPK, z.shape[-1])).sum(),
                alpha.sum())
        return sums, z if row_weight is None else z.mul_(row_weight[:, None])
    return _soft_ce_grad_torch(z, t, row_weight)


def soft_ce_rows_(z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    """Soft CE per row in torch's ops, in place like the native pass: head logits z (C, V) become the gradient
    softmax(z) − p, target logits t (C, V) the target's softmax p; beside them only logsumexp's temporary is ever
    (C, V). Returns (CE (C,), α (C,), the gradient (z), p (t)). No grad."""
    p = t.sub_(t.amax(-1, keepdim=True)).exp_()
    p.div_(p.sum(-1, keepdim=True))
    lse = torch.logsumexp(z, -1)  # (C,)
    # Σ_v p·z per row as a batched dot product: no (C, V) product tensor
    ce = lse - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
    dz = z.sub_(lse[:, None]).exp_().sub_(p)  # d CE / d z = softmax(z) - p
    # α = Σ min(q, p) = 1 - ½ Σ |q - p| per row: a norm of the gradient, no (C, V) minimum
    alpha = 1.0 - 0.5 * torch.linalg.vector_norm(dz, ord=1, dim=-1)
    return ce, alpha, dz, p


def _soft_ce_grad_torch(z: torch.Tensor, t: torch.Tensor,
                        row_weight: torch.Tensor | None) -> tuple[ChunkSums, torch.Tensor]:
    """`_soft_ce_grad` in torch's ops (`soft_ce_rows_`: z becomes the gradient, t the target's softmax)."""
    top1, topk = accuracy_counts(z, t.argmax(-1))
    ce, alpha, dz, _ = soft_ce_rows_(z, t)
    if row_weight is not None:
        dz.mul_(row_weight[:, None])
    return (weighted_sum(ce, row_weight), top1, topk, alpha.sum()), dz


PROBE_CHUNK = (256, 8192)  # (rows, vocabulary) of the probe's logits: a quarter of a default chunk, the demo's V


def _soft_ce_probe_setup() -> Callable[[str], tuple[Callable[[], object], Callable[[], object]]]:
    """One chunk of logits; (the fused native pass, torch's ops) over the same chunk, each after the copy the native
    pass needs (it overwrites both inputs), so that only the loss's work differs."""
    g = torch.Generator().manual_seed(0)
    z0, t0 = torch.randn(*PROBE_CHUNK, generator=g), torch.randn(*PROBE_CHUNK, generator=g)
    z, t = torch.empty_like(z0), torch.empty_like(t0)

    def native() -> None:
        z.copy_(z0), t.copy_(t0)
        _soft_ce_grad(z, t, None)  # its native branch: kernel_choice answers "native" while it measures

    def reference() -> None:
        z.copy_(z0), t.copy_(t0)
        _soft_ce_grad_torch(z, t, None)

    return lambda cls: (native, reference)


kernel_choice.register(kernel_choice.Probe("soft_ce", ("chunk",), _soft_ce_probe_setup, budget_s=0.15))

# The kinds of `loss.kind`, in the order messages list them (the registry is declared on the settings floor, which
# checks the name; its first read imports this module).
TOKEN_LOSSES.add(TokenLoss("soft_ce", _soft_ce, chunk=_soft_ce_chunk, grad=_soft_ce_grad))
TOKEN_LOSSES.add(TokenLoss("rkl", _rkl))
TOKEN_LOSSES.add(TokenLoss("jsd", _jsd))
TOKEN_LOSSES.add(TokenLoss("tv", _tv))
TOKEN_LOSSES.add(TokenLoss("nla", _nla))
TOKEN_LOSSES.add(TokenLoss("lk_hybrid", _lk_hybrid))
TOKEN_LOSSES.add(TokenLoss("argmax_ce", _argmax_ce))


def token_loss(kind: str) -> TokenLoss:
    """The registered token loss `kind`; ValueError naming the known kinds otherwise."""
    return TOKEN_LOSSES.get(kind)


def row_loss(kind: str, z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row losses (C,) (differentiable in z) and α (C,) (no grad) of head logits z and target logits t, (C, V)."""
    loss = token_loss(kind)
    log_q, log_p = z.log_softmax(-1), t.detach().log_softmax(-1)
    rows = loss.rows(log_q, log_p)
    with torch.no_grad():
        alpha = acceptance(log_q.detach(), log_p)
    return rows, alpha
