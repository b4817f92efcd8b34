"""The precompute output contract: `manifest.json`, the train/val rule, and atomic file writes.

A precompute folder holds `shard-r{rank}-{n:05d}.safetensors` files (each with a `.json` sidecar
written after it) and, written last, `manifest.json`. The manifest is the only source of truth: a shard
it does not list does not exist for readers, and a folder without a manifest is an unfinished run.

Shard file (safetensors), S samples of T tokens in total, H = hidden size, k = number of aux layers:

    input_ids   int32  (T,)      the samples' tokens, concatenated
    loss_mask   uint8  (T,)      1 on tokens the head learns to predict (assistant tokens)
    hidden      bf16   (T, H)    target hidden state after the final norm (storage dtype configurable)
    aux_hidden  bf16   (T, k*H)  optional: HF `hidden_states[j]` for each aux layer j, concatenated in order
    hidden_scale      f32  (T, 1)  only with fp8 storage (`hidden.dtype` float8_e4m3fn): per-token scales,
    aux_hidden_scale  f32  (T, k)  hidden = fp8 · scale (`precompute.quant`); one scale per aux layer
    offsets     int64  (S+1,)    sample s is rows offsets[s]:offsets[s+1]
    metadata: {"format_version": "1", "sample_ids": JSON list of S ids, "hidden_dtype", "aux_layers": JSON}

Beside it, `token_counts.safetensors` (written by rank 0 just before the manifest, which names it with its sha256)
holds what a draft vocabulary is chosen from, so that no reader opens every shard for it:

    train  int64  (V,)  occurrences of each token id under the loss mask, over the train split's samples
    val    int64  (V,)  the same over the val split's samples (V = target.vocab_size)
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from mtp_train.config.head import aux_layers_problem
from mtp_train.fileio import atomic_write, atomic_write_text, leads_outside, sha256_file
from mtp_train.precompute.safetensors_file import write_safetensors

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKEN_COUNTS_NAME = "token_counts.safetensors"  # per-split counts of loss-masked token ids (module docstring)
# What a shard entry's `file` may be: the plain name precompute gives a shard (`plan.shard_name`), nothing that
# could lead out of the folder.
SHARD_FILE = re.compile(r"shard-r[0-9]+-[0-9]{5,}\.safetensors")
# `hidden.dtype` values: the storage dtypes of hidden / aux_hidden, as torch names them.
HIDDEN_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
# How the train/val split is decided, written into every manifest so the rule travels with the data.
SPLIT_RULE = "val iff int.from_bytes(sha256(f'{seed}:{id}')[:8], 'big') / 2**64 < val_fraction"


class ManifestError(ValueError):
    """A precompute folder or manifest that cannot be used; the message says what to do."""


class ManifestMismatchError(ManifestError):
    """The folder was precomputed for another target, tokenizer or chat template."""


def restore_advice(directory: str | Path) -> str:
    """What to do about a manifest that does not describe its folder's shards (which are not at fault)."""
    return (f"restore this folder's own {MANIFEST_NAME}, or re-run mtp-precompute on {directory} with the settings "
            "that made it (its finished shards are kept and the manifest is written anew)")


def link_advice(directory: str | Path) -> str:
    """What to do about a file of a precompute folder that is a link leading outside it (a re-run without
    `overwrite=true` refuses the link too, so the advice names it)."""
    return (f"put the file itself in the folder, or re-run mtp-precompute on {directory} with overwrite=true (it "
            "removes the link, leaving what it points at alone, and writes the file anew)")


def refuse_outside(directory: Path, path: Path, what: str) -> None:
    """Raise ManifestError when `path` (`what`, in words) is a link leading outside the precompute folder
    `directory`: a folder is read from its own files only."""
    real = leads_outside(directory, path)
    if real is not None:
        raise ManifestError(f"{path} ({what}) is a link leading outside {directory} (to {real}): a precompute "
                            f"folder reads only its own files; {link_advice(directory)}")


def is_val(sample_id: str, seed: int, val_fraction: float) -> bool:
    """Whether `sample_id` falls in the validation split (`SPLIT_RULE`).

    Hashing the id, not its position, keeps the split the same for any world size, shard size or
    sample order, and lets the reader recompute it without a stored list of ids.
    """
    if val_fraction <= 0.0:
        return False
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


