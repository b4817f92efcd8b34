"""Stage two: train a draft head on precomputed target hidden states with DeepSpeed (ZeRO-0/1/2) under torchrun.

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

Evaluation runs the head's *inference* forward, as speculative decoding runs it (`inference_chain`): step 0 is
the engine-style prefill of the val sequences over the target's hidden states, and step j > 0 drafts from every
position at once, one decode step per chain over the head's paged KV cache. Its step-j top-1 is the share of
positions where a chain started there drafts the target's own next token at its (j+1)-th draft.

Models and heads never import deepspeed; only this floor does, lazily.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from omegaconf import OmegaConf
from torch import nn
from tqdm.auto import tqdm

from mtp_train import dist
from mtp_train.config import LossConfig, TrainConfig, bf16_enabled, typed
from mtp_train.dist import DistInfo
from mtp_train.engine import KVCache
from mtp_train.heads import DraftHead, FrozenTargetParts, build_head, packed_shift
from mtp_train.layers import AttentionMetadata
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute import LengthBucketedBatchSampler, PrecomputedDataset
from mtp_train.train.checkpoint import (
    CKPT_DIR,
    HEADS_DIR,
    checkpoint_ranks,
    export_head,
    load_engine_state,
    mark_latest,
    resolve_resume,
    rng_file,
    rng_state,
    save_engine_state,
    tag_for,
    verify_checkpoint,
    write_checksums,
)
from mtp_train.train.data import MicroBatchStream, PackedBatch, eval_batches
from mtp_train.train.deepspeed_config import build_ds_config, make_lr_scheduler
from mtp_train.train.logging import RunLogger
from mtp_train.train.losses import draft_loss, step_targets, step_token_counts, unrolled_loss

log = logging.getLogger(__name__)

StepHook = Callable[["Trainer", int, dict[str, float]], None]  # (trainer, step, metrics) after each step
EVAL_KV_SLOTS = 1 << 18  # padded (chain, cached token) pairs per decode call of the evaluation chains


class HeadLoss(nn.Module):
    """The module DeepSpeed wraps: a draft head and its training loss.

    Its parameters are exactly the head's (named `head.*`); the loss is computed inside `forward` so that the
    engine's forward and backward hooks see one call per micro-batch.
    """

    def __init__(self, head: DraftHead, loss_cfg: LossConfig) -> None:
        super().__init__()
        self.head = head
        self.loss_cfg = loss_cfg

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                seq_lens: Sequence[int], num_tokens: torch.Tensor,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """hidden: (T, H); input_ids, loss_mask: (T,); seq_lens: (B,); num_tokens: (steps,) global counts.

        Returns `unrolled_loss`'s (loss, metrics): sums over this micro-batch divided by the global counts.
        """
        return unrolled_loss(self.head, hidden, input_ids, loss_mask, seq_lens, self.loss_cfg,
                             num_tokens=num_tokens, generator=generator)


# --- evaluation through the inference path ------------------------------------------------------------------------


def _chunks(kv_lens: Sequence[int], budget: int) -> list[range]:
    """Consecutive runs of chains whose padded gather (count · longest kv) stays within `budget` slots."""
    out: list[range] = []
    start, longest = 0, 0
    for i, n in enumerate(kv_lens):
        if i > start and (i - start + 1) * max(longest, n) > budget:
            out.append(range(start, i))
            start, longest = i, 0
        longest = max(longest, n)
    if len(kv_lens) > start:
        out.append(range(start, len(kv_lens)))
    return out


@torch.no_grad()
def inference_chain(head: DraftHead, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int],
                    steps: int, kv_slots: int = EVAL_KV_SLOTS) -> list[torch.Tensor]:
    """The head's draft features for every position and step, through its inference `forward` and paged cache.

    hidden: (T, H) target hidden h_i of packed sequences; input_ids: (T,) tokens t_i; seq_lens: (B,).
    Step 0 is one engine-style prefill over the target's hidden states (tokens t_{i+1}), which also fills the
    head's KV cache, one page (page_size 1) per row. Step j > 0 continues a chain from every row i at once:
    chain i reads the prefix pages of rows 0..i of its sequence and its own pages of steps 1..j, feeds its
    previous output with token t_{i+j+1} at position i+j, and writes its new entry to a page of its own, so
    chains never see each other. Returns one (T, H) tensor per step, row i of step j estimating h_{i+j+1}
    (rows past the end of their sequence are computed with token 0 and are not meaningful).
    """
    lens = [int(n) for n in seq_lens]
    total = hidden.shape[0]
    device = hidden.device
    layers, layout = head.kv_shape
    cache = KVCache(layers, num_pages=total * steps, page_size=1, layout=layout, dtype=head.dtype, device=device)
    starts = np.cumsum([0] + lens[:-1]).tolist()
    # Page r holds row r's step-0 entry; page total·j + r holds chain r's step-j entry.
    meta = AttentionMetadata.build(lens, lens, [list(range(s, s + n)) for s, n in zip(starts, lens)], 1, device)
    x = head(hidden, packed_shift(input_ids, lens, 1), meta, cache.layers[0]).hidden  # (T, H)
    outs = [x]
    rows = [(s, i) for s, n in zip(starts, lens) for i in range(n)]  # (sequence start, index within) per row
    for j in range(1, steps):
        tokens = packed_shift(input_ids, lens, j + 1)  # t_{i+j+1}
        kv_lens = [i + 1 + j for _, i in rows]
        nxt = torch.empty_like(x)
        for part in _chunks(kv_lens, kv_slots):
            tables = [list(range(rows[r][0], rows[r][0] + rows[r][1] + 1)) + [total * m + r for m in range(1, j + 1)]
                      for r in part]
            meta = AttentionMetadata.build([1] * len(part), [kv_lens[r] for r in part], tables, 1, device)
            sl = slice(part.start, part.stop)
            nxt[sl] = head(x[sl], tokens[sl], meta, cache.layers[0]).hidden
        x = nxt
        outs.append(x)
    return outs


@torch.no_grad()
def evaluate(head: DraftHead, batches: Iterable[PackedBatch], loss_cfg: LossConfig, device: torch.device,
             world: int = 1) -> dict[str, float]:
    """Loss and top-1 / top-3 per draft step on `batches`, with the head's inference path (`inference_chain`).

    Sums are all-reduced over ranks (every rank must call it with its share of the batches). Returns
    eval/loss (Σ_j w_j · loss_j, as in training), eval/step{j}/{loss,feat_loss,tok_loss,top1,top3,num_tokens}
    and the step-0 values without the step prefix; {} when no rank had a counted token.
    """
    was_training = head.training
    head.eval()
    lm_head = head.lm_head_weight()
    steps = loss_cfg.steps
    sums = torch.zeros(steps, 5, dtype=torch.float64, device=device)  # feat, tok, top1, top3, count per step
    for batch in batches:
        b = batch.to(device, non_blocking=True)
        preds = inference_chain(head, b.hidden, b.input_ids, b.seq_lens, steps)
        for j, pred in enumerate(preds):
            target, counted = step_targets(b.hidden, b.loss_mask, b.seq_lens, j)
            # num_tokens=1: the metrics come back as plain sums over the batch's counted rows.
            _, m = draft_loss(pred, target, counted, lm_head, 1.0, w_feat=loss_cfg.w_feat, w_tok=loss_cfg.w_tok,
                              smooth_l1_beta=loss_cfg.smooth_l1_beta, chunk_size=loss_cfg.chunk_size)
            sums[j] += torch.stack([m[k].double() for k in ("feat_loss", "tok_loss", "top1", "top3", "num_tokens")])
    if world > 1:
        tdist.all_reduce(sums)
    head.train(was_training)
    if float(sums[0, 4]) == 0:
        return {}
    out: dict[str, float] = {}
    total = 0.0
    for j, w in enumerate(loss_cfg.weights()):
        feat, tok, top1, top3, n = sums[j].tolist()
        n = max(n, 1.0)
        loss_j = loss_cfg.w_feat * feat / n + loss_cfg.w_tok * tok / n
        total += w * loss_j
        values = {"loss": loss_j, "feat_loss": feat / n, "tok_loss": tok / n, "top1": top1 / n, "top3": top3 / n,
                  "num_tokens": n}
        out.update({f"eval/step{j}/{k}": v for k, v in values.items()})
    out["eval/loss"] = total
    out.update({f"eval/{k}": out[f"eval/step0/{k}"] for k in ("feat_loss", "tok_loss", "top1", "top3", "num_tokens")})
    return out


def draft_vocab_from_data(dataset: PrecomputedDataset, size: int, vocab_size: int,
                          always: Sequence[int] = ()) -> torch.Tensor:
    """(size,) ascending ids of the `size` most frequent assistant tokens of `dataset`, plus the `always` ids (EOS).

    Ties go to the lower id, and every rank reads the same (whole) split, so every rank picks the same set.
    """
    counts = dataset.token_counts(vocab_size)
    keep = [int(t) for t in always if 0 <= int(t) < vocab_size]
    counts[keep] = torch.iinfo(torch.long).max  # always in
    order = torch.sort(-counts, stable=True).indices  # stable: ties stay in id order
    return order[:size].sort().values


# --- the trainer --------------------------------------------------------------------------------------------------


def _process_group_for_deepspeed(device: torch.device) -> bool:
    """DeepSpeed needs torch.distributed even on one process: make a world of one when torchrun did not.

    Returns True when this call created the group (the caller destroys it). DeepSpeed also insists on
    LOCAL_RANK in the environment, which only launchers set.
    """
    os.environ.setdefault("LOCAL_RANK", "0")
    if tdist.is_initialized():
        return False
    if device.type == "cuda":
        # Naming the device spares NCCL guessing it (and warning at every barrier).
        dev = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        tdist.init_process_group(backend="nccl", store=tdist.HashStore(), rank=0, world_size=1, device_id=dev)
    else:
        tdist.init_process_group(backend="gloo", store=tdist.HashStore(), rank=0, world_size=1)
    return True


def _noise_generator(seed: int, step: int, micro: int, rank: int, device: torch.device) -> torch.Generator:
    """A generator for the feature noise of one micro-batch, from (seed, step, micro, rank) alone.

    Stateless, so a resumed run draws exactly the noise the uninterrupted run would have drawn.
    """
    state = int(np.random.SeedSequence([seed, step, micro, rank]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(state & ((1 << 63) - 1))


class Trainer:
    """One training run: data, head, DeepSpeed engine, loop, evaluation, checkpoints, logging.

    cfg: the run's TrainConfig; info: this process's place in the job; device: where it computes;
    config_yaml: the resolved config as YAML (saved with each head export); on_step(trainer, step, metrics):
    called on every rank after each optimizer step and its checkpoint, if any (tests use it to look inside a
    run, or to stop it mid-way as a crash would). on_start(): called on rank 0 once the data, the engine and
    the checkpoint to resume from have all been checked, before the run writes anything (the place to save
    the run's config: a run refused at set-up must not overwrite the config of the run that made the folder).
    """

    def __init__(self, cfg: TrainConfig, info: DistInfo, device: torch.device, config_yaml: str,
                 on_step: StepHook | None = None, on_start: Callable[[], None] | None = None) -> None:
        self.cfg, self.info, self.device = cfg, info, device
        self.config_yaml, self.on_step = config_yaml, on_step
        self.out = Path(cfg.out)
        self.loss_cfg = cfg.loss
        self.step = 0
        self.samples_seen = 0
        self.tokens_seen = 0
        self.last_eval: dict[str, float] = {}
        self._spec_target: tuple[Any, Any, list, list[int]] | None = None  # (model, tokenizer, prompts, stops)
        self.last_train: dict[str, float] = {}
        self.head_dir: Path | None = None
        self._saved_step = -1
        self._setup_data()
        resume_from = self._check_resume()  # before the engine: a damaged checkpoint fails fast
        self._setup_engine()
        self._resume_step = self._maybe_resume(resume_from)
        if on_start is not None and info.is_main:
            on_start()
        self.logger = RunLogger(enabled=info.is_main, out=self.out, wandb_cfg=dataclasses.asdict(cfg.wandb),
                                config=dataclasses.asdict(cfg), resume_step=self._resume_step)

    # -- set-up --

    def _setup_data(self) -> None:
        c = self.cfg
        self.target_dir = Path(c.model.path)
        # Not split by rank here: the batch sampler splits batches (see mtp_train.train.data).
        self.train_set = PrecomputedDataset(c.data.dir, expect_target_fingerprint=weights_fingerprint(self.target_dir),
                                            split="train", verify=c.data.verify)
        manifest = self.train_set.manifest
        self.target_fingerprint = manifest.target.fingerprint  # recorded in every checkpoint and head export
        if manifest.hidden.kind != "final_norm":
            raise ValueError(f"{c.data.dir} holds hidden states of kind {manifest.hidden.kind!r}; heads train on "
                             "the target's last hidden state after the final norm (kind 'final_norm')")
        made_from = manifest.data.get("name")
        if made_from and made_from != c.data.name:
            log.warning("data=%s, but %s was precomputed from data %r; training reads data.dir", c.data.name,
                        c.data.dir, made_from)
        if len(self.train_set) == 0:
            raise ValueError(f"{c.data.dir} has no training samples (every sample is in the val split?)")
        self.val_set = PrecomputedDataset(c.data.dir, expect_target_fingerprint=self.target_fingerprint,
                                          split="val", verify=c.data.verify) if c.train.eval_batches > 0 else None
        if self.val_set is not None and len(self.val_set) == 0:
            log.warning("%s has no val samples (precompute val_fraction=0?): no evaluation", c.data.dir)
            self.val_set = None
        sampler = LengthBucketedBatchSampler(self.train_set.lengths, c.train.micro_batch_tokens, shuffle=True,
                                             seed=c.train.seed, rank=self.info.rank, world=self.info.world)
        self.stream = MicroBatchStream(self.train_set, sampler, num_workers=c.data.num_workers,
                                       pin_memory=self.device.type == "cuda")

    def _setup_engine(self) -> None:
        import deepspeed  # heavy, and only the training floor may use it

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step INFO lines drown ours
        if self.device.type == "cpu":
            # CPU runs are tests and development: gloo's collectives are enough, and DeepSpeed's shared-memory
            # allreduce op would be JIT-built on first use, which takes minutes on a small machine. DeepSpeed
            # consults this table only for that op; filling it ourselves also skips its compiler probes.
            import deepspeed.ops

            ops = vars(deepspeed.ops)
            ops.setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
        c = self.cfg
        bf16 = bf16_enabled(self.device)
        frozen = FrozenTargetParts.from_pretrained(self.target_dir, device=self.device,
                                                   dtype=torch.bfloat16 if bf16 else torch.float32)
        torch.manual_seed(c.train.seed)  # the same initial head on every rank (DeepSpeed also broadcasts rank 0's)
        head = build_head(c.head, self.target_dir, device=self.device,
                          dtype=torch.float32, backend=c.model.backend, frozen=frozen)
        if head.draft_vocab is not None:
            head.set_draft_vocab(draft_vocab_from_data(self.train_set, head.vocab_size, head.args.vocab_size,
                                                             head.args.eos_token_ids))
        head.train()
        module = HeadLoss(head, self.loss_cfg)
        params = [p for p in module.parameters() if p.requires_grad]
        ds_config = build_ds_config(c.deepspeed, optim=c.optim, grad_accum=c.train.grad_accum, bf16=bf16)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=module, model_parameters=params, config=ds_config,
            lr_scheduler=make_lr_scheduler(c.optim, c.train.max_steps))
        if self.info.is_main:
            log.info("head %s: %.2fM trainable parameters; DeepSpeed ZeRO-%d, %s, world %d, grad_accum %d",
                     c.head.type, sum(p.numel() for p in params) / 1e6,
                     int(ds_config.get("zero_optimization", {}).get("stage", 0)), "bf16" if bf16 else "fp32",
                     self.info.world, c.train.grad_accum)

    @property
    def head(self) -> DraftHead:
        return self.engine.module.head

    def _check_resume(self) -> tuple[Path, str] | None:
        """The checkpoint `resume` names, checked: written by as many ranks as this run has, and every file as
        its checksums say. None for a fresh run."""
        found = resolve_resume(self.cfg.resume, self.out)
        if found is None:
            return None
        ckpt_dir, tag = found
        ranks = checkpoint_ranks(ckpt_dir / tag)
        if ranks and ranks != self.info.world:
            raise ValueError(f"checkpoint {ckpt_dir / tag} was written by {ranks} ranks, this run has "
                             f"{self.info.world}: resume with the same number of processes (ZeRO partitions "
                             "optimizer state per rank), or start afresh with resume=none and another out")
        # DeepSpeed unpickles its files: every file is checked against the checkpoint's checksums first, by rank 0
        # (each other rank checks its own RNG file), and no rank loads anything before that has passed.
        verify_checkpoint(ckpt_dir / tag, None if self.info.is_main else [rng_file(self.info.rank)])
        dist.barrier()
        return found

    def _maybe_resume(self, found: tuple[Path, str] | None) -> int | None:
        """Load the checkpoint `_check_resume` found; returns its step, or None for a fresh run."""
        if found is None:
            return None
        ckpt_dir, tag = found
        client = load_engine_state(self.engine, ckpt_dir, tag, self.info.rank)
        self.step = int(client["step"])
        self.stream.load_state_dict(client["data"])
        self.samples_seen, self.tokens_seen = int(client["samples_seen"]), int(client["tokens_seen"])
        self._saved_step = self.step
        for key, now in (("micro_batch_tokens", self.cfg.train.micro_batch_tokens), ("seed", self.cfg.train.seed)):
            if client.get(key) != now:
                log.warning("resuming with train.%s=%s (checkpoint: %s): the batch order differs from the "
                            "interrupted run's", key, now, client.get(key))
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
        counts = sum(step_token_counts(b.loss_mask, b.seq_lens, steps) for b in micro)  # (steps,)
        counts = self._all_reduce(counts.to(self.device))
        lr = float(self.engine.get_lr()[0])  # the rate this step uses (the schedule moves after the update)
        self.engine.train()
        sums: dict[str, torch.Tensor] = {}
        for m, batch in enumerate(micro):
            b = batch.to(self.device, non_blocking=True)
            gen = (_noise_generator(c.train.seed, self.step, m, self.info.rank, self.device)
                   if self.loss_cfg.noise_std > 0 else None)
            loss, metrics = self.engine(b.hidden, b.input_ids, b.loss_mask, b.seq_lens, counts, gen)
            # x world: the engine averages gradients over ranks, the loss is already a share of the global mean.
            self.engine.backward(loss * world, scale_wrt_gas=False)
            self.engine.step()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0) + v.detach().double()
        seen = torch.tensor([sum(len(b.seq_lens) for b in micro), sum(b.num_rows for b in micro)],
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
        return out

    # -- evaluation, checkpoints --

    def evaluate(self) -> dict[str, float]:
        """Validation metrics of the current head (every rank; {} without a val split)."""
        if self.val_set is None:
            return {}
        c = self.cfg
        batches = eval_batches(self.val_set, c.train.micro_batch_tokens, c.train.eval_batches, self.info.rank,
                               self.info.world, seed=c.train.seed)
        self.last_eval = evaluate(self.head, batches, self.loss_cfg, self.device, self.info.world)
        if c.spec_eval.prompts and self.info.is_main:
            self.last_eval.update(self.spec_acceptance())
        return self.last_eval

    def spec_acceptance(self) -> dict[str, float]:
        """spec/tau, spec/acceptance_rate, spec/pos{j}: greedy speculative decoding with the current head on the
        held-out prompts of `spec_eval`, through the inference engine (the target is loaded on first use)."""
        from mtp_train.data.chat import load_tokenizer
        from mtp_train.engine.turns import stop_token_ids
        from mtp_train.eval.acceptance import head_acceptance
        from mtp_train.eval.prompts import load_prompt_sets
        from mtp_train.models.loader import load_model
        from mtp_train.speculative.proposers import HeadProposer

        se = self.cfg.spec_eval
        if self._spec_target is None:
            dtype = "bfloat16" if bf16_enabled(self.device) else "float32"
            model = load_model(self.target_dir, dtype=dtype, device=self.device, backend=self.cfg.model.backend)
            tokenizer = load_tokenizer(self.target_dir)
            convs = [c for ps in load_prompt_sets(list(se.prompts), se.limit) for c in ps.convs]
            self._spec_target = (model, tokenizer, convs, stop_token_ids(tokenizer, model.args.eos_token_ids))
        model, tokenizer, convs, stops = self._spec_target
        head = self.head
        was_training = head.training
        try:
            return head_acceptance(model, tokenizer, lambda: HeadProposer(head), convs, se.k, se.max_new_tokens,
                                   page_size=self.cfg.model.page_size, batch_size=se.batch_size,
                                   stop_token_ids=stops)
        finally:
            head.train(was_training)

    def save(self) -> None:
        """Checkpoint the current step on every rank, export the head on rank 0, then mark it `latest`."""
        client = {
            "step": self.step, "data": self.stream.state_dict(), "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen, "world": self.info.world,
            "micro_batch_tokens": self.cfg.train.micro_batch_tokens, "seed": self.cfg.train.seed,
            "target_fingerprint": self.target_fingerprint, "rng": rng_state(),
        }
        tag_dir = save_engine_state(self.engine, self.out, self.step, client, self.info.rank)
        dist.barrier()
        if self.info.is_main:
            write_checksums(tag_dir)
            extra = {"samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen,
                     "data_dir": str(self.cfg.data.dir), "eval": self.last_eval}
            self.head_dir = export_head(self.head, self.out, self.step, self.config_yaml,
                                        target_fingerprint=self.target_fingerprint, extra=extra)
            mark_latest(self.out, self.step)
            log.info("step %d: checkpoint %s, head %s", self.step, self.out / CKPT_DIR, self.head_dir)
        dist.barrier()
        self._saved_step = self.step

    # -- the loop --

    def fit(self) -> dict[str, Any]:
        """Train up to train.max_steps (from the resumed step); returns the last train and eval metrics."""
        c = self.cfg.train
        try:
            bar = tqdm(total=c.max_steps, initial=self.step, desc="train", dynamic_ncols=True,
                       disable=not (self.info.is_main and c.progress))
            t0, rows0 = time.perf_counter(), self.tokens_seen
            evaluated_at = -1
            while self.step < c.max_steps:
                metrics = self.train_step()
                self.step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", top1=f"{metrics['train/top1']:.3f}")
                if not math.isfinite(metrics["train/loss"]):
                    raise FloatingPointError(f"step {self.step}: training loss is {metrics['train/loss']}; lower "
                                             "optim.lr or check the precompute folder")
                self.last_train = metrics
                if self.step % c.log_every == 0 or self.step == c.max_steps:
                    now = time.perf_counter()
                    metrics["train/tokens_per_s"] = (self.tokens_seen - rows0) / max(now - t0, 1e-9)
                    t0, rows0 = now, self.tokens_seen
                    self.logger.log(metrics, self.step)
                if c.eval_every and self.step % c.eval_every == 0:
                    self.logger.log(self.evaluate(), self.step)
                    evaluated_at = self.step
                if c.save_every and self.step % c.save_every == 0:
                    self.save()
                if self.on_step is not None:
                    self.on_step(self, self.step, metrics)
            bar.close()
            if evaluated_at != self.step:
                self.logger.log(self.evaluate(), self.step)
            if self._saved_step != self.step:
                self.save()
            elif self.head_dir is None and (self.out / HEADS_DIR / tag_for(self.step)).is_dir():
                self.head_dir = self.out / HEADS_DIR / tag_for(self.step)  # resumed at the end: already exported
            self.logger.summary(self.last_eval)
            return {"step": self.step, "out": str(self.out), "head_dir": str(self.head_dir) if self.head_dir else None,
                    **self.last_train, **self.last_eval}
        finally:
            self.logger.finish()



def train(cfg: TrainConfig, info: DistInfo, device: torch.device,
          on_step: StepHook | None = None, on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run (or resume) one training; returns the final metrics (train/..., eval/...), `step`, `out`, `head_dir`.

    Every rank calls it; torch.distributed is initialised by the caller under torchrun, or here as a world of
    one (DeepSpeed needs a process group either way). on_step, on_start: see Trainer.
    """
    tc = typed(cfg, TrainConfig)
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(tc))
    own_group = _process_group_for_deepspeed(device)
    try:
        return Trainer(tc, info, device, config_yaml, on_step, on_start).fit()
    finally:
        if own_group and tdist.is_initialized():
            import deepspeed.comm

            if deepspeed.comm.is_initialized():
                # Through DeepSpeed, which then forgets the groups it derived from this one (a later run in the
                # same process, e.g. a resume, builds a new world).
                deepspeed.comm.destroy_process_group()
            else:  # the run failed before DeepSpeed set up its communication
                tdist.destroy_process_group()
