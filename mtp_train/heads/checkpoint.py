"""Head checkpoints: `save_head` / `load_head` (model.safetensors + config.json with checksums), and the checks.

A head folder holds the head's trainable weights only (never the frozen target parts) and a config.json recording
the format, the head config, the target dims it fits, the target's weight fingerprint and the files' sha256.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from mtp_train.config.head import HeadConfig
from mtp_train.fileio import atomic_write, atomic_write_text, file_problem, sha256_file, tensor_bytes
from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.registry import new_head
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.models.foreign import head_target_args, target_model_type
from mtp_train.models.loader import open_safetensors, resolve_dtype

log = logging.getLogger(__name__)

HEAD_FORMAT = "mtp_train.head"
HEAD_FORMAT_VERSION = 1
# Target dimensions a head checkpoint must agree with (vocab_size shows in no head tensor, so it is checked here).
DIM_KEYS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
            "qkv_bias", "o_bias", "mlp_bias", "qk_norm")


def head_dims(args: ModelArgs) -> dict[str, Any]:
    """The target dimensions a head depends on, as recorded in a head's config.json."""
    return {k: getattr(args, k) for k in DIM_KEYS}


def file_checksums(folder: str | Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{name: {"sha256", "bytes"}} of files in `folder`, the record `verify_files` checks."""
    folder = Path(folder)
    return {n: {"sha256": sha256_file(folder / n), "bytes": (folder / n).stat().st_size} for n in names}


def verify_files(folder: str | Path, files: dict[str, Any] | None, config: str | Path) -> bool:
    """Check files of `folder` against the `files` record of its config (`config`, named in errors).

    Raises ModelConfigError naming the first file that is missing or differs; returns False (after a warning)
    when there is no record (a folder written before checksums were recorded), True when everything matched.
    """
    folder = Path(folder)
    if not files:
        log.warning("%s records no checksums (written by an older version): %s is not verified", config, folder)
        return False
    todo = "the file is damaged or was changed; copy or export the head again from the run's heads/step-N"
    for name, want in sorted(files.items()):
        path = folder / name
        try:
            sha, size = str(want["sha256"]), int(want["bytes"])
        except (KeyError, TypeError, ValueError):
            raise ModelConfigError(f"{config}: malformed checksum entry for {name!r}") from None
        problem = file_problem(path)  # a FIFO would block the hash
        if problem:
            raise ModelConfigError(f"{path} {'is missing' if problem == 'does not exist' else problem} (its "
                                   f"checksum is in {config}); {todo}")
        if path.stat().st_size != size:
            raise ModelConfigError(f"{path} has {path.stat().st_size} bytes, {config} records {size}: {todo}")
        if sha256_file(path) != sha:
            raise ModelConfigError(f"{path} does not match the sha256 recorded in {config}: {todo}")
    return True


def save_head(head: DraftHead, out_dir: str | Path, extra_config: dict[str, Any] | None = None, *,
              target_fingerprint: str | None = None) -> Path:
    """Write `model.safetensors` (the head's trainable weights only) and `config.json` into `out_dir`.

    config.json records the format, the head config (flat, resolved: the shared keys and the type's own,
    `HeadConfig.to_dict`), the target dims, the target's weight fingerprint when given (`load_head` then refuses
    other weights), the parameter count, the dtype, the sha256 and size of model.safetensors under "files"
    (`load_head` checks them), and `extra_config` under "extra" (e.g. training step, data manifest). Files are
    written to a temporary name and renamed, so a crash never leaves a half-written head.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    atomic_write(out / "model.safetensors", lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}),
                 size=tensor_bytes(state))
    config = {
        "format": HEAD_FORMAT,
        "format_version": HEAD_FORMAT_VERSION,
        "head": head.cfg.to_dict(),
        "dims": head_dims(head.target_args),
        "target_model_type": target_model_type(head.target_args),
        "target_fingerprint": target_fingerprint,
        "num_params": head.num_params(),
        "dtype": str(head.dtype).replace("torch.", ""),
        "files": file_checksums(out, ["model.safetensors"]),
        "extra": extra_config or {},
    }
    config[CONFIG_DIGEST] = config_digest(config)  # `read_head_config` checks it: config.json is covered too
    atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


CONFIG_DIGEST = "config_sha256"  # in a head's config.json: the sha256 of the rest of it (`config_digest`)


