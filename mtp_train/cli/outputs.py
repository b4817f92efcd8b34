"""Whose output a folder holds, and refusing an `out` that holds anything else before a command changes it.

The rule (docs/errors.md): an output folder is checked entirely before anything is written into it; anything
found there that this command did not create is refused by name unless the user passes `overwrite=true`; nothing
is followed out of a run folder. `check_output` is that check, one for every command:

* `out` does not exist, is an empty folder (lock files and `.tmp-*` leftovers of killed runs aside), or holds
  that command's own earlier output, which it resumes or replaces by the rules of its stage: written.
* a folder holding another tool's output (a precompute folder given to mtp-train as `out`, say) or anything
  unrecognised, and an `out` that is a file where a folder is written: refused, `overwrite` or not.
* a link anywhere under `out` that leads outside it (a planted `.lock` or `.tmp-config.yaml`, a shard linked from
  elsewhere): refused naming it, since a writer would write through it or a reader follow it out; `overwrite=true`
  removes the links themselves (never what they point at) before the command starts. Links that stay inside
  (W&B's `latest-run`) are left alone, and the writers never write through any link anyway (`mtp_train.fileio`).
  A stitched export's own links to its target's shards, named by its index, are its output, and the links W&B
  makes inside its `wandb/` folder of a run (to its logs in its cache) are W&B's.
* mtp-export: never into the head it exports; an export of another head, or a head mtp-train saved, is replaced
  only with `overwrite=true` (`Claim.replaces`: the command then writes a new folder beside and swaps it in).
  Stages check the rest once their inputs are known: mtp-precompute a finished folder of other settings
  (`mtp_train.precompute.writer.check_replaces`), mtp-train the checkpoint it resumes from.

`claim_output` is that check followed by the folder's lock (`mtp_train.fileio.output_lock`), for the rank that
writes; `claims_output` wraps a one-process command. mtp-demo's `out` holds the stages' outputs in subfolders,
each claimed by its own command, and `stages.json`, which marks the folder as the demo's before the first stage
writes anything.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mtp_train.config import ConfigError
from mtp_train.fileio import LOCK_NAME, TMP_PREFIX, fsync_dir, leads_outside, links_in, output_lock

F = TypeVar("F", bound=Callable[..., Any])

PRECOMPUTE, TRAIN, EVAL, EXPORT, DEMO = "mtp-precompute", "mtp-train", "mtp-eval", "mtp-export", "mtp-demo"
# Top-level keys that only one command's saved config.yaml has.
CONFIG_KEYS = {PRECOMPUTE: "shard_tokens", TRAIN: "optim", EVAL: "prompts"}
OVERWRITES = (PRECOMPUTE, TRAIN, EVAL, EXPORT)  # the commands that take `overwrite=true`
TRAINED_HEAD_FILES = ("train_config.yaml", "best.json")  # beside a head mtp-train saved, never in an export
# W&B's own folder in a run (`wandb.dir` unset): it links its logs to its cache, and nothing of ours is written there.
WANDB_DIR = "wandb"


class OutputError(ConfigError):
    """`out` holds another tool's output or unrelated files, or is a file where a folder is written."""


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file of the folder ({} when it is not one, or is a link: nothing is read through a link)."""
    if path.is_symlink():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _config_owner(path: Path) -> str | None:
    """The command whose resolved config `config.yaml` is, by the keys only it has (a link: nobody's)."""
    if path.is_symlink():
        return None
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


def head_weights_sha256(cfg: dict[str, Any]) -> str | None:
    """Which head an export's or a head's config.json is of: the sha256 of the head's own weights (a native
    export's are the head's, a layout export records its head's as `mtp_train.head_sha256`); None when unknown."""
    meta = cfg.get("mtp_train")
    if isinstance(meta, dict):
        return meta.get("head_sha256")
    files = cfg.get("files")
    entry = files.get("model.safetensors") if isinstance(files, dict) else None
    return entry.get("sha256") if isinstance(entry, dict) else None


def _stitched_links(out: Path) -> set[Path]:
    """The links a stitched export wrote to its target's shards (the files its index names), if `out` is one."""
    from mtp_train.export.stitch import INDEX, NEW_SHARD

    meta = _json(out / "config.json").get("mtp_train")
    if not (isinstance(meta, dict) and meta.get("stitched")) or (out / "config.json").is_symlink():
        return set()
    weight_map = _json(out / INDEX).get("weight_map") if not (out / INDEX).is_symlink() else None
    if not isinstance(weight_map, dict):
        return set()
    return {out / str(f) for f in set(weight_map.values()) - {NEW_SHARD} if "/" not in str(f)}


def _refuse(out: Path, command: str, what: str, todo: str, overwrite: bool) -> None:
    """Raise OutputError: `out` holds `what`, which `command` replaces only with overwrite=true."""
    also = " or pass overwrite=true to replace it" if command in OVERWRITES and not overwrite else ""
    raise OutputError(f"out={out} holds {what}: {command} {todo}; choose another `out`{also}")


def _check_export(out: Path, head_ckpt: str | Path, overwrite: bool) -> bool:
    """mtp-export into a folder holding a head or an export; True when `overwrite` lets it replace another's."""
    if out.resolve() == Path(head_ckpt).resolve():
        raise OutputError(f"out={out} is the head being exported (head_ckpt={head_ckpt}): the export would replace "
                          "the head's own weights; choose another `out`")
    trained = [name for name in TRAINED_HEAD_FILES if (out / name).exists()]
    if trained:
        if overwrite:
            return True
        _refuse(out, EXPORT, f"a head saved by mtp-train ({out / trained[0]} beside its weights)",
                "does not replace a trained head", overwrite)
    old, new = _json(out / "config.json"), _json(Path(head_ckpt) / "config.json")
    old_sha, new_sha = head_weights_sha256(old), head_weights_sha256(new)
    same = _head_identity(old) == _head_identity(new) and (old_sha is None or old_sha == new_sha)
    if same:
        return False
    if overwrite:
        return True
    _refuse(out, EXPORT, f"an export of another head than {head_ckpt}",
            "replaces only an export of the same head", overwrite)
    return False


def check_output(out: str | Path, command: str, *, head_ckpt: str | Path | None = None,
                 overwrite: bool = False) -> bool:
    """Refuse (OutputError) an `out` folder of `command` that holds anything but its own earlier output (the
    module docstring); with `overwrite`, remove the links found in it. Returns True when `overwrite` lets the
    command replace an output that is not its own (mtp-export: another head's export, or a trained head).

    `head_ckpt`: for mtp-export, the head being exported; an existing export must be one of the same head.
    """
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return False
    if not out.is_dir():
        raise OutputError(f"out={out} is a file, but {command} writes a folder there: choose another `out` "
                          "(a new or empty folder)")
    own = _stitched_links(out)
    links = [p for p in links_in(out) if p not in own and WANDB_DIR not in p.relative_to(out).parts[:-1]
             and leads_outside(out, p) is not None]
    owner = output_owner(out)
    if owner is None or owner not in ("", command):
        what = f"the output of {owner}" if owner else "files that no mtp command wrote"
        raise OutputError(f"out={out} holds {what}: {command} writes only into a new or empty folder or into its "
                          "own earlier output; choose another `out`")
    if links and not overwrite:
        more = f" (and {len(links) - 1} more)" if len(links) > 1 else ""
        _refuse(out, command, f"a link leading outside it, {links[0]} → {os.readlink(links[0])}{more}",
                "writes nothing through a link and follows none out of its output folder; remove it (what it "
                "points at is left alone)", overwrite)
    replaces = owner == EXPORT and head_ckpt is not None and _check_export(out, head_ckpt, overwrite)
    for link in links:  # overwrite=true: the links themselves go, what they point at stays
        link.unlink()
    return replaces


@dataclass
class Claim:
    """An output a command holds: its lock file, and whether `overwrite=true` let it replace another's output."""

    lock: Path
    replaces: bool


@contextlib.contextmanager
def claim_output(out: str | Path, command: str, *, head_ckpt: str | Path | None = None,
                 overwrite: bool = False) -> Iterator[Claim]:
    """`check_output`, then hold `out`'s lock while the block runs (see `mtp_train.fileio.output_lock`)."""
    replaces = check_output(out, command, head_ckpt=head_ckpt, overwrite=overwrite)
    with output_lock(out, command=command) as lock:
        yield Claim(lock, replaces)


@contextlib.contextmanager
def staged_folder(out: str | Path) -> Iterator[Path]:
    """A new folder beside `out` for the block to fill; on success it replaces `out` (two renames), on failure it
    is removed and `out` stays as it was. For a command that replaces an output that is not its own."""
    out = Path(out)
    stage = out.with_name(f"{TMP_PREFIX}{out.name}.{os.getpid()}")
    old = out.with_name(f"{TMP_PREFIX}{out.name}.{os.getpid()}.old")
    for leftover in (stage, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    os.replace(out, old)
    os.replace(stage, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def claims_output(command: str) -> Callable[[F], F]:
    """Decorate a one-process command `fn(cfg)` to run under `claim_output(cfg.out, command)` with the command's
    `overwrite`; mtp-export's `cfg.head_ckpt` is the head an earlier export in `out` must be of."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(cfg: Any, *args: Any, **kwargs: Any) -> Any:
            head = cfg.get("head_ckpt") or None if command == EXPORT else None
            with claim_output(cfg.out, command, head_ckpt=head, overwrite=bool(cfg.get("overwrite"))):
                return fn(cfg, *args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
