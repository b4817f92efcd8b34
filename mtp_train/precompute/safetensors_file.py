"""Writing one safetensors file byte for byte the same on every run (shards, counts files, token counts).

Kept apart from `shards` and `manifest` so that both write through it without importing each other.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import torch

# torch dtype → the safetensors header's dtype name
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
             torch.int32: "I32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}


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
        header[k] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [start, start + n]}
        start += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # spaces pad the header so the data starts 8-byte aligned
    h = hashlib.sha256()
    for block in (struct.pack("<Q", len(raw)), raw):
        fh.write(block)
        h.update(block)
    for k in order:
        if tensors[k].numel() == 0:  # no bytes (and a view of none cannot be taken)
            continue
        buf = tensors[k].contiguous().view(-1).view(torch.uint8).numpy()  # the tensor's own memory, no copy
        fh.write(memoryview(buf))
        h.update(buf)
    return h.hexdigest()
