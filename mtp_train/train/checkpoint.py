"""Training checkpoints: the full training state for exact resume, and a head export at each save.

Layout under a run's `out`:

    checkpoints/latest                  the tag of the newest *complete* checkpoint (written last, atomically)
    checkpoints/step-N/                 the DeepSpeed engine's state as safetensors + JSON (`train.engine_state`):
                  state.json            rank 0: step, data position, samples / tokens seen, LR schedule, engine
                                        counters, ZeRO stage, world size, the head's config
                  model.safetensors     rank 0: the engine module's weights (the head's trainable tensors)
                  optim-rank{r}.safetensors / .json   each rank: its ZeRO partition of the fp32 master weights and
                                        AdamW's moments / the optimizer's other fields (loss scaler, paddings, ...)
                  rng-rank{r}.json      each rank's Python / NumPy / torch RNG states
                  checksums.json        sha256 and size of every file above, written by rank 0 after a barrier
    heads/step-N/                       `save_head` output (model.safetensors + config.json, which holds the
                                        weights' sha256) + train_config.yaml
    heads/best/                         with train.keep_best: a copy of the best evaluated heads/step-N, plus
                                        best.json (metric, mode, value, step); see `publish_best`

Nothing here is a pickle, and resuming never unpickles: DeepSpeed's own `save_checkpoint` / `load_checkpoint`
(`torch.save` / `torch.load(weights_only=False)`, which runs whatever code a file names) are not used. A folder in
that older format (`*.pt` files, no state.json) is refused by name unless `resume_trust_pickles=true`. Every file
is still checked against `checksums.json` before it is read, which catches damage (a truncated or altered file).

Our own `latest` marker, not DeepSpeed's: it is written after a barrier that follows every part (every rank's
files and the head export), so a crash in between never leaves `resume=auto` pointing at an incomplete checkpoint.

The engine's module holds only the head's trainable weights (the frozen embedding and lm_head sit on a plain
attribute of the head), so neither the training state nor the export contains target tensors.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtp_train.fileio import atomic_write, atomic_write_text, fsync_dir, sha256_file
from mtp_train.heads import DraftHead, save_head
from mtp_train.train.engine_state import STATE, TODO, CheckpointError, load_engine, optim_files, read_state, save_engine

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
HEADS_DIR = "heads"
BEST = "best"  # heads/best: a copy of the best evaluated head (train.keep_best)
BEST_FILE = "best.json"  # in heads/best: which metric made it the best, its value and step
LATEST = "latest"
RESUME_MODES = ("auto", "none")
CHECKSUMS = "checksums.json"
CHECKPOINT_FORMAT = "mtp_train.checkpoint"
RNG_FORMAT = "mtp_train.rng"

__all__ = ["CheckpointError"]  # defined with the engine state's files, raised from here too


def rng_file(rank: int) -> str:
    """The name of rank `rank`'s RNG file in a checkpoint tag folder."""
    return f"rng-rank{rank}.json"


def tag_for(step: int) -> str:
    """The checkpoint tag (folder name) of optimizer step `step`."""
    return f"step-{step}"


def tag_step(tag: str) -> int | None:
    """The step a checkpoint tag names (`step-N`), or None for anything else (a path, a name of another kind)."""
    match = re.fullmatch(r"step-(0|[1-9][0-9]*)", tag)
    return int(match.group(1)) if match else None


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
    if tag_step(tag) is None:  # an edited marker must not lead the resume to another run's checkpoint
        raise CheckpointError(f"{marker} names {tag!r}, which is not a checkpoint of this run (a folder step-N in "
                              f"{ckpt_dir}): the marker was edited; write the newest complete step-N there, point "
                              "`resume` at a checkpoint folder, or start afresh with resume=none")
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


def save_engine_state(engine: Any, out: str | Path, step: int, client_state: dict[str, Any], rank: int,
                      world: int, head_config: dict[str, Any]) -> Path:
    """Every rank: the engine's state (`engine_state.save_engine`) + this rank's RNG file. Returns the tag folder.

    client_state: JSON-able (step, data position, ...); head_config: the head's config (checked on resume).
    Call `write_checksums` and then `mark_latest` on rank 0 once every rank has returned (after a barrier).
    """
    tag_dir = Path(out) / CKPT_DIR / tag_for(step)
    save_engine(engine, tag_dir, rank, world, client_state, head_config)
    atomic_write_text(tag_dir / rng_file(rank), rng_to_json(rng_state()))
    return tag_dir


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
        # Written by a version that records checksums: damaged (or its checksums removed on purpose).
        if (Path(tag_dir) / STATE).is_file() or any(Path(tag_dir).glob("rng-rank*.json")):
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
    todo = TODO
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


def pickle_files(tag_dir: str | Path) -> list[Path]:
    """The `*.pt` files of a checkpoint folder: DeepSpeed's pickles, in the format of earlier versions."""
    return sorted(p for p in Path(tag_dir).rglob("*.pt") if p.is_file())


def pickle_format(tag_dir: Path, trust_pickles: bool) -> bool:
    """Whether `tag_dir` is a checkpoint in the older pickle format that may be loaded (`resume_trust_pickles`);
    False for ours. CheckpointError naming the file for an untrusted one, or a folder with neither format."""
    if (tag_dir / STATE).is_file():
        return False  # ours: a `*.pt` planted beside it is never opened
    pickles = pickle_files(tag_dir)
    if not pickles:
        raise CheckpointError(f"{tag_dir / STATE} is missing: {tag_dir} is not a complete checkpoint; {TODO}")
    if not trust_pickles:
        raise CheckpointError(f"{pickles[0]}: a checkpoint in DeepSpeed's pickle format (an earlier version wrote "
                              "it); loading it would unpickle it, which runs any code the file names, so it is not "
                              "loaded. Start afresh with resume=none (or another out), or, only if you trust where "
                              "the folder came from, resume with resume_trust_pickles=true")
    log.warning("%s: loading DeepSpeed's pickles (resume_trust_pickles=true): they run any code they name", tag_dir)
    return True


