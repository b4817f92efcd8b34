"""The chained training attention (EAGLE-3's training-time test): `diagonal` against `masked`, forward + backward.

`ChainTrainAttention` computes step j of an unrolled chain two ways that give the same attention (a test checks
it): `masked` scores all (j+1)·n keys of a sequence and masks all but the causal block and one own key per step,
`diagonal` scores the causal block once and the j own keys as dot products. Two lines per step count:

* attention alone: the `steps` chained calls of one unroll on SmolLM2-135M's head shape (9 query / 3 KV heads of
  64), one packed micro-batch of the curve's size (`--lens`, 2048 tokens), forward and backward;
* the whole head unroll: an `eagle3` head (the target's shapes, read from `--model`) over the same batch, its
  `steps` chained forwards and their backward (no lm_head: the loss's cost does not depend on the mode).

Ratios are masked / diagonal time, taken per alternating round (> 1 = diagonal faster). Usage:
python -m bench.chain_attention --model models/smollm2-135m-instruct [--steps 3 7] [--repeat 3].
The last line printed is one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bench.common import compare, parser, report
from mtp_train.config.head import HeadConfig
from mtp_train.heads import build_head
from mtp_train.heads.chain_attention import ChainTrainAttention, attend_chain

HQ, HKV, D = 9, 3, 64


def attention_only(lens: list[int], steps: int, mode: str, qkv: list[tuple[torch.Tensor, ...]]) -> None:
    """One unroll's `steps` chained attention calls and their backward. qkv: per step (q, k, v), (T, H, D)."""
    outs = attend_chain(ChainTrainAttention(HQ, HKV, D, mode=mode), qkv[:steps], lens)
    torch.stack([o.square().mean() for o in outs]).sum().backward()


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct", help="the target folder (head shapes)")
    ap.add_argument("--lens", type=int, nargs="+", default=[700, 700, 648], help="packed sequence lengths")
    ap.add_argument("--steps", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if not Path(args.model).is_dir():
        sys.exit(f"bench.chain_attention: no model folder {args.model}; run `make model` or pass --model")
    torch.manual_seed(0)
    t = sum(args.lens)
    res: dict = {"threads": torch.get_num_threads(), "lens": args.lens}
    qkv = [tuple(torch.randn(t, h, D, requires_grad=True) for h in (HQ, HKV, HKV)) for _ in range(max(args.steps))]
    head = build_head(HeadConfig(type="eagle3", draft_vocab_size=8192), args.model, dtype="float32")
    head.train()
    x = torch.randn(t, head.input_width)
    ids = torch.randint(0, head.args.vocab_size, (t,))
    for steps in args.steps:
        def diag(steps: int = steps) -> None:
            attention_only(args.lens, steps, "diagonal", qkv)

        def masked(steps: int = steps) -> None:
            attention_only(args.lens, steps, "masked", qkv)

        t_diag, t_masked, r = compare(diag, masked, repeat=args.repeat)
        res[f"attention_s{steps}_masked_over_diagonal"] = r
        print(f"attention, {steps} steps, lens {args.lens}: diagonal {t_diag * 1e3:.0f} ms, masked "
              f"{t_masked * 1e3:.0f} ms: {r:.2f}x", flush=True)

        def unroll(mode: str, steps: int = steps) -> None:
            head.zero_grad(set_to_none=True)
            outs = head.unroll(x, ids, args.lens, steps, "chain", mode)
            torch.stack([o.square().mean() for o in outs]).sum().backward()

        t_diag, t_masked, r = compare(lambda: unroll("diagonal"), lambda: unroll("masked"), repeat=args.repeat)
        res[f"unroll_s{steps}_masked_over_diagonal"] = r
        print(f"eagle3 head unroll, {steps} steps: diagonal {t_diag * 1e3:.0f} ms, masked {t_masked * 1e3:.0f} ms: "
              f"{r:.2f}x", flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
