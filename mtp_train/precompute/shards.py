"""Shard files on disk: writing one (safetensors, then its sidecar) and recognising one that is already done.

Each shard is written to `.tmp-<name>`, fsynced and renamed; then its sidecar `<name>.json` (sha256, counts, ids
hash, plan hash) is written the same way. A shard counts as done only when its sidecar matches the plan, so a
re-run skips exactly the shards a previous run finished (see `mtp_train.precompute.plan` for why the plans of
two runs agree). The tensors a shard holds are listed in `mtp_train.precompute.manifest`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch

from mtp_train.fileio import atomic_write, sha256_file
from mtp_train.precompute.manifest import FORMAT_VERSION, ShardInfo, read_json, write_json
from mtp_train.precompute.plan import ShardPlan

# safetensors dtype names of the tensors a shard can hold
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


def _sidecar(plan: ShardPlan, sha256: str, size: int) -> dict[str, Any]:
    info = ShardInfo(file=plan.name, rank=plan.rank, index=plan.index, samples=len(plan.rows), tokens=plan.tokens,
                     loss_tokens=plan.loss_tokens, sha256=sha256, bytes=size)
    return {**info.__dict__, "format_version": FORMAT_VERSION, "first_id": plan.rows[0].id,
            "last_id": plan.rows[-1].id, "ids_sha256": plan.ids_sha256, "plan_sha256": plan.plan_sha256}


def finished_shard(out_dir: Path, plan: ShardPlan, verify: bool) -> ShardInfo | None:
    """The shard's info if file + sidecar exist and match the plan (and the file's sha256 when verify)."""
    path = out_dir / plan.name
    side = sidecar_path(path)
    if not (path.is_file() and side.is_file()):
        return None
    try:
        d = read_json(side)
        info = ShardInfo.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # torn or foreign sidecar: redo the shard
    same = (d.get("format_version") == FORMAT_VERSION and d.get("plan_sha256") == plan.plan_sha256
            and d.get("ids_sha256") == plan.ids_sha256 and info.samples == len(plan.rows)
            and info.tokens == plan.tokens and info.loss_tokens == plan.loss_tokens
            and info.bytes == path.stat().st_size)
    if not same or (verify and sha256_file(path) != info.sha256):
        return None
    return info


def write_safetensors(fh: Any, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write `tensors` to the open binary file `fh` in the safetensors format; returns the bytes' sha256.

    Written here rather than with `safetensors.torch.save_file` because the library orders the metadata
    map arbitrarily (so two runs would not give byte-identical shards) and first copies every tensor to
    a bytes object. Tensors go in order of decreasing element size, then name (as the library does), so
    each is naturally aligned after the 8-byte aligned header.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    start = 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [start, start + n]}
        start += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # spaces pad the header so the data starts 8-byte aligned
    h = hashlib.sha256()
    for block in (struct.pack("<Q", len(raw)), raw):
        fh.write(block)
        h.update(block)
    for k in order:
        buf = tensors[k].contiguous().view(-1).view(torch.uint8).numpy()  # the tensor's own memory, no copy
        fh.write(memoryview(buf))
        h.update(buf)
    return h.hexdigest()


def write_shard(out_dir: Path, plan: ShardPlan, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str]) -> ShardInfo:
    """Atomically write one shard, then its sidecar (which is what marks the shard as done)."""
    path = out_dir / plan.name
    meta = {**metadata, "sample_ids": json.dumps([r.id for r in plan.rows])}
    digest: list[str] = []

    def write(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            digest.append(write_safetensors(fh, tensors, meta))

    atomic_write(path, write)
    side = _sidecar(plan, digest[0], path.stat().st_size)
    write_json(sidecar_path(path), side)
    return ShardInfo.from_dict(side)
