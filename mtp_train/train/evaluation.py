"""Validation loss and top-k of a head, measured through its inference path (its head type's `inference_path`).

For the chain head types (`speculative.chain.inference_chain`) step 0 is the engine-style prefill of the val
sequences over the target's hidden states, and step j > 0 drafts from every position at once, one decode step per
chain over the head's paged KV cache. Step j's top-1 is the share of positions where a chain started there drafts
the target's own next token at its (j+1)-th draft.

Under sequence parallelism (train.sequence_parallel > 1) no rank runs a whole long sample: each batch is split over
the group's ranks as in training and scored by the head's training unroll without gradients (`unrolled_loss` with
the batch's shard, every row scored): the chain unroll is the inference chain (its attention reproduces the drafts'
caches) and a block drafter's inference path is its unroll from every position, so the numbers are the inference
path's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.distributed as tdist

from mtp_train.config import LossConfig, head_type
from mtp_train.heads import DraftHead
from mtp_train.heads.sequence import SequenceShard
from mtp_train.train.data import PackedBatch
from mtp_train.train.losses import head_inputs, in_draft_vocab, step_loss, unrolled_loss

SUMMED = ("feat_loss", "tok_loss", "top1", "top3", "alpha", "num_tokens")  # per-step sums; the count comes last


@torch.no_grad()
def evaluate(head: DraftHead, batches: Iterable[PackedBatch], loss_cfg: LossConfig, device: torch.device,
             world: int = 1, aux_columns: torch.Tensor | None = None,
             shard_of: Callable[[int], SequenceShard | None] | None = None) -> dict[str, float]:
    """Loss and top-1 / top-3 per draft step on `batches`, with the head's inference path (`HeadType.inference_path`).

    aux_columns: the columns of the batches' aux_hidden an aux head reads (`train.data.aux_columns`; None = all).
    shard_of: rows → this rank's shard of a batch of that many rows (sequence parallelism: the ranks of a group pass
    the same batches, each scores its rows with the training unroll; module docstring), or None.

    Sums are all-reduced over ranks (every rank must call it with its share of the batches). Returns
    eval/loss (Σ_j w_j · loss_j, as in training), eval/step{j}/{loss,feat_loss,tok_loss,top1,top3,alpha,num_tokens}
    and the step-0 values without the step prefix; {} when no rank had a counted token.
    """
    was_training = head.training
    head.eval()
    steps = loss_cfg.steps
    inference_path = head_type(head.cfg.type).inference_path  # e.g. the chain drafted from every position
    sums = torch.zeros(steps, len(SUMMED), dtype=torch.float64, device=device)  # SUMMED's values per step
    unweighted = dataclasses.replace(loss_cfg, position_weights="decay")
    for batch in batches:
        b = batch.to(device, non_blocking=True)
        shard = None if shard_of is None else shard_of(b.num_rows)
        if shard is not None:
            # num_tokens=1 per step: the metrics come back as sums over this rank's counted rows; unweighted rows
            # (as below: D-PACE's weights are training's)
            _, m = unrolled_loss(head, b.hidden, b.input_ids, b.loss_mask, b.seq_lens, unweighted, [1.0] * steps,
                                 aux_hidden=b.head_aux(aux_columns), shard=shard, every_row=True)
            sums += torch.tensor([[float(m[f"step{j}/{k}"]) for k in SUMMED] for j in range(steps)],
                                 dtype=torch.float64, device=device)
            continue
        x = head_inputs(head, b.hidden, b.head_aux(aux_columns))  # step 0's input: final hidden or aux features
        preds = inference_path(head, x, b.input_ids, b.seq_lens, steps)
        in_vocab = in_draft_vocab(head, b.hidden, loss_cfg.chunk_size) if loss_cfg.mask_out_of_draft else None
        for j, pred in enumerate(preds):
            # num_tokens=1: the metrics come back as plain sums over the batch's counted rows.
            _, m = step_loss(head, pred, b.hidden, b.loss_mask, b.seq_lens, j, loss_cfg, 1.0, in_vocab)
            sums[j] += torch.stack([m[k].double() for k in SUMMED])
    if world > 1:
        tdist.all_reduce(sums)
    head.train(was_training)
    if float(sums[0, -1]) == 0:
        return {}
    out: dict[str, float] = {}
    total = 0.0
    for j, w in enumerate(loss_cfg.weights()):
        row = dict(zip(SUMMED, sums[j].tolist()))
        n = max(row["num_tokens"], 1.0)
        values = {k: v / n for k, v in row.items() if k != "num_tokens"}
        loss_j = loss_cfg.w_feat * values["feat_loss"] + loss_cfg.w_tok * values["tok_loss"]
        total += w * loss_j
        values.update(loss=loss_j, num_tokens=n)
        out.update({f"eval/step{j}/{k}": v for k, v in values.items()})
    out["eval/loss"] = total
    out.update({f"eval/{k}": out[f"eval/step0/{k}"] for k in SUMMED})
    return out
