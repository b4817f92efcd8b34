"""Crash-safe file writes and file hashing, shared by every stage that writes outputs.

An output is written to `.tmp-<name>` beside its destination, fsynced and renamed into place, then
the directory is fsynced: a crash leaves either the old file or the new one, never a torn file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX = ".tmp-"  # leftovers with this prefix are from killed runs and may be deleted


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Create `path` atomically: `write(tmp)` fills `.tmp-<name>`, which is fsynced and renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(TMP_PREFIX + path.name)
    try:
        write(tmp)
        with tmp.open("rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """`atomic_write` of a UTF-8 text."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a whole file, read in chunks (never whole into memory)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
