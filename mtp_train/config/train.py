"""`mtp-train`: a draft head trained on target hidden states (precomputed, or computed online) with DeepSpeed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.data import DataConfig, TrainDataConfig
from mtp_train.config.errors import ConfigError
from mtp_train.config.head import HeadConfig
from mtp_train.config.loss import LossConfig
from mtp_train.config.model import ModelConfig
from mtp_train.config.precompute import PrecomputeConfig

KEEP_BEST_MODES = ("auto", "max", "min")  # train.keep_best_mode
OPTIMIZERS = ("adamw", "muon")  # train.optimizer
SCHEDULES = ("cosine", "linear")  # optim.schedule: the learning rate's decay after the warmup
MUON_ADJUST_LR = ("original", "match_rms_adamw")  # optim.muon_adjust_lr_fn (torch.optim.Muon's adjust_lr_fn)
PLAN_DEVICES = ("", "cuda", "cpu")  # plan_device


@dataclass
class OptimConfig:
    """The optimiser's settings (AdamW's, and Muon's under train.optimizer=muon) and the learning-rate schedule
    (linear warmup, then a cosine or a linear decay down to min_lr_ratio · lr), which scales every group's rate
    alike."""

    lr: float = 1e-4  # peak learning rate (AdamW; under muon the AdamW group of norms, biases and vectors)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 100  # optimizer steps of linear warmup from lr/warmup_steps to lr
    min_lr_ratio: float = 0.1  # the decay ends at min_lr_ratio · lr at train.max_steps
    # the decay from lr after the warmup: cosine | linear (speculators' default scheduler, with min_lr_ratio=0)
    schedule: str = "cosine"
    grad_clip: float = 0.5  # clip the global gradient norm to this (0 = off)
    # train.optimizer=muon (torch.optim.Muon on the 2-D weight matrices; the vocabulary-indexed matrices, a head's
    # own lm_head or Markov tables, take AdamW at muon_lr and muon_weight_decay, as speculators does):
    muon_lr: float | None = None  # peak rate of the Muon group; null = 10 · optim.lr (speculators' default)
    muon_momentum: float = 0.95  # Muon's momentum
    muon_nesterov: bool = True  # Nesterov momentum
    muon_weight_decay: float = 0.1  # Muon's decoupled weight decay
    muon_ns_steps: int = 5  # Newton-Schulz iterations of the orthogonalisation
    # original (lr · sqrt(max(1, rows/cols))) | match_rms_adamw (lr · 0.2 · sqrt(max(rows, cols)): AdamW's update RMS)
    muon_adjust_lr_fn: str = "match_rms_adamw"

    def __post_init__(self) -> None:
        # torch's AdamW would refuse some of these too, but without naming the key; lr=0 it would accept.
        if not math.isfinite(self.lr) or self.lr < 0:
            raise ConfigError(f"optim.lr={self.lr} is out of range: `optim.lr` (the peak learning rate) must be a "
                              "positive finite number, e.g. optim.lr=1e-4")
        if self.lr == 0:
            raise ConfigError("optim.lr=0 is refused: a learning rate of 0 never changes the head, so the run would "
                              "train nothing; give a positive rate, e.g. optim.lr=1e-4")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)}: give two numbers in [0, 1), e.g. [0.9, 0.95]")
        for key in ("eps", "weight_decay", "grad_clip"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"optim.{key}={value} is out of range: `optim.{key}` must be 0 or more")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} is out of range: it must be in [0, 1]")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule={self.schedule!r}: give one of {' | '.join(SCHEDULES)} (the learning "
                              "rate's decay after optim.warmup_steps)")
        if self.muon_lr is not None and (not math.isfinite(self.muon_lr) or self.muon_lr <= 0):
            raise ConfigError(f"optim.muon_lr={self.muon_lr} is out of range: give a positive rate, or null for "
                              "10 · optim.lr")
        for key in ("muon_momentum", "muon_weight_decay"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"optim.{key}={value} is out of range: `optim.{key}` must be 0 or more")
        if self.muon_ns_steps < 1:
            raise ConfigError(f"optim.muon_ns_steps={self.muon_ns_steps}: give 1 or more Newton-Schulz steps, e.g. 5")
        if self.muon_adjust_lr_fn not in MUON_ADJUST_LR:
            raise ConfigError(f"optim.muon_adjust_lr_fn={self.muon_adjust_lr_fn!r}: give one of "
                              f"{' | '.join(MUON_ADJUST_LR)}")

    @property
    def muon_peak_lr(self) -> float:
        """The Muon group's peak rate: optim.muon_lr, or 10 · optim.lr when it is null."""
        return float(self.muon_lr) if self.muon_lr is not None else 10.0 * float(self.lr)


