"""One training step of each head type on the same micro-batch, per token: what a block drafter costs against a chain.

Every head is built as `mtp-train` builds it (the default target's frozen embedding and lm_head, fp32, its training
recipe composed by Hydra as the learning curve composes it: conf/experiment/curve.yaml's shared `train:` overrides,
then the variant's own) and wrapped in the trainer's `HeadLoss`; no DeepSpeed. One packed micro-batch
(`--tokens` rows: sequences of `--min-len`..`--max-len` tokens, the first ~30% of each out of the loss as a prompt
is; random token ids, random stored states in bfloat16 of the real shapes: (T, H) final hidden and each head's
(T, k·H) aux layers) is shared by all heads. A step is the forward and the backward of the head's loss (the
trainer's `HeadLoss.forward` then `loss.backward()`), the optimiser step NOT included (it costs per parameter,
not per token); the per-step counts of counted rows (`step_token_counts` over the head's `loss_rows`) are
computed before the clock starts, as the trainer does once per step. A block drafter's anchors are drawn afresh per
repetition (`step_anchor_seed`), as training draws them per step.

Timing: torch.set_num_threads(1) (`--threads`), the heads interleaved (each repetition times every head once, in
the same order), `--warmup` repetitions first; the median seconds per step, per packed token, and each head's
ratio to eagle3's per token (the same micro-batch, so the per-token and the per-step ratios are equal).

Variants (the curve's names): mtp (`mtp-soft_ce-s1`), eagle3 (`eagle3-s3`), dflash at B = 4, 8, 16 (`dflash-b*-l1`:
B-1 steps, D-PACE) and dspark (`dspark-b4-l1`: the whole vocabulary); all on the 8k draft vocabulary (dspark: 0)
and `loss.ce_impl=checkpoint` (the curve's; `--ce-impl fused` for the demo's).

Usage: python -m bench.head_train_step [--model DIR] [--tokens 2048] [--repeat 7] [--heads mtp,eagle3,...]
       [--quick] [key=value ...] (overrides for every head). The last line printed is one JSON object.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.common import DEFAULT_MODEL, ROOT, compose_train, parser, report

CURVE_FILE = ROOT / "conf" / "experiment" / "curve.yaml"
# bench name → the curve's variant it times
VARIANTS = {
    "mtp": "mtp-soft_ce-s1",
    "eagle3": "eagle3-s3",
    "dflash-b4": "dflash-b4-l1",
    "dflash-b8": "dflash-b8-l1",
    "dflash-b16": "dflash-b16-l1",
    "dspark": "dspark-b4-l1",
}
BASELINE = "eagle3"


def curve_overrides(name: str) -> tuple[str, list[str]]:
    """The curve's shared train overrides plus variant `name`'s own → (head type, overrides), from CURVE_FILE."""
    from omegaconf import OmegaConf

    curve = OmegaConf.to_container(OmegaConf.load(CURVE_FILE), resolve=True)
    assert isinstance(curve, dict)
    variants = curve.get("variants") or {}
    if name not in variants:
        raise ValueError(f"{CURVE_FILE} has no variant {name!r} (bench.head_train_step's VARIANTS names it)")
    spec = variants[name]
    return str(spec["head"]), [str(o) for o in curve.get("train") or []] + [str(o) for o in spec["overrides"]]


def micro_batch(tokens: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """A packed micro-batch of random sequences: input_ids (T,), loss_mask (T,) (each sequence's first ~30% out of the
    loss), seq_lens; T = `tokens` (the last sequence cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(int(torch.randint(min_len, max_len + 1, (1,), generator=g)), tokens - sum(lens)))
    mask = torch.cat([(torch.arange(n) >= max(1, int(0.3 * n))).long() for n in lens])
    return {"input_ids": torch.randint(0, vocab, (tokens,), generator=g), "loss_mask": mask, "seq_lens": lens,
            "generator": g}


def build(name: str, model: str, frozen: Any, batch: dict[str, Any], extra: list[str], block_extra: list[str],
          seed: int = 0) -> dict[str, Any]:
    """One head of VARIANTS as the trainer builds it, wrapped in `HeadLoss`, with its inputs on the shared batch.
    extra: overrides for every head; block_extra: for the block drafters only (those with head.max_anchors)."""
    from mtp_train.config import TrainConfig, typed
    from mtp_train.heads import build_head
    from mtp_train.train.losses import HeadLoss

    head_type, overrides = curve_overrides(VARIANTS[name])
    composed = compose_train([f"model.path={model}", f"head={head_type}", *overrides, *extra])
    if block_extra and "max_anchors" in composed.head:
        composed = compose_train([f"model.path={model}", f"head={head_type}", *overrides, *extra, *block_extra])
    cfg = typed(composed, TrainConfig)
    torch.manual_seed(seed)
    head = build_head(cfg.head, model, dtype=torch.float32, frozen=frozen)
    if head.draft_vocab is not None:  # a fixed random draft vocabulary with the EOS ids (the data's top-N in training)
        g = torch.Generator().manual_seed(seed + 1)
        ids = set(torch.randperm(head.args.vocab_size, generator=g)[:head.vocab_size].tolist())
        eos = [int(t) for t in head.args.eos_token_ids][:head.vocab_size]
        ids = sorted(set(eos) | set(sorted(ids - set(eos))[:head.vocab_size - len(eos)]))
        head.set_draft_vocab(torch.tensor(ids))
    head.train()
    module = HeadLoss(head, cfg.loss)
    g = torch.Generator().manual_seed(seed + 2)
    t, h = batch["input_ids"].shape[0], head.args.hidden_size
    hidden = torch.randn(t, h, generator=g).to(torch.bfloat16)  # the stored states' dtype
    aux = torch.randn(t, head.input_width, generator=g).to(torch.bfloat16) if head.aux_layers else None
    return {"module": module, "hidden": hidden, "aux": aux, "cfg": cfg}


