"""A fetched folder: its completeness marker, and putting a finished folder in place without a half-written state.

The marker (`MARKER_NAME`) goes in last and lists every file with its size; a folder with a valid marker is
complete. Folders are built next to their destination and renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from mtp_train.fetch.registry import ModelSpec

log = logging.getLogger(__name__)

MARKER_NAME = ".mtp_fetch.json"
MARKER_FORMAT = 1
# Leftovers of a killed run (partial or replaced folders) older than this are deleted on the next run; younger
# ones may belong to a run still in progress next to us.
STALE_AFTER_S = 3600.0


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a fetched folder, or None when it is missing or unreadable."""
    try:
        data = json.loads((Path(folder) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_complete(folder: Path, marker: dict[str, Any] | None = None) -> str | None:
    """Why `folder` is not a complete fetched model, or None when it is.

    Only cheap checks (marker present, every listed file there with its recorded size): the expensive ones ran
    before the marker was written, and this runs on every fetch.
    """
    folder = Path(folder)
    marker = read_marker(folder) if marker is None else marker
    if marker is None:
        return f"no readable {MARKER_NAME}"
    if marker.get("format") != MARKER_FORMAT:
        return f"{MARKER_NAME} has format {marker.get('format')!r}, expected {MARKER_FORMAT}"
    files = marker.get("files")
    if not isinstance(files, dict) or "config.json" not in files or "model.safetensors" not in files:
        return f"{MARKER_NAME} lists no model files"
    for rel, size in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, expected {size}"
    return None


def is_fetched(folder: Path) -> bool:
    """True when `folder` holds a complete, verified fetched model."""
    return check_complete(folder) is None


def marker_matches(marker: dict[str, Any], spec: ModelSpec, package: str, version: str,
                    gguf_sha256: str | None) -> bool:
    """Whether an existing folder was made from the source now asked for."""
    if marker.get("name") != spec.name:
        return False
    if gguf_sha256 is not None:  # a local GGUF: the same bytes give the same folder, whatever their origin
        return marker.get("gguf_sha256") == gguf_sha256
    if marker.get("package") == package and marker.get("version") == version:
        return True
    # A folder converted from a local copy of exactly the registry's GGUF is as good as a downloaded one.
    pinned = spec.gguf_sha256 if (package, version) == (spec.package, spec.version) else None
    return pinned is not None and marker.get("gguf_sha256") == pinned


def remove_stale_leftovers(out: Path) -> None:
    """Delete old partial/replaced siblings of `out` left by killed runs (each can be ~0.5 GB)."""
    now = time.time()
    for pattern in (f".{out.name}.partial-*", f".{out.name}.old-*"):
        for p in out.parent.glob(pattern):
            try:
                if p.is_dir() and now - p.stat().st_mtime > STALE_AFTER_S:
                    log.info("removing leftover %s", p)
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                pass  # raced with another run removing it


def replace_dir(staging: Path, out: Path) -> None:
    """Move the finished `staging` folder to `out`, replacing what is there, never leaving `out` half-written.

    Both are siblings on one file system, so each step is a rename; `out` is missing only between the two
    renames, and an old folder is restored when the second one fails.
    """
    if not (out.exists() or out.is_symlink()):
        os.rename(staging, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rmdir(old)  # only the unique name is wanted
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


def normalise_modes(folder: Path) -> None:
    """Give every file the permissions of config.json (which follow the umask).

    safetensors writes its file owner-only, which would make a shared models folder unreadable to others.
    """
    mode = (folder / "config.json").stat().st_mode & 0o777
    for p in folder.rglob("*"):
        if p.is_file() and (p.stat().st_mode & 0o777) != mode:
            p.chmod(mode)


def file_list(folder: Path) -> dict[str, int]:
    """Relative path → size of every file in `folder` except the marker."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER_NAME}

