"""The learning curve's token points and batch plan: which optimizer step reaches which training-token count, and
the step hook that exports the head there (with a resumable checkpoint every `checkpoint_every` steps)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def log_spaced(first: int, last: int) -> list[int]:
    """first, 2·first, 4·first, ... below last, then last itself ([last] when last ≤ first)."""
    if first < 1 or last < 1:
        raise ValueError(f"token points must be positive, got first={first}, last={last}")
    points = []
    t = first
    while t < last:
        points.append(t)
        t *= 2
    return points + [last]


def steps_for_tokens(lengths: list[int], micro_batch_tokens: int, grad_accum: int, seed: int,
                     points: list[int]) -> list[tuple[int, int]]:
    """(step, tokens seen after it) of the first optimizer step whose cumulative packed rows reach each point.

    Replays the trainer's batch plan (LengthBucketedBatchSampler over epochs, one rank) on the sample lengths,
    so the steps are exact for a run with these settings.
    """
    from mtp_train.data.sampler import LengthBucketedBatchSampler

    sampler = LengthBucketedBatchSampler(lengths, micro_batch_tokens, shuffle=True, seed=seed)
    out: list[tuple[int, int]] = []
    todo = sorted(points)
    step = tokens = epoch = micro = 0
    while todo:
        sampler.set_epoch(epoch)
        for batch in sampler:
            tokens += sum(lengths[i] for i in batch)
            micro += 1
            if micro % grad_accum:
                continue
            step += 1
            while todo and tokens >= todo[0]:
                out.append((step, tokens))
                todo.pop(0)
            if not todo:
                break
        epoch += 1
    return out


class PointSaver:
    """The step hook: export the head (with a full checkpoint) at the points' steps and every `every` steps,
    then delete every full checkpoint but the newest, and the exports that are not points."""

    def __init__(self, point_steps: list[int], every: int) -> None:
        self.point_steps, self.every = set(point_steps), every

    def __call__(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        from mtp_train.train.checkpoint import CKPT_DIR, HEADS_DIR, latest_tag, tag_for

        due = step in self.point_steps or (self.every and step % self.every == 0)
        ckpt = trainer.out / CKPT_DIR
        if not due or latest_tag(ckpt) == tag_for(step):  # saved already (train.save_every)
            return
        trainer.save()
        if not trainer.info.is_main:
            return
        keep = {tag_for(s) for s in self.point_steps}
        for d in ckpt.glob("step-*"):
            if d.name != tag_for(step):
                shutil.rmtree(d, ignore_errors=True)
        for d in (trainer.out / HEADS_DIR).glob("step-*"):
            if d.name not in keep and d.name != tag_for(step):
                shutil.rmtree(d, ignore_errors=True)


def schedule(data_dir: Path, points: list[int], train_cfg: Any) -> list[tuple[int, int]]:
    from mtp_train.precompute import PrecomputedDataset

    lengths = PrecomputedDataset(data_dir, split="train", verify="never").lengths
    return steps_for_tokens(list(lengths), int(train_cfg.train.micro_batch_tokens), int(train_cfg.train.grad_accum),
                            int(train_cfg.train.seed), points)
