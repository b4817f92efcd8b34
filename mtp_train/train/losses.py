"""The draft-head training loss: feature regression plus a token loss against the target, vocabulary-chunked.

Per counted row r (a row whose target position is in the loss mask, see `step_targets`):

    loss_r = w_feat · mean_H SmoothL1(ĥ_r, h_r) + w_tok · D(softmax(lm_head(h_r)), softmax(W_d ĥ_r))

D is `loss.kind` (`mtp_train.train.divergences`): soft cross-entropy by default, or an acceptance-aimed loss
(reverse KL, JSD, TV = 1 − α, −log α, the LK hybrid, the hard CE at the target's argmax). What follows is said of
the soft CE; the other kinds are chunked the same way, their d/dz taken by autograd over one chunk at a time.

summed over rows and divided by `num_tokens` (by default the local count of counted rows; a trainer passes
the count over all ranks). The target distribution is recomputed from the stored (bf16) target hidden with
the frozen lm_head, never stored. Logits are computed `chunk_size` rows at a time, so a (T, V) tensor never
exists: `impl="checkpoint"` recomputes each chunk's logits in the backward (torch.utils.checkpoint,
non-reentrant); `impl="fused"` computes the gradient with respect to ĥ chunk by chunk during the forward and
keeps only that (N, H) gradient, which saves the recomputation (about a third of the lm_head work) and half of
the chunk's memory; it is `loss.ce_impl`'s default (checkpoint stays for comparison). In fp32 on
CPU its per-row work (softmaxes, CE, argmax and top-k counts, the gradient softmax(z) − p) runs in one native
kernel (`cpu_kernels.soft_ce_`) that reads each (C, V) chunk once, where torch's ops pass over it ~8 times;
its top-k counts rank the target's argmax among the head's logits, which equals torch's top-k except on exact ties.

With a draft vocabulary, `lm_head` is the target's rows of the draft tokens only (the target distribution is
restricted to them and renormalised; no full-vocabulary target logits), and the head's side W_d is
`head.draft_lm_head()`: the same frozen rows, or the head's own trainable rows (eagle3, whose gradient the fused
path then also computes chunk by chunk). ĥ is `head.logit_input(out)` (eagle3: the final norm of the output it feeds
forward). `loss.mask_out_of_draft` drops positions whose full-vocabulary target argmax is outside the draft
vocabulary, as EAGLE-3 trains (one no-grad argmax pass per batch); the normaliser and num_tokens still count them,
as EAGLE-3's mean does, so top-1 is the share of all loss positions drafted right (those rows are misses).

A block drafter (its `loss_rows` a bool mask of anchors) has many rows per target position across its steps: its
token loss runs over all steps at once, rows grouped by target position, the target's logits once per distinct
position of a chunk (`grouped_token_losses`); the loss and every gradient are the per-step path's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mtp_train.config.errors import ConfigError
from mtp_train.config.loss import CE_IMPLS, LossConfig
from mtp_train.heads import DraftHead, packed_shift, packed_valid, resolve_seq_lens
from mtp_train.heads.packing import step_rows
from mtp_train.heads.sequence import SequenceShard
from mtp_train.layers import cpu_kernels, kernel_choice
from mtp_train.train.divergences import TOPK, ChunkSums, acceptance, soft_ce_rows_, token_loss, weighted_sum
from mtp_train.train.position_weights import dpace_weights, target_argmax_probability

# --- alignment --------------------------------------------------------------------------------------------------


def step_targets(hidden: torch.Tensor, loss_mask: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
                 step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of draft step `step` (0-based) for a packed batch.

    hidden: (T, H) target hidden h_i; loss_mask: (T,) 1 on tokens to learn (assistant tokens).
    Returns target (T, H) = h_{i+step+1} and counted (T,) bool = loss_mask[i+step+1], False on the last
    step+1 rows of each sequence (no target there). The mask travels with the target: row i is counted
    when the position whose hidden it predicts is a masked-in token.
    """
    shift = step + 1
    target = packed_shift(hidden, seq_lens, shift)
    counted = packed_shift(loss_mask.to(torch.bool), seq_lens, shift, fill=False)
    return target, counted


def step_token_counts(loss_mask: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor, steps: int,
                      rows: torch.Tensor | None = None, shard: SequenceShard | None = None) -> torch.Tensor:
    """(steps,) float counted rows per step: all-reduce (sum) it over ranks and pass it as `num_tokens`.

    rows: the head's `loss_rows` (only those rows count: `heads.packing.step_rows`, per step), or None. shard: count
    this rank's rows of the batch only (sequence parallelism: the ranks of a group hold one batch, and each row is
    counted once)."""
    mask = loss_mask.to(torch.bool)
    counted = [packed_shift(mask, seq_lens, j + 1, fill=False) for j in range(steps)]
    if rows is not None:
        counted = [c & step_rows(rows.to(c.device), j) for j, c in enumerate(counted)]
    if shard is not None:  # the pad rows past the batch's end are never counted: the slice may run past it
        counted = [c[shard.lo:shard.hi] for c in counted]
    return torch.stack([c.sum() for c in counted]).float()


