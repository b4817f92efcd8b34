"""A block drafter's training attention: ours (per sequence, anchors in chunks) against one dense masked SDPA.

DFlash trains many blocks per packed batch: each of A anchors has B query rows that see their own sequence's
context before the anchor and the B rows of their own block. Ours (`heads/block_attention.py`) cuts each
sequence's anchors into chunks: one mask-free fused SDPA over a chunk's common prefix of that sequence's context,
the rest (the ragged context and the block's own B keys) explicit and folded in as one extra key, so it keeps no
scores: its memory is the blocks' rows, the context and one chunk's explicit scores (`python -m
bench.attention_memory` counts it against the explicit formula's). The baseline is what a
packed trainer writes without the block structure: every block row of the batch against every key of the batch
(T context rows and A·B block rows) in one `scaled_dot_product_attention`, with a dense boolean mask of
(A·B) × (T + A·B) and K/V expanded to the query heads.

For each block size, forward + backward of both on the same inputs (SmolLM2-135M's head shape, 9 query / 3 KV
heads of 64; `--lens` packed sequences, `--anchors` anchors drawn among their positions):

* time: the two alternated in this process (`bench.common.compare`), ours / baseline (< 1 = ours faster);
* memory: the peak resident memory each adds over its inputs, measured in a fresh child process per side (its
  peak reset first: Linux's VmHWM after `clear_refs`), in KiB per packed token, and ours / baseline.

A test checks that both give the same attention (`tests/test_bench_block_attention.py`).
Usage: python -m bench.block_attention [--lens 512 512 512 512] [--anchors 512] [--blocks 4 8 16] [--repeat 3].
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import compare, parser, report
from mtp_train.heads.block_attention import BlockLayout, packed_block_attention

HQ, HKV, D = 9, 3, 64


def make_inputs(lens: list[int], anchors: int, block: int, seed: int = 0) -> dict:
    """Random q / K / V of a packed batch and a layout of `anchors` blocks (at most one per position ≥ 1),
    grouped by sequence as the head groups them."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    cand = torch.tensor([(s, p) for s, n in enumerate(lens) for p in range(1, n)])
    pick = cand[torch.randperm(len(cand), generator=g)[:anchors]]
    pick = pick[torch.argsort(pick[:, 0] * total + pick[:, 1])]  # grouped by sequence, ascending
    seq, pos = pick[:, 0], pick[:, 1]
    groups, a0 = [], 0
    for s, n in enumerate(lens):
        c = int((seq == s).sum())
        if c:
            groups.append((a0, a0 + c, starts[s], starts[s] + n))
        a0 += c
    a = pick.shape[0]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_()

    return {"q": rand(a, block, HQ, D), "k_blk": rand(a, block, HKV, D), "v_blk": rand(a, block, HKV, D),
            "k_ctx": rand(total, HKV, D), "v_ctx": rand(total, HKV, D), "seq": seq, "pos": pos,
            "starts": torch.tensor(starts), "layout": BlockLayout(tuple(groups), pos)}


def ours(x: dict) -> torch.Tensor:
    """(A, B, Hq, D) by `packed_block_attention`."""
    return packed_block_attention(x["q"], x["k_blk"], x["v_blk"], x["k_ctx"], x["v_ctx"], x["layout"])


