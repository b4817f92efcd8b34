"""Stage two's training throughput: the `mtp` head trained through `train_main` on the default target.

A small precompute folder is made in a temp dir first: from the regenerated SmolLM2 conversations in
`../shared/data/train/regen_smollm2_greedy.jsonl` when that file exists (`--limit` conversations, `--max-seq-len`
tokens), else from random token sequences with random loss masks (the output says which, as `data`). Then
`--warmup` + `--steps` optimizer steps run (W&B disabled, no intermediate eval or checkpoint), timed from the step
hook: only the last `--steps` steps count.

Reported (one process run): tokens_per_s (all packed rows) and counted_tokens_per_s (rows in the loss at draft
step 0), the achieved GFLOP/s of the training step, the peak matmul GFLOP/s of this machine measured in the same
run (the best of ten 2048×2048 matmuls, fp32 on CPU, bf16 on CUDA like the engine), mfu_ratio = achieved ÷ peak,
and peak memory (ru_maxrss on CPU, torch.cuda.max_memory_allocated on CUDA; ru_maxrss is the process's
lifetime peak, so it also covers the precompute stage, which holds the whole target in fp32). On CPU also
kernel_paths: which path each hot op took, native kernel or torch's, with the ratio measured on this machine
(`mtp_train.layers.kernel_choice`; the fused loss with `loss.ce_impl=fused`, the linears where inference ran them).

FLOPs are counted analytically per optimizer step, summed over its packed batches and unrolled draft steps j, for
the loss as configured (V_d: the head's output rows, the draft vocabulary when it has one, else the target's V):

    body_j   = 2 · P · T + Σ_layers 4 · H · Σ_seq n·(n+1)/2      (P: trainable head params, T: packed rows,
                                                                   causal attention: QKᵀ and AV over i+1 keys;
                                                                   for j > 0 an estimate: the chain's own keys
                                                                   are left out)
    train    = 3 · Σ_j body_j                                     (forward + backward ≈ 3 × forward)
             + Σ_j 6 · N_j · H · V_d                              (N_j: counted rows of step j; the target's
                                                                   logits, the head's logits and their gradient
                                                                   with respect to ĥ: 2 + 2 + 2; the lm_head is
                                                                   frozen, so it has no weight gradient)

A block head (dflash, dspark) runs its layers once per batch, not once per step: its fc and every layer's context
K/V projections over the T packed rows, then the whole layer over the A·B rows of its A blocks (A: the anchors,
step 0's counted rows), each block attending to its context (taken as the batch's mean token position,
Σ n² / 2 Σ n) and to its own B rows:

    block    = 2 · fc · T + 2 · kv · T + 2 · (P − fc) · A · B + layers · 4 · H · A · B · (ctx + B)
    train    = 3 · block + Σ_j 6 · N_j · H · V_d

The lm_head products dominate for a small head over a large vocabulary. Recomputation inside the chunked loss
(ce_impl=checkpoint recomputes both chunks' logits in the backward) is not counted: it is work the step does, not
useful FLOPs. The defaults are the demo's training settings (conf/demo.yaml: 8k draft vocabulary, one draft step,
2k-token micro-batches, w_tok 1, the fused loss; `loss.ce_impl=checkpoint` times `mtp-train`'s own default).

Usage: python -m bench.train [--model DIR] [--data FILE] [--limit 64] [--max-seq-len 512] [--steps 20]
                                   [--draft-vocab 8192] [--steps-unrolled 1] [--micro-batch-tokens 2048] [key=value ...]
The last line printed is one JSON object.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_MODEL, REGEN_DATA, compose_train, make_precompute, parser, peak_matmul_gflops, report


def body_flops(params: int, seq_lens: list[int], hidden: int, layers: int) -> float:
    """Forward FLOPs of the head's body for one draft step over a packed batch (matmuls + causal attention)."""
    rows = sum(seq_lens)
    attn = sum(n * (n + 1) // 2 for n in seq_lens)
    return 2.0 * params * rows + layers * 4.0 * hidden * attn


class StepMeter:
    """The on_step hook: wall time per optimizer step, and the packed batches each step consumed.

    At the first call it wraps the trainer's batch stream so that later steps' batches (lengths only) are
    recorded; steps after `warmup` are the measured ones.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []  # seconds per measured step
        self.rows: list[int] = []  # packed rows per measured step
        self.counted: list[list[float]] = []  # counted rows per draft step, per measured step
        self.seq_lens: list[list[int]] = []  # all sequence lengths of each measured step
        self._pending: list[int] = []
        self._last = 0.0
        self.params = 0
        self.layers = 1
        self.hidden = 0
        self.vocab = 0
        self.block_size = 0  # a block head's B (0: a chain head)
        self.fc_params = 0  # a block head's fc, over every packed row
        self.kv_params = 0  # its layers' k/v projections, which also run over every packed row (the context K/V)

    def __call__(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if device_is_cuda(trainer.device):
            torch.cuda.synchronize(trainer.device)
        now = time.perf_counter()
        if step == 1:
            stream = trainer.stream
            inner = stream.next

            def recording_next() -> Any:
                batch = inner()
                self._pending.extend(batch.seq_lens)
                return batch

            stream.next = recording_next
            head = trainer.head
            self.params = sum(p.numel() for p in trainer.engine.module.parameters() if p.requires_grad)
            self.layers = int(head.kv_shape[0])
            self.vocab, self.hidden = (int(d) for d in head.lm_head_weight().shape)  # V_d rows: what the loss uses
            if head.spec.block:
                self.block_size = int(head.block_size)
                self.fc_params = head.fc.weight.numel()
                self.kv_params = sum(layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()
                                     for layer in head.layers)
        elif step > self.warmup:
            self.times.append(now - self._last)
            self.rows.append(sum(self._pending))
            self.seq_lens.append(list(self._pending))
            steps = trainer.loss_cfg.steps
            self.counted.append([metrics.get(f"train/step{j}/num_tokens", 0.0) for j in range(steps)])
        self._pending = []
        self._last = time.perf_counter()

    def flops(self) -> float:
        """Analytic training FLOPs of all measured steps (see the module docstring)."""
        total = 0.0
        for lens, counted in zip(self.seq_lens, self.counted):
            if self.block_size:
                total += 3.0 * block_flops(self, lens, counted[0] if counted else 0.0)
            else:
                total += 3.0 * body_flops(self.params, lens, self.hidden, self.layers) * len(counted)
            total += sum(6.0 * n * self.hidden * self.vocab for n in counted)
        return total


def head_aux_layers(cfg: Any, model_dir: str) -> list[int]:
    """The target layers the composed config's head reads as features ([] for heads on the final hidden), so the
    precompute folder holds them (eagle3, dflash and dspark refuse a folder without them)."""
    from mtp_train.config import TrainConfig, typed
    from mtp_train.models.families import args_from_dir

    head = typed(cfg, TrainConfig).head.resolved(args_from_dir(Path(model_dir)).num_layers)
    return list(head.aux_layers) if head.features == "aux" else []


def block_flops(meter: StepMeter, seq_lens: list[int], anchors: float) -> float:
    """Forward FLOPs of a block head's body over one packed batch with `anchors` blocks (the module docstring)."""
    rows = sum(seq_lens)
    ctx = sum(n * n for n in seq_lens) / (2 * max(rows, 1))
    blk = anchors * meter.block_size
    attention = meter.layers * 4.0 * meter.hidden * blk * (ctx + meter.block_size)
    return 2.0 * (meter.fc_params + meter.kv_params) * rows + 2.0 * (meter.params - meter.fc_params) * blk + attention


def device_is_cuda(device: torch.device) -> bool:
    """Whether steps on device run asynchronously (then the hook synchronizes before reading the clock)."""
    return device.type == "cuda"


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--data", default=str(REGEN_DATA), help="conversations (random tokens when missing)")
    ap.add_argument("--limit", type=int, default=64, help="conversations (or random samples) to precompute")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    ap.add_argument("--warmup", type=int, default=3, help="optimizer steps before the measured ones")
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--head", default="mtp")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="head.draft_vocab_size (0 = the full vocabulary)")
    ap.add_argument("--steps-unrolled", type=int, default=1, help="loss.steps: chained draft steps per batch")
    ap.add_argument("overrides", nargs="*", help="more mtp-train overrides, key=value")
    args = ap.parse_args(argv)
    from mtp_train.cli.common import configure_from_env

    configure_from_env()  # MTP_TRAIN_CPU_KERNELS, MTP_TRAIN_KERNEL_DIR, CC, as the commands read them

    from mtp_train.cli.train import train_main

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "pc"
        overrides = [
            f"model.path={args.model}", f"head={args.head}", f"data.dir={data_dir}",
            f"out={Path(tmp) / 'run'}",
            "wandb.mode=disabled", "train.progress=false", f"train.max_steps={args.warmup + args.steps}",
            f"train.micro_batch_tokens={args.micro_batch_tokens}", "train.eval_every=0", "train.eval_batches=1",
            "train.save_every=0", "train.log_every=1", "spec_eval.prompts=[]",
            f"head.draft_vocab_size={args.draft_vocab}", f"loss.steps={args.steps_unrolled}", "loss.w_tok=1.0",
            "loss.ce_impl=fused", *args.overrides,
        ]
        aux = head_aux_layers(compose_train(overrides), args.model)
        t0 = time.perf_counter()
        kind, name = make_precompute(args.model, data_dir, args.data, args.limit, args.max_seq_len, aux_layers=aux)
        print(f"precompute ({kind}, aux layers {aux}): {time.perf_counter() - t0:.1f}s", flush=True)
        cfg = compose_train([*overrides, f"data.name={name}"])
        meter = StepMeter(args.warmup)
        result = train_main(cfg, on_step=meter)

    device = torch.device("cuda") if torch.cuda.is_available() and cfg.model.device != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        peak_mem_mb = torch.cuda.max_memory_allocated() / 2**20
        dtype = torch.bfloat16
    else:
        peak_mem_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        dtype = torch.float32
    gflops_peak = peak_matmul_gflops(device, dtype)
    seconds = sum(meter.times)
    rows, counted = sum(meter.rows), sum(c[0] for c in meter.counted)
    gflops = meter.flops() / seconds / 1e9
    res: dict[str, Any] = {
        "data": kind, "device": str(device), "head": args.head, "steps": len(meter.times),
        "warmup_steps": args.warmup, "micro_batch_tokens": args.micro_batch_tokens,
        "loss_steps": int(cfg.loss.steps), "head_params": meter.params, "draft_vocab": meter.vocab,
        "ce_impl": str(cfg.loss.ce_impl),
        "tokens_per_s": rows / seconds, "counted_tokens_per_s": counted / seconds,
        "step_s_median": statistics.median(meter.times), "gflops_achieved": gflops, "gflops_peak": gflops_peak,
        "mfu_ratio": gflops / gflops_peak, "peak_memory_mb": peak_mem_mb,
        "final_train_loss": result.get("train/loss"),
    }
    print(f"{res['tokens_per_s']:.0f} tok/s ({res['counted_tokens_per_s']:.0f} counted), {gflops:.1f} GFLOP/s of "
          f"{gflops_peak:.1f} peak (MFU {res['mfu_ratio']:.2f}), peak memory {peak_mem_mb:.0f} MiB", flush=True)
    if device.type == "cpu":
        from mtp_train.layers import kernel_choice

        res["kernel_paths"] = kernel_choice.summary()
        print("\n".join(kernel_choice.lines()), flush=True)
    report(res)
    return res


if __name__ == "__main__":
    main()
