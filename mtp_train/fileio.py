"""Crash-safe file writes, file hashing, output locks and links, shared by every stage that writes outputs.

An output is written to `.tmp-<name>` beside its destination, fsynced and renamed into place, then
the directory is fsynced: a crash leaves either the old file or the new one, never a torn file. Every file written
so gets the mode a plain `open` would give it (0666 less the umask), whatever the writer used. Nothing is written
through a link: a `.tmp-<name>` found in the way is removed (the link, not what it points at), and a lock file
that is a link is refused (`LinkError`). `output_lock` keeps a second run from writing the same output at the same
time; `links_in` and `leads_outside` find what a folder holds that would lead a reader or a writer out of it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"  # leftovers with this prefix are from killed runs and may be deleted


class LinkError(ValueError):
    """A link where a run writes or reads its own files; the message names it, where it leads and what to do."""


def umask() -> int:
    """This process's umask, read without changing it where /proc says it (else set and restored at once)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def links_in(folder: Path) -> list[Path]:
    """Every symbolic link under `folder` (files and folders alike; none is followed), sorted."""
    found: list[Path] = []
    for root, dirs, files in os.walk(folder):  # os.walk never descends into a linked folder
        for name in dirs + files:
            if os.path.islink(os.path.join(root, name)):
                found.append(Path(root) / name)
    return sorted(found)


def leads_outside(folder: Path, path: Path) -> Path | None:
    """Where `path` really is when that is outside `folder` (a link leading out, or a loop: the path itself);
    None when it stays inside."""
    try:
        real = path.resolve(strict=False)
        home = folder.resolve(strict=False)
    except (OSError, RuntimeError):  # a link loop
        return path
    return None if real.is_relative_to(home) else real


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


def atomic_write(path: str | Path, write: Callable[[Path], None], size: int | None = None) -> None:
    """Create `path` atomically: `write(tmp)` fills `.tmp-<name>`, which is fsynced and renamed into place.

    size: the bytes the file will take, when known; a write that finds no room (disk full, quota, file size
    limit) raises DiskFullError naming the folder and these bytes (else the bytes written when it failed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(TMP_PREFIX + path.name)
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()  # a killed run's leftover, or a planted link: never written through
    try:
        write(tmp)
        with tmp.open("rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
            # Some writers (safetensors' save_file) create 0600 files; outputs follow the umask like any other file.
            os.fchmod(fh.fileno(), 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException as exc:
        written = _size_or_zero(tmp)
        with contextlib.suppress(OSError):
            tmp.unlink()
        code = disk_errno(exc)
        if code is not None:
            raise DiskFullError(code, path, size, written) from exc
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """`atomic_write` of a UTF-8 text."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), size=len(text.encode("utf-8")))


# --- writes that find no room -----------------------------------------------------------------------------------

# A write that found no room: no space left on the device, the disk quota used up, the file size limit reached.
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_errno(exc: BaseException) -> int | None:
    """The errno behind `exc` when it is a write that found no room (NO_ROOM_ERRNOS), else None: an OSError's own,
    or the `(os error N)` with which Rust's I/O errors (safetensors' writer) end their message."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno in NO_ROOM_ERRNOS:
            return e.errno
    match = re.search(r"\(os error (\d+)\)", str(exc))
    return int(match.group(1)) if match and int(match.group(1)) in NO_ROOM_ERRNOS else None


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _bytes(n: int) -> str:
    """`n` bytes for a reader: "1.5 GiB (1610612736 bytes)"."""
    size, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} bytes" if unit == "bytes" else f"{size:.1f} {unit} ({n} bytes)"


def human_bytes(n: int) -> str:
    """`n` bytes for a reader, in the unit that fits: "1.5 GiB (1610612736 bytes)"."""
    return _bytes(n)


class DiskFullError(OSError):
    """A write found no room (see NO_ROOM_ERRNOS); the message names the folder, the file, the bytes it needs and
    what to do. The file it was writing is left as it was (the temporary is removed): a re-run resumes."""

    def __init__(self, code: int, path: Path, size: int | None, written: int = 0) -> None:
        folder = path.parent
        need = f"{_bytes(size)}" if size else f"more than the {_bytes(written)} written when it failed"
        then = "then re-run the same command: it goes on from what was finished"
        if code == errno.EFBIG:
            import resource

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit == resource.RLIM_INFINITY:  # no limit of ours: the file system's largest file (FAT's 4 GiB)
                msg = (f"writing {path.name} into {folder} needs {need}, more than the file system there takes in "
                       f"one file; choose an `out` on another file system, {then}")
            else:
                msg = (f"writing {path.name} into {folder} needs {need}, over this process's file size limit "
                       f"(ulimit -f: {_bytes(limit)}); raise the limit, {then}")
        else:
            try:
                free = f"{_bytes(shutil.disk_usage(folder).free)} free"
            except OSError:
                free = "free space unknown"
            what = (f"the disk quota is used up at {folder}" if code == errno.EDQUOT else
                    f"no space left on the device of {folder} ({free})")
            msg = (f"{what}: writing {path.name} needs {need}; free some space there (or choose another `out`), "
                   f"{then}")
        super().__init__(code, msg)
        self.folder, self.path, self.size = folder, path, size

    def __str__(self) -> str:
        return str(self.strerror)


def tensor_bytes(tensors: Any) -> int:
    """The bytes of a dict of tensors' data (what a safetensors file of them needs, less its small header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a whole file, read in chunks (never whole into memory)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


