"""`mtp-precompute` end to end on the real default model (small): manifest, read-back, resume, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mtp_train.cli.common import CONF_DIR
from mtp_train.cli.precompute import precompute_main
from mtp_train.config import register_configs
from mtp_train.engine import prefill_hidden
from mtp_train.models import load_model
from mtp_train.precompute import PrecomputedDataset

FIXTURES = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.slow


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("precompute", overrides=overrides)


TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "glass"]


def test_precompute_command_writes_readable_shards_and_resumes(default_model_dir, tmp_path):
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Tell me one fact about {t}."},
        {"role": "assistant", "content": f"Here is one fact about {t}: it is older than most people think."}]}) + "\n"
        for i, t in enumerate(TOPICS)))
    out = tmp_path / "pc"
    overrides = [f"model.path={default_model_dir}", f"data.paths=[{data}]", f"out={out}",
                 "max_seq_len=96", "shard_tokens=120", "progress=false", "val_fraction=0.0"]
    res = precompute_main(_cfg(overrides))
    assert res["samples"] == len(TOPICS) and res["shards"] >= 3
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"]["hidden_size"] == 576 and manifest["hidden"]["dtype"] == "bfloat16"
    saved = OmegaConf.load(out / "config.yaml")  # the resolved config of the run, with its overrides
    assert saved.out == str(out) and saved.max_seq_len == 96 and saved.shard_tokens == 120

    model = load_model(default_model_dir, dtype="float32")
    ds = PrecomputedDataset(out, split="all", expect_target_fingerprint=manifest["target"]["fingerprint"])
    assert len(ds) == res["samples"]
    for i in range(len(ds)):
        item = ds[i]
        ref = prefill_hidden(model, [item["input_ids"].tolist()]).hidden.to(torch.bfloat16)
        torch.testing.assert_close(item["hidden"].float(), ref.float(), rtol=0, atol=2e-2)
        assert item["loss_mask"].sum() > 0

    before = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    (out / "manifest.json").unlink()
    res2 = precompute_main(_cfg(overrides))  # resumes: every shard verified and kept
    assert res2["samples"] == res["samples"]
    assert {p.name: p.read_bytes() for p in out.glob("shard-*")} == before


def test_precompute_command_line_errors(tmp_path):
    base = [sys.executable, "-m", "mtp_train.cli.precompute", f"out={tmp_path / 'x'}"]
    r = subprocess.run(base + ["max_seq_lenn=3"], capture_output=True, text=True)
    assert r.returncode != 0 and "max_seq_lenn" in r.stderr
    r = subprocess.run(base + [f"model.path={tmp_path / 'nope'}", "model.fetch=null",
                               f"data.paths=[{FIXTURES / 'messages.jsonl'}]"], capture_output=True, text=True)
    assert r.returncode == 2 and "nope" in r.stderr and "Traceback" not in r.stderr