def counts(entry: dict[str, Any], batch: dict[str, Any], anchor_seed: int) -> torch.Tensor:
    """(steps,) the counted rows per step, as the trainer computes them once per step (outside the timed part)."""
    from mtp_train.train.losses import step_token_counts

    head, steps = entry["module"].head, entry["cfg"].loss.steps
    rows = head.loss_rows(batch["input_ids"], batch["loss_mask"], batch["seq_lens"], anchor_seed)
    return step_token_counts(batch["loss_mask"], batch["seq_lens"], steps, rows)


def step(entry: dict[str, Any], batch: dict[str, Any], num_tokens: torch.Tensor, anchor_seed: int) -> float:
    """One forward + backward of the head's loss (gradients zeroed first, no optimiser step); returns the loss."""
    module = entry["module"]
    module.zero_grad(set_to_none=True)
    loss, _ = module(entry["hidden"], batch["input_ids"], batch["loss_mask"], batch["seq_lens"], num_tokens,
                     None, entry["aux"], None, anchor_seed)
    loss.backward()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(__doc__)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--heads", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=2048, help="packed rows of the micro-batch (the curve's)")
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=768, help="longest sequence (the curve's max_seq_len)")
    ap.add_argument("--repeat", type=int, default=7, help="timed repetitions, every head once each")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (one: the machine is shared)")
    ap.add_argument("--ce-impl", default="checkpoint", help="loss.ce_impl (the curve's checkpoint; the demo's fused)")
    ap.add_argument("--quick", action="store_true", help="a tiny run for tests: 256 tokens, 32 anchors, 1 repeat")
    ap.add_argument("overrides", nargs="*", help="more mtp-train overrides for every head, key=value")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.min_len, args.max_len, args.repeat, args.warmup = 256, 48, 128, 1, 0
    names = [n for n in args.heads.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--heads: unknown {unknown}; choose among {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)

    from mtp_train.cli.common import configure_from_env
    from mtp_train.heads import FrozenTargetParts
    from mtp_train.train.losses import step_anchor_seed

    configure_from_env()  # MTP_TRAIN_CPU_KERNELS and the kernel settings, as the commands read them
    frozen = FrozenTargetParts.from_pretrained(args.model, dtype=torch.float32)
    batch = micro_batch(args.tokens, args.min_len, args.max_len, frozen.args.vocab_size)
    extra = [f"loss.ce_impl={args.ce_impl}", *args.overrides]
    block_extra = ["head.max_anchors=32"] if args.quick else []
    entries = {n: build(n, args.model, frozen, batch, extra, block_extra) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, float] = {}
    for r in range(args.warmup + args.repeat):
        seed = step_anchor_seed(0, r, 0, 0)  # fresh anchors per repetition, the same for every head
        for n in names:
            num = counts(entries[n], batch, seed)
            t0 = time.perf_counter()
            losses[n] = step(entries[n], batch, num, seed)
            if r >= args.warmup:
                times[n].append(time.perf_counter() - t0)
    t = args.tokens
    res: dict[str, Any] = {"tokens": t, "seq_lens": batch["seq_lens"], "threads": args.threads,
                           "repeat": args.repeat, "ce_impl": args.ce_impl, "optimizer_step": False, "heads": {}}
    base = statistics.median(times[BASELINE]) if BASELINE in times and times[BASELINE] else None
    for n in names:
        med = statistics.median(times[n]) if times[n] else float("nan")
        c = entries[n]["cfg"]
        row = {"variant": VARIANTS[n], "step_s": med, "us_per_token": med / t * 1e6, "tokens_per_s": t / med,
               "loss_steps": int(c.loss.steps), "loss": losses[n],
               "ratio_to_eagle3": med / base if base else None}
        res["heads"][n] = row
        ratio = f"{row['ratio_to_eagle3']:.2f}x eagle3" if base else "-"
        print(f"{n:11s} {VARIANTS[n]:15s} {med * 1e3:8.1f} ms/step {row['us_per_token']:8.1f} us/token "
              f"{row['tokens_per_s']:7.0f} tok/s  {ratio}", flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
