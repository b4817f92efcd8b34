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


def remove_torn(folder: str | Path) -> None:
    """Remove temporaries a killed writer left (a whole file is never a temporary)."""
    for tmp in Path(folder).glob(f"{TMP}*"):
        tmp.unlink(missing_ok=True)
