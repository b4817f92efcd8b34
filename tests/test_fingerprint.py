"""The weights fingerprint: stable for the same weights, changed by real weight edits, cheap for big files."""

from __future__ import annotations

import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from mtp_train.models import ModelConfigError
from mtp_train.models.fingerprint import weights_fingerprint


def _data_start(path) -> int:
    with path.open("rb") as fh:
        return 8 + struct.unpack("<Q", fh.read(8))[0]


def _poke(path, offset: int) -> None:
    """Change one byte at `offset` (negative: from the end)."""
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_same_weights_same_fingerprint(tiny_checkpoints, tmp_path):
    src, hf = tiny_checkpoints["llama"]
    fp = weights_fingerprint(src)
    assert fp.startswith("v1-edges:") and fp == weights_fingerprint(src)
    shutil.copytree(src, tmp_path / "copy")
    assert weights_fingerprint(tmp_path / "copy") == fp
    hf.save_pretrained(tmp_path / "resaved", safe_serialization=True)  # same values written again
    assert weights_fingerprint(tmp_path / "resaved") == fp
    assert weights_fingerprint(tiny_checkpoints["qwen2"][0]) != fp


def test_weight_change_in_first_mib_changes_it(tiny_checkpoints, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["llama"][0], d)
    before = weights_fingerprint(d)
    f = d / "model.safetensors"
    _poke(f, _data_start(f) + 1000)
    assert weights_fingerprint(d) != before


def test_large_file_hashes_the_edges(tmp_path):
    # 3 MiB of data: the first and last MiB are hashed, the middle only with full=True.
    d = tmp_path / "big"
    d.mkdir()
    f = d / "model.safetensors"
    save_file({"a.weight": torch.arange(3 * 2**18, dtype=torch.float32)}, str(f))
    edges, full = weights_fingerprint(d), weights_fingerprint(d, full=True)
    start = _data_start(f)

    _poke(f, start + 3 * 2**19)  # the middle
    assert weights_fingerprint(d) == edges
    assert weights_fingerprint(d, full=True) != full
    _poke(f, start + 3 * 2**19)  # undo
    assert weights_fingerprint(d, full=True) == full

    _poke(f, -1)  # the last byte
    assert weights_fingerprint(d) != edges
    _poke(f, -1)

    # Same bytes under another tensor name, or another shape: the header differs.
    save_file({"b.weight": torch.arange(3 * 2**18, dtype=torch.float32)}, str(f))
    assert weights_fingerprint(d) != edges
    save_file({"a.weight": torch.arange(3 * 2**18, dtype=torch.float32).view(2**18, 3)}, str(f))
    assert weights_fingerprint(d) != edges


def test_sharded_files_all_count(tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    save_file({"a": torch.ones(4)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(4)}, str(d / "model-00002-of-00002.safetensors"))
    fp = weights_fingerprint(d)
    save_file({"b": torch.full((4,), 2.0)}, str(d / "model-00002-of-00002.safetensors"))
    assert weights_fingerprint(d) != fp


def test_folder_without_safetensors(tmp_path):
    with pytest.raises(ModelConfigError, match=r"no \*.safetensors files"):
        weights_fingerprint(tmp_path)


def test_truncated_file_is_named_not_fingerprinted(tmp_path):
    """A cut file would get a new fingerprint and be refused as "other weights" far from the cause."""
    d = tmp_path / "cut"
    d.mkdir()
    f = d / "model.safetensors"
    save_file({"a.weight": torch.ones(1024)}, str(f))
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelConfigError, match=rf"{f}: truncated \(\d+ bytes of tensor data, its header describes"):
        weights_fingerprint(d)
