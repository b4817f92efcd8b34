"""Training checkpoints: the full DeepSpeed state for exact resume, and a head export at each save.

Layout under a run's `out`:

    checkpoints/latest                  the tag of the newest *complete* checkpoint (written last, atomically)
    checkpoints/step-N/                 DeepSpeed's engine state (module, ZeRO optimizer partitions, LR schedule)
                                        + client state (step, data position, rank 0's RNG), and
                  rng-rank{r}.json      each rank's Python / NumPy / torch RNG states (plain JSON)
                  checksums.json        sha256 and size of every file above, written by rank 0 after a barrier
    heads/step-N/                       `save_head` output (model.safetensors + config.json, which holds the
                                        weights' sha256) + train_config.yaml

DeepSpeed's own `latest` file is not used: it is written before the per-rank files and the head export exist,
so a crash in between would leave `resume=auto` pointing at an incomplete checkpoint. Ours is written after a
barrier that follows every part.

What resuming trusts: our own files are never unpickled (the RNG states are JSON, the head is safetensors), but
DeepSpeed's `*.pt` files are pickles that `engine.load_checkpoint` unpickles, and unpickling runs whatever code
the file names. So `checksums.json` is checked first, naming the file that does not match: that catches damage
(a truncated or altered file) before anything is unpickled, but not a folder that someone rewrote together with
its checksums. Resume only from checkpoint folders you (or your jobs) wrote.

The engine's module holds only the head's trainable weights (the frozen embedding and lm_head sit on a plain
attribute of the head), so neither the DeepSpeed state nor the export contains target tensors.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtp_train.fileio import atomic_write_text, sha256_file
from mtp_train.heads import DraftHead, save_head

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
HEADS_DIR = "heads"
LATEST = "latest"
RESUME_MODES = ("auto", "none")
CHECKSUMS = "checksums.json"
CHECKPOINT_FORMAT = "mtp_train.checkpoint"
RNG_FORMAT = "mtp_train.rng"


class CheckpointError(RuntimeError):
    """A training checkpoint that cannot be resumed from; the message names the file and what to do."""


def rng_file(rank: int) -> str:
    """The name of rank `rank`'s RNG file in a checkpoint tag folder."""
    return f"rng-rank{rank}.json"


def tag_for(step: int) -> str:
    """The checkpoint tag (folder name) of optimizer step `step`."""
    return f"step-{step}"


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


def _tensor_to_text(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")


def _text_to_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_to_json(state: dict[str, Any]) -> str:
    """`rng_state()` as JSON text (torch's byte states base64-encoded): nothing that needs unpickling."""
    version, internal, gauss = state["python"]
    doc: dict[str, Any] = {"format": RNG_FORMAT, "python": [version, list(internal), gauss],
                           "numpy": state["numpy"], "torch": _tensor_to_text(state["torch"])}
    if "cuda" in state:
        doc["cuda"] = _tensor_to_text(state["cuda"])
    return json.dumps(doc) + "\n"


def rng_from_json(path: Path) -> dict[str, Any]:
    """Read an RNG file written by `rng_to_json` into `set_rng_state`'s shape; CheckpointError naming it if bad."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != RNG_FORMAT:
            raise ValueError(f"format {doc.get('format')!r} is not {RNG_FORMAT!r}")
        version, internal, gauss = doc["python"]
        state: dict[str, Any] = {"python": (int(version), tuple(int(x) for x in internal), gauss),
                                 "numpy": list(doc["numpy"]), "torch": _text_to_tensor(doc["torch"])}
        if "cuda" in doc:
            state["cuda"] = _text_to_tensor(doc["cuda"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a readable RNG state ({type(exc).__name__}: {exc}); resume from "
                              "another checkpoint, or start afresh with resume=none") from None
    return state


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

    Call `write_checksums` and then `mark_latest` on rank 0 once every rank has returned (after a barrier).
    """
    ckpt_dir = Path(out) / CKPT_DIR
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    atomic_write_text(ckpt_dir / tag / rng_file(rank), rng_to_json(rng_state()))
    return ckpt_dir / tag


def write_checksums(tag_dir: str | Path) -> Path:
    """Rank 0, after every rank saved: record the sha256 and size of every file in the tag folder."""
    tag_dir = Path(tag_dir)
    files = {p.relative_to(tag_dir).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(tag_dir.rglob("*")) if p.is_file() and p.name != CHECKSUMS}
    path = tag_dir / CHECKSUMS
    atomic_write_text(path, json.dumps({"format": CHECKPOINT_FORMAT, "files": files}, indent=2) + "\n")
    return path


def read_checksums(tag_dir: str | Path) -> dict[str, dict[str, Any]] | None:
    """{file: {sha256, bytes}} of a checkpoint, or None for one written before checksums were recorded."""
    path = Path(tag_dir) / CHECKSUMS
    if not path.is_file():
        if any(Path(tag_dir).glob("rng-rank*.json")):  # written by a version that records checksums: damaged
            raise CheckpointError(f"{path} is missing, so {tag_dir} cannot be verified; resume from another "
                                  "checkpoint, or start afresh with resume=none")
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        files = doc["files"]
        if doc.get("format") != CHECKPOINT_FORMAT or not isinstance(files, dict):
            raise ValueError("not a checkpoint checksum file")
        return {str(k): {"sha256": str(v["sha256"]), "bytes": int(v["bytes"])} for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc}); resume from another "
                              "checkpoint, or start afresh with resume=none") from None


