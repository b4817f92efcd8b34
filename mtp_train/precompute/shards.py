"""Shard files on disk: writing one (safetensors, then its sidecar) and recognising one that is already done.

Each shard is written to `.tmp-<name>`, fsynced and renamed; then its sidecar `<name>.json` (sha256, counts, ids
hash, plan hash) is written the same way. A shard counts as done only when its sidecar matches the plan, so a
re-run skips exactly the shards a previous run finished (see `mtp_train.precompute.plan` for why the plans of
two runs agree). The tensors a shard holds are listed in `mtp_train.precompute.manifest`.

Beside them, `<name without .safetensors>.counts.safetensors` holds the shard's samples counted by split (the
split rule's seed and val_fraction in its metadata): for train and val, the token ids under the loss mask, sparse
(`<split>_ids` int32 (U,) sorted, `<split>_counts` int64 (U,)), and the split's samples, tokens and loss tokens.
Rank 0 sums them into the folder's `token_counts.safetensors` and `split.counts` without opening a shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtp_train.fileio import atomic_write, sha256_file, tensor_bytes
from mtp_train.precompute.manifest import FORMAT_VERSION, ShardInfo, is_val, read_json, write_json
from mtp_train.precompute.plan import ShardPlan
from mtp_train.precompute.quant import FP8_NAME
from mtp_train.precompute.safetensors_file import write_safetensors

# safetensors dtype names of the tensors a shard can hold
# safetensors dtype of stored hidden states → the manifest's `hidden.dtype`
_HIDDEN_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": FP8_NAME}


class ShardLayoutError(ValueError):
    """A shard whose header does not hold the tensors, shapes and metadata of the format (the shard is at fault)."""


@dataclass
class ShardLayout:
    """What a shard's own header says it holds (read from the header and `offsets`, no hidden states)."""

    ids: list[str]  # (S,) sample ids
    offsets: np.ndarray  # (S+1,) int64
    tokens: int  # T
    hidden_size: int  # H
    dtype: str  # storage dtype of hidden / aux_hidden, as the manifest's `hidden.dtype` names it
    aux_layers: list[int] | None  # from the metadata (None: a shard that does not record them)
    aux_count: int  # k: aux_hidden is (T, k*H)


def shard_layout(f: Any) -> ShardLayout:
    """The layout of the shard open as safetensors handle `f`; raises ShardLayoutError naming what is wrong.

    Reads the header (tensor names, dtypes, shapes, metadata) and the small `offsets` tensor only, so checking
    every shard of a big folder costs a few KB per shard.
    """
    meta = dict(f.metadata() or {})
    names: list[str] = f.keys()
    spec = {k: (sl.get_dtype(), tuple(sl.get_shape())) for k in names for sl in [f.get_slice(k)]}

    def need(name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None = None, why: str = "") -> None:
        if name not in spec:
            raise ShardLayoutError(f"it holds no `{name}` tensor{why}")
        dt, sh = spec[name]
        if dt not in dtypes or (shape is not None and sh != shape):
            want = f"{'/'.join(dtypes)} {list(shape) if shape is not None else ''}".strip()
            raise ShardLayoutError(f"its `{name}` tensor is {dt} {list(sh)}, the format says {want}")

    need("hidden", tuple(_HIDDEN_DTYPES))
    st_dtype, hshape = spec["hidden"]
    if len(hshape) != 2 or hshape[1] < 1:
        raise ShardLayoutError(f"its `hidden` tensor is {list(hshape)}, the format says (T, H)")
    t, h = hshape
    need("input_ids", ("I32", "I64"), (t,))
    need("loss_mask", ("U8",), (t,))
    need("offsets", ("I64",))
    try:
        ids = json.loads(meta["sample_ids"])
    except (KeyError, ValueError) as e:
        raise ShardLayoutError(f"its metadata has no readable sample_ids ({type(e).__name__}: {e})") from None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ShardLayoutError("its metadata's sample_ids is not a list of ids")
    need("offsets", ("I64",), (len(ids) + 1,))
    offsets = f.get_tensor("offsets").numpy().astype(np.int64)
    if offsets[0] != 0 or int(offsets[-1]) != t or (np.diff(offsets) < 0).any():
        raise ShardLayoutError(f"its offsets do not cut its {t} rows into {len(ids)} samples")
    dtype = _HIDDEN_DTYPES[st_dtype]
    if meta.get("hidden_dtype", dtype) != dtype:
        raise ShardLayoutError(f"its metadata says hidden_dtype {meta['hidden_dtype']}, its `hidden` tensor is "
                               f"{dtype}")
    aux_layers = None
    if "aux_layers" in meta:
        try:
            aux_layers = [int(j) for j in json.loads(meta["aux_layers"])]
        except (ValueError, TypeError) as e:
            raise ShardLayoutError(f"its metadata's aux_layers is unreadable ({e})") from None
    width = spec["aux_hidden"][1][1] if "aux_hidden" in spec and len(spec["aux_hidden"][1]) == 2 else 0
    k = len(aux_layers) if aux_layers is not None else width // h
    if k:
        need("aux_hidden", (st_dtype,), (t, k * h), f" for its {k} aux layers")
    elif "aux_hidden" in spec:
        raise ShardLayoutError("it holds an `aux_hidden` tensor, but its metadata lists no aux layers")
    if dtype == FP8_NAME:  # fp8 values mean nothing without their per-token scales
        need("hidden_scale", ("F32",), (t, 1), f" (the per-token scales of its {FP8_NAME} hidden states)")
        if k:
            need("aux_hidden_scale", ("F32",), (t, k), f" (the per-token scales of its {FP8_NAME} aux_hidden)")
    return ShardLayout(ids=ids, offsets=offsets, tokens=t, hidden_size=h, dtype=dtype, aux_layers=aux_layers,
                       aux_count=k)


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


