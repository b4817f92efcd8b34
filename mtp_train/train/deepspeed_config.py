"""The DeepSpeed JSON config of a run, from a `conf/deepspeed/*.yaml` preset and the train config, and the LR schedule.

A preset holds DeepSpeed's own fields; every value "auto" is filled here from `optim.*` and `train.*`, so one
number is never written in two places:

    gradient_accumulation_steps   train.grad_accum
    gradient_clipping             optim.grad_clip
    bf16.enabled                  True on CUDA (with bf16 support), False on CPU (fp32 training)
    optimizer.params.lr/betas/eps/weight_decay   optim.*
    optimizer.params.torch_adam   True: torch's AdamW. On CPU DeepSpeed's own Adam op would need building; on
                                  CUDA ZeRO hands the optimizer one flat fp32 partition per group, which torch's
                                  multi-tensor AdamW updates in a few kernels, so the fused op gains little.

The learning-rate schedule is a torch `LambdaLR` over `WarmupDecay` (`optim.schedule`: cosine or linear), handed
to `deepspeed.initialize`:
DeepSpeed's `WarmupCosineLR` starts warmup at lr 0 (the first step is wasted), needs at least two warmup steps,
and its log-shaped warmup is not what `optim.warmup_steps` promises. The engine steps it once per optimizer step
and saves its state in checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mtp_train.config import DeepSpeedConfig, OptimConfig
from mtp_train.config.train import SCHEDULES

AUTO = "auto"
NOT_DEEPSPEED_KEYS = ("name", "extra")  # preset fields of ours, not DeepSpeed's
ZERO_STAGES = (0, 1, 2)


class WarmupDecay:
    """lr multiplier of optimizer step s (0-based): linear warmup, then a decay from 1 to `min_ratio`.

    s < warmup: (s + 1) / warmup (the first step already learns); then, with p = (s - warmup) / (total - warmup)
    clamped to 1 (steps past `total` stay at min_ratio):
        cosine   min_ratio + (1 - min_ratio) · (1 + cos(π · p)) / 2
        linear   min_ratio + (1 - min_ratio) · (1 - p)   (min_ratio 0: transformers' `get_linear_schedule_with_warmup`
                 after its warmup, (total - s) / (total - warmup), which speculators' trainer uses)
    A callable object rather than a closure: `LambdaLR.state_dict` saves its fields.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float, shape: str = "cosine") -> None:
        if warmup_steps < 0 or total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_ratio}")
        if shape not in SCHEDULES:
            raise ValueError(f"optim.schedule={shape!r}: give one of {' | '.join(SCHEDULES)}")
        self.warmup_steps, self.total_steps, self.min_ratio = int(warmup_steps), int(total_steps), float(min_ratio)
        self.shape = shape

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        p = min(1.0, (step - self.warmup_steps) / span)
        left = 1.0 - p if self.shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        return self.min_ratio + (1.0 - self.min_ratio) * left


class WarmupCosine(WarmupDecay):
    """`WarmupDecay` with the cosine decay (optim.schedule=cosine, the default)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float) -> None:
        super().__init__(warmup_steps, total_steps, min_ratio, "cosine")


def make_lr_scheduler(optim: OptimConfig, max_steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """What `deepspeed.initialize(lr_scheduler=...)` takes: optimizer → LambdaLR(WarmupDecay(...)) of optim.schedule."""
    fn = WarmupDecay(optim.warmup_steps, max_steps, optim.min_lr_ratio, optim.schedule)

    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

    return build


def _fill(node: Any, values: Mapping[str, Any], path: str = "") -> Any:
    """Replace "auto" leaves of a nested dict by values[dotted path]; an "auto" without a value is an error."""
    if isinstance(node, Mapping):
        return {k: _fill(v, values, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values, f"{path}[{i}]") for i, v in enumerate(node)]
    if node == AUTO:
        if path not in values:
            raise ValueError(f"deepspeed.{path}: 'auto' is not supported for this key (auto-filled keys: "
                             f"{', '.join(sorted(values))}); give a value")
        return values[path]
    return node


def build_ds_config(preset: DeepSpeedConfig, *, optim: OptimConfig, grad_accum: int, bf16: bool,
                    client_optimizer: bool = False) -> dict[str, Any]:
    """The DeepSpeed config dict for `deepspeed.initialize(config=...)`.

    preset: the `deepspeed` settings; optim: `optim.*`; grad_accum: `train.grad_accum`; bf16: train in bf16
    (`mtp_train.config.bf16_enabled` of the device). client_optimizer: the trainer hands `deepspeed.initialize` an
    optimiser of its own (train.optimizer=muon, `train.optimizers`): the preset's `optimizer` block is left out,
    and so is DeepSpeed's gradient clipping (that optimiser clips at optim.grad_clip and reports the norm, which
    DeepSpeed does not when it clips an fp32 client optimiser); it needs ZeRO off (stage 0).
    Refuses what this trainer cannot honour, naming the key: a micro-batch size other than 1, ZeRO-3 (it
    would partition the head's weights, which evaluation and the head export read whole), fp16, and a
    DeepSpeed `scheduler` (the schedule comes from `optim.*`).
    """
    preset = copy.deepcopy(dataclasses.asdict(preset))
    extra = dict(preset.get("extra") or {})
    cfg = {k: v for k, v in preset.items() if k not in NOT_DEEPSPEED_KEYS}
    clash = sorted(set(extra) & set(cfg))
    if clash:
        raise ValueError(f"deepspeed.extra repeats {', '.join(clash)}: set them at the top of the deepspeed config")
    cfg.update(extra)

    values = {
        "gradient_accumulation_steps": int(grad_accum),
        "gradient_clipping": float(optim.grad_clip),
        "bf16.enabled": bool(bf16),
        "optimizer.params.lr": float(optim.lr),
        "optimizer.params.betas": [float(b) for b in optim.betas],
        "optimizer.params.eps": float(optim.eps),
        "optimizer.params.weight_decay": float(optim.weight_decay),
        "optimizer.params.torch_adam": True,
    }
    if client_optimizer:
        cfg.pop("optimizer", None)
    cfg = _fill(cfg, values)
    if client_optimizer:
        cfg["gradient_clipping"] = 0.0

    if cfg.get("train_micro_batch_size_per_gpu", 1) != 1:
        raise ValueError("deepspeed.train_micro_batch_size_per_gpu must be 1: a micro-batch is one packed batch of "
                         "train.micro_batch_tokens tokens; change that instead")
    stage = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    if stage not in ZERO_STAGES:
        raise ValueError(f"deepspeed.zero_optimization.stage {stage} is not supported: use 0, 1 or 2 (ZeRO-3 would "
                         "partition the head's weights, which evaluation and the head export read whole)")
    if client_optimizer and stage != 0:
        raise ValueError(f"train.optimizer=muon with deepspeed.zero_optimization.stage {stage}: ZeRO hands the "
                         "optimiser flat partitions of the weights, and Muon orthogonalises each whole matrix; use "
                         "deepspeed=zero0")
    if (cfg.get("fp16") or {}).get("enabled"):
        raise ValueError("deepspeed.fp16 is not supported: heads train in bf16 on CUDA (bf16.enabled) or fp32 on CPU")
    if "scheduler" in cfg:
        raise ValueError("deepspeed.scheduler must not be set: the schedule comes from optim.warmup_steps, "
                         "optim.schedule, optim.min_lr_ratio and train.max_steps")
    if grad_accum < 1:
        raise ValueError(f"train.grad_accum must be >= 1, got {grad_accum}")
    return cfg
