"""`make bench-memory`'s disk figure: the per-token formula against the bytes of real precompute shards, and the aux
layers each shipped head type stores."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

from bench.memory_plan import disk_bytes_per_token, disk_total, stored_aux_layers
from mtp_train.config import PrecomputeConfig
from mtp_train.models import load_model
from mtp_train.precompute import precompute
from tests._precompute_worker import make_samples

pytestmark = pytest.mark.usefixtures("one_thread")
AUX = [1, 2]  # two aux layers of the tiny 3-layer target (hidden_states numbering)
KW = dict(tokenizer_fingerprint="tok-fp", chat_template_fingerprint="tmpl-fp", data_info={"source": "random"})


def shard_bytes(path: Path) -> tuple[int, int, int, int]:
    """(tokens, samples, header bytes, tensor bytes) of one shard: the safetensors header is an 8-byte length and the
    JSON it gives; everything after it is tensor data."""
    with path.open("rb") as fh:
        header = 8 + struct.unpack("<Q", fh.read(8))[0]
    with safe_open(str(path), "pt") as f:
        tokens = f.get_slice("input_ids").get_shape()[0]
        samples = f.get_slice("offsets").get_shape()[0] - 1
    return tokens, samples, header, path.stat().st_size - header


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3", "float32"])
@pytest.mark.parametrize("aux", [[], AUX])
def test_formula_is_the_bytes_of_real_shards(tiny_checkpoints, tmp_path, storage, aux):
    """Every shard's tensor bytes are tokens × the formula plus 8 bytes of offsets per sample (and one), exactly; the
    whole file per token is within the safetensors header of it."""
    model_dir = tiny_checkpoints["llama"][0]
    model = load_model(model_dir, dtype="float32", backend="torch")
    cfg = PrecomputeConfig(out=str(tmp_path), progress=False, val_fraction=0.0, shard_tokens=256, batch_tokens=128,
                           aux_layers=list(aux), hidden_dtype=storage)
    precompute(model, make_samples(24, seed=3), cfg, model_dir=model_dir, **KW)
    per_token = disk_bytes_per_token(model.args.hidden_size, len(aux), storage)
    # the shards the manifest names (a folder also holds token counts per shard and in all, per folder not per token)
    shards = [tmp_path / s["file"] for s in json.loads((tmp_path / "manifest.json").read_text())["shards"]]
    assert len(shards) > 1
    for shard in shards:
        tokens, samples, header, data = shard_bytes(shard)
        assert data == tokens * per_token + 8 * (samples + 1), shard.name
        overhead = (header + 8 * (samples + 1)) / tokens  # the header and offsets, spread over the shard's tokens
        assert per_token <= (data + header) / tokens <= per_token + overhead + 1e-9
    totals = json.loads((tmp_path / "manifest.json").read_text())["totals"]
    assert totals["tokens"] == sum(shard_bytes(p)[0] for p in shards)


def test_formula_by_hand():
    """5 + 2H(1 + k) in bf16 and fp16, 5 + (H + 4)(1 + k) in fp8, 5 + 4H(1 + k) in fp32."""
    for h, k in [(576, 0), (576, 3), (4096, 3), (7168, 5)]:
        assert disk_bytes_per_token(h, k, "bfloat16") == 5 + 2 * h * (1 + k)
        assert disk_bytes_per_token(h, k, "float16") == 5 + 2 * h * (1 + k)
        assert disk_bytes_per_token(h, k, "float8_e4m3") == 5 + (h + 4) * (1 + k)
        assert disk_bytes_per_token(h, k, "float32") == 5 + 4 * h * (1 + k)
    total = disk_total(10**6, 2048, 4096, 3)
    assert round(total["bfloat16"] / 1e12, 1) == 67.1
    assert round(total["float8_e4m3"] / 1e12, 1) == 33.6


def test_shipped_head_types_store_their_default_aux_layers():
    """mtp and eagle1 read the final hidden only; eagle3 stores EAGLE-3's three layers, the block drafters five."""
    assert stored_aux_layers("mtp", 30) == []
    assert stored_aux_layers("eagle1", 30) == []
    assert stored_aux_layers("eagle3", 30) == [2, 15, 27]
    assert len(stored_aux_layers("dflash", 30)) == 5
    assert len(stored_aux_layers("dspark", 32)) == 5
