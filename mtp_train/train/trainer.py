"""Stage two: train a draft head on target hidden states with DeepSpeed (ZeRO-0/1/2) under torchrun.

The hidden states come from a precompute folder, from the target held here, or from both (`data.source`,
`mtp_train.train.sources`); the loop below sees the same packed micro-batches whichever it is.

One optimizer step:

    1. each rank takes `grad_accum` packed micro-batches from its share of the length-bucketed batch plan;
    2. the counted-token count per draft step is summed over the micro-batches and all-reduced over ranks;
    3. each micro-batch's loss is (its summed per-row loss) / (that global count), scaled by `world`:
       DeepSpeed *averages* gradients over ranks, and called with `scale_wrt_gas=False` it does not divide by
       the accumulation steps, so the applied gradient is exactly d(global summed loss / global count)
       whatever the world size, the accumulation and the split of tokens over micro-batches;
    4. `engine.backward` / `engine.step` after every micro-batch (the engine steps the optimizer and the LR
       schedule at the accumulation boundary and clips the global gradient norm).

The engine's module is `HeadLoss` (the head and its loss): the frozen target embedding / lm_head sit on a plain
attribute of the head, outside the module tree, so DeepSpeed neither casts, optimises nor saves them; they are
bf16 on CUDA and fp32 on CPU, like the engine's compute (`deepspeed.bf16.enabled` decides the precision;
`model.dtype` does not apply to training). Every parameter of the module trains (the frozen tensors are not
parameters at all) and exactly those go to the optimizer, so what ZeRO partitions is settled before
`deepspeed.initialize` looks.

Sequence parallelism (`train.sequence_parallel=N`, `train.sequence_parallel`): groups of N consecutive ranks read
the batches of one data-parallel rank and split each batch's rows; each rank's loss is its rows' share and counts
only its rows, so steps 2-4 above hold unchanged (the sum over all ranks' gradients is the global one). The
samples and tokens seen are counted once per group.

Evaluation runs the head's *inference* forward, as speculative decoding runs it (`mtp_train.train.evaluation`),
plus the injected validator, if any, on rank 0 (e.g. `speculative.validator.SpeculativeValidator`, which measures
τ by decoding). Models and heads never import deepspeed; only this floor does, lazily (`train.deepspeed_setup`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from mtp_train import dist
from mtp_train.config import Interrupted, TrainConfig, bf16_enabled
from mtp_train.config.checks import plain
from mtp_train.dist import DistInfo
from mtp_train.heads import DraftHead, FrozenTargetParts, build_head
from mtp_train.train.best import BestTracker, check_keep_best, sync_best
from mtp_train.train.checkpoint import (
    CKPT_DIR,
    HEADS_DIR,
    check_resume,
    export_head,
    load_engine_state,
    mark_latest,
    publish_best,
    save_engine_state,
    tag_for,
    write_checksums,
)
from mtp_train.train.data import aux_columns, draft_vocab_from_data, eval_batches
from mtp_train.train.deepspeed_config import build_ds_config, make_lr_scheduler
from mtp_train.train.deepspeed_setup import prepare_deepspeed, release_deepspeed
from mtp_train.train.evaluation import evaluate
from mtp_train.train.foreign import check_foreign_target
from mtp_train.train.logging import RunLogger
from mtp_train.train.losses import HeadLoss, noise_generator, step_anchor_seed, step_token_counts
from mtp_train.train.memory_plan import peak_bytes
from mtp_train.train.optimizers import build_muon
from mtp_train.train.sequence_parallel import SequenceParallel, check_sequence_parallel
from mtp_train.train.sources import build_source

log = logging.getLogger(__name__)

StepHook = Callable[["Trainer", int, dict[str, float]], None]  # (trainer, step, metrics) after each step
Validator = Callable[[DraftHead], dict[str, float]]  # head → metrics, on rank 0 at every evaluation


class TrainingDivergedError(ValueError):
    """The loss or the head's weights stopped being finite; the message names the step and what to change."""


