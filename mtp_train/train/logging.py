"""Run logging on rank 0: Weights & Biases (online | offline | disabled) and a local `metrics.jsonl`.

`metrics.jsonl` gets one JSON object per logged step, whatever the W&B mode, so a run's numbers are on disk
beside its checkpoints. On resume the lines after the resumed step are dropped: the resumed run logs those
steps again. A torn last line (a kill in the middle of a write) is dropped too, with a warning, as mtp-regenerate
does; a bad line before the last one means the file was damaged otherwise, and stops the run naming the line.

W&B `online` needs an API key (`WANDB_API_KEY`, or `wandb login`'s netrc entry; the entry point looks). Without
one the run is logged `offline` instead, with a log line saying so, rather than stopping a training job at its
start or hanging on a login prompt; `wandb sync <run folder>` uploads it later. Only rank 0 constructs a W&B run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mtp_train.config import WandbConfig
from mtp_train.fileio import atomic_write_text

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")
METRICS_FILE = "metrics.jsonl"
RUN_ID_FILE = "wandb-run-id"


def resolve_wandb_mode(mode: str, has_key: bool) -> str:
    """The mode W&B actually runs in: `online` without an API key (`has_key` False) becomes `offline` (logged).

    has_key: whether W&B can authenticate (WANDB_API_KEY set, or a netrc entry for its host): the entry point
    looks (`mtp_train.cli.common.has_wandb_key`), so that this library reads no environment.
    """
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb.mode must be one of {'|'.join(WANDB_MODES)}, got {mode!r}")
    if mode == "online" and not has_key:
        log.warning("wandb: no API key (WANDB_API_KEY unset and no netrc entry): logging offline instead; "
                    "upload later with `wandb sync <run folder>`")
        return "offline"
    return mode


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def read_metrics_lines(path: Path) -> list[tuple[int, str]]:
    """(step, line) of every record of a metrics.jsonl; a torn last line is left out with a warning.

    Raises ValueError naming file:line for a bad line that is not the last one (not a torn write).
    """
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    if raw.endswith(b"\n"):
        lines = lines[:-1]
    out: list[tuple[int, str]] = []
    for lineno, data in enumerate(lines, start=1):
        last = lineno == len(lines)
        if not data.strip():
            continue
        try:
            text = data.decode("utf-8")
            step = json.loads(text)["step"]
            if not isinstance(step, int):
                raise TypeError(f"step is {type(step).__name__}")
        except (ValueError, KeyError, TypeError) as exc:
            if last:
                log.warning("%s:%d: dropping a torn last line (%s), left by an interrupted write; its step is "
                            "logged again", path, lineno, exc)
                break
            raise ValueError(f"{path}:{lineno}: not a metrics record ({type(exc).__name__}: {exc}); the file is "
                             "damaged (only a torn last line is repaired): remove the line, or resume into "
                             "another `out`") from None
        out.append((step, text))
    return out


class RunLogger:
    """Metrics sink of one run. On ranks other than 0 (`enabled=False`) every call is a no-op.

    out: the run folder (metrics.jsonl, the W&B run id); wandb: the `wandb` settings (project, entity, name, dir,
    tags); mode: the mode to run in (`resolve_wandb_mode`'s answer, not `wandb.mode`); config: the resolved run
    config, recorded with the W&B run; resume_step: the step a resumed run continues after (None for a fresh run).
    """

    def __init__(self, *, enabled: bool, out: str | Path, wandb: WandbConfig, mode: str, config: dict[str, Any],
                 resume_step: int | None = None) -> None:
        self.enabled = enabled
        self.out = Path(out)
        self.run: Any = None
        self.mode = "disabled"
        if not enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._metrics_path = self.out / METRICS_FILE
        self._start_metrics_file(resume_step)
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb mode must be one of {'|'.join(WANDB_MODES)}, got {mode!r}")
        self.mode = mode
        if self.mode == "disabled":
            return

        import wandb as wandb_lib  # only rank 0 with W&B on pays for the import

        run_dir = Path(wandb.dir or self.out)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = self.out / RUN_ID_FILE
        kwargs: dict[str, Any] = {}
        if resume_step is not None and self.mode == "online" and id_file.is_file():
            # Continue the same W&B run after a resume (offline runs cannot be continued; they start a new one).
            kwargs = {"id": id_file.read_text().strip(), "resume": "allow"}
        self.run = wandb_lib.init(mode=self.mode, project=wandb.project, entity=wandb.entity, name=wandb.name,
                                  dir=str(run_dir), tags=list(wandb.tags), config=config, **kwargs)
        atomic_write_text(id_file, self.run.id + "\n")
        log.info("wandb: %s run %s in %s", self.mode, self.run.id, run_dir)

    def _start_metrics_file(self, resume_step: int | None) -> None:
        """A fresh run starts an empty file; a resumed one keeps the lines up to its step."""
        kept: list[str] = []
        if resume_step is not None and self._metrics_path.is_file():
            kept = [line for step, line in read_metrics_lines(self._metrics_path) if step <= resume_step]
        atomic_write_text(self._metrics_path, "".join(k + "\n" for k in kept))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record `metrics` (floats or 0-d tensors) at optimizer step `step`."""
        if not self.enabled or not metrics:
            return
        row = {k: _scalar(v) for k, v in metrics.items()}
        with self._metrics_path.open("a") as fh:
            fh.write(json.dumps({"step": step, **row}) + "\n")
        if self.run is not None:
            self.run.log(row, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Final values shown on the W&B run page (e.g. the last evaluation)."""
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = _scalar(v)

    def finish(self) -> None:
        """Close the W&B run (flushes an offline run's files)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
