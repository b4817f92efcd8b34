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
  random positions: the explicit formula (`explicit_block_attention`, its (A, H, B, N) probabilities) against
  ours (`packed_block_attention`).

Usage: python -m bench.attention_memory [--lens 1024 2048 4096 8192 16384] [--steps 3] [--window W]
[--anchors 512] [--block 16]. The last line printed is one JSON object (MiB per side and length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.common import parser, report
from mtp_train.heads.block_attention import BlockLayout, explicit_block_attention, packed_block_attention
from mtp_train.heads.chain_attention import ChainTrainAttention, attend_chain

HQ, HKV, D = 9, 3, 64
MIB = 2**20


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


def block_saved(layout: BlockLayout, block: int, explicit: bool, dtype: torch.dtype = torch.float32
                ) -> tuple[int, int]:
    """`saved_bytes` of a block attention over `layout` (one sequence) with blocks of `block` rows: the explicit
    formula or ours."""
    a, n = layout.ctx_len.shape[0], layout.groups[0][3]
    blk = [torch.randn(a, block, h, D, dtype=dtype, requires_grad=True) for h in (HQ, HKV, HKV)]
    ctx = [torch.randn(n, HKV, D, dtype=dtype, requires_grad=True) for _ in range(2)]
    fn = explicit_block_attention if explicit else packed_block_attention
    return saved_bytes(lambda: fn(*blk, *ctx, layout), blk + ctx)


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
            explicit, _ = block_saved(layout, args.block, explicit=True)
            ours, _ = block_saved(layout, args.block, explicit=False)
        row = {"chain_masked_mib": masked / MIB, "chain_diagonal_mib": diagonal / MIB,
               "block_explicit_mib": explicit / MIB, "block_ours_mib": ours / MIB}
        res[str(n)] = {k: round(v, 1) for k, v in row.items()}
        print(f"n {n}: chain ({args.steps} steps) masked {masked / MIB:.1f} MiB, diagonal {diagonal / MIB:.1f} MiB "
              f"({diagonal / n / 1024:.1f} KiB/token); block ({layout.ctx_len.shape[0]} anchors of {args.block}) "
              f"explicit {explicit / MIB:.1f} MiB, ours {ours / MIB:.1f} MiB ({ours / n / 1024:.1f} KiB/token)",
              flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