SPLITS = ("train", "val", "all")


def in_split(sample_id: str, split: str, seed: int, val_fraction: float) -> bool:
    """Whether `sample_id` belongs to `split` ("train", "val" or "all") by the rule `is_val`; the one selection
    the precompute reader and online training both use."""
    return split == "all" or (split == "val") == is_val(sample_id, seed, val_fraction)


# ----------------------------------------------------------------------------------------------------------------
# manifest


@dataclass
class TargetInfo:
    """The target model whose hidden states the folder holds."""

    path: str  # model folder as given to precompute
    fingerprint: str  # mtp_train.models.fingerprint.weights_fingerprint
    model_type: str
    hidden_size: int  # H
    num_layers: int
    vocab_size: int
    dtype: str  # dtype the target computed in, e.g. "bfloat16"


@dataclass
class TokenizerInfo:
    """Given by the caller; readers compare them with the tokenizer they use."""

    fingerprint: str
    chat_template_fingerprint: str


@dataclass
class HiddenInfo:
    """What the `hidden` / `aux_hidden` tensors are."""

    kind: str = "final_norm"  # hidden is the target's last hidden state after the final norm
    dtype: str = "bfloat16"  # storage dtype of hidden and aux_hidden
    aux_layers: list[int] = field(default_factory=list)  # HF hidden_states indices in aux_hidden, in order


@dataclass
class SplitInfo:
    """The train/val split: a rule over sample ids (`SPLIT_RULE`) and what it gave."""

    val_fraction: float
    seed: int
    rule: str = SPLIT_RULE
    counts: dict[str, int] = field(default_factory=dict)  # {train,val}_{samples,tokens,loss_tokens}


@dataclass
class ShardInfo:
    """One shard as listed in the manifest (and, with a few more keys, in its sidecar)."""

    file: str  # name inside the folder
    rank: int  # rank that wrote it
    index: int  # n in shard-r{rank}-{n:05d}
    samples: int  # S
    tokens: int  # T
    loss_tokens: int  # tokens with loss_mask == 1
    sha256: str  # of the whole file
    bytes: int  # file size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardInfo:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass
class Totals:
    """What a precompute folder holds, summed over its shards (the manifest's `totals`)."""

    samples: int = 0
    tokens: int = 0  # every token of every sample
    loss_tokens: int = 0  # tokens in the loss (assistant tokens)
    bytes: int = 0  # shard file sizes