def _sidecar(plan: ShardPlan, sha256: str, size: int) -> dict[str, Any]:
    info = ShardInfo(file=plan.name, rank=plan.rank, index=plan.index, samples=len(plan.rows), tokens=plan.tokens,
                     loss_tokens=plan.loss_tokens, sha256=sha256, bytes=size)
    return {**info.__dict__, "format_version": FORMAT_VERSION, "first_id": plan.rows[0].id,
            "last_id": plan.rows[-1].id, "ids_sha256": plan.ids_sha256, "plan_sha256": plan.plan_sha256}


def finished_shard(out_dir: Path, plan: ShardPlan, verify: bool) -> ShardInfo | None:
    """The shard's info if file + sidecar exist and match the plan (and the file's sha256 when verify). A shard or
    sidecar that is a link is never done: the reader refuses links, so the shard is written in the folder itself."""
    info = matching_sidecar(out_dir, plan.name, plan_sha256=plan.plan_sha256, ids_sha256=plan.ids_sha256,
                            samples=len(plan.rows), tokens=plan.tokens, loss_tokens=plan.loss_tokens)
    if info is None or (verify and sha256_file(out_dir / plan.name) != info.sha256):
        return None
    return info


def matching_sidecar(out_dir: Path, name: str, *, plan_sha256: str, ids_sha256: str, samples: int, tokens: int,
                     loss_tokens: int) -> ShardInfo | None:
    """The info of shard `name` when its file and sidecar are there (not links) and the sidecar records this plan
    (hashes and counts) and the file's size; None otherwise (a torn or foreign sidecar: the shard is redone).

    Args:
        out_dir: the folder.
        name: the shard's file name.
        plan_sha256: the plan hash the sidecar must record (settings and every row).
        ids_sha256: the hash of the shard's sample ids.
        samples, tokens, loss_tokens: the counts the sidecar must record.
    """
    path = out_dir / name
    side = sidecar_path(path)
    if path.is_symlink() or side.is_symlink() or not (path.is_file() and side.is_file()):
        return None
    try:
        d = read_json(side)
        info = ShardInfo.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    same = (d.get("format_version") == FORMAT_VERSION and d.get("plan_sha256") == plan_sha256
            and d.get("ids_sha256") == ids_sha256 and info.samples == samples and info.tokens == tokens
            and info.loss_tokens == loss_tokens and info.bytes == path.stat().st_size)
    return info if same else None


