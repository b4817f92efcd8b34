"""The capture through a real vLLM (its CPU build, in its own venv): the default model's hidden states as vLLM
computes them land in the shards our engine writes, within fp32 reordering error. Skipped when there is no vLLM
venv (`make vllm-venv`; or VLLM_PYTHON=<its python>)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mtp_train.config import PrecomputeConfig
from mtp_train.config.data import DataConfig
from mtp_train.config.model import ModelConfig
from mtp_train.data.chat import load_tokenizer
from mtp_train.models import load_model
from mtp_train.precompute.pipeline import run_precompute
from mtp_train.precompute.vllm_backend import precompute_vllm

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")).absolute()
AUX = [0, 2, 15, 30]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv, or VLLM_PYTHON)")
def test_vllm_capture_matches_our_engine(default_model_dir, tmp_path):
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Name {i + 2} colours."},
        {"role": "assistant", "content": "Red, green and blue are three of them."}]}) + "\n" for i in range(2)))

    def cfg(out: Path, **kw) -> PrecomputeConfig:
        return PrecomputeConfig(model=ModelConfig(path=str(default_model_dir), dtype="float32"),
                                data=DataConfig(paths=[str(convs)]), out=str(out), aux_layers=AUX,
                                hidden_dtype="float32", val_fraction=0.0, progress=False, **kw)

    ours = cfg(tmp_path / "ours")
    run_precompute(load_model(default_model_dir, dtype="float32"), load_tokenizer(default_model_dir),
                   default_model_dir, ours, rank=0, world=1, tp_rank=0, tp_size=1, config_dict={})
    theirs = cfg(tmp_path / "vllm", backend="vllm", vllm_python=str(VLLM_PYTHON))
    precompute_vllm(theirs, environ=dict(os.environ), config_dict={})
    name = "shard-r0-00000.safetensors"
    with safe_open(str(tmp_path / "ours" / name), "pt") as a, safe_open(str(tmp_path / "vllm" / name), "pt") as b:
        assert a.metadata()["sample_ids"] == b.metadata()["sample_ids"]
        for key in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(a.get_tensor(key), b.get_tensor(key))
        for key in ("hidden", "aux_hidden"):
            torch.testing.assert_close(b.get_tensor(key), a.get_tensor(key), rtol=1e-3, atol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv, or VLLM_PYTHON)")
def test_a_model_vllm_cannot_serve_is_one_line(tmp_path):
    from mtp_train.precompute import PrecomputeError
    from tests.conftest import make_chat_target

    target = make_chat_target(tmp_path / "target", num_layers=2)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    convs = tmp_path / "convs.jsonl"
    convs.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Tell me about owls."},
                                                         {"role": "assistant", "content": "Owls fly."}]}) + "\n")
    cfg = PrecomputeConfig(model=ModelConfig(path=str(target), dtype="float32", fetch=None),
                           data=DataConfig(paths=[str(convs)]), out=str(tmp_path / "out"), backend="vllm",
                           vllm_python=str(VLLM_PYTHON), progress=False)
    with pytest.raises(PrecomputeError, match=r"vLLM cannot serve .*NoSuchForCausalLM.* are not supported") as e:
        precompute_vllm(cfg, environ=dict(os.environ), config_dict={})
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