def uniform_noise(x: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """x + U(-std, std), elementwise (EAGLE's feature augmentation)."""
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return x + ((2 * u - 1) * std).to(x.dtype)


def step_anchor_seed(seed: int, step: int, micro: int, dp_rank: int) -> int:
    """The seed a block drafter draws one micro-batch's anchors from (`DraftHead.loss_rows`), from (train.seed,
    step, micro-batch, data-parallel rank) alone: fresh every step, so a batch seen again in a later epoch trains
    other anchors; the same for a sequence-parallel group's ranks (they share the data-parallel rank) and for a
    resumed run."""
    return int(np.random.SeedSequence([seed, step, micro, dp_rank, 0xA7C]).generate_state(1, dtype=np.uint64)[0]
               & ((1 << 63) - 1))


def noise_generator(seed: int, step: int, micro: int, rank: int, device: torch.device) -> torch.Generator:
    """A generator for the feature noise of one micro-batch, from (seed, step, micro, rank) alone.

    Stateless, so a resumed run draws exactly the noise the uninterrupted run would have drawn.
    """
    state = int(np.random.SeedSequence([seed, step, micro, rank]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(state & ((1 << 63) - 1))


# --- chunked soft cross-entropy -------------------------------------------------------------------------------


def _logits(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
            target_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, H), (C, H), (V, H) head side, (V, H) target side → head logits z (C, V), target logits (C, V) (no grad).

    The matmuls run in the weights' dtypes; the logits come out in float32 at least (float64 stays float64).
    """
    acc = torch.promote_types(torch.promote_types(weight.dtype, target_weight.dtype), torch.float32)
    z = F.linear(pred.to(weight.dtype), weight).to(acc)
    with torch.no_grad():
        t = F.linear(target.to(target_weight.dtype), target_weight).to(acc)
    return z, t


def _ce_chunk(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, target_weight: torch.Tensor,
              kind: str = "soft_ce", row_weight: torch.Tensor | None = None) -> ChunkSums:
    """The token loss summed over one chunk's rows (each times its row_weight, when given), top-1 / top-k counts
    and Σ α (unweighted): the kind's `chunk_sums` over this chunk's logits."""
    z, t = _logits(pred, target, weight, target_weight)
    return token_loss(kind).chunk_sums(z, t, row_weight)


class _FusedTokenLoss(torch.autograd.Function):
    """The token loss over all rows; d/d pred (and d/d weight when it trains) is computed chunk by chunk in the
    forward, so only (N, H) (and (V, H)) is kept. d/dz comes from the kind's `chunk_grad`: written out where the kind
    has a closed form (soft CE: softmax(z) − p, natively on fp32 CPU), else autograd over the one chunk."""

    @staticmethod
    def forward(ctx, pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                target_weight: torch.Tensor, chunk_size: int, kind: str, row_weight: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = torch.promote_types(torch.promote_types(weight.dtype, target_weight.dtype), torch.float32)
        ce = torch.zeros((), dtype=acc, device=pred.device)
        alpha = torch.zeros((), dtype=acc, device=pred.device)
        top1 = torch.zeros((), dtype=torch.long, device=pred.device)
        topk = torch.zeros_like(top1)
        grad = torch.empty_like(pred) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[2] else None
        loss = token_loss(kind)
        for s in range(0, pred.shape[0], chunk_size):
            chunk = pred[s:s + chunk_size]
            rw = None if row_weight is None else row_weight[s:s + chunk_size].to(acc)
            z, t = _logits(chunk, target[s:s + chunk_size], weight, target_weight)
            (c, a, b, al), dz = loss.chunk_grad(z, t, rw)  # soft CE: its closed form (native on fp32 CPU)
            ce += c
            top1 += a
            topk += b
            alpha += al
            # then through the linear: (C, V) @ (V, H), and (V, C) @ (C, H)
            if grad is not None:
                if dz.dtype == weight.dtype == pred.dtype:
                    torch.mm(dz, weight, out=grad[s:s + chunk_size])
                else:
                    grad[s:s + chunk_size] = (dz.to(weight.dtype) @ weight).to(pred.dtype)
            if grad_w is not None:
                grad_w.addmm_(dz.T, chunk.to(acc))
            # the chunk's (C, V) pair goes before the next one is made (held until rebinding, two chunks' would meet)
            del z, t, dz
        ctx.has = (grad is not None, grad_w is not None)
        ctx.save_for_backward(grad if grad is not None else torch.empty(0),
                              grad_w.to(weight.dtype) if grad_w is not None else torch.empty(0))
        ctx.mark_non_differentiable(top1, topk, alpha)
        return ce, top1, topk, alpha

    @staticmethod
    def backward(ctx, g_ce: torch.Tensor, *_: torch.Tensor):  # type: ignore[override]
        grad, grad_w = ctx.saved_tensors
        gp = grad * g_ce.to(grad.dtype) if ctx.has[0] else None
        gw = grad_w * g_ce.to(grad_w.dtype) if ctx.has[1] else None
        return gp, None, gw, None, None, None, None


def chunked_soft_ce(pred: torch.Tensor, target: torch.Tensor, lm_head: torch.Tensor, chunk_size: int = 1024,
                    impl: str = "checkpoint", pred_head: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of the head's distribution against the target's, summed over rows: `chunked_token_loss`
    of kind soft_ce without its α (see there)."""
    return chunked_token_loss(pred, target, lm_head, chunk_size, impl, pred_head)[:3]


def chunked_token_loss(pred: torch.Tensor, target: torch.Tensor, lm_head: torch.Tensor, chunk_size: int = 1024,
                       impl: str = "checkpoint", pred_head: torch.Tensor | None = None, kind: str = "soft_ce",
                       row_weight: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token loss of `kind` (`mtp_train.train.divergences`) of the head's distribution against the target's,
    summed over rows, with top-k counts and Σ α (the acceptance rate a sampled draft would get, summed).

    pred: (N, H) head features ĥ (differentiable); target: (N, H) target hidden h; lm_head: (V, H) frozen, the
    target's side; pred_head: (V, H) the head's side (None = lm_head; a trainable one gets its gradient).
    Returns (loss_sum scalar in float32 or wider, top1 count, top3 count, α sum): top-k = the target's argmax is
    among the head's k most likely tokens. At most `chunk_size` rows of (·, V) logits exist at a time. Gradients
    reach `pred` and a trainable `pred_head` only (the target and the target's lm_head are constants).
    row_weight: (N,) constants multiplying each row's loss (and gradient); top-k and α stay unweighted counts.
    """
    if impl not in CE_IMPLS:
        raise ValueError(f"unknown ce impl {impl!r}; choose one of {', '.join(CE_IMPLS)}")
    n = pred.shape[0]
    w = lm_head.detach() if pred_head is None else pred_head
    grad = torch.is_grad_enabled() and (pred.requires_grad or w.requires_grad)
    token_loss(kind)  # an unknown kind is refused here, naming the known ones
    if impl == "fused" and grad:
        return _FusedTokenLoss.apply(pred, target.detach(), w, lm_head.detach(), chunk_size, kind,
                                     None if row_weight is None else row_weight.detach())
    acc = torch.promote_types(torch.promote_types(lm_head.dtype, w.dtype), torch.float32)
    ce = torch.zeros((), dtype=acc, device=pred.device)
    alpha = torch.zeros((), dtype=acc, device=pred.device)
    top1 = torch.zeros((), dtype=torch.long, device=pred.device)
    topk = torch.zeros_like(top1)
    for s in range(0, n, chunk_size):
        rw = None if row_weight is None else row_weight[s:s + chunk_size].detach()
        args = (pred[s:s + chunk_size], target[s:s + chunk_size].detach(), w, lm_head.detach(), kind, rw)
        # Non-reentrant: unrolled steps reuse one module, which reentrant checkpointing breaks under ZeRO-2.
        c, a, b, al = checkpoint(_ce_chunk, *args, use_reentrant=False) if grad else _ce_chunk(*args)
        ce = ce + c
        top1 += a
        topk += b
        alpha += al.detach()
    return ce, top1, topk, alpha


# --- the losses -------------------------------------------------------------------------------------------------


def draft_loss(pred: torch.Tensor, target: torch.Tensor, counted: torch.Tensor, lm_head: torch.Tensor,
               num_tokens: float | torch.Tensor | None = None, *, w_feat: float = 1.0, w_tok: float = 0.1,
               smooth_l1_beta: float = 1.0, chunk_size: int = 1024, impl: str = "checkpoint",
               pred_head: torch.Tensor | None = None, kind: str = "soft_ce", row_weight: torch.Tensor | None = None,
               tok: ChunkSums | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one draft step.

    pred: (T, H) head output (what its lm_head reads); target: (T, H) target hidden of the same rows; counted:
    (T,) bool rows to learn; lm_head: (V, H) frozen, the target's side; pred_head: the head's side (None =
    lm_head); num_tokens: the normaliser (None → counted.sum(); a trainer passes the global count).
    Rows not counted are dropped before any arithmetic, so their values (even NaN) never matter.
    kind: the token loss (`mtp_train.train.divergences`); row_weight: (T,) constant weights of the rows' feature and
    token losses (D-PACE, `mtp_train.train.position_weights`), None = 1.
    Returns (loss, metrics): loss, feat_loss, tok_loss, top1, top3, alpha (the mean acceptance α of a draft
    sampled from the head), each a sum over this batch's rows divided by num_tokens (so they add up over ranks),
    and num_tokens = this batch's counted rows.
    tok: the token loss's sums over the counted rows, computed already (`grouped_token_losses`: a block drafter's
    steps share target positions), as constants: the loss then carries no token-loss gradient (the caller adds it).
    """
    idx = counted.nonzero().squeeze(1)
    p, t = pred[idx], target[idx]  # (N, H)
    n_local = torch.tensor(float(idx.numel()), device=pred.device)
    denom = n_local if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32, device=pred.device)
    denom = denom.clamp_min(1.0)  # a batch without counted rows gives a zero (still differentiable) loss
    acc = torch.promote_types(pred.dtype, torch.float32)  # bf16 features are compared in float32
    rw = None if row_weight is None else row_weight.detach()[idx]
    # A head whose logit input carries more than its feature (dspark: the Markov embedding after it) compares the
    # feature, its first H columns.
    feat = weighted_sum(F.smooth_l1_loss(p[:, :t.shape[-1]].to(acc), t.to(acc), reduction="none",
                                         beta=smooth_l1_beta).mean(-1), rw)
    if tok is None:
        ce, top1, top3, alpha = chunked_token_loss(p, t, lm_head, chunk_size, impl, pred_head, kind, rw)
    else:
        ce, top1, top3, alpha = tok
    feat_loss, tok_loss = feat / denom, ce / denom
    loss = w_feat * feat_loss + w_tok * tok_loss
    metrics = {
        "loss": loss.detach(),
        "feat_loss": feat_loss.detach(),
        "tok_loss": tok_loss.detach(),
        "top1": top1.float() / denom,
        "top3": top3.float() / denom,
        "alpha": alpha.float() / denom,
        "num_tokens": n_local,
    }
    return loss, metrics


def in_draft_vocab(head: DraftHead, hidden: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor | None:
    """(T,) bool: the target's full-vocabulary argmax at each row lies in the head's draft vocabulary (EAGLE-3's
    position mask); None without a draft vocabulary. No grad; `chunk_size` rows of (·, V) logits at a time."""
    dv = head.draft_vocab
    if dv is None:
        return None
    w = head.require_frozen().lm_head
    member = torch.zeros(w.shape[0], dtype=torch.bool, device=hidden.device)
    member[dv.to(hidden.device)] = True
    with torch.no_grad():
        best = torch.cat([F.linear(hidden[s:s + chunk_size].to(w.dtype), w).argmax(-1)
                          for s in range(0, hidden.shape[0], chunk_size)])
    return member[best]


def _counted_rows(hidden: torch.Tensor, loss_mask: torch.Tensor, lens: list[int], step: int,
                  in_vocab: torch.Tensor | None, rows: torch.Tensor | None = None, span: slice = slice(None),
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step `step`'s target rows (R, H), its counted rows (R,) bool (the head's `loss_rows` and in_vocab applied)
    and the count before in_vocab: of the batch's rows `span` (a sequence shard's own; default all, R = T). The
    targets and the mask are read from the whole batch (row i's target is row i + step + 1); only the span's target
    rows are gathered (a sequence shard holds R of the T rows, not a shifted copy of the whole batch)."""
    shift = step + 1
    valid = packed_valid(lens, shift, hidden.device)
    own = torch.arange(hidden.shape[0], device=hidden.device)[span]
    ok = valid[span]
    src = torch.where(ok, own + shift, own)
    target = torch.where(ok.view(-1, *([1] * (hidden.dim() - 1))), hidden[src], torch.zeros((), dtype=hidden.dtype,
                                                                                           device=hidden.device))
    counted, n_all = _counted_mask(loss_mask, lens, step, in_vocab, rows, span)
    return target, counted, n_all


def _counted_mask(loss_mask: torch.Tensor, lens: list[int], step: int, in_vocab: torch.Tensor | None,
                  rows: torch.Tensor | None = None, span: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """`_counted_rows` without the targets: step `step`'s counted rows (R,) bool of the rows `span` and the count
    before in_vocab. A counted row i's target is row i + step + 1 of the batch (it lies in the row's sequence)."""
    shift = step + 1
    counted = packed_shift(loss_mask.to(torch.bool), lens, shift, fill=False)
    if rows is not None:
        counted = counted & step_rows(rows, step)
    if in_vocab is not None:
        kept = counted & packed_shift(in_vocab, lens, shift, fill=False)
    counted = counted[span]
    n_all = counted.sum().float()
    if in_vocab is not None:
        counted = kept[span]
    return counted, n_all


def row_weights(head: DraftHead, preds: list[torch.Tensor], hidden: torch.Tensor, loss_mask: torch.Tensor,
                lens: list[int], cfg: LossConfig, in_vocab: torch.Tensor | None,
                rows: torch.Tensor | None = None, span: slice = slice(None)) -> list[torch.Tensor | None]:
    """Per step, the (R,) row weights of `cfg.position_weights` (None for `decay`, whose weights are per step):
    D-PACE's from one no-grad lm_head pass per step over the head's predictions (of the batch's rows `span`)."""
    if cfg.position_weights != "dpace":
        return [None] * len(preds)
    conf, masks = [], []
    for j, pred in enumerate(preds):
        target, counted, _ = _counted_rows(hidden, loss_mask, lens, j, in_vocab, rows, span)
        # Only the counted rows: dpace_weights ignores the others, and a block head counts a quarter of its rows
        # or fewer (its anchors), so the two lm_head passes over every row were most of a step's forward.
        idx = counted.nonzero().squeeze(1)
        q = torch.ones(counted.shape[0], dtype=torch.float32, device=counted.device)
        q[idx] = target_argmax_probability(head.logit_input(pred.detach()[idx]), target[idx],
                                           head.draft_lm_head().detach(), head.lm_head_weight(), cfg.chunk_size)
        conf.append(q)
        masks.append(counted)
    return list(dpace_weights(torch.stack(conf), torch.stack(masks), cfg.dpace_alpha).unbind(0))


# --- the token loss of rows that share target positions (block drafters) ----------------------------------------
#
# A block drafter's rows do not map 1:1 to target positions: slot j of anchor a and slot j-1 of anchor a+1 predict
# the same token, so with A anchors of B slots a position is the target of up to B-1 rows (about A·(B-1) / P of
# them on average over the P distinct positions). `grouped_token_losses` takes every step's counted rows at once,
# ordered by target position and cut into chunks of `loss.chunk_size` rows, so the target's lm_head runs once per
# distinct position of a chunk and its logits are read by every row of that position. It also takes each row's
# head logits once in the forward for the loss values, the metrics and D-PACE's confidence together (the per-step
# path ran the head's lm_head twice and the target's twice there, and once more each under `checkpoint`); the
# gradient is the fused path's (computed in that pass, scaled by the row weights once they are known) or, under
# `checkpoint` and for a trainable head-side lm_head, recomputed chunk by chunk in the backward. The loss, the
# metrics and every gradient are the per-step path's up to float rounding (tests/test_losses.py compares them).


def _target_chunks(pos: torch.Tensor, chunk_size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """pos (N,) each row's target position → the rows grouped by position, in chunks of at most `chunk_size`:
    per chunk (rows (C,) long, its distinct positions u (U,) ascending, inverse (C,): row k's position is
    u[inverse[k]])."""
    order = torch.argsort(pos, stable=True)
    out = []
    for s in range(0, pos.shape[0], chunk_size):
        rows = order[s:s + chunk_size]
        u, inv = torch.unique_consecutive(pos[rows], return_inverse=True)
        out.append((rows, u, inv))
    return out


def _chunk_logits(x: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target_weight: torch.Tensor,
                  rows: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of `_target_chunks`: head logits z (C, V) of x[rows] (x (N, H) detached) and the target's logits
    (U, V) of its distinct positions u, the target's lm_head run on those rows of `hidden` (T, H) only. No grad."""
    acc = torch.promote_types(torch.promote_types(weight.dtype, target_weight.dtype), torch.float32)
    with torch.no_grad():
        z = F.linear(x.index_select(0, rows).to(weight.dtype), weight).to(acc)
        t_u = F.linear(hidden.index_select(0, u).to(target_weight.dtype), target_weight).to(acc)
    return z, t_u


def _rows_of(per_position: torch.Tensor, inv: torch.Tensor, rows: int) -> torch.Tensor:
    """A chunk's per-position values (U, ...) → per row (C, ...) (row k's position inv[k]): the tensor itself when
    every row has its own position (inv is then 0..C-1), else a fresh copy."""
    return per_position if per_position.shape[0] == rows else per_position.index_select(0, inv)


def _softmax_at_max(t: torch.Tensor, block: int = 64) -> torch.Tensor:
    """softmax(t) at each row's argmax, (U, V) → (U,): exp(max − logsumexp) a `block` of rows at a time, so that
    logsumexp's (rows, V) temporary stays small beside the chunk's logits."""
    return torch.cat([(b.amax(-1) - torch.logsumexp(b, -1)).exp_() for b in t.split(block)])


def _row_stats(z: torch.Tensor, t_u: torch.Tensor, inv: torch.Tensor, kind: str, grad: bool,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row of one chunk of head logits z (C, V) against the target logits t_u (U, V) of its distinct positions
    (row k's are t_u[inv[k]]): (the token loss of `kind` (C,), top-1 hit (C,) bool, top-TOPK hit (C,) bool, α (C,),
    the head's probability of the target's argmax (C,) (D-PACE's confidence), d loss_r / d z_r (C, V) unweighted
    when `grad`, else None). z and t_u may be overwritten.

    The values are those of the kind's `chunk_sums` row by row: soft CE's closed form (natively on fp32 CPU, as its
    fused path), the other kinds' row losses; top-k and α as `divergences.accuracy_counts` and `alpha_sum`."""
    k = min(TOPK, z.shape[-1])
    t = _rows_of(t_u, inv, z.shape[0])
    if kind == "soft_ce" and cpu_kernels.serves(z, t) and kernel_choice.prefers_native("soft_ce", "chunk"):
        with torch.no_grad():  # softmax(t) at its argmax, per position, before the kernel takes t as scratch
            p_best = _rows_of(_softmax_at_max(t_u), inv, z.shape[0])
        ce, best, rank, alpha = cpu_kernels.soft_ce_(z, t)  # z becomes softmax(z) − softmax(t)
        q = (z.gather(1, best[:, None]).squeeze(1) + p_best).clamp_(0.0, 1.0)
        return ce, rank == 0, rank < k, alpha, q, z if grad else None
    with torch.no_grad():
        best = t.argmax(-1)
        top = z.topk(k, dim=-1).indices
        top1, topk = top[:, 0] == best, (top == best[:, None]).any(-1)
    if kind == "soft_ce":  # −Σ p·log_softmax(z) = logsumexp(z) − Σ p·z, d/dz = softmax(z) − p
        with torch.no_grad():
            ce, alpha, dz, p = soft_ce_rows_(z, t)  # in place: z becomes softmax(z) − p, t becomes p
            q = (dz.gather(1, best[:, None]) + p.gather(1, best[:, None])).squeeze(1).clamp_(0.0, 1.0)
            return ce, top1, topk, alpha, q, dz if grad else None
    with torch.enable_grad():
        zg = z.detach().requires_grad_(grad)
        log_q = zg.log_softmax(-1)
        log_p = t.detach().log_softmax(-1)
        loss = token_loss(kind).rows(log_q, log_p)
        dz = torch.autograd.grad(loss.sum(), zg)[0] if grad else None
    with torch.no_grad():
        alpha = acceptance(log_q.detach(), log_p)
        q = log_q.detach().gather(1, best[:, None]).squeeze(1).exp_()
    return loss.detach(), top1, topk, alpha, q, dz


class _GroupedTokenLoss(torch.autograd.Function):
    """Σ_r scale_r · loss_r over the rows of `grouped_token_losses`, its value computed already: the forward returns
    it, the backward gives d/dx (and d/dw when the head's side of the lm_head trains) from the unweighted per-row
    gradient rows computed in the forward (g_rows (N, H), `fused` with a frozen w), or recomputes each chunk's
    logits and gradient (`checkpoint`, or a trainable w)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                scale: torch.Tensor, g_rows: torch.Tensor | None, hidden: torch.Tensor, target_weight: torch.Tensor,
                chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], kind: str) -> torch.Tensor:
        ctx.has_rows = g_rows is not None
        ctx.save_for_backward(x, w, scale, g_rows if g_rows is not None else torch.empty(0))
        ctx.plan = (hidden, target_weight, chunks, kind)
        return value.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w, scale, g_rows = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rw = scale * g.to(scale.dtype)  # (N,) each row's weight in the caller's objective
        if ctx.has_rows:
            return g_rows * rw[:, None].to(g_rows.dtype), None, None, None, None, None, None, None, None
        hidden, target_weight, chunks, kind = ctx.plan
        acc = torch.promote_types(torch.promote_types(w.dtype, target_weight.dtype), torch.float32)
        loss = token_loss(kind)
        gx = torch.zeros_like(x) if need_x else None
        gw = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        wd = w.detach()
        for rows, u, inv in chunks:
            z, t_u = _chunk_logits(x, hidden, wd, target_weight, rows, u)
            # (chunk_grad may take the rows' logits as scratch: t_u has no reader after it)
            _, dz = loss.chunk_grad(z, _rows_of(t_u, inv, rows.numel()), rw.index_select(0, rows))
            if gx is not None:
                gx.index_copy_(0, rows, (dz.to(wd.dtype) @ wd).to(x.dtype))
            if gw is not None:
                gw.addmm_(dz.T, x.index_select(0, rows).to(acc))
            del z, t_u, dz  # before the next chunk's logits
        return gx, None if gw is None else gw.to(w.dtype), None, None, None, None, None, None, None


def grouped_token_losses(head: DraftHead, preds: list[torch.Tensor], hidden: torch.Tensor, loss_mask: torch.Tensor,
                         lens: list[int], cfg: LossConfig, in_vocab: torch.Tensor | None,
                         rows: torch.Tensor | None = None, span: slice = slice(None),
                         num_tokens: Sequence[float] | torch.Tensor | None = None,
                         ) -> tuple[list[ChunkSums], list[torch.Tensor | None], torch.Tensor | None]:
    """The token loss of every step at once, its rows grouped by target position (the section's comment).

    preds: per step (R, H) the head's output over the batch's rows `span`; the other arguments are `unrolled_loss`'s
    (hidden (T, H) the whole batch's). Returns (per step its `ChunkSums` (loss sum weighted by the row weights, top-1
    and top-3 counts, Σ α), detached: `step_loss`'s `tok`; per step the (R,) row weights of `cfg.position_weights`
    (`row_weights`'s); a scalar that is zero but carries the gradient of Σ_j w_j · w_tok · loss_j / denom_j (the
    token part of `unrolled_loss`'s total; None without grad)), denom_j `draft_loss`'s normaliser of step j."""
    steps, dev = len(preds), hidden.device
    own = torch.arange(hidden.shape[0], device=dev)[span]
    masks, n_alls, idxs, xs, pos, step_of = [], [], [], [], [], []
    for j, pred in enumerate(preds):
        counted, n_all = _counted_mask(loss_mask, lens, j, in_vocab, rows, span)
        idx = counted.nonzero().squeeze(1)
        masks.append(counted)
        n_alls.append(n_all)
        idxs.append(idx)
        xs.append(head.logit_input(pred[idx]))  # a row's logit input is its own row's (a norm at most)
        pos.append(own[idx] + (j + 1))  # counted rows have their target in their sequence
        step_of.append(torch.full_like(idx, j))
    x, all_pos, all_step, all_idx = torch.cat(xs), torch.cat(pos), torch.cat(step_of), torch.cat(idxs)
    w, tw = head.draft_lm_head(), head.lm_head_weight().detach()
    acc = torch.promote_types(torch.promote_types(w.dtype, tw.dtype), torch.float32)
    n = x.shape[0]
    grad = torch.is_grad_enabled() and n > 0 and (x.requires_grad or w.requires_grad)
    # the fused path's gradient rows are computed in this pass when the head-side lm_head is frozen (dflash);
    # a trainable one (dspark's Markov columns) needs the row weights in its gradient sum: recomputed in the backward
    rows_in_forward = grad and cfg.ce_impl == "fused" and not w.requires_grad
    chunks = _target_chunks(all_pos, cfg.chunk_size)
    loss_r = torch.empty(n, dtype=acc, device=dev)
    alpha_r = torch.empty(n, dtype=acc, device=dev)
    conf_r = torch.empty(n, dtype=torch.float32, device=dev)
    top1_r = torch.empty(n, dtype=torch.bool, device=dev)
    topk_r = torch.empty(n, dtype=torch.bool, device=dev)
    g_rows = torch.empty(x.shape, dtype=x.dtype, device=dev) if rows_in_forward else None
    xd, wd = x.detach(), w.detach()
    for r, u, inv in chunks:
        z, t_u = _chunk_logits(xd, hidden, wd, tw, r, u)
        c, a, b, al, q, dz = _row_stats(z, t_u, inv, cfg.kind, rows_in_forward)
        loss_r[r], top1_r[r], topk_r[r], alpha_r[r], conf_r[r] = c.to(acc), a, b, al.to(acc), q.float()
        if g_rows is not None and dz is not None:
            g_rows.index_copy_(0, r, (dz.to(wd.dtype) @ wd).to(x.dtype))
        del z, t_u, dz  # before the next chunk's logits
    rw_steps: list[torch.Tensor | None] = [None] * steps
    rw_r = None
    if cfg.position_weights == "dpace":
        conf = torch.ones(steps, masks[0].shape[0], dtype=torch.float32, device=dev)
        conf[all_step, all_idx] = conf_r
        weights = dpace_weights(conf, torch.stack(masks), cfg.dpace_alpha)  # (S, R)
        rw_steps = list(weights.unbind(0))
        rw_r = weights[all_step, all_idx].to(acc)
    weighted = loss_r if rw_r is None else loss_r * rw_r
    ce_s = torch.zeros(steps, dtype=acc, device=dev).index_add_(0, all_step, weighted)
    alpha_s = torch.zeros(steps, dtype=acc, device=dev).index_add_(0, all_step, alpha_r)
    top1_s = torch.zeros(steps, dtype=torch.long, device=dev).index_add_(0, all_step, top1_r.long())
    topk_s = torch.zeros(steps, dtype=torch.long, device=dev).index_add_(0, all_step, topk_r.long())
    toks: list[ChunkSums] = [(ce_s[j], top1_s[j], topk_s[j], alpha_s[j]) for j in range(steps)]
    if not grad:
        return toks, rw_steps, None
    per_step = []
    for j, wj in enumerate(cfg.weights()):  # d total / d loss_sum_j, as `draft_loss` and `unrolled_loss` weigh it
        nt = num_tokens[j] if num_tokens is not None else (n_alls[j] if in_vocab is not None else masks[j].sum())
        denom = torch.as_tensor(nt, dtype=torch.float32, device=dev).clamp_min(1.0)
        per_step.append(wj * cfg.w_tok / denom.to(acc))
    scale = torch.stack(per_step)[all_step]
    if rw_r is not None:
        scale = scale * rw_r
    value = (scale * loss_r).sum()
    out = _GroupedTokenLoss.apply(x, w, value, scale, g_rows, hidden, tw, chunks, cfg.kind)
    return toks, rw_steps, out - out.detach()


def step_loss(head: DraftHead, out: torch.Tensor, hidden: torch.Tensor, loss_mask: torch.Tensor, lens: list[int],
              step: int, cfg: LossConfig, num_tokens: float | torch.Tensor | None,
              in_vocab: torch.Tensor | None = None, row_weight: torch.Tensor | None = None,
              rows: torch.Tensor | None = None, span: slice = slice(None), tok: ChunkSums | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`draft_loss` of draft step `step` of a head: out (R, H) its output, hidden (T, H) the target's final hidden.

    The head's lm_head reads `head.logit_input(out)` through `head.draft_lm_head()`; the target's distribution
    comes from its own lm_head rows of the draft vocabulary. in_vocab (T,) (see `in_draft_vocab`): rows whose
    target position is out of the draft vocabulary are not counted; rows (T,): the head's `loss_rows`, or None;
    span: the batch's rows `out` holds (a sequence shard's own, R of them; default all, R = T); tok: the step's
    token-loss sums computed already, constants (`draft_loss`).
    """
    target, counted, n_all = _counted_rows(hidden, loss_mask, lens, step, in_vocab, rows, span)
    if in_vocab is not None:
        num_tokens = n_all if num_tokens is None else num_tokens
    loss, m = draft_loss(head.logit_input(out), target, counted, head.lm_head_weight(), num_tokens, w_feat=cfg.w_feat,
                         w_tok=cfg.w_tok, smooth_l1_beta=cfg.smooth_l1_beta, chunk_size=cfg.chunk_size,
                         impl=cfg.ce_impl, pred_head=head.draft_lm_head(), kind=cfg.kind, row_weight=row_weight,
                         tok=tok)
    extra = head.step_extra_loss(out, target, counted)  # a head's own term (dspark's confidence head), a sum
    if extra is not None:
        denom = torch.as_tensor(counted.sum() if num_tokens is None else num_tokens, dtype=torch.float32,
                                device=out.device).clamp_min(1.0)
        loss = loss + extra[0] / denom
        m.update({k: v / denom for k, v in extra[1].items()}, loss=loss.detach())
    if row_weight is not None:
        # the mean D-PACE weight of the rows, over the same normaliser as the others (so it adds up over ranks)
        denom = torch.as_tensor(n_all if num_tokens is None else num_tokens, dtype=torch.float32)
        m["pos_weight"] = row_weight[counted].sum() / denom.to(row_weight.device).clamp_min(1.0)
    m["num_tokens"] = n_all  # masked-out rows stay in every normaliser: their top-1 counts as a miss
    return loss, m


def head_inputs(head: DraftHead, hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> torch.Tensor:
    """Step 0's input rows: (T, k·H) aux features for an aux head (refused when missing), else the final hidden."""
    if not head.aux_layers:
        return hidden
    if aux_hidden is None or aux_hidden.shape[-1] != head.input_width:
        got = None if aux_hidden is None else tuple(aux_hidden.shape)
        raise ValueError(f"the {head.type_name} head reads aux layers {head.aux_layers} ((T, {head.input_width}) "
                         f"features), got {got}")
    return aux_hidden


def unrolled_loss(head: DraftHead, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  seq_lens: Sequence[int] | torch.Tensor, cfg: LossConfig,
                  num_tokens: Sequence[float] | torch.Tensor | None = None,
                  generator: torch.Generator | None = None,
                  aux_hidden: torch.Tensor | None = None, *, shard: SequenceShard | None = None,
                  checkpoint: bool = False, every_row: bool = False, anchor_seed: int | None = None,
                  group_targets: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss of a packed batch over `cfg.steps` chained draft steps.

    hidden: (T, H) stored target hidden h_i (the targets, and the input of a final-features head); aux_hidden:
    (T, k·H) the head's aux layers (its input when `head.aux_layers`); input_ids: (T,) tokens t_i; loss_mask: (T,);
    seq_lens: (B,). Step j is aligned as in `mtp_train.heads.base` (row i predicts h_{i+j+1}, counted by
    loss_mask[i+j+1]). num_tokens: per-step normalisers (steps,) (None → local counts; see `step_token_counts`).
    In training mode, uniform noise of `cfg.noise_std` is added to the input features (never to the targets).
    shard: sequence parallelism (`heads/sequence.py`): every rank passes the batch whole; the targets, counted
    rows and noise are taken from the whole batch (so they are those of an unsharded run), then the head unrolls
    this rank's rows and the loss and metrics are this rank's rows' share (they add up over the group's ranks:
    num_tokens must then count each row once, `step_token_counts(..., shard=shard)`). checkpoint: the head's
    unrolled steps are recomputed in the backward (train.activation_checkpointing). every_row: score every row, not
    only the head's `loss_rows` (a block drafter's sampled anchors), as its inference path does (evaluation).
    anchor_seed: the seed of those anchors' draw (`step_anchor_seed`; the trainer's counts must use the same), or
    None: a draw fixed by the batch. group_targets: a block drafter's token loss over all steps at once, its rows
    grouped by target position (`grouped_token_losses`); False: step by step (the same loss and gradients, slower).
    Returns (Σ_j w_j · loss_j, metrics): loss (the total), step{j}/{loss,feat_loss,tok_loss,top1,top3,
    num_tokens} and the step-0 values without prefix.
    """
    lens = resolve_seq_lens(hidden.shape[0], seq_lens)
    if num_tokens is not None and len(num_tokens) != cfg.steps:
        raise ValueError(f"{len(num_tokens)} num_tokens for {cfg.steps} steps")
    x = head_inputs(head, hidden, aux_hidden)
    made_here = False  # x a tensor of this function's (not a view of the caller's batch)
    if head.training and cfg.noise_std > 0:
        x = uniform_noise(x, cfg.noise_std, generator)  # the whole batch's draw, whatever the shard
        made_here = True
    in_vocab = None
    if cfg.mask_out_of_draft:
        if shard is None:
            in_vocab = in_draft_vocab(head, hidden, cfg.chunk_size)
        else:  # only the rows this rank's steps read (its own and the `steps` after them): an lm_head pass each
            lo, hi = shard.lo, min(shard.hi + cfg.steps, hidden.shape[0])
            part = in_draft_vocab(head, hidden[lo:hi], cfg.chunk_size) if lo < hi else None
            if part is not None:
                in_vocab = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
                in_vocab[lo:hi] = part
            elif head.draft_vocab is not None:  # a rank holding only pad rows
                in_vocab = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    rows = None if every_row else head.loss_rows(input_ids, loss_mask, lens, anchor_seed)  # a block drafter's
    options: dict[str, object] = {} if rows is None else {"rows": rows}
    span = slice(None)
    if shard is not None:
        # the pad sequence: never counted, never an anchor, attended by none of the batch's rows
        hidden, x, input_ids = shard.padded(hidden), shard.padded(x), shard.padded(input_ids)
        loss_mask, lens = shard.padded(loss_mask), shard.padded_lens(lens)
        in_vocab = None if in_vocab is None else shard.padded(in_vocab, False)
        if rows is not None:
            rows = options["rows"] = shard.padded(rows, False)
        x, span = shard.local(x), slice(shard.lo, shard.hi)
        if made_here or shard.pad:  # keep this rank's rows, not a view that holds the whole batch's (T, k·H) alive
            x = x.clone()
        options["shard"] = shard
    if checkpoint:
        options["checkpoint"] = True
    refuse_unroll_options(head, options)
    preds = head.unroll(x, input_ids, lens, cfg.steps, cfg.unroll_attention, **options)
    toks: list[ChunkSums | None] = [None] * cfg.steps
    tok_grad = None
    if group_targets and rows is not None and rows.dtype == torch.bool:  # a block drafter: steps share positions
        grouped, rows_w, tok_grad = grouped_token_losses(head, preds, hidden, loss_mask, lens, cfg, in_vocab, rows,
                                                         span, num_tokens)
        toks = list(grouped)
    else:
        rows_w = row_weights(head, preds, hidden, loss_mask, lens, cfg, in_vocab, rows, span)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    metrics: dict[str, torch.Tensor] = {}
    for j, (pred, w) in enumerate(zip(preds, cfg.weights())):
        loss_j, m = step_loss(head, pred, hidden, loss_mask, lens, j, cfg,
                              None if num_tokens is None else num_tokens[j], in_vocab, rows_w[j], rows, span,
                              toks[j])
        total = total + w * loss_j
        metrics.update({f"step{j}/{k}": v for k, v in m.items()})
    if tok_grad is not None:  # zero: the token losses' gradient, their values being in the steps' (detached)
        total = total + tok_grad.to(total.dtype)
    metrics.update({k: metrics[f"step0/{k}"] for k in ("feat_loss", "tok_loss", "top1", "top3", "alpha",
                                                        "num_tokens")})
    metrics["loss"] = total.detach()
    return total, metrics


UNROLL_OPTION_SETTINGS = {"shard": "train.sequence_parallel", "checkpoint": "train.activation_checkpointing"}


def refuse_unroll_options(head: DraftHead | type[DraftHead], options: Sequence[str]) -> None:
    """Refuse, naming the setting, an unroll keyword (`shard`, `checkpoint`) the head type's `unroll` does not take."""
    for name, setting in UNROLL_OPTION_SETTINGS.items():
        if name in options and not head.accepts_unroll_option(name):
            raise ConfigError(f"{setting}: the {head.type_name} head type's training unroll does not support it "
                              f"(its unroll takes no `{name}`); train it without {setting}")


# --- the module DeepSpeed trains ---------------------------------------------------------------------------------


class HeadLoss(nn.Module):
    """The module DeepSpeed wraps: a draft head and its training loss.

    Its parameters are exactly the head's (named `head.*`); the loss is computed inside `forward` so that the
    engine's forward and backward hooks see one call per micro-batch.
    """

    def __init__(self, head: DraftHead, loss_cfg: LossConfig, checkpoint: bool = False) -> None:
        super().__init__()
        self.head = head
        self.loss_cfg = loss_cfg
        self.checkpoint = checkpoint  # train.activation_checkpointing

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                seq_lens: Sequence[int], num_tokens: torch.Tensor, generator: torch.Generator | None = None,
                aux_hidden: torch.Tensor | None = None, shard: SequenceShard | None = None,
                anchor_seed: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """hidden: (T, H); input_ids, loss_mask: (T,); seq_lens: (B,); num_tokens: (steps,) global counts;
        aux_hidden: (T, k·H) the head's aux layers, or None; shard: this rank's rows under sequence parallelism;
        anchor_seed: a block drafter's anchor draw (`step_anchor_seed`), the one its counts used.

        Returns `unrolled_loss`'s (loss, metrics): sums over this micro-batch (this rank's rows of it) divided by
        the global counts.
        """
        return unrolled_loss(self.head, hidden, input_ids, loss_mask, seq_lens, self.loss_cfg,
                             num_tokens=num_tokens, generator=generator, aux_hidden=aux_hidden, shard=shard,
                             checkpoint=self.checkpoint and self.training, anchor_seed=anchor_seed)
