"""Whose output a folder holds, and refusing an `out` that holds anything else before a command changes it.

A command writes into `out` only when `out` does not exist, is an empty folder (lock files and `.tmp-*`
leftovers of killed runs aside), or holds that command's own earlier output, which it resumes or replaces by
the rules of its stage. A folder holding another tool's output (a precompute folder given to mtp-train as `out`,
say) or anything unrecognised is refused with one line naming what it holds, before anything is written, and so
is an `out` that is a file where a folder is written. `claim_output` is that check followed by the folder's lock
(`mtp_train.fileio.output_lock`), for the rank that writes; `claims_output` wraps a one-process command.

mtp-demo's `out` holds the stages' outputs in subfolders, each claimed by its own command, and `stages.json`, which
marks the folder as the demo's before the first stage writes anything.

mtp-export replaces an earlier export only of the same head (the same head settings, target and parameter
count recorded in its config.json): an export of another head is refused, so that it is never lost silently.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from mtp_train.config import ConfigError
from mtp_train.fileio import LOCK_NAME, TMP_PREFIX, output_lock

F = TypeVar("F", bound=Callable[..., Any])

PRECOMPUTE, TRAIN, EVAL, EXPORT, DEMO = "mtp-precompute", "mtp-train", "mtp-eval", "mtp-export", "mtp-demo"
# Top-level keys that only one command's saved config.yaml has.
CONFIG_KEYS = {PRECOMPUTE: "shard_tokens", TRAIN: "optim", EVAL: "prompts"}


class OutputError(ConfigError):
    """`out` holds another tool's output or unrelated files, or is a file where a folder is written."""


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _config_owner(path: Path) -> str | None:
    """The command whose resolved config `config.yaml` is, by the keys only it has."""
    try:
        import yaml

        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception:  # unreadable or not YAML: not one of ours
        return None
    if not isinstance(data, dict):
        return None
    owners = [cmd for cmd, key in CONFIG_KEYS.items() if key in data]
    return owners[0] if len(owners) == 1 else None


def output_owner(folder: str | Path) -> str | None:
    """The command whose output `folder` holds: "mtp-precompute", "mtp-train", "mtp-eval", "mtp-export" (a head
    or an export), "mtp-demo"; "" for a folder with nothing in it but leftovers; None for anything else."""
    folder = Path(folder)
    names = {p.name for p in folder.iterdir() if p.name != LOCK_NAME and not p.name.startswith(TMP_PREFIX)}
    if not names:
        return ""
    if "stages.json" in names:  # written by mtp-demo before its first stage
        return DEMO
    if "config.yaml" in names:
        owner = _config_owner(folder / "config.yaml")
        if owner is not None:
            return owner
    if "manifest.json" in names or any(n.startswith("shard-r") and n.endswith(".safetensors") for n in names):
        return PRECOMPUTE
    if names & {"checkpoints", "metrics.jsonl"}:
        return TRAIN
    if "report.json" in names:
        return EVAL
    if "config.json" in names:
        cfg = _json(folder / "config.json")
        if cfg.get("format") == "mtp_train.head" or isinstance(cfg.get("mtp_train"), dict):
            return EXPORT
    return None


def _head_identity(cfg: dict[str, Any]) -> tuple[Any, ...]:
    """What an export's or a head's config.json says about the head: settings, target, parameter count."""
    meta = cfg.get("mtp_train") if isinstance(cfg.get("mtp_train"), dict) else cfg
    head = dict(meta.get("head") or {})
    head.pop("init", None)  # how it was initialised is history once trained
    return json.dumps(head, sort_keys=True), meta.get("target_fingerprint"), meta.get("num_params")


def check_output(out: str | Path, command: str, *, head_ckpt: str | Path | None = None) -> None:
    """Refuse (OutputError) an `out` folder of `command` that holds anything but its own earlier output.

    `head_ckpt`: for mtp-export, the head being exported; an existing export must be one of the same head.
    """
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"out={out} is a file, but {command} writes a folder there: choose another `out` "
                          "(a new or empty folder)")
    owner = output_owner(out)
    if owner == "" or owner == command and head_ckpt is None:
        return
    if owner == command:
        old, new = _json(out / "config.json"), _json(Path(head_ckpt) / "config.json")
        if _head_identity(old) == _head_identity(new):
            return
        raise OutputError(f"out={out} holds an export of another head than {head_ckpt}: {command} replaces only "
                          "an export of the same head; choose another `out` or remove the old export")
    what = f"the output of {owner}" if owner else "files that no mtp command wrote"
    raise OutputError(f"out={out} holds {what}: {command} writes only into a new or empty folder or into its own "
                      "earlier output; choose another `out`")


@contextlib.contextmanager
def claim_output(out: str | Path, command: str, *, head_ckpt: str | Path | None = None) -> Iterator[Path]:
    """`check_output`, then hold `out`'s lock while the block runs (see `mtp_train.fileio.output_lock`)."""
    check_output(out, command, head_ckpt=head_ckpt)
    with output_lock(out, command=command) as lock:
        yield lock


def claims_output(command: str) -> Callable[[F], F]:
    """Decorate a one-process command `fn(cfg)` to run under `claim_output(cfg.out, command)`; mtp-export's
    `cfg.head_ckpt` is the head an earlier export in `out` must be of."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(cfg: Any, *args: Any, **kwargs: Any) -> Any:
            head = cfg.get("head_ckpt") or None if command == EXPORT else None
            with claim_output(cfg.out, command, head_ckpt=head):
                return fn(cfg, *args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
