"""The per-request file the vLLM connector writes and the driver turns into shards: one conversation's capture.

A capture folder (the connector's `spool_dir`) holds `req-<sha256(sample id)[:32]>.safetensors` files, each with
`hidden_states` [n, k, H] (vLLM's aux ids in the order of `layer_ids`, in the engine's dtype) and `token_ids`
int64 [n] (the ids vLLM ran); the metadata names the sample id, `layer_ids` (JSON) and the run's `tag` (what
the driver made the request with: a file of other settings is captured again). Files are written to a
temporary sibling and renamed, so a file that exists is whole: a run killed midway leaves only whole files, which
the next run keeps. Imports only the standard library, torch and safetensors (it runs inside vLLM's processes).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PREFIX, SUFFIX, TMP = "req-", ".safetensors", ".tmp-"
# Bytes of a capture file's safetensors header besides its sample id, tag and layer ids: the two tensors' names,
# dtypes, shapes and offsets, the metadata's keys, the length prefix and the alignment padding (about 300 in fact).
HEADER_BOUND = 1024


def file_name(sample_id: str) -> str:
    """The capture file of a sample id (a hash: ids may hold any character)."""
    return f"{PREFIX}{hashlib.sha256(sample_id.encode()).hexdigest()[:32]}{SUFFIX}"


@dataclass
class Captured:
    """One request's capture: token_ids (n,) int64 and hidden_states (n, k, H), k = len(layer_ids)."""

    sample_id: str
    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    layer_ids: list[int]


def write_capture(folder: str | Path, sample_id: str, token_ids: torch.Tensor, hidden_states: torch.Tensor,
                  layer_ids: list[int], tag: str = "") -> Path:
    """Write one capture atomically (temporary sibling, fsync, rename); returns its path.

    Args:
        folder: the capture folder (created if missing).
        sample_id: the conversation's sample id (stored in the metadata).
        token_ids: (n,) the ids the engine ran.
        hidden_states: (n, k, H) on the CPU.
        layer_ids: vLLM's aux ids of the k states.
        tag: the driver's tag of the run (stored).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(sample_id)
    tmp = folder / f"{TMP}{os.getpid()}-{path.name}"
    save_file({"hidden_states": hidden_states.contiguous(), "token_ids": token_ids.to(torch.int64).contiguous()},
              str(tmp), metadata={"sample_id": sample_id, "layer_ids": json.dumps([int(i) for i in layer_ids]),
                                  "tag": tag})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_capture(path: str | Path) -> Captured:
    """Read a capture file (the whole of it; one conversation)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return Captured(sample_id=meta["sample_id"], token_ids=f.get_tensor("token_ids"),
                        hidden_states=f.get_tensor("hidden_states"), layer_ids=json.loads(meta["layer_ids"]))


def capture_bound(num_tokens: int, num_layers: int, hidden_size: int, itemsize: int, sample_id: str,
                  tag: str = "") -> int:
    """The most bytes the capture file of a `num_tokens`-token request can take on disk (its temporary as well):
    the states (n · k · H · itemsize), the token ids (8 · n) and the header (the sample id and tag as JSON, at most
    6 bytes per byte escaped, 8 bytes per layer id, and `HEADER_BOUND`).

    Args:
        num_tokens: the request's prompt tokens (a capture holds every prompt token).
        num_layers: k, the captured layers (vLLM's aux ids).
        hidden_size: H.
        itemsize: bytes per value of the served dtype.
        sample_id: the name the request gives its capture.
        tag: the run's tag.
    """
    text = 6 * (len(sample_id.encode()) + len(tag.encode())) + 8 * num_layers
    return num_tokens * (num_layers * hidden_size * itemsize + 8) + text + HEADER_BOUND


def torn_of(folder: str | Path, sample_id: str) -> list[Path]:
    """The temporaries of one sample's capture in `folder` (a writer killed midway, or one still writing)."""
    return list(Path(folder).glob(f"{TMP}*-{file_name(sample_id)}"))


def remove_torn(folder: str | Path) -> None:
    """Remove temporaries a killed writer left (a whole file is never a temporary)."""
    for tmp in Path(folder).glob(f"{TMP}*"):
        tmp.unlink(missing_ok=True)