@dataclass
class Manifest:
    """Everything a later stage needs to trust and read a precompute folder."""

    target: TargetInfo
    tokenizer: TokenizerInfo
    hidden: HiddenInfo
    data: dict[str, Any]  # given by the caller: sources, max_seq_len, limit, dropped rows, ...
    split: SplitInfo
    shards: list[ShardInfo]
    totals: Totals
    provenance: dict[str, Any]  # package version, settings, caller's command/config
    created_at: str = ""  # ISO 8601 UTC
    format_version: int = FORMAT_VERSION
    # {"file": TOKEN_COUNTS_NAME, "sha256", "bytes"}; None in a folder written before the file existed
    token_counts: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        counts = d.pop("token_counts")
        provenance = d.pop("provenance")
        # format_version and created_at first: what a person opening the file looks for. A manifest without token
        # counts is written as before they existed.
        return {"format_version": d.pop("format_version"), "created_at": d.pop("created_at"), **d,
                **({"token_counts": counts} if counts is not None else {}), "provenance": provenance}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = MANIFEST_NAME) -> Manifest:
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"{source}: format_version {version!r} is not supported (this version reads {FORMAT_VERSION}); "
                "re-run precompute with this version of mtp_train"
            )
        try:
            return cls(
                format_version=version,
                created_at=d.get("created_at", ""),
                target=TargetInfo(**d["target"]),
                tokenizer=TokenizerInfo(**d["tokenizer"]),
                hidden=HiddenInfo(**d["hidden"]),
                data=dict(d.get("data") or {}),
                split=SplitInfo(**d["split"]),
                shards=[ShardInfo.from_dict(s) for s in d["shards"]],
                totals=Totals(**d["totals"]),
                provenance=dict(d.get("provenance") or {}),
                token_counts=dict(d["token_counts"]) if d.get("token_counts") is not None else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{source}: malformed manifest ({type(e).__name__}: {e}); re-run precompute") from None

    def save(self, directory: str | Path) -> Path:
        """Write `<directory>/manifest.json` atomically; returns its path."""
        path = Path(directory) / MANIFEST_NAME
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        """Read `<directory>/manifest.json` with errors that say what went wrong and what to do."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ManifestError(f"precompute folder {directory} does not exist; point at the folder precompute wrote")
        path = directory / MANIFEST_NAME
        if not path.is_file():
            shards = sorted(p for p in directory.glob("shard-r*.safetensors") if SHARD_FILE.fullmatch(p.name))
            if shards:
                why = (f"it holds {len(shards)} shard(s) but no {MANIFEST_NAME}: the precompute run did not finish; "
                       "re-run it with the same settings (finished shards are kept)")
            else:
                why = f"it has no {MANIFEST_NAME}: point at the folder a finished precompute run wrote"
            raise ManifestError(f"{directory} is not a finished precompute folder: {why}")
        refuse_outside(directory, path, "the folder's manifest")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ManifestError(
                f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; re-run precompute"
            ) from None
        if not isinstance(d, dict):
            raise ManifestError(f"{path}: expected a JSON object; re-run precompute")
        manifest = cls.from_dict(d, source=str(path))
        manifest.check_listing(directory)
        return manifest

    def check_listing(self, directory: str | Path) -> None:
        """Refuse fields of the wrong type or range, and a shard list that could read anything but the folder's own
        shards, each once; raises ManifestError naming the field and the shard.

        Nothing outside the folder is opened, or even looked at: a `file` that is not a plain shard file name is
        refused as written, and a listed file that is a link is resolved (not opened) to see where it leads.
        """
        directory = Path(directory)
        source, todo = directory / MANIFEST_NAME, restore_advice(directory)
        self._check_fields(source, todo)
        try:
            home = directory.resolve()
        except (OSError, RuntimeError) as e:
            raise ManifestError(f"precompute folder {directory} cannot be resolved ({e})") from None
        names: dict[str, int] = {}
        reals: dict[Path, int] = {}
        for i, s in enumerate(self.shards):
            entry = f"{source}: shards[{i}].file {s.file!r}"
            if not isinstance(s.file, str) or not SHARD_FILE.fullmatch(s.file):
                raise ManifestError(
                    f"{entry} {_name_problem(s.file)}: a manifest names each shard by its plain file name inside the "
                    f"folder (shard-r<rank>-<n>.safetensors) and reads no other file; {todo}"
                )
            if s.file in names:
                raise ManifestError(f"{entry} is listed twice (shards[{names[s.file]}] and shards[{i}]): each shard "
                                    f"is listed once; {todo}")
            names[s.file] = i
            try:
                real = (directory / s.file).resolve()
            except (OSError, RuntimeError) as e:  # a link loop
                raise ManifestError(f"{directory / s.file} (shards[{i}] of {source}) cannot be resolved ({e}); "
                                    f"put the shard itself in the folder, or {todo}") from None
            if not real.is_relative_to(home):
                raise ManifestError(
                    f"{directory / s.file} (shards[{i}] of {source}) is a link leading outside {directory} (to "
                    f"{real}): a precompute folder reads only its own files; {link_advice(directory)}"
                )
            if real in reals:
                raise ManifestError(f"{entry} is the same file as shards[{reals[real]}] ({real}): each shard is "
                                    f"listed once; {todo}")
            reals[real] = i
        # A shard copied under a second name is caught by its sample ids (the reader refuses an id in two shards).

    def _check_fields(self, source: Path, todo: str) -> None:
        """Every count a non-negative integer, sizes positive, the storage dtype known, aux layers in range."""
        def count(field: str, value: Any, least: int = 0) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ManifestError(f"{source}: {field} is {value!r}, expected an integer >= {least}; {todo}")

        t = self.target
        for name, least in (("hidden_size", 1), ("num_layers", 1), ("vocab_size", 1)):
            count(f"target.{name}", getattr(t, name), least)
        for name in ("samples", "tokens", "loss_tokens", "bytes"):
            count(f"totals.{name}", getattr(self.totals, name))
        for i, s in enumerate(self.shards):
            for name, least in (("rank", 0), ("index", 0), ("samples", 1), ("tokens", 1), ("loss_tokens", 0),
                                ("bytes", 1)):
                count(f"shards[{i}].{name} ({s.file})", getattr(s, name), least)
            if not (isinstance(s.sha256, str) and re.fullmatch(r"[0-9a-f]{64}", s.sha256)):
                raise ManifestError(f"{source}: shards[{i}].sha256 ({s.file}) is {s.sha256!r}, expected 64 hex "
                                    f"digits; {todo}")
        if self.hidden.dtype not in HIDDEN_DTYPES:
            raise ManifestError(f"{source}: hidden.dtype is {self.hidden.dtype!r}, expected one of "
                                f"{', '.join(HIDDEN_DTYPES)}; {todo}")
        aux = self.hidden.aux_layers
        if not isinstance(aux, list) or any(not isinstance(j, int) or isinstance(j, bool) for j in aux):
            raise ManifestError(f"{source}: hidden.aux_layers is {aux!r}, expected a list of layer indices; {todo}")
        problem = aux_layers_problem(aux, t.num_layers)
        if problem is not None:
            raise ManifestError(f"{source}: hidden.aux_layers={aux}: {problem} (target.num_layers={t.num_layers}); "
                                f"{todo}")

    def check_totals(self, directory: str | Path) -> None:
        """Refuse totals and split counts that are not the sums over the listed shards (ManifestError)."""
        directory = Path(directory)
        source, todo = directory / MANIFEST_NAME, restore_advice(directory)
        for name in ("samples", "tokens", "loss_tokens", "bytes"):
            have, want = getattr(self.totals, name), sum(getattr(s, name) for s in self.shards)
            if have != want:
                raise ManifestError(f"{source}: totals.{name} is {have}, but its {len(self.shards)} shards hold "
                                    f"{want} (the sum of shards[*].{name}): the manifest was edited; {todo}")
        c = self.split.counts
        for name in ("samples", "tokens", "loss_tokens"):
            parts = [c.get(f"{s}_{name}") for s in ("train", "val")]
            if all(isinstance(p, int) for p in parts) and sum(parts) != getattr(self.totals, name):
                raise ManifestError(
                    f"{source}: split.counts train_{name} + val_{name} is {parts[0]} + {parts[1]}, but "
                    f"totals.{name} is {getattr(self.totals, name)}: the manifest was edited; {todo}"
                )

    def check(self, *, target_fingerprint: str | None = None, tokenizer_fingerprint: str | None = None,
              chat_template_fingerprint: str | None = None, where: str = "this folder") -> None:
        """Raise ManifestMismatchError if any expected fingerprint differs from the recorded one (None = skip)."""
        checks = [
            ("target weights", target_fingerprint, self.target.fingerprint,
             f"re-run precompute for this target (the folder was made from {self.target.path})"),
            ("tokenizer", tokenizer_fingerprint, self.tokenizer.fingerprint,
             "re-run precompute with this tokenizer"),
            ("chat template", chat_template_fingerprint, self.tokenizer.chat_template_fingerprint,
             "re-run precompute with this chat template"),
        ]
        for what, want, have, todo in checks:
            if want is not None and want != have:
                raise ManifestMismatchError(
                    f"{where} was precomputed with {what} fingerprint {have}, but this run expects {want}: "
                    f"{todo}, or point at the folder precomputed for it"
                )


def _name_problem(file: Any) -> str:
    """Why a shard entry's `file` is refused, in words."""
    if not isinstance(file, str) or not file:
        return "is not a file name"
    if file.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", file):
        return "is an absolute path"
    if ".." in re.split(r"[/\\]", file):
        return "leads out of the folder (..)"
    if "/" in file or "\\" in file:
        return "is a path, not a file name"
    return "is not a shard file name"


# ----------------------------------------------------------------------------------------------------------------
# token counts


def write_token_counts(directory: str | Path, train: torch.Tensor, val: torch.Tensor) -> dict[str, Any]:
    """Write `<directory>/token_counts.safetensors` atomically from int64 counts train (V,) and val (V,); returns
    the manifest's entry for it: {"file", "sha256", "bytes"}."""

    path = Path(directory) / TOKEN_COUNTS_NAME
    tensors = {"train": train.to(torch.int64).contiguous(), "val": val.to(torch.int64).contiguous()}
    digest: list[str] = []

    def write(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            digest.append(write_safetensors(fh, tensors, {"format_version": str(FORMAT_VERSION)}))

    atomic_write(path, write)
    return {"file": TOKEN_COUNTS_NAME, "sha256": digest[0], "bytes": path.stat().st_size}


def read_token_counts(folder: Path, split: str, vocab_size: int) -> torch.Tensor | None:
    """(vocab_size,) int64 occurrences of each token id under the loss mask over `split`'s samples ("train", "val",
    or "all": their sum), as the folder's `token_counts.safetensors` records them; None for a folder written
    before the file existed (its manifest names none, and it holds none).

    Raises ManifestError naming the file when it is damaged (unreadable, not the sha256 its manifest records, a
    tensor missing, misshapen or negative), is a link leading outside the folder, is missing though the manifest
    names it, or counts another vocabulary than `vocab_size`.

    Args:
        folder: the precompute folder.
        split: "train", "val" or "all".
        vocab_size: the target's vocabulary size V the counts must have.
    """
    from safetensors import safe_open

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    folder = Path(folder)
    path = folder / TOKEN_COUNTS_NAME
    entry = _manifest_entry(folder)
    todo = (f"re-run mtp-precompute on {folder} with the settings that made it (its finished shards are kept and "
            "the counts written anew)")
    if not path.exists() and not path.is_symlink():
        if entry is None:
            return None
        raise ManifestError(f"{path} is missing, though {folder / MANIFEST_NAME} names it; {todo}")
    refuse_outside(folder, path, "the folder's token counts")
    if entry is not None and isinstance(entry.get("sha256"), str):
        try:
            have = sha256_file(path)
        except OSError as e:
            raise ManifestError(f"{path} cannot be read ({e}); {todo}") from None
        if have != entry["sha256"]:
            raise ManifestError(f"{path} is damaged: sha256 {have}, {folder / MANIFEST_NAME} records "
                                f"{entry['sha256']}; {todo}")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            missing = [k for k in ("train", "val") if k not in names]
            if missing:
                raise ManifestError(f"{path} is damaged: it holds no `{missing[0]}` tensor; {todo}")
            counts = {k: f.get_tensor(k) for k in ("train", "val")}
    except ManifestError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a file that is not one
        raise ManifestError(f"{path} is damaged: not a readable safetensors file ({type(e).__name__}: {e}); "
                            f"{todo}") from None
    for name, t in counts.items():
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ManifestError(f"{path} is damaged: its `{name}` tensor is {str(t.dtype).removeprefix('torch.')} "
                                f"{list(t.shape)}, expected int64 (vocab_size,); {todo}")
        if t.numel() != vocab_size:
            raise ManifestError(f"{path} counts a vocabulary of {t.numel()} token ids, this target has {vocab_size}: "
                                f"the folder was precomputed for another target; point at its own folder or {todo}")
        if bool((t < 0).any()):
            raise ManifestError(f"{path} is damaged: its `{name}` tensor holds negative counts; {todo}")
    if split == "all":
        return counts["train"] + counts["val"]
    return counts[split]


def _manifest_entry(folder: Path) -> dict[str, Any] | None:
    """The manifest's `token_counts` entry, or None (no manifest, an unreadable one, an older one without it)."""
    try:
        d = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    entry = d.get("token_counts") if isinstance(d, dict) else None
    return entry if isinstance(entry, dict) else None


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (sidecars, manifests)."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def read_json(path: Path) -> Any:
    with path.open() as fh:
        return json.load(fh)
