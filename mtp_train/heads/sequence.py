"""Sequence parallelism inside a head's training unroll: one packed batch's rows split over the N ranks of a group.

Every rank of the group holds the batch whole (token ids, loss mask, target states: small next to activations)
and computes the activations of its own contiguous rows only. The batch's T rows are padded to a multiple of N
with one pad sequence whose loss mask is 0 (it is never counted and no real row attends to it), so every rank
holds T/N rows, rank k the rows [k·T/N, (k+1)·T/N).

What crosses ranks, per head kind:

* chain heads (mtp, eagle1, eagle3): the attention of each unrolled step is Ulysses: an all-to-all turns
  (T/N rows, all heads) into (T rows, heads/N), the whole-batch attention (the chain's, or causal) runs over those
  heads, and an all-to-all turns it back. The exchange itself is the caller's (`SequenceShard.attention`: the
  training floor builds it on DeepSpeed's `DistributedAttention`; heads never import deepspeed).
* block drafters (dflash, dspark): the context K/V of every draft layer, computed on the rank's rows, are
  all-gathered (`gather_rows`, differentiable) and each rank runs the blocks of the anchors in its rows locally.

Only torch.distributed is used here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtp_train.layers.attention import AttentionBackend, AttentionMetadata
from mtp_train.models.config import ModelArgs, ModelConfigError

# (the whole-batch attention over this rank's heads, the KV-head repeat) → the attention the head's layer calls
# with its own rows: the Ulysses exchange around it.
AttentionWrap = Callable[[AttentionBackend, int], AttentionBackend]


def ulysses_heads(args: ModelArgs, size: int) -> tuple[ModelArgs, int]:
    """The head block's attention shape on one of `size` ranks under Ulysses, and the KV-head repeat it needs.

    Each rank attends over num_heads / size query heads. The KV heads split the same way; where num_kv_heads does
    not divide by `size` (fewer KV heads than ranks, e.g. 8 ranks over 4 KV heads), each KV head is repeated r
    times (the smallest r that divides the query group and makes the count divisible), which keeps every query
    head with its own KV head. Returns (args with the local head counts, r). Refuses what cannot be split: a
    latent (MLA) block, or a query-head count `size` does not divide.
    """
    if args.kv_layout.latent:
        raise ModelConfigError(f"train.sequence_parallel={size}: the head block of this target attends over one "
                               "latent KV row per token (DeepSeek MLA), which Ulysses cannot split by heads; train "
                               "with train.sequence_parallel=1 (and more data-parallel ranks)")
    hq, hkv = args.num_heads, args.num_kv_heads
    if hq % size:
        raise ModelConfigError(f"train.sequence_parallel={size} splits the head's attention heads over {size} ranks, "
                               f"but the target has num_attention_heads={hq} (num_key_value_heads={hkv}): choose a "
                               f"train.sequence_parallel that divides {hq}")
    group = hq // hkv
    repeat = next(r for r in range(1, group + 1) if group % r == 0 and (hkv * r) % size == 0)
    return dataclasses.replace(args, num_heads=hq // size, num_kv_heads=hkv * repeat // size), repeat


class _GatherRows(torch.autograd.Function):
    """All-gather of row blocks over a group, concatenated in rank order; the gradient of a rank's block is the sum
    of every rank's gradient of it (each rank's loss read the whole gathered tensor)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int,  # type: ignore[override]
                index: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.size, ctx.index = group, size, index
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        n = grad.shape[0] // ctx.size
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            out = grad.new_empty((n, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        else:  # gloo has no reduce-scatter: the whole sum, then this rank's block
            out = grad.clone()
            dist.all_reduce(out, group=ctx.group)
            out = out[ctx.index * n:(ctx.index + 1) * n]
        return out, None, None, None


@dataclass(frozen=True)
class SequenceShard:
    """One packed batch as this rank of a sequence-parallel group sees it (module docstring).

    group: the group's ranks; size: N; index: this rank's place in the group; rows: the batch's rows padded to a
    multiple of N; pad: how many of them are padding (one pad sequence at the end, when pad > 0); attention: the
    Ulysses exchange the chain heads wrap their whole-batch attention in (None: the batch's head is a block
    drafter, or the caller has none to give).
    """

    group: dist.ProcessGroup
    size: int
    index: int
    rows: int
    pad: int
    attention: AttentionWrap | None = None

    @classmethod
    def split(cls, group: dist.ProcessGroup, size: int, index: int, num_rows: int,
              attention: AttentionWrap | None = None) -> SequenceShard:
        """The shard of a batch of `num_rows` real rows (padded here to a multiple of `size`)."""
        pad = -num_rows % size
        return cls(group, size, index, num_rows + pad, pad, attention)

    @property
    def lo(self) -> int:
        """This rank's first row."""
        return self.index * (self.rows // self.size)

    @property
    def hi(self) -> int:
        """One past this rank's last row."""
        return (self.index + 1) * (self.rows // self.size)

    def padded(self, x: torch.Tensor, fill: float | int | bool = 0) -> torch.Tensor:
        """(T, ...) the batch's real rows → (rows, ...), the pad rows `fill`."""
        if self.pad == 0:
            return x
        return torch.cat([x, x.new_full((self.pad, *x.shape[1:]), fill)])

    def padded_lens(self, seq_lens: Sequence[int]) -> list[int]:
        """The batch's sequence lengths with the pad sequence (if any) after them."""
        return [int(n) for n in seq_lens] + ([self.pad] if self.pad else [])

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, ...) → (rows / N, ...) this rank's rows."""
        return x[self.lo:self.hi]

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(rows / N, ...) every rank's own rows → (rows, ...) all of them, differentiable."""
        return _GatherRows.apply(x, self.group, self.size, self.index)

    def local_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The whole batch's cache-free metadata `meta` → one for this rank's rows, carrying their global positions
        (what their RoPE rotates to); the attention itself reads the whole batch's metadata (`attention`)."""
        local = AttentionMetadata.build([self.hi - self.lo], device=meta.positions.device)
        local.positions = meta.positions[self.lo:self.hi]
        return local

    def wrap(self, inner: AttentionBackend, kv_repeat: int) -> AttentionBackend:
        """`inner` (the whole-batch attention over this rank's heads) inside the group's Ulysses exchange."""
        if self.attention is None:
            raise ValueError("this sequence shard carries no attention exchange: a chain head's unroll needs one "
                             "(mtp_train.train.sequence_parallel builds it)")
        return self.attention(inner, kv_repeat)