def dense(x: dict) -> torch.Tensor:
    """(A, B, Hq, D) by one SDPA over all A·B block rows and all T + A·B keys under a dense boolean mask."""
    q, k_blk, v_blk, k_ctx, v_ctx = x["q"], x["k_blk"], x["v_blk"], x["k_ctx"], x["v_ctx"]
    a, b, hq, d = q.shape
    t = k_ctx.shape[0]
    starts, seq, pos = x["starts"], x["seq"], x["pos"]
    ctx_seq = torch.bucketize(torch.arange(t), starts, right=True) - 1  # (T,) each context row's sequence
    ctx_pos = torch.arange(t) - starts[ctx_seq]
    row_anchor = torch.arange(a).repeat_interleave(b)  # (A·B,) each block row's anchor
    see_ctx = (ctx_seq[None, :] == seq[row_anchor][:, None]) & (ctx_pos[None, :] < pos[row_anchor][:, None])
    see_blk = row_anchor[:, None] == row_anchor[None, :]
    mask = torch.cat([see_ctx, see_blk], dim=1)  # (A·B, T + A·B)
    rep = hq // k_ctx.shape[1]
    keys = torch.cat([k_ctx, k_blk.reshape(a * b, -1, d)]).repeat_interleave(rep, dim=1)  # (T + A·B, Hq, D)
    vals = torch.cat([v_ctx, v_blk.reshape(a * b, -1, d)]).repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.reshape(a * b, hq, d).transpose(0, 1), keys.transpose(0, 1),
                                         vals.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1).reshape(a, b, hq, d)


def step(fn, x: dict) -> None:
    """Forward and backward of one side."""
    for name in ("q", "k_blk", "v_blk", "k_ctx", "v_ctx"):
        x[name].grad = None
    fn(x).square().mean().backward()


def _status_kib(field: str) -> int:
    """A /proc/self/status field in KiB (VmRSS: resident now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: the memory side of this benchmark needs Linux")


def child(side: str, lens: list[int], anchors: int, block: int) -> None:
    """In a fresh process: the peak resident memory one forward + backward adds over the inputs, in KiB.

    The peak is reset first (`clear_refs` 5), since a forked process starts with its parent's."""
    torch.set_num_threads(1)
    x = make_inputs(lens, anchors, block)
    fn = ours if side == "ours" else dense
    step(fn, make_inputs([8, 8], 4, block))  # the first call's one-off allocations (kernels, thread pools)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    step(fn, x)
    print(json.dumps({"peak_kib": _status_kib("VmHWM") - before}))


def peak_kib(side: str, lens: list[int], anchors: int, block: int) -> float:
    out = subprocess.run([sys.executable, "-m", "bench.block_attention", "--child", side, "--lens", *map(str, lens),
                          "--anchors", str(anchors), "--blocks", str(block)], capture_output=True, text=True,
                         check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"])


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 512, 512, 512], help="packed sequence lengths")
    ap.add_argument("--anchors", type=int, default=512, help="blocks per packed batch (head.max_anchors)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16], help="block sizes B")
    ap.add_argument("--repeat", type=int, default=3)
    # internal: one side's memory measured in a fresh process
    ap.add_argument("--child", choices=["ours", "dense"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.lens, args.anchors, args.blocks[0])
        return {}
    tokens = sum(args.lens)
    res: dict = {"threads": torch.get_num_threads(), "lens": args.lens, "anchors": args.anchors}
    for b in args.blocks:
        x = make_inputs(args.lens, args.anchors, b)
        t_ours, t_dense, r = compare(lambda x=x: step(ours, x), lambda x=x: step(dense, x), repeat=args.repeat)
        m_ours, m_dense = peak_kib("ours", args.lens, args.anchors, b), peak_kib("dense", args.lens, args.anchors, b)
        res[f"b{b}"] = {"ours_ms": t_ours * 1e3, "dense_ms": t_dense * 1e3, "time_ours_over_dense": 1.0 / r,
                        "ours_kib_per_token": m_ours / tokens, "dense_kib_per_token": m_dense / tokens,
                        "memory_ours_over_dense": m_ours / max(m_dense, 1.0)}
        print(f"B {b}, {args.anchors} anchors over {tokens} tokens: time ours {t_ours * 1e3:.0f} ms, dense "
              f"{t_dense * 1e3:.0f} ms (ours / dense {1.0 / r:.2f}); memory ours {m_ours / tokens:.1f} KiB/token, "
              f"dense {m_dense / tokens:.1f} KiB/token (ours / dense {m_ours / max(m_dense, 1.0):.2f})", flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