@dataclass
class LoopConfig:
    """The training loop (`train.*`): steps, batch sizes, evaluation, checkpoints, logging."""

    max_steps: int = 1000  # optimizer steps in the whole run (the cosine schedule ends here)
    # Wall-clock budget of this invocation's training loop in seconds (0 = off): the run stops after the first
    # step that ends past it, then evaluates, checkpoints and exports as at max_steps; a re-run resumes and trains
    # another max_seconds. Set-up (data, target, engine) is not counted.
    max_seconds: float = 0.0
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch (len(batch) · longest ≤ this)
    grad_accum: int = 1  # micro-batches per rank per optimizer step (global batch = world · grad_accum of them)
    eval_every: int = 500  # evaluate on the val split every N steps (0 = only at the end)
    eval_batches: int = 16  # val micro-batches per rank per evaluation (0 = no evaluation)
    save_every: int = 1000  # full checkpoint + head export every N steps (0 = only at the end)
    log_every: int = 10  # log training metrics every N steps
    seed: int = 0  # seeds the head's init, the batch order, the feature noise and a block drafter's anchors
    # adamw (torch's AdamW over every parameter, the deepspeed preset's optimizer) | muon (torch.optim.Muon on the
    # 2-D weight matrices, AdamW on the rest; needs deepspeed.zero_optimization.stage=0, deepspeed=zero0: ZeRO
    # hands the optimiser flat partitions of the weights, and Muon orthogonalises each whole matrix)
    optimizer: str = "adamw"
    progress: bool = True  # tqdm progress bar on rank 0
    # Keep heads/best as a copy of the best evaluated head by this validation metric ("" = off), e.g. spec/tau
    # (needs spec_eval.prompts) or eval/loss; each improvement logs best/<metric> and best/step (train/best.py).
    keep_best: str = ""
    keep_best_mode: str = "auto"  # max | min | auto (min for a name ending in loss, else max)
    # Ranks that share one sample's positions (Ulysses attention for chain heads, gathered context K/V for block
    # drafters); the world must be a multiple of it, data parallel over world / sequence_parallel (1 = off).
    sequence_parallel: int = 1
    # Recompute each unrolled step's head forward (each draft layer of a block drafter) in the backward instead
    # of keeping its activations: less memory, one more forward per step.
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sequence_parallel, bool) or not isinstance(self.sequence_parallel, int) \
                or self.sequence_parallel < 1:
            raise ConfigError(f"train.sequence_parallel={self.sequence_parallel!r}: give a whole number of ranks "
                              "≥ 1 that divides the world size (1 = off), e.g. train.sequence_parallel=2")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer={self.optimizer!r}: give one of {' | '.join(OPTIMIZERS)}")
        if self.keep_best_mode not in KEEP_BEST_MODES:
            raise ConfigError(f"train.keep_best_mode={self.keep_best_mode!r}: give one of "
                              f"{' | '.join(KEEP_BEST_MODES)} (auto = min for a metric ending in loss, else max)")


@dataclass
class SpecEvalConfig:
    """Speculative decoding on held-out prompts at every evaluation (`spec_eval.*`, rank 0): logs spec/tau."""

    prompts: list[str] = field(default_factory=list)  # conf/data names or prompt files; [] = off
    limit: int = 8  # conversations per prompt set
    k: int = 3  # draft tokens per step
    max_new_tokens: int = 64  # per turn, greedy
    batch_size: int = 8  # concurrent requests


