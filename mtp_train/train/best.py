"""The best head kept by a validation metric (`train.keep_best`): `heads/best` follows the best evaluated head.

At every evaluation the tracker compares the named metric with the best so far. The direction is
`train.keep_best_mode`: max, min, or auto = min for a name ending in `loss` (eval/loss, eval/step1/tok_loss),
else max (spec/tau, eval/top1, eval/alpha); a tie keeps the earlier step. On an improvement the trainer logs
`best/<metric>` and `best/step` with that evaluation in metrics.jsonl, exports the step's head if the step saves
none, and makes `heads/best` a copy of it (`checkpoint.publish_best`).

The best value and step are part of every checkpoint's client state, so a resumed run compares against the best
of the run it continues, never overwriting `heads/best` with a worse head. `sync_best` puts `heads/best` back in
line with that state at start: a crash between a checkpoint and a later improvement leaves a `heads/best` from a
trajectory the resumed run replays.

The metric must be one the run logs: eval/* from the validation loss (`train.evaluation`; not with
train.eval_batches=0), spec/* from the speculative validator (`speculative.validator`; only with
spec_eval.prompts). Any other name is refused at start, with the valid names.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp_train.config import ConfigError, LoopConfig, TrainConfig
from mtp_train.train.checkpoint import BEST, HEADS_DIR, publish_best, read_best, remove_best, tag_for
from mtp_train.train.evaluation import SUMMED

log = logging.getLogger(__name__)

SPEC_METRICS = ("tau", "acceptance_rate")  # speculative.validator.head_acceptance's quality metrics (+ pos{j})


def validation_metrics(cfg: TrainConfig) -> list[str]:
    """The names of the validation metrics a run with `cfg` logs at every evaluation (what keep_best accepts)."""
    names: list[str] = []
    if cfg.train.eval_batches > 0:
        quality = [k for k in SUMMED if k != "num_tokens"]  # a count says nothing of the head
        names += ["eval/loss", *(f"eval/{k}" for k in quality)]
        names += [f"eval/step{j}/{k}" for j in range(cfg.loss.steps) for k in ("loss", *quality)]
    if cfg.spec_eval.prompts:
        names += [f"spec/{k}" for k in SPEC_METRICS] + [f"spec/pos{j}" for j in range(cfg.spec_eval.k)]
    return names


def best_mode(metric: str, mode: str) -> str:
    """max or min for `metric` under train.keep_best_mode `mode` (auto: min for a name ending in loss, else max)."""
    if mode != "auto":
        return mode
    return "min" if metric.endswith("loss") else "max"


def check_keep_best(cfg: TrainConfig, has_val: bool) -> None:
    """Refuse (ConfigError) a train.keep_best that no evaluation of this run would log, naming the valid names.

    has_val: whether the data has a validation split (without one, no evaluation logs anything).
    """
    name = cfg.train.keep_best
    if not name:
        return
    valid = validation_metrics(cfg)
    if name in valid:
        if not has_val:
            raise ConfigError(f"train.keep_best={name}: the data has no validation split, so no evaluation logs "
                              "it; make one (precompute's val_fraction > 0), or drop train.keep_best")
        return
    why = ""
    if name.startswith("spec/") and not cfg.spec_eval.prompts:
        why = " (spec/* are logged only when spec_eval.prompts names prompts, e.g. spec_eval.prompts=[demo-heldout])"
    elif name.startswith("eval/") and cfg.train.eval_batches <= 0:
        why = " (eval/* are not logged with train.eval_batches=0)"
    raise ConfigError(f"train.keep_best={name} is not a validation metric this run logs{why}; valid names: "
                      + (", ".join(valid) or "none"))


@dataclass
class BestTracker:
    """The best value of one metric so far and the step it came from; `metric` "" = off (every call a no-op)."""

    metric: str = ""
    mode: str = "max"  # max | min (already resolved from auto)
    value: float | None = None
    step: int | None = None

    @classmethod
    def from_config(cls, cfg: LoopConfig) -> BestTracker:
        return cls(cfg.keep_best, best_mode(cfg.keep_best, cfg.keep_best_mode))

    @property
    def enabled(self) -> bool:
        return bool(self.metric)

    def beats(self, value: float) -> bool:
        """Whether `value` is strictly better than the best so far (a NaN never is)."""
        if math.isnan(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def update(self, metrics: Mapping[str, float], step: int) -> dict[str, float]:
        """{best/<metric>, best/step} when `metrics` holds the metric and it beats the best so far (which it then
        becomes); else {} (also on ranks that do not compute it: spec/* exist on rank 0 only)."""
        if not self.enabled or self.metric not in metrics:
            return {}
        value = float(metrics[self.metric])
        if not self.beats(value):
            return {}
        self.value, self.step = value, step
        return {f"best/{self.metric}": value, "best/step": float(step)}

    def record(self) -> dict[str, Any]:
        """What heads/best's best.json says: the metric, its direction, the value and the step."""
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step}

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's share (JSON-able): the same as `record`."""
        return self.record()

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Continue from a checkpoint's best; one kept for another metric or direction (or none) starts afresh."""
        if not self.enabled or not state or state.get("value") is None:
            return
        if state.get("metric") != self.metric or state.get("mode") != self.mode:
            log.warning("resuming with train.keep_best=%s (%s); the checkpoint kept the best by %s (%s): the best "
                        "starts afresh at the next evaluation", self.metric, self.mode, state.get("metric"),
                        state.get("mode"))
            return
        self.value, self.step = float(state["value"]), int(state["step"])


def sync_best(out: str | Path, tracker: BestTracker) -> None:
    """Rank 0 at start: make `heads/best` what the tracker's state says (fresh or resumed).

    A `heads/best` of a later step than the checkpoint's best (the run crashed after an improvement it had not yet
    checkpointed) is put back to the checkpoint's best step, or removed when the state holds no best yet: the
    resumed run replays those evaluations and publishes again.
    """
    if not tracker.enabled:
        return
    found = read_best(out)
    if found is not None and found.get("step") == tracker.step and found.get("metric") == tracker.metric:
        return
    if tracker.step is None:
        if (Path(out) / HEADS_DIR / BEST).exists():
            log.info("removing %s: this run's state holds no best yet", Path(out) / HEADS_DIR / BEST)
            remove_best(out)
        return
    if (Path(out) / HEADS_DIR / tag_for(tracker.step) / "config.json").is_file():
        publish_best(out, tracker.step, tracker.record())
        log.info("heads/best restored to %s (%s %s = %.6g)", tag_for(tracker.step), tracker.metric, tracker.mode,
                 tracker.value)
    else:
        log.warning("the best head so far, %s, is missing from %s: heads/best follows the next improvement",
                    tag_for(tracker.step), Path(out) / HEADS_DIR)
        remove_best(out)