def config_digest(config: dict[str, Any]) -> str:
    """sha256 (hex) of a head config without its own digest, as sorted compact JSON."""
    rest = {k: v for k, v in config.items() if k != CONFIG_DIGEST}
    return sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def check_draft_vocab(state: dict[str, torch.Tensor], vocab_size: int, weights: Path) -> None:
    """Refuse a saved draft vocabulary that is not distinct, ascending target ids in [0, vocab_size), naming the
    file: every lookup through it (lm_head rows, drafted ids) would index outside the target or repeat a token."""
    dv = state.get("draft_vocab")
    if dv is None:
        return
    if dv.dim() != 1 or dv.is_floating_point():
        what = "is not a 1-D tensor of integer token ids"
    elif dv.numel() and (int(dv.min()) < 0 or int(dv.max()) >= vocab_size):
        what = f"holds ids outside the target vocabulary [0, {vocab_size}) (min {int(dv.min())}, max {int(dv.max())})"
    elif dv.numel() > 1 and not bool((dv[1:] > dv[:-1]).all()):
        what = "repeats token ids or is not ascending"
    else:
        return
    if what:
        raise ModelConfigError(f"{weights}: draft_vocab {what}; the head is damaged or was edited: copy or export "
                               "it again from the run's heads/step-N")