def write_shard(out_dir: Path, plan: ShardPlan, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str]) -> ShardInfo:
    """Atomically write one shard, then its sidecar (which is what marks the shard as done)."""
    path = out_dir / plan.name
    meta = {**metadata, "sample_ids": json.dumps([r.id for r in plan.rows])}
    digest: list[str] = []

    def write(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            digest.append(write_safetensors(fh, tensors, meta))

    atomic_write(path, write, size=tensor_bytes(tensors))
    side = _sidecar(plan, digest[0], path.stat().st_size)
    write_json(sidecar_path(path), side)
    return ShardInfo.from_dict(side)


# ----------------------------------------------------------------------------------------------------------------
# per-shard counts

COUNTS_SUFFIX = ".counts.safetensors"
SPLIT_NAMES = ("train", "val")


def counts_path(shard: Path) -> Path:
    """Where the counts of the shard at `shard` go: `shard-r0-00000.counts.safetensors` beside it."""
    return shard.with_name(shard.name.removesuffix(".safetensors") + COUNTS_SUFFIX)


@dataclass
class ShardCounts:
    """A shard's samples counted by split (module docstring)."""

    ids: dict[str, np.ndarray]  # split → (U,) int32 token ids under the loss mask, sorted, unique
    counts: dict[str, np.ndarray]  # split → (U,) int64 occurrences of each
    split: dict[str, int]  # {train,val}_{samples,tokens,loss_tokens}, as the manifest's `split.counts`

    def add_to(self, dense: dict[str, torch.Tensor]) -> None:
        """Add the counts into dense (V,) int64 tensors, one per split."""
        for s in SPLIT_NAMES:
            dense[s].index_add_(0, torch.from_numpy(self.ids[s].astype(np.int64)), torch.from_numpy(self.counts[s]))


def count_samples(samples: Iterable[tuple[str, np.ndarray, np.ndarray]], seed: int, val_fraction: float) -> ShardCounts:
    """The counts of (id, input_ids (L,), loss_mask (L,)) samples under the split rule (`manifest.is_val`)."""
    split = {f"{s}_{k}": 0 for s in SPLIT_NAMES for k in ("samples", "tokens", "loss_tokens")}
    masked: dict[str, list[np.ndarray]] = {s: [] for s in SPLIT_NAMES}
    for sample_id, ids, mask in samples:
        s = "val" if is_val(sample_id, seed, val_fraction) else "train"
        kept = ids[mask.astype(bool)]
        split[f"{s}_samples"] += 1
        split[f"{s}_tokens"] += int(ids.size)
        split[f"{s}_loss_tokens"] += int(kept.size)
        masked[s].append(kept)
    ids_of, counts_of = {}, {}
    for s in SPLIT_NAMES:
        flat = np.concatenate(masked[s]) if masked[s] else np.zeros(0, dtype=np.int32)
        u, c = np.unique(flat.astype(np.int32), return_counts=True)
        ids_of[s], counts_of[s] = u.astype(np.int32), c.astype(np.int64)
    return ShardCounts(ids_of, counts_of, split)


def write_shard_counts(out_dir: Path, plan: ShardPlan, seed: int, val_fraction: float) -> ShardCounts:
    """Atomically write the counts of `plan`'s samples beside its shard (tied to it by the plan hash)."""
    counts = count_samples(((r.id, r.ids, r.mask) for r in plan.rows), seed, val_fraction)
    tensors = {}
    for s in SPLIT_NAMES:
        tensors[f"{s}_ids"] = torch.from_numpy(counts.ids[s])  # (U,) int32
        tensors[f"{s}_counts"] = torch.from_numpy(counts.counts[s])  # (U,) int64
    meta = {"format_version": str(FORMAT_VERSION), "plan_sha256": plan.plan_sha256, "seed": str(seed),
            "val_fraction": repr(float(val_fraction)), "split_counts": json.dumps(counts.split, sort_keys=True)}

    def write(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            write_safetensors(fh, tensors, meta)

    atomic_write(counts_path(out_dir / plan.name), write)
    return counts


def read_shard_counts(out_dir: Path, name: str, plan_sha256: str, seed: int, val_fraction: float,
                      ) -> ShardCounts | None:
    """The counts beside shard `name` when they are of that plan and split rule; None when missing, torn, a link,
    or of another plan or rule (then `counts_from_shard` counts the shard itself)."""
    from safetensors import safe_open

    path = counts_path(out_dir / name)
    if path.is_symlink() or not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            if (meta.get("format_version") != str(FORMAT_VERSION) or meta.get("plan_sha256") != plan_sha256
                    or meta.get("seed") != str(seed) or meta.get("val_fraction") != repr(float(val_fraction))):
                return None
            ids = {s: f.get_tensor(f"{s}_ids").numpy().astype(np.int32) for s in SPLIT_NAMES}
            counts = {s: f.get_tensor(f"{s}_counts").numpy().astype(np.int64) for s in SPLIT_NAMES}
            split = {k: int(v) for k, v in json.loads(meta["split_counts"]).items()}
    except Exception:  # noqa: BLE001 - unreadable: counted again from the shard
        return None
    if any(ids[s].shape != counts[s].shape or ids[s].ndim != 1 for s in SPLIT_NAMES):
        return None
    return ShardCounts(ids, counts, split)


def counts_from_shard(path: Path, seed: int, val_fraction: float) -> ShardCounts:
    """Count a shard's samples from its own ids, masks and offsets (no hidden state is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        layout = shard_layout(f)
        ids = f.get_tensor("input_ids").numpy()
        mask = f.get_tensor("loss_mask").numpy()
    o = layout.offsets
    return count_samples(((sid, ids[o[k]:o[k + 1]], mask[o[k]:o[k + 1]]) for k, sid in enumerate(layout.ids)),
                         seed, val_fraction)