# --- the trainer --------------------------------------------------------------------------------------------------


class Trainer:
    """One training run: data, head, DeepSpeed engine, loop, evaluation, checkpoints, logging.

    cfg: the run's TrainConfig; info: this process's place in the job; device: where it computes;
    config_yaml: the resolved config as YAML (saved with each head export); wandb_mode: the W&B mode to run in
    (online | offline | disabled, already resolved); validator(head) -> metrics: run on rank 0 at every
    evaluation after the validation loss (None = none); on_step(trainer, step, metrics):
    called on every rank after each optimizer step and its checkpoint, if any (tests use it to look inside a
    run, or to stop it mid-way as a crash would). on_start(): called on rank 0 once the data, the engine and
    the checkpoint to resume from have all been checked, before the run writes anything (the place to save
    the run's config: a run refused at set-up must not overwrite the config of the run that made the folder).
    """

    def __init__(self, cfg: TrainConfig, info: DistInfo, device: torch.device, config_yaml: str, *,
                 wandb_mode: str, validator: Validator | None = None, on_step: StepHook | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        self.cfg, self.info, self.device = cfg, info, device
        self.config_yaml, self.on_step, self.validator = config_yaml, on_step, validator
        self.out = Path(cfg.out)
        self.loss_cfg = cfg.loss
        self.step = 0
        self.samples_seen = 0
        self.tokens_seen = 0
        self.last_eval: dict[str, float] = {}
        self.last_train: dict[str, float] = {}
        self.head_dir: Path | None = None
        self._saved_step = -1
        self.best = BestTracker.from_config(cfg.train)  # train.keep_best: heads/best (train/best.py)
        # train.sequence_parallel: the groups (collective: every rank here at once) and each batch's shard
        self.sp = SequenceParallel.setup(cfg.train.sequence_parallel, info.rank, info.world, device)
        self._setup_data()
        try:
            check_keep_best(cfg, self.val_set is not None)
            resume_from = self._check_resume()  # before the engine: a damaged checkpoint fails fast
            if resume_from is None:
                self.data.read_ahead()  # the first batch's reading overlaps the engine's set-up
            self._setup_engine()
            self._resume_step = self._maybe_resume(resume_from)
            if on_start is not None and info.is_main:
                on_start()
                sync_best(self.out, self.best)  # heads/best as the resumed state says (a crash may have left another)
            # After the config is saved: a hybrid source starts writing its folder here.
            self.data.begin(self.stream.epoch, self.stream.position)
        except BaseException:
            self.data.close()
            raise
        self.logger = RunLogger(enabled=info.is_main, out=self.out, wandb=cfg.wandb, mode=wandb_mode,
                                config=plain(cfg), resume_step=self._resume_step)  # the head flat, as W&B filters it

    # -- set-up --

    def _setup_data(self) -> None:
        self.target_dir = Path(self.cfg.model.path)
        # A sequence-parallel group reads one data-parallel rank's batches (its ranks split each batch's rows).
        g = self.sp.groups
        self.data = build_source(self.cfg, dataclasses.replace(self.info, rank=g.dp_rank, world=g.dp_world),
                                 self.device)
        self.train_set, self.val_set, self.stream = self.data.train_set, self.data.val_set, self.data.stream
        self.target_fingerprint = self.data.target_fingerprint  # recorded in every checkpoint and head export

    def _setup_engine(self) -> None:
        import deepspeed  # heavy, and only the training floor may use it (set up by prepare_deepspeed)

        c = self.cfg
        bf16 = bf16_enabled(self.device)
        frozen = FrozenTargetParts.from_pretrained(self.target_dir, device=self.device,
                                                   dtype=torch.bfloat16 if bf16 else torch.float32)
        torch.manual_seed(c.train.seed)  # the same initial head on every rank (DeepSpeed also broadcasts rank 0's)
        head = build_head(c.head, self.target_dir, device=self.device,
                          dtype=torch.float32, backend=c.model.backend, frozen=frozen)
        # An aux head (eagle3, features=aux) reads target layers the folder must hold (refused here, by key); an
        # online target computes exactly the head's.
        self.aux_cols = aux_columns(self.data.stored_aux_layers, head.aux_layers, head.args.hidden_size,
                                    self.data.where)
        if head.draft_vocab is not None:
            head.set_draft_vocab(draft_vocab_from_data(self.train_set, head.vocab_size, head.args.vocab_size,
                                                             head.args.eos_token_ids))
        head.train()
        module = HeadLoss(head, self.loss_cfg, checkpoint=c.train.activation_checkpointing)
        params = [p for p in module.parameters() if p.requires_grad]
        # adamw: the preset's optimizer block (DeepSpeed builds torch's AdamW); muon: torch's Muon + AdamW, built here
        muon = c.train.optimizer == "muon"
        ds_config = build_ds_config(c.deepspeed, optim=c.optim, grad_accum=c.train.grad_accum, bf16=bf16,
                                    client_optimizer=muon)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=module, model_parameters=params, config=ds_config, optimizer=build_muon(module, c.optim) if muon
            else None, lr_scheduler=make_lr_scheduler(c.optim, c.train.max_steps))
        if self.info.is_main:
            log.info("head %s: %.2fM trainable parameters; DeepSpeed ZeRO-%d, %s, world %d (sequence parallel %d), "
                     "grad_accum %d%s", c.head.type, sum(p.numel() for p in params) / 1e6,
                     int(ds_config.get("zero_optimization", {}).get("stage", 0)), "bf16" if bf16 else "fp32",
                     self.info.world, self.sp.size, c.train.grad_accum,
                     ", activation checkpointing" if c.train.activation_checkpointing else "")

    @property
    def head(self) -> DraftHead:
        return self.engine.module.head

    def _check_resume(self) -> tuple[Path, str] | None:
        found = check_resume(self.cfg.resume, self.out, self.info.world, self.info.rank, head_type=self.cfg.head.type,
                             trust_pickles=self.cfg.resume_trust_pickles, data=(self.data.name, str(self.data.where)))
        dist.barrier()  # no rank loads anything before rank 0 has checked every file
        return found

    def _maybe_resume(self, found: tuple[Path, str] | None) -> int | None:
        """Load the checkpoint `_check_resume` found; returns its step, or None for a fresh run."""
        if found is None:
            return None
        ckpt_dir, tag = found
        client = load_engine_state(self.engine, ckpt_dir, tag, self.info.rank, self.info.world,
                                   trust_pickles=self.cfg.resume_trust_pickles)
        self.step = int(client["step"])
        self.stream.load_state_dict(client["data"])
        self.samples_seen, self.tokens_seen = int(client["samples_seen"]), int(client["tokens_seen"])
        self._saved_step = self.step
        self.best.load_state_dict(client.get("best"))  # compare against the interrupted run's best, not afresh
        for key, now in (("micro_batch_tokens", self.cfg.train.micro_batch_tokens), ("seed", self.cfg.train.seed),
                         ("sequence_parallel", self.sp.size)):
            if client.get(key, 1 if key == "sequence_parallel" else None) != now:
                log.warning("resuming with train.%s=%s (checkpoint: %s): the batch order differs from the "
                            "interrupted run's", key, now, client.get(key))
        self.data.check_resume(client)  # online and hybrid share one batch plan; offline's is the folder's
        if self.info.is_main:
            log.info("resumed from %s at step %d (epoch %d, batch %d)", ckpt_dir / tag, self.step,
                     self.stream.epoch, self.stream.position)
        return self.step

    # -- one step --

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.info.world > 1:
            tdist.all_reduce(x)
        return x

    def train_step(self) -> dict[str, float]:
        """One optimizer step over grad_accum micro-batches per rank; returns global metrics (train/...)."""
        c = self.cfg
        steps, world = self.loss_cfg.steps, self.info.world
        micro = [self.stream.next() for _ in range(c.train.grad_accum)]
        shards = [self.sp.shard(b.num_rows) for b in micro]  # this rank's rows of each (None: all of them)
        # a block drafter's anchors, drawn afresh every step (a group's ranks draw the same: the dp rank's seed)
        seeds = [step_anchor_seed(c.train.seed, self.step, m, self.sp.groups.dp_rank) for m in range(len(micro))]
        # (steps,); a block drafter counts its anchors only (`DraftHead.loss_rows`); a shard its own rows only
        counts = sum(step_token_counts(b.loss_mask, b.seq_lens, steps,
                                       self.head.loss_rows(b.input_ids, b.loss_mask, b.seq_lens, seed), shard)
                     for b, shard, seed in zip(micro, shards, seeds))
        counts = self._all_reduce(counts.to(self.device))
        lr = float(self.engine.get_lr()[0])  # the rate this step uses (the schedule moves after the update)
        self.engine.train()
        sums: dict[str, torch.Tensor] = {}
        for m, (batch, shard) in enumerate(zip(micro, shards)):
            b = self.data.fill(batch).to(self.device, non_blocking=True)  # online: the target runs here
            # the data-parallel rank's generator: a group's ranks draw the same noise for their shared batch
            gen = (noise_generator(c.train.seed, self.step, m, self.sp.groups.dp_rank, self.device)
                   if self.loss_cfg.noise_std > 0 else None)
            loss, metrics = self.engine(b.hidden, b.input_ids, b.loss_mask, b.seq_lens, counts, gen,
                                        b.head_aux(self.aux_cols), shard, seeds[m])
            # x world: the engine averages gradients over ranks, the loss is already a share of the global mean.
            self.engine.backward(loss * world, scale_wrt_gas=False)
            self.engine.step()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0) + v.detach().double()
        # a group's ranks share their batches: the first of them counts them
        mine = self.sp.groups.index == 0
        seen = torch.tensor([sum(len(b.seq_lens) for b in micro) * mine, sum(b.num_rows for b in micro) * mine],
                            dtype=torch.float64)
        keys = sorted(sums)
        vec = self._all_reduce(torch.cat([torch.stack([sums[k] for k in keys]), seen.to(self.device)]))
        values = vec.tolist()
        self.samples_seen += int(values[-2])
        self.tokens_seen += int(values[-1])
        out = {f"train/{k}": v for k, v in zip(keys, values[:-2])}
        norm = self.engine.get_global_grad_norm()
        out["train/grad_norm"] = float(norm) if norm is not None else float("nan")
        out["train/lr"] = lr
        out["train/samples_seen"] = float(self.samples_seen)
        out["train/tokens_seen"] = float(self.tokens_seen)
        out["train/epoch"] = float(self.stream.epoch)
        # the busiest rank's peak so far, the measured side of the memory plan (`mtp-train plan=true`)
        peak = torch.tensor([float(peak_bytes(self.device))], dtype=torch.float64, device=self.device)
        if self.info.world > 1:
            tdist.all_reduce(peak, op=tdist.ReduceOp.MAX)
        out["train/peak_memory_gib"] = float(peak.item()) / 2**30
        return out

    # -- evaluation, checkpoints --

    def evaluate(self) -> dict[str, float]:
        """Validation metrics of the current head (every rank; {} without a val split)."""
        if self.val_set is None:
            return {}
        c = self.cfg
        g = self.sp.groups
        batches = (self.data.fill(b) for b in eval_batches(self.val_set, c.train.micro_batch_tokens,
                                                             c.train.eval_batches, g.dp_rank, g.dp_world,
                                                             seed=c.train.seed))
        # under sequence parallelism every rank scores its rows of the group's batches (train.evaluation)
        self.last_eval = evaluate(self.head, batches, self.loss_cfg, self.device, self.info.world, self.aux_cols,
                                  shard_of=self.sp.shard if self.sp.size > 1 else None)
        if self.validator is not None and self.info.is_main:
            self.last_eval.update(self.validator(self.head))
        return self.last_eval

    def save(self) -> None:
        """Checkpoint the current step on every rank, export the head on rank 0, then mark it `latest`."""
        # Never a broken checkpoint (ZeRO-1/2 keep the weights whole on every rank: all ranks agree).
        if not all(bool(torch.isfinite(p).all()) for p in self.engine.module.parameters()):
            raise self._diverged("the head's weights are not finite")
        self.data.flush()  # a hybrid source's shards written so far are on disk before the step is recorded
        client = {
            "step": self.step, "data": self.stream.state_dict(), "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen, "world": self.info.world,
            "micro_batch_tokens": self.cfg.train.micro_batch_tokens, "seed": self.cfg.train.seed,
            "sequence_parallel": self.sp.size,
            "target_fingerprint": self.target_fingerprint, "data_source": self.data.name,
            "data_where": str(self.data.where),  # a resume on other data is refused (check_resume)
            "best": self.best.state_dict(),
        }
        tag_dir = save_engine_state(self.engine, self.out, self.step, client, self.info.rank, self.info.world,
                                    self.head.cfg.to_dict())
        dist.barrier()
        if self.info.is_main:
            write_checksums(tag_dir)
            self.head_dir = self._export_head()
            mark_latest(self.out, self.step)
            log.info("step %d: checkpoint %s, head %s", self.step, self.out / CKPT_DIR, self.head_dir)
        dist.barrier()
        self._saved_step = self.step

    def _export_head(self) -> Path:
        """Rank 0: `heads/step-N` of the current head, with the run's counters and its last evaluation."""
        extra = {"samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen,
                 **self.data.record(), "eval": self.last_eval}
        return export_head(self.head, self.out, self.step, self.config_yaml,
                           target_fingerprint=self.target_fingerprint, extra=extra)

    def _log_evaluation(self) -> bool:
        """Evaluate and log, with best/<metric> and best/step when train.keep_best's metric improved (then True)."""
        metrics = self.evaluate()
        best = self.best.update(metrics, self.step)
        self.logger.log({**metrics, **best}, self.step)
        return bool(best)

    def _publish_best(self) -> None:
        """Rank 0, after an improvement and the step's save (if due): heads/best becomes a copy of this step's head,
        exported here when the step saves none (no checkpoint: only the head is needed)."""
        if self.info.is_main:
            if self._saved_step != self.step:
                self._export_head()
            publish_best(self.out, self.step, self.best.record())
            log.info("step %d: best %s %.6g, heads/best", self.step, self.best.metric, self.best.value)

    def _diverged(self, what: str) -> TrainingDivergedError:
        """The error that stops a run whose loss or weights are no longer finite: one line naming the step, the
        last checkpoint (which stays as it is) and what to change."""
        kept = f"the last checkpoint, {tag_for(self._saved_step)}, stays" if self._saved_step > 0 else "none saved"
        return TrainingDivergedError(f"step {self.step}: {what}, so the run stops without saving it ({kept}): "
                                     f"lower optim.lr (now {self.cfg.optim.lr:g}) or check the data "
                                     f"({self.data.where})")

    # -- the loop --

    def _out_of_time(self, started: float) -> bool:
        """Whether this invocation's loop has used up train.max_seconds since `started` (time.monotonic). Every rank
        gets the same answer (one past the budget stops all): else one would wait alone in the next collective."""
        if self.cfg.train.max_seconds <= 0:
            return False
        late = torch.tensor([float(time.monotonic() - started >= self.cfg.train.max_seconds)], device=self.device)
        return bool(self._all_reduce(late).item() > 0)

    def fit(self) -> dict[str, Any]:
        """Train up to train.max_steps (from the resumed step) or train.max_seconds; returns the last train and eval
        metrics, `train_seconds` (this invocation's loop) and `stopped_by` (max_steps | max_seconds)."""
        c = self.cfg.train
        try:
            bar = tqdm(total=c.max_steps, initial=self.step, desc="train", dynamic_ncols=True,
                       disable=not (self.info.is_main and c.progress))
            started = time.monotonic()
            t0, rows0 = time.perf_counter(), self.tokens_seen
            evaluated_at = -1
            stopped_by = "max_steps"
            while self.step < c.max_steps and stopped_by == "max_steps":
                metrics = self.train_step()
                self.step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", top1=f"{metrics['train/top1']:.3f}")
                if not math.isfinite(metrics["train/loss"]):
                    raise self._diverged(f"the training loss is {metrics['train/loss']}")
                self.last_train = metrics
                # Decided before logging, so that the last step of a run stopped by the clock is logged too.
                if self.step < c.max_steps and self._out_of_time(started):
                    stopped_by = "max_seconds"
                if self.step % c.log_every == 0 or self.step == c.max_steps or stopped_by == "max_seconds":
                    now = time.perf_counter()
                    metrics["train/tokens_per_s"] = (self.tokens_seen - rows0) / max(now - t0, 1e-9)
                    metrics["train/elapsed_s"] = time.monotonic() - started
                    t0, rows0 = now, self.tokens_seen
                    self.logger.log(metrics, self.step)
                improved = False
                if c.eval_every and self.step % c.eval_every == 0:
                    improved = self._log_evaluation()
                    evaluated_at = self.step
                if c.save_every and self.step % c.save_every == 0:
                    self.save()
                if improved:
                    self._publish_best()
                if self.on_step is not None:
                    self.on_step(self, self.step, metrics)
            bar.close()
            train_seconds = time.monotonic() - started
            # Stopped by either limit: the final evaluation, checkpoint and head export (a re-run resumes from them).
            improved = self._log_evaluation() if evaluated_at != self.step else False
            if self._saved_step != self.step:
                self.save()
            elif self.head_dir is None and (self.out / HEADS_DIR / tag_for(self.step)).is_dir():
                self.head_dir = self.out / HEADS_DIR / tag_for(self.step)  # resumed at the end: already exported
            if improved:
                self._publish_best()
            self.logger.summary(self.last_eval)
            return {"step": self.step, "out": str(self.out), "head_dir": str(self.head_dir) if self.head_dir else None,
                    "train_seconds": train_seconds, "stopped_by": stopped_by, **self.last_train, **self.last_eval}
        except KeyboardInterrupt:
            then = (f"resume from its last checkpoint, {self.out / CKPT_DIR / tag_for(self._saved_step)}"
                    if self._saved_step > 0 else f"start again (no checkpoint was saved yet in {self.out})")
            raise Interrupted(f"at step {self.step} of {c.max_steps}; re-run the same command to {then}") from None
        finally:
            self.data.close()
            self.logger.finish()


def train(cfg: TrainConfig, info: DistInfo, device: torch.device, *, wandb_mode: str,
          validator: Validator | None = None, on_step: StepHook | None = None,
          on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run (or resume) one training; returns the final metrics (train/..., eval/...), `step`, `out`, `head_dir`.

    Every rank calls it; torch.distributed is initialised by the caller under torchrun, or here as a world of
    one (DeepSpeed needs a process group either way). wandb_mode: the W&B mode to run in (resolved by the caller,
    `mtp_train.train.logging.resolve_wandb_mode`); validator, on_step, on_start: see Trainer.
    """
    check_foreign_target(cfg)  # a target our engine does not implement: only what reads no layer of it
    check_sequence_parallel(cfg, info.world)  # train.sequence_parallel / activation_checkpointing, before any work
    config_yaml = OmegaConf.to_yaml(plain(cfg))  # the head flat, as the user says it
    own_group = prepare_deepspeed(device)
    try:
        return Trainer(cfg, info, device, config_yaml, wandb_mode=wandb_mode, validator=validator,
                       on_step=on_step, on_start=on_start).fit()
    finally:
        if own_group:
            release_deepspeed()