def read_json_config(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, with a ModelConfigError naming the file (line, column) when it is not one, or
    what the path is when it is not a regular file (never opened then: a FIFO would block)."""
    problem = file_problem(path)
    if problem:
        raise ModelConfigError(f"{path} {problem}; copy or export the head again (a head folder holds config.json "
                               "and model.safetensors as plain files)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; the file is "
                               "damaged: copy or export the head again") from None
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}); the file is damaged: copy or "
                               "export the head again") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def read_head_config(head_dir: str | Path) -> dict[str, Any]:
    """The config.json of a head folder, checked to be one of ours."""
    path = Path(head_dir) / "config.json"
    if file_problem(path) == "does not exist":
        raise ModelConfigError(f"{path} is missing: {head_dir} is not a head checkpoint (see save_head)")
    cfg = read_json_config(path)
    if cfg.get("format") != HEAD_FORMAT:
        raise ModelConfigError(f"{path}: format {cfg.get('format')!r} is not {HEAD_FORMAT!r}")
    if cfg.get("format_version") != HEAD_FORMAT_VERSION:
        raise ModelConfigError(f"{path}: format_version {cfg.get('format_version')} is not {HEAD_FORMAT_VERSION}")
    if CONFIG_DIGEST not in cfg:
        log.warning("%s records no checksum of itself (written by an older version): it is not verified", path)
    elif cfg[CONFIG_DIGEST] != config_digest(cfg):
        raise ModelConfigError(f"{path} does not match the {CONFIG_DIGEST} it records: the file is damaged or was "
                               "edited; copy or export the head again from the run's heads/step-N")
    bad = [k for k in ("head", "dims") if not isinstance(cfg.get(k), dict)]
    if bad:
        raise ModelConfigError(f"{path}: {', '.join(bad)} missing or not an object; the file is damaged: copy or "
                               "export the head again")
    return cfg


TARGET_KEY = "target_path"  # in a head's config.json `extra`: its target's folder, absolute (export, import)
TRAIN_CONFIG = "train_config.yaml"  # beside a head mtp-train saved: the run's resolved settings


@dataclass(frozen=True)
class RecordedTarget:
    """The target a head records it was trained on."""

    path: Path  # the target's folder, absolute
    source: str  # where the head records it (file and key), for messages


def recorded_target(head_dir: str | Path) -> RecordedTarget | None:
    """The target folder the head in `head_dir` records, or None when it records none (a head saved by `save_head`
    alone).

    Read from config.json's `extra.target_path` (written by mtp-export for the heads it writes), else from
    `train_config.yaml` beside a head mtp-train saved: its `model.path`, which a relative path names from the folder
    mtp-train ran in. That folder is where the run's `out` (relative too) leads to the head's `heads/<tag>`, so it
    is told from where the head lies, not from the folder this process runs in. Raises ModelConfigError naming the
    file when the record cannot be read or a relative path cannot be placed.
    """
    head_dir = Path(head_dir)
    cfg = read_head_config(head_dir)
    extra = cfg.get("extra")
    if isinstance(extra, dict) and isinstance(extra.get(TARGET_KEY), str) and extra[TARGET_KEY]:
        return RecordedTarget(Path(extra[TARGET_KEY]), f"{head_dir / 'config.json'} (extra.{TARGET_KEY})")
    record = head_dir / TRAIN_CONFIG
    if file_problem(record):
        return None
    try:
        run = yaml.safe_load(record.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{record}: not readable YAML ({str(e).splitlines()[0]}); pass model.path=<the "
                               "target's folder>, or copy the head again from its run") from None
    model = run.get("model") if isinstance(run, dict) else None
    path = model.get("path") if isinstance(model, dict) else None
    if not isinstance(path, str) or not path:
        return None
    if Path(path).is_absolute():
        return RecordedTarget(Path(path), f"{record} (model.path)")
    ran_in = _training_folder(head_dir, run.get("out"))
    if ran_in is None:
        raise ModelConfigError(f"{record} records model.path={path}, relative to the folder mtp-train ran in, which "
                               f"cannot be told from where the head lies now (its run's out: {run.get('out')}); "
                               "pass model.path=<the target's folder>")
    return RecordedTarget(ran_in / path, f"{record} (model.path={path}, from {ran_in}, where mtp-train ran)")


def _training_folder(head_dir: Path, out: Any) -> Path | None:
    """The folder a run with a relative `out` ran in, when `head_dir` is its `<out>/heads/<tag>`; else None."""
    if not isinstance(out, str) or not out or Path(out).is_absolute() or ".." in Path(out).parts:
        return None
    parts = Path(out).parts
    head = head_dir.resolve()
    run = head.parent.parent
    # "heads": mtp-train's HEADS_DIR (mtp_train/train/checkpoint.py, which imports this module)
    if head.parent.name != "heads" or len(run.parts) <= len(parts) or run.parts[-len(parts):] != parts:
        return None  # copied elsewhere: where it was trained is not in its path any more
    return Path(*run.parts[:-len(parts)])


def load_head(head_dir: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
              dtype: str | torch.dtype | None = None, backend: str = "torch", *,
              verify_fingerprint: bool = True) -> DraftHead:
    """Load a head saved by `save_head` for the target in `target_dir` (frozen parts read from there).

    Refuses, naming the file, a model.safetensors whose sha256 is not the one config.json records; then, naming
    every offending key with both values: target dims that differ from the recorded ones, and tensors whose
    shapes differ from what the target implies. When the head recorded a target
    fingerprint (and verify_fingerprint), the target's weights must have that fingerprint. dtype None keeps
    the checkpoint's dtype.
    """
    head_dir, target_dir = Path(head_dir), Path(target_dir)
    cfg_json = read_head_config(head_dir)
    verify_files(head_dir, cfg_json.get("files"), head_dir / "config.json")  # before a byte of it is read
    args = head_target_args(target_dir)

    problems = [f"dims.{k}: head checkpoint {cfg_json['dims'].get(k)!r}, target {v!r}"
                for k, v in head_dims(args).items() if cfg_json["dims"].get(k) != v]
    try:
        # The flat form (shared keys and the type's own; a folder saved before the types had their own settings
        # recorded every type's keys, dropped there). `init` is history here: the weights come from the file.
        head_cfg = HeadConfig.from_dict(cfg_json["head"])
    except (TypeError, ValueError) as e:  # a key the type lacks, or a value it refuses (an unknown type)
        raise ModelConfigError(f"{head_dir / 'config.json'}: head {e}") from None
    with torch.device("meta"):
        head = new_head(head_cfg, args, None, backend)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    weights = head_dir / "model.safetensors"
    with open_safetensors(weights) as f:
        names = set(f.keys())  # noqa: SIM118 (safe_open is not a dict)
        for k in sorted(names & expected.keys()):
            shape = tuple(f.get_slice(k).get_shape())
            if shape != expected[k]:
                problems.append(f"{k}: head checkpoint {shape}, target implies {expected[k]}")
        problems += [f"{k}: missing from the head checkpoint" for k in sorted(expected.keys() - names)]
        problems += [f"{k}: not a tensor of a {head_cfg.type} head" for k in sorted(names - expected.keys())]
        if problems:
            raise ModelConfigError(f"head {head_dir} does not fit target {target_dir}:\n  " + "\n  ".join(problems))
        state = {k: f.get_tensor(k) for k in names}
    check_draft_vocab(state, args.vocab_size, weights)

    recorded = cfg_json.get("target_fingerprint")
    if recorded and verify_fingerprint:
        actual = weights_fingerprint(target_dir, full="-full:" in recorded)
        if actual != recorded:
            raise ModelConfigError(f"head {head_dir} was trained for target weights {recorded}, but {target_dir} "
                                   f"has {actual}; pass the right target (or verify_fingerprint=False)")

    dt = resolve_dtype(dtype, args) if dtype is not None else next(v for v in state.values()
                                                                   if v.is_floating_point()).dtype
    # Integer buffers (the draft vocabulary) keep their dtype.
    head.load_state_dict({k: v.to(device=device, dtype=dt if v.is_floating_point() else v.dtype)
                          for k, v in state.items()}, assign=True)
    head.attach(FrozenTargetParts.from_pretrained(target_dir, device=device, dtype=dt))
    return head.eval()
