"""The heads' training attentions' memory: the bytes autograd keeps for the backward, the quadratic formulas
against ours, for growing sequences.

Counted, not timed: every tensor a forward saves for its backward (`torch.autograd.graph.saved_tensors_hooks`),
each storage once, the inputs' own storages (q, K, V: the projections keep them anyway) not counted. The forward
runs under torch's FakeTensorMode (shapes, strides and the kernel choice as on this CPU, no data, no memory), so
the quadratic sides count at 16k tokens too; a test checks that the count is the real one.

* chain: the attention alone of one `--steps`-step unroll (`attend_chain`, EAGLE-3's training-time test) over one
  sequence of n tokens on SmolLM2-135M's head shape (9 query / 3 KV heads of 64): `masked`, the dense reference,
  against `diagonal` (`--window`: a sliding window for both);
* block: a DFlash block attention over one sequence of n context tokens, `--anchors` blocks of `--block` rows at
  random positions: the explicit formula (`explicit_block_attention`, its (A, H, B, N) probabilities), the
  stride-0 form (`stride0_block_attention`: each chunk of anchors the batch of one SDPA over a stride-0 view of
  the context, a boolean prefix mask per anchor) and ours (`packed_block_attention`); for each, besides what
  autograd keeps, the largest tensor its backward allocates (`backward_largest`): the stride-0 form's dK/dV at
  the view's size, chunk × Hkv × n × (D + e).

Usage: python -m bench.attention_memory [--lens 1024 2048 4096 8192 16384] [--steps 3] [--window W]
[--anchors 512] [--block 16]. The last line printed is one JSON object (MiB per side and length; `*_grad_mib`:
the backward's largest tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.common import parser, report
from mtp_train.heads.block_attention import (
    BlockLayout,
    explicit_block_attention,
    fold_query,
    packed_block_attention,
    sink_columns,
    sink_keys,
    unfold_sink,
)
from mtp_train.heads.chain_attention import ChainTrainAttention, attend_chain

HQ, HKV, D = 9, 3, 64
MIB = 2**20
BLOCK_SIDES = ("explicit", "stride0", "ours")
STRIDE0_MASK_BUDGET = 1 << 24  # the stride-0 form's chunk: anchors × context mask entries


def saved_bytes(fn: Callable[[], object], inputs: Sequence[torch.Tensor] = ()) -> tuple[int, int]:
    """What autograd saves while `fn` runs: (bytes of the distinct storages, the largest one's elements), the
    storages of `inputs` not counted."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)  # kept alive, so that no storage is freed and its address reused while counting
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    skip = {x.untyped_storage()._cdata for x in inputs}
    sizes: dict[int, tuple[int, int]] = {}
    for t in saved:
        s = t.untyped_storage()
        if s._cdata not in skip:
            sizes[s._cdata] = (s.nbytes(), s.nbytes() // t.element_size())
    return sum(b for b, _ in sizes.values()), max((e for _, e in sizes.values()), default=0)


def chain_saved(n: int, steps: int, mode: str, window: int | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """`saved_bytes` of one `steps`-step chain unroll's attention over one sequence of n tokens (fresh random
    q, K, V per step, in the ambient mode: under FakeTensorMode none is allocated)."""
    qkv = [tuple(torch.randn(n, h, D, dtype=dtype, requires_grad=True) for h in (HQ, HKV, HKV))
           for _ in range(steps)]
    attn = ChainTrainAttention(HQ, HKV, D, window, mode)
    return saved_bytes(lambda: attend_chain(attn, qkv, [n]), [x for step in qkv for x in step])


def block_layout(n: int, anchors: int, seed: int = 0) -> BlockLayout:
    """One sequence of n context rows with `anchors` blocks at distinct random positions 1..n-1, ascending."""
    g = torch.Generator().manual_seed(seed)
    pos = (torch.randperm(n - 1, generator=g)[:anchors] + 1).sort().values
    return BlockLayout(((0, pos.shape[0], 0, n),), pos)


def stride0_block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                            v_ctx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The block attention as each chunk of anchors the batch of one SDPA over a stride-0 view of the sequence's
    context (a boolean prefix mask per anchor, the own block folded in as the sink): it keeps nothing quadratic,
    but its backward writes the context's dK/dV at the view's size, chunk × Hkv × (n+1) × (D+e). Arguments and
    result as `packed_block_attention`'s."""
    a, b, hq, d = q.shape
    hkv, extra, scale = k_blk.shape[2], sink_columns(q), d ** -0.5
    parts: list[torch.Tensor] = []
    for a0, a1, c0, c1 in layout.groups:
        k_ext, v_ext = sink_keys(k_ctx[c0:c1], v_ctx[c0:c1], d, extra)  # (n+1, Hkv, D+e)
        chunk = max(1, STRIDE0_MASK_BUDGET // (c1 - c0 + 1))
        for s in range(a0, a1, chunk):
            e = min(s + chunk, a1)
            c = e - s
            qg = q[s:e].reshape(c, b, hkv, hq // hkv, d).float()
            s_blk = torch.einsum("abkgd,ackd->akgbc", qg, k_blk[s:e].float()) * scale  # (C, Hkv, G, B, B)
            own = torch.einsum("akgbc,ackd->akgbd", torch.softmax(s_blk, -1), v_blk[s:e].float())
            q_ext = fold_query(q[s:e].transpose(1, 2), torch.logsumexp(s_blk, -1).reshape(c, hq, b), scale, d,
                               extra)  # (C, Hq, B, D+e)
            seen = torch.arange(k_ext.shape[0], device=q.device)[None, :] <= layout.ctx_len[s:e, None]  # (C, n+1)
            out = F.scaled_dot_product_attention(
                q_ext, k_ext.transpose(0, 1)[None].expand(c, -1, -1, -1),
                v_ext.transpose(0, 1)[None].expand(c, -1, -1, -1), attn_mask=seen[:, None, None, :], scale=scale,
                enable_gqa=hkv != hq)  # (C, Hq, B, D+e)
            parts.append(unfold_sink(out, own.reshape(c, hq, b, d), d).transpose(1, 2).to(q.dtype))
    return torch.cat(parts)


BLOCK_FNS = {"explicit": explicit_block_attention, "stride0": stride0_block_attention,
             "ours": packed_block_attention}


class _LargestAllocation(TorchDispatchMode):
    """Records the largest storage an op returns that none of its inputs had (a fresh allocation), in bytes; keeps
    each such output alive, so that no storage is freed and its identity reused while counting."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self._seen: set[int] = set()
        self._kept: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._seen.add(t.untyped_storage()._cdata)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self._seen:
                self._seen.add(t.untyped_storage()._cdata)
                self._kept.append(t)
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def backward_largest(out: torch.Tensor) -> int:
    """The largest tensor (bytes) that the backward of out.sum() allocates: its largest transient, the gradients
    it writes included."""
    with _LargestAllocation() as rec:
        out.float().sum().backward()
    return rec.largest


def block_memory(layout: BlockLayout, block: int, side: str, dtype: torch.dtype = torch.float32
                 ) -> tuple[int, int, int]:
    """A block attention over `layout` (one sequence) with blocks of `block` rows, one of `BLOCK_SIDES`, in the
    ambient mode (under FakeTensorMode nothing is allocated): (bytes autograd keeps, the largest kept storage's
    elements: `saved_bytes`; the largest tensor its backward allocates, bytes: `backward_largest`)."""
    a, n = layout.ctx_len.shape[0], layout.groups[0][3]
    blk = [torch.randn(a, block, h, D, dtype=dtype, requires_grad=True) for h in (HQ, HKV, HKV)]
    ctx = [torch.randn(n, HKV, D, dtype=dtype, requires_grad=True) for _ in range(2)]
    outs: list[torch.Tensor] = []
    saved, biggest = saved_bytes(lambda: outs.append(BLOCK_FNS[side](*blk, *ctx, layout)), blk + ctx)
    return saved, biggest, backward_largest(outs[0])


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384], help="tokens n")
    ap.add_argument("--steps", type=int, default=3, help="chain steps (loss.steps)")
    ap.add_argument("--window", type=int, default=None, help="a sliding window for the chain (none: full)")
    ap.add_argument("--anchors", type=int, default=512, help="blocks per batch (head.max_anchors)")
    ap.add_argument("--block", type=int, default=16, help="rows per block (head.block_size)")
    args = ap.parse_args(argv)
    res: dict = {"steps": args.steps, "window": args.window, "anchors": args.anchors, "block": args.block}
    for n in args.lens:
        layout = block_layout(n, args.anchors)
        with FakeTensorMode(allow_non_fake_inputs=True):
            masked, _ = chain_saved(n, args.steps, "masked", args.window)
            diagonal, _ = chain_saved(n, args.steps, "diagonal", args.window)
            block = {side: block_memory(layout, args.block, side) for side in BLOCK_SIDES}
        row = {"chain_masked_mib": masked / MIB, "chain_diagonal_mib": diagonal / MIB}
        for side, (saved, _, grad) in block.items():
            row[f"block_{side}_mib"], row[f"block_{side}_grad_mib"] = saved / MIB, grad / MIB
        res[str(n)] = {k: round(v, 1) for k, v in row.items()}
        kept = ", ".join(f"{side} {saved / MIB:.1f}" for side, (saved, _, _) in block.items())
        grads = ", ".join(f"{side} {grad / MIB:.1f}" for side, (_, _, grad) in block.items())
        print(f"n {n}: chain ({args.steps} steps) masked {masked / MIB:.1f} MiB, diagonal {diagonal / MIB:.1f} MiB "
              f"({diagonal / n / 1024:.1f} KiB/token); block ({layout.ctx_len.shape[0]} anchors of {args.block}) "
              f"kept: {kept} MiB; the backward's largest tensor: {grads} MiB", flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