def verify_checkpoint(tag_dir: str | Path, only: list[str] | None = None) -> bool:
    """Check the files of a checkpoint against its `checksums.json` (all of them, or the names in `only`).

    Raises CheckpointError naming the first file that is missing or differs; returns False (after a warning)
    for a checkpoint written before checksums were recorded, True when everything matched.
    """
    tag_dir = Path(tag_dir)
    recorded = read_checksums(tag_dir)
    if recorded is None:
        log.warning("%s has no %s (written by an older version): its files cannot be verified", tag_dir, CHECKSUMS)
        return False
    todo = "resume from another checkpoint (resume=<out>/checkpoints/step-N), or start afresh with resume=none"
    for name in (sorted(recorded) if only is None else only):
        want = recorded.get(name)
        path = tag_dir / name
        if want is None:
            raise CheckpointError(f"{path} is not listed in {tag_dir / CHECKSUMS}; {todo}")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (listed in {tag_dir / CHECKSUMS}); {todo}")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, {CHECKSUMS} says {want['bytes']}: the file is "
                                  f"damaged; {todo}")
        if sha256_file(path) != want["sha256"]:
            raise CheckpointError(f"{path} does not match its sha256 in {CHECKSUMS}: the file is damaged or "
                                  f"was replaced; {todo}")
    return True


def mark_latest(out: str | Path, step: int) -> None:
    """Rank 0, after every part of checkpoint `step` is written: make it what `resume=auto` picks."""
    atomic_write_text(Path(out) / CKPT_DIR / LATEST, tag_for(step) + "\n")


def checkpoint_ranks(tag_dir: str | Path) -> int:
    """How many ranks wrote the checkpoint (its RNG files; an older checkpoint's `rng-rank*.pt` count too)."""
    tag_dir = Path(tag_dir)
    return len(list(tag_dir.glob("rng-rank*.json"))) or len(list(tag_dir.glob("rng-rank*.pt")))


def check_resume(resume: str, out: str | Path, world: int, rank: int) -> tuple[Path, str] | None:
    """The checkpoint `resume` names (see `resolve_resume`), checked: written by as many ranks as this run has
    (`world`), and every file as its checksums say. None for a fresh run.

    DeepSpeed unpickles its files, so every file is checked against the checkpoint's checksums first, by rank 0
    (each other rank checks its own RNG file); the caller lets no rank load anything before that has passed.
    """
    found = resolve_resume(resume, out)
    if found is None:
        return None
    ckpt_dir, tag = found
    ranks = checkpoint_ranks(ckpt_dir / tag)
    if ranks and ranks != world:
        raise ValueError(f"checkpoint {ckpt_dir / tag} was written by {ranks} ranks, this run has {world}: resume "
                         "with the same number of processes (ZeRO partitions optimizer state per rank), or start "
                         "afresh with resume=none and another out")
    verify_checkpoint(ckpt_dir / tag, None if rank == 0 else [rng_file(rank)])
    return found


def load_engine_state(engine: Any, ckpt_dir: str | Path, tag: str, rank: int) -> dict[str, Any]:
    """Every rank: load DeepSpeed's state (module, optimizer, LR schedule) and this rank's RNG; return the client
    state saved with it (step, data position, ...).

    Verify the checkpoint first (`verify_checkpoint`): DeepSpeed unpickles its files. This rank's RNG file is
    JSON; an older checkpoint's `rng-rank*.pt` pickles are never loaded (rank 0's state in the client state,
    which DeepSpeed's own file carries, stands in for them).
    """
    path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint {tag!r} in {ckpt_dir}; resume from another "
                              "checkpoint, or start afresh with resume=none")
    rng = Path(ckpt_dir) / tag / rng_file(rank)
    if rng.is_file():
        set_rng_state(rng_from_json(rng))
    elif "rng" in client_state:
        set_rng_state(client_state["rng"])  # an older checkpoint: rank 0's state is the best there is
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
