"""bench/common.py: the benches' default head is the demo's, read from the demo's own record or config."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from bench import common
from bench.common import demo_head_dir, head_run_args, parse_head_run


def test_the_default_head_follows_the_demo_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/demo here: the head is where the demo's training will write it
    cfg = OmegaConf.load(common.ROOT / "conf" / "demo.yaml")
    steps = [o.split("=", 1)[1] for o in cfg.train if o.startswith("train.max_steps=")]
    assert len(steps) == 1
    assert demo_head_dir() == f"{cfg.out}/train/heads/step-{steps[0]}"


def test_a_finished_demo_s_recorded_head_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "stages.json").write_text(
        json.dumps({"train": {"head_dir": "runs/demo/train/heads/step-77", "minutes": 1.0}}))
    assert demo_head_dir() == "runs/demo/train/heads/step-77"


def test_a_demo_config_without_steps_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "demo.yaml"
    conf.write_text("out: runs/x\ntrain:\n  - head=mtp\n")
    with pytest.raises(ValueError, match=r"demo\.yaml: .*train\.max_steps"):
        demo_head_dir(conf)



def test_parsing_fills_the_default_head_and_keeps_a_given_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "stages.json").write_text(json.dumps({"train": {"head_dir": "runs/demo/h"}}))
    assert parse_head_run(head_run_args(None), []).head == "runs/demo/h"
    assert parse_head_run(head_run_args(None), ["--head", "mine"]).head == "mine"