# --- what a path really is, before a reader opens it ---------------------------------------------------------


def _kind(mode: int) -> str:
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else
            "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a plain file")


def file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a regular file, as the words that follow its name in a message ("does not
    exist", "is not a regular file: it is a FIFO (named pipe)", "is a link loop ..."), or None when it is one (a
    link to one counts).

    Readers check this before they open a file: opening a FIFO for reading blocks until a writer comes, and
    `Path.is_file()` is False alike for a missing file, a FIFO and a link loop, which a message must tell apart.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a link loop (following its links leads back to one of them), not a file"
        if exc.errno == errno.ENOENT and os.path.islink(path):
            return f"is a link to {os.readlink(path)}, which does not exist"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "does not exist"
        return f"cannot be read ({exc.strerror})"
    return None if stat.S_ISREG(mode) else f"is not a regular file: it is {_kind(mode)}"


def safetensors_problem(path: str | Path) -> str | None:
    """Why `path` is not a whole safetensors file, as the words that follow its name in a message ("is empty (0
    bytes)", "is truncated: ...", "is not a safetensors file: ..."), or None when its header reads and every tensor
    it describes lies inside the file. The tensors' bytes themselves are not read (a checksum is the check for
    those); `file_problem` first, so that nothing blocks on a FIFO.
    """
    path = Path(path)
    problem = file_problem(path)
    if problem:
        return problem
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"is not a safetensors file: {size} bytes, less than the 8 of a header's length"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            # A header longer than the file: cut short, or not the format at all (text reads as a huge length).
            return (f"is truncated or not a safetensors file: its first 8 bytes give a header of {n} bytes, the "
                    f"file holds {size}")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return "is not a safetensors file: its header is not JSON"
    if not isinstance(header, dict):
        return "is not a safetensors file: its header is not a JSON object"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2 and isinstance(entry["data_offsets"][1], int)]
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"is truncated: its header describes {need} bytes, the file holds {size}"
    return None


# --- one run per output -----------------------------------------------------------------------------------------

LOCK_NAME = ".lock"  # inside an output folder; an output file `x` has `x.lock` beside it


class OutputLockedError(RuntimeError):
    """Another live process holds the lock of an output; the message names it (pid, host) and what to do."""


def lock_path(out: str | Path, folder: bool = True) -> Path:
    """The lock file of output `out`: `<out>/.lock` for a folder, `<out>.lock` beside a file."""
    out = Path(out)
    return out / LOCK_NAME if folder else out.with_name(out.name + ".lock")


def _holder(fd: int) -> dict[str, Any]:
    """What the lock file open at `fd` says about its last holder ({} when it says nothing readable)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "a process that has not recorded itself yet"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}"
            + (f" ({holder['command']}" + (f", since {holder['since']}" if holder.get("since") else "") + ")"
               if holder.get("command") else ""))


def _acquire(lock: Path, out: Path, command: str) -> int:
    """Open and flock `lock`; returns its descriptor, or raises OutputLockedError naming the holder."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if not lock.is_symlink():
                raise
            raise LinkError(f"{lock} is a link (to {os.readlink(lock)}): a lock file is never written through a "
                            f"link; remove it (what it points at is left alone), or choose another `out`") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputLockedError(
                f"{out} is in use by another run: {_describe(holder)}. Wait for it to finish (or stop it), or "
                f"choose another `out`; its lock {lock} is released when that process ends") from None
        except OSError as exc:  # a file system without locks (some network mounts): run, but say so
            log.warning("cannot lock %s (%s): nothing stops a second run from writing %s at the same time",
                        lock, exc.strerror, out)
            return fd
        # A run that ended between our open and flock removed the file, and a third may have made a new one:
        # a lock on the removed file would exclude nobody, so lock whatever file the name now points at.
        try:
            current = os.stat(lock).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)
    previous = _holder(fd)
    if previous:
        log.info("%s: taking over the lock left by %s, which is no longer running", out, _describe(previous))
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


@contextlib.contextmanager
def output_lock(out: str | Path, *, folder: bool = True, command: str = "") -> Iterator[Path]:
    """Hold an exclusive lock on output `out` (a folder, or a file with `folder=False`) while the block runs.

    Two runs writing one output would interleave their files, so the second refuses at once
    (OutputLockedError naming the holder's pid and host). The lock is a `flock` on `lock_path(out)`, which the
    kernel drops when its holder exits, however it exits: a lock file left by a killed run is taken over by the
    next one. The file records the holder (pid, host, `command`, start time) for that message and is removed
    on release. Folders this call creates for the lock are removed again when the block fails while they are
    still empty, so that a refused run leaves nothing behind.
    """
    out = Path(out)
    home = out if folder else out.parent
    created = [p for p in (home, *home.parents) if not p.exists()]
    home.mkdir(parents=True, exist_ok=True)
    lock = lock_path(out, folder)
    fd = _acquire(lock, out, command or " ".join(sys.argv)[:300])
    ok = False
    try:
        yield lock
        ok = True
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # while still holding the flock; `_acquire` copes with the name changing under it
        os.close(fd)
        if not ok:
            for d in created:  # deepest first
                try:
                    d.rmdir()
                except OSError:
                    break
