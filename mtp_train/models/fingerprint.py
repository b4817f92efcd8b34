"""A fast fingerprint of a checkpoint's weights, recorded in manifests so later stages can refuse other weights.

Hashing every byte of a 140 GB checkpoint takes minutes, and the fingerprint is computed by every
precompute, train and export run. Instead, for each `*.safetensors` file (sorted by name) we hash:

* its file name and size;
* its JSON header (every tensor's name, dtype, shape and byte offsets, plus the metadata);
* the sha256 of the first and of the last 1 MiB of its data section.

That reads about 2 MiB per file. It changes when tensors are added, removed, renamed, re-typed or
re-shaped, when a file is re-sharded, and when the values at either end of any file change (a
fine-tune, a re-quantisation or a different checkpoint of the same architecture touch those). It does
not see an edit confined to the middle of a file that keeps every shape; `full=True` hashes all data
for that case. A checkpoint saved twice with the same values gets the same fingerprint, since
safetensors writes tensors in a fixed order.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from mtp_train.models.config import ModelConfigError

SCHEME = "v1"  # prefix of every fingerprint: a changed scheme never compares equal to an old one
_EDGE = 1 << 20  # bytes hashed at each end of a file's data section
_CHUNK = 8 << 20  # read size when hashing everything


def _hash_range(fh, start: int, length: int, chunk: int = _CHUNK) -> bytes:
    """sha256 of `length` bytes of `fh` from `start`."""
    h = hashlib.sha256()
    fh.seek(start)
    left = length
    while left > 0:
        block = fh.read(min(chunk, left))
        if not block:
            break
        h.update(block)
        left -= len(block)
    return h.digest()


def _data_end(header: bytes, path: Path) -> int:
    """Where the last tensor of a safetensors header ends, relative to the data section."""
    try:
        entries = json.loads(header)
        return max((int(v["data_offsets"][1]) for k, v in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise ModelConfigError(f"{path}: unreadable safetensors header; the file is damaged or not safetensors: "
                               "copy, fetch or save it again") from None


def file_fingerprint(path: str | Path, full: bool = False) -> bytes:
    """Digest of one safetensors file: name, size, header, and sha256 of the first/last MiB (all data if full)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    h.update(path.name.encode() + b"\0" + str(size).encode() + b"\0")
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ModelConfigError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        data_start = 8 + header_len
        if data_start > size:
            raise ModelConfigError(f"{path}: header length {header_len} exceeds the file size {size}: the file is "
                                   "truncated or not safetensors; copy, fetch or save it again")
        header = fh.read(header_len)
        h.update(header)
        data_len = size - data_start
        want = _data_end(header, path)
        if data_len < want:
            # A cut file would otherwise get a new fingerprint and be refused as "other weights".
            raise ModelConfigError(f"{path}: truncated ({data_len} bytes of tensor data, its header describes "
                                   f"{want}); copy, fetch or save it again")
        if full or data_len <= 2 * _EDGE:
            h.update(_hash_range(fh, data_start, data_len))
        else:
            h.update(_hash_range(fh, data_start, _EDGE))
            h.update(_hash_range(fh, size - _EDGE, _EDGE))
    return h.digest()


def weights_fingerprint(model_dir: str | Path, full: bool = False) -> str:
    """Fingerprint of every `*.safetensors` file in `model_dir`, as `"v1:<sha256 hex>"` (see the module doc)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise ModelConfigError(f"no *.safetensors files in {model_dir}; cannot fingerprint the weights")
    h = hashlib.sha256()
    for f in files:
        h.update(file_fingerprint(f, full=full))
    mode = "full" if full else "edges"
    return f"{SCHEME}-{mode}:{h.hexdigest()}"