def check_resume(resume: str, out: str | Path, world: int, rank: int, *, head_type: str,
                 trust_pickles: bool = False, data: tuple[str, str] | None = None) -> tuple[Path, str] | None:
    """The checkpoint `resume` names (see `resolve_resume`), checked: written by as many ranks as this run has
    (`world`), for a head of this run's type, in our format (the pickle format only with `trust_pickles`), and
    every file as its checksums say (rank 0 checks all, other ranks their own); its state's step is the one its
    folder names, and it read the same data as this run (`data`: this run's data source and where it reads, as
    `DataSource.name` / `.where` say; a checkpoint of another source is judged by the source). None for a fresh
    run.

    The caller lets no rank load anything before every rank has passed.
    """
    found = resolve_resume(resume, out)
    if found is None:
        return None
    ckpt_dir, tag = found
    tag_dir = ckpt_dir / tag
    ranks = checkpoint_ranks(tag_dir)
    if ranks and ranks != world:
        raise ValueError(f"checkpoint {tag_dir} was written by {ranks} ranks, this run has {world}: resume "
                         "with the same number of processes (ZeRO partitions optimizer state per rank), or start "
                         "afresh with resume=none and another out")
    legacy = pickle_format(tag_dir, trust_pickles)
    verify_checkpoint(tag_dir, None if rank == 0 else [rng_file(rank)] + ([] if legacy else list(optim_files(rank))))
    if not legacy:
        state = read_state(tag_dir)
        saved = (state.get("head") or {}).get("type")
        if saved != head_type:
            raise CheckpointError(f"{tag_dir / STATE} holds the state of a {saved!r} head, this run asks for "
                                  f"head.type={head_type!r}: resume with head={saved}, or start afresh with "
                                  "resume=none (or another out)")
        client = state.get("client") or {}
        if client.get("step") != tag_step(tag):  # resumed, it would save (and export) over other steps' files
            raise CheckpointError(f"{tag_dir / STATE} records step {client.get('step')!r}, but its folder is {tag}: "
                                  f"the state was edited or moved; {TODO}")
        _check_same_data(tag_dir / STATE, client, data)
    return found


def _check_same_data(state: Path, client: dict[str, Any], data: tuple[str, str] | None) -> None:
    """Refuse to resume a checkpoint that read other data with the same source (`check_resume`)."""
    was = client.get("data_where")
    if data is None or was is None or client.get("data_source") != data[0]:
        return
    now = data[1]
    if was != now and Path(was).resolve() != Path(now).resolve():
        raise CheckpointError(f"{state}: the interrupted run read {was}, this run reads {now}: resuming would go on "
                              f"training on other data; resume with the data it read, start afresh with "
                              "resume=none, or choose another out")


def load_engine_state(engine: Any, ckpt_dir: str | Path, tag: str, rank: int, world: int, *,
                      trust_pickles: bool = False) -> dict[str, Any]:
    """Every rank: load the engine's state (module, optimizer, LR schedule) and this rank's RNG; return the client
    state saved with it (step, data position, ...). Check it first (`check_resume`).

    A checkpoint of ours is safetensors + JSON. One in DeepSpeed's pickle format is refused here too, unless
    `trust_pickles`; then DeepSpeed loads (unpickles) it, and rank 0's RNG state from its client state stands in
    for a missing RNG file (its `rng-rank*.pt` pickles are never loaded).
    """
    tag_dir = Path(ckpt_dir) / tag
    if pickle_format(tag_dir, trust_pickles):
        path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint {tag!r} in {ckpt_dir}; {TODO}")
    else:
        client_state = load_engine(engine, tag_dir, rank, world)
    rng = tag_dir / rng_file(rank)
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


def publish_best(out: str | Path, step: int, record: dict[str, Any]) -> Path:
    """Rank 0: make `heads/best` a copy of the exported `heads/step-N` plus `best.json` (`record`).

    A plain copy, not a symlink: it survives copying or syncing the run folder to another machine, and
    `mtp-eval head_ckpt=<out>/heads/best` / `mtp-export` read it as any head folder (its config.json, with the
    weights' sha256, is the step's own, byte for byte). Written beside as a temporary folder, then swapped in with
    two renames, so a crash never leaves a half-copied `best`.
    """
    heads = Path(out) / HEADS_DIR
    src, final = heads / tag_for(step), heads / BEST
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not an exported head: heads/{BEST} can only copy one")
    tmp, old = heads / f".{BEST}.{os.getpid()}.tmp", heads / f".{BEST}.{os.getpid()}.old"
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if path.is_dir():
            shutil.copytree(path, tmp / path.name)
        else:
            atomic_write(tmp / path.name, lambda dst, path=path: shutil.copyfile(path, dst))  # fsynced
    atomic_write_text(tmp / BEST_FILE, json.dumps({**record, "head": tag_for(step)}, indent=1) + "\n")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(heads)
    shutil.rmtree(old, ignore_errors=True)
    return final


def read_best(out: str | Path) -> dict[str, Any] | None:
    """`heads/best/best.json` of a run (metric, mode, value, step, head), or None when there is no readable one."""
    path = Path(out) / HEADS_DIR / BEST / BEST_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def remove_best(out: str | Path) -> None:
    """Rank 0: remove `heads/best` (a run whose state holds no best yet must not show another trajectory's)."""
    shutil.rmtree(Path(out) / HEADS_DIR / BEST, ignore_errors=True)
