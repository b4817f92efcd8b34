"""Training checkpoints: the full DeepSpeed state for exact resume, and a head export at each save.

Layout under a run's `out`:

    checkpoints/latest                  the tag of the newest *complete* checkpoint (written last, atomically)
    checkpoints/step-N/                 DeepSpeed's engine state (module, ZeRO optimizer partitions, LR schedule)
                                        + client state (step, data position, rank 0's RNG), and
                  rng-rank{r}.pt        each rank's Python / NumPy / torch RNG states
    heads/step-N/                       `save_head` output (model.safetensors + config.json) + train_config.yaml

DeepSpeed's own `latest` file is not used: it is written before the per-rank files and the head export exist,
so a crash in between would leave `resume=auto` pointing at an incomplete checkpoint. Ours is written after a
barrier that follows every part.

The engine's module holds only the head's trainable weights (the frozen embedding and lm_head sit on a plain
attribute of the head), so neither the DeepSpeed state nor the export contains target tensors.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtp_train.fileio import atomic_write, atomic_write_text
from mtp_train.heads import DraftHead, save_head

CKPT_DIR = "checkpoints"
HEADS_DIR = "heads"
LATEST = "latest"
RESUME_MODES = ("auto", "none")


def tag_for(step: int) -> str:
    """The checkpoint tag (folder name) of optimizer step `step`."""
    return f"step-{step}"


def step_of(tag: str) -> int:
    """Inverse of `tag_for`."""
    if not tag.startswith("step-") or not tag[5:].isdigit():
        raise ValueError(f"{tag!r} is not a checkpoint tag (step-N)")
    return int(tag[5:])


# --- RNG ----------------------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU, and CUDA when present), as picklable plain data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # NumPy's tuple holds an ndarray; lists keep the state loadable without NumPy pickles.
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- finding a checkpoint -----------------------------------------------------------------------------------------


def latest_tag(ckpt_dir: str | Path) -> str | None:
    """The tag of the newest complete checkpoint in `ckpt_dir`, or None when there is none."""
    ckpt_dir = Path(ckpt_dir)
    marker = ckpt_dir / LATEST
    if not marker.is_file():
        return None
    tag = marker.read_text().strip()
    if not (ckpt_dir / tag).is_dir():
        raise FileNotFoundError(f"{marker} names checkpoint {tag!r}, but {ckpt_dir / tag} is missing; restore it, "
                                f"or point `resume` at another checkpoint folder under {ckpt_dir}")
    return tag


def resolve_resume(resume: str, out: str | Path) -> tuple[Path, str] | None:
    """(checkpoints folder, tag) to resume from, or None to start fresh.

    resume: "auto" = the latest complete checkpoint under `out` (none yet: start fresh), "none" = start fresh,
    else a tag folder (`.../checkpoints/step-N`) or a checkpoints folder (its latest).
    """
    if resume == "none":
        return None
    if resume == "auto":
        ckpt_dir = Path(out) / CKPT_DIR
        tag = latest_tag(ckpt_dir)
        return None if tag is None else (ckpt_dir, tag)
    path = Path(resume)
    if (path / LATEST).is_file():
        tag = latest_tag(path)
        assert tag is not None
        return path, tag
    if path.is_dir() and path.name.startswith("step-"):
        return path.parent, path.name
    raise FileNotFoundError(f"resume={resume!r}: not a checkpoint folder (expected auto, none, "
                            f"<out>/{CKPT_DIR}/step-N, or <out>/{CKPT_DIR})")


# --- saving and loading -------------------------------------------------------------------------------------------


def save_engine_state(engine: Any, out: str | Path, step: int, client_state: dict[str, Any], rank: int) -> Path:
    """Every rank: DeepSpeed's state (its own files, per rank) + this rank's RNG file. Returns the tag folder.

    Call `mark_latest` on rank 0 once every rank has returned (after a barrier).
    """
    ckpt_dir = Path(out) / CKPT_DIR
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    state = rng_state()
    atomic_write(ckpt_dir / tag / f"rng-rank{rank}.pt", lambda tmp: torch.save(state, tmp))
    return ckpt_dir / tag


def mark_latest(out: str | Path, step: int) -> None:
    """Rank 0, after every part of checkpoint `step` is written: make it what `resume=auto` picks."""
    atomic_write_text(Path(out) / CKPT_DIR / LATEST, tag_for(step) + "\n")


def load_engine_state(engine: Any, ckpt_dir: str | Path, tag: str, rank: int) -> dict[str, Any]:
    """Every rank: load DeepSpeed's state (module, optimizer, LR schedule) and this rank's RNG; return the client
    state saved with it (step, data position, ...)."""
    path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {ckpt_dir}")
    rng_file = Path(ckpt_dir) / tag / f"rng-rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    elif "rng" in client_state:
        set_rng_state(client_state["rng"])  # another world size: rank 0's state is the best there is
    return client_state


def export_head(head: DraftHead, out: str | Path, step: int, train_config_yaml: str, *,
                target_fingerprint: str | None, extra: dict[str, Any] | None = None) -> Path:
    """Rank 0: write `heads/step-N/` (save_head + train_config.yaml) through a temporary folder and a rename."""
    heads = Path(out) / HEADS_DIR
    final = heads / tag_for(step)
    tmp = heads / f".{tag_for(step)}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(head, tmp, {"step": step, **(extra or {})}, target_fingerprint=target_fingerprint)
    atomic_write_text(tmp / "train_config.yaml", train_config_yaml)
    if final.exists():
        shutil.rmtree(final)  # a re-run of the same step (resumed after a crash past this save) replaces it
    os.replace(tmp, final)
    return final