@dataclass
class DeepSpeedConfig:
    """DeepSpeed JSON-config fields (`conf/deepspeed/*.yaml`); "auto" values are filled from the train config."""

    name: str = "zero2"  # short name of this preset (not a DeepSpeed key)
    train_micro_batch_size_per_gpu: Any = 1  # must be 1: a micro-batch is one token-budget packed batch
    gradient_accumulation_steps: Any = "auto"  # auto = train.grad_accum
    gradient_clipping: Any = "auto"  # auto = optim.grad_clip
    bf16: dict[str, Any] = field(default_factory=lambda: {"enabled": "auto"})  # auto = on for CUDA, off (fp32) on CPU
    zero_optimization: dict[str, Any] = field(default_factory=lambda: {"stage": 2})  # ZeRO stage 0, 1 or 2 + knobs
    optimizer: dict[str, Any] = field(default_factory=lambda: {  # AdamW; auto params come from optim.*
        "type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                    "torch_adam": "auto"}})
    steps_per_print: int = 1_000_000_000  # DeepSpeed's own periodic log line: effectively off (we log ourselves)
    wall_clock_breakdown: bool = False  # DeepSpeed's forward/backward/step timers
    extra: dict[str, Any] = field(default_factory=dict)  # any other DeepSpeed keys, passed through unchanged


@dataclass
class WandbConfig:
    """Weights & Biases logging (rank 0 only)."""

    mode: str = "online"  # online | offline | disabled; online falls back to offline when no API key is set
    project: str = "mtp-train"  # W&B project
    entity: str | None = None  # W&B team or user; null = the account's default
    name: str | None = None  # run name; null = W&B picks one
    dir: str | None = None  # where the run's files go; null = the run's `out` folder
    tags: list[str] = field(default_factory=list)  # run tags


@dataclass
class TrainConfig:
    """`mtp-train`: a draft head trained on target hidden states with DeepSpeed; `data.source` says where they come
    from (a precompute folder, the target held by the trainer, or both)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    data: TrainDataConfig = field(default_factory=TrainDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    spec_eval: SpecEvalConfig = field(default_factory=SpecEvalConfig)
    out: str = "runs/train"  # run folder: config.yaml, metrics.jsonl, checkpoints/, heads/, wandb/
    overwrite: bool = False  # remove links found in `out` that lead outside it (else refused by name)
    resume: str = "auto"  # auto (the latest checkpoint under out, if any) | none | a checkpoint tag folder
    # Also resume from a checkpoint in DeepSpeed's pickle format (`*.pt`, written by earlier versions): loading it
    # unpickles it, which runs any code the file names. Only for folders whose origin you trust.
    resume_trust_pickles: bool = False
    # The memory plan (train/memory_plan.py): the predicted peak memory per rank, term by term. plan=true prints it
    # and exits without training or writing anything; every run checks it against the device's memory first.
    plan: bool = False
    plan_world: int = 0  # ranks to plan for (0 = this launch's world size), e.g. 8 to plan an 8-GPU job from one
    plan_length: int = 0  # tokens of the longest sample (0 = the data's longest when readable, else micro_batch_tokens)
    plan_device: str = ""  # cuda | cpu: the device to plan for ("" = the run's, model.device)
    # Memory a rank may use in GiB (0 = the device's: a GPU's total memory, or the memory available to this process
    # on the CPU); a run whose plan is over it is refused before anything is written.
    memory_limit_gib: float = 0.0
    memory_check: bool = True  # false = run even when the plan is over memory_limit_gib (the plan is only logged)

    def __post_init__(self) -> None:
        if self.plan_world < 0 or self.plan_length < 0 or self.memory_limit_gib < 0:
            raise ConfigError(f"plan_world={self.plan_world}, plan_length={self.plan_length}, memory_limit_gib="
                              f"{self.memory_limit_gib}: each must be 0 (the run's own) or more")
        if self.plan_device not in PLAN_DEVICES:
            raise ConfigError(f"plan_device={self.plan_device!r}: give one of cuda | cpu, or \"\" for the run's device")
        stage = (self.deepspeed.zero_optimization or {}).get("stage", 0)
        if self.train.optimizer == "muon" and int(stage) != 0:
            raise ConfigError(f"train.optimizer=muon with deepspeed.zero_optimization.stage={stage}: ZeRO hands the "
                              "optimiser flat partitions of the weights, and Muon orthogonalises each whole matrix; "
                              "use deepspeed=zero0 (or deepspeed.zero_optimization.stage=0)")
        self.apply_derived()

    def apply_derived(self) -> None:
        """Take what the head type derives from its settings (`HeadSettings.derived`: a block drafter's loss.steps
        from head.block_size) where the user left it unset (null); refuse a value set to something else, naming
        both."""
        assert self.head.settings is not None  # HeadConfig sets it
        for key, value in self.head.settings.derived().items():
            if key != "loss.steps":
                raise ConfigError(f"head type {self.head.type} derives {key}, which mtp-train cannot take; it may "
                                  "derive loss.steps only")
            if self.loss.steps_unset:
                self.loss.steps = value
            elif self.loss.steps != value:
                raise ConfigError(f"loss.steps={self.loss.steps} contradicts the head: {self.head.type} heads train "
                                  f"one step per drafted slot, loss.steps={value} "
                                  f"({self.head.settings.derived_from(key)}); leave loss.steps unset or give {value}")
        if self.loss.step_weights is not None and len(self.loss.step_weights) != self.loss.steps:
            raise ConfigError(f"loss.step_weights has {len(self.loss.step_weights)} weights for loss.steps="
                              f"{self.loss.steps}: give one per step")

    def precompute_config(self, aux_layers: Sequence[int] = ()) -> PrecomputeConfig:
        """The `mtp-precompute` settings whose samples (and folder, for hybrid) an online or hybrid run reads:
        `data.*` of the conversations, `data.online.*`, `data.dir` as the out folder, and the target layers
        `aux_layers` the head reads. Precompute run with them plans the same samples and split."""
        d, o = self.data, self.data.online
        conversations = DataConfig(**{f.name: copy_value(getattr(d, f.name)) for f in dataclasses.fields(DataConfig)})
        return PrecomputeConfig(model=self.model, data=conversations, out=d.dir, max_seq_len=o.max_seq_len,
                                limit=o.limit, shard_tokens=o.shard_tokens, batch_tokens=self.train.micro_batch_tokens,
                                aux_layers=[int(j) for j in aux_layers], hidden_dtype=o.hidden_dtype,
                                val_fraction=o.val_fraction, seed=o.seed,
                                chat_template_kwargs=dict(o.chat_template_kwargs), progress=False)


def copy_value(value: Any) -> Any:
    """A shallow copy of a list or dict setting (so that two configs never share one), other values as they are."""
    return type(value)(value) if isinstance(value, (list, dict)) else value
