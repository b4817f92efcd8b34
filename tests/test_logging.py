"""Run logging (train/logging.py): the W&B mode without a key, and metrics.jsonl on resume."""

from __future__ import annotations

import json
import logging

import pytest

from mtp_train.cli.common import has_wandb_key
from mtp_train.config import WandbConfig
from mtp_train.train.logging import RunLogger, resolve_wandb_mode


def test_online_without_a_key_falls_back_to_offline(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not has_wandb_key()
    with caplog.at_level(logging.WARNING, logger="mtp_train.train.logging"):
        assert resolve_wandb_mode("online", has_wandb_key()) == "offline"
    assert "no API key" in caplog.text and "offline" in caplog.text
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert has_wandb_key() and resolve_wandb_mode("online", has_wandb_key()) == "online"
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert has_wandb_key()
    assert resolve_wandb_mode("disabled", True) == "disabled"
    with pytest.raises(ValueError, match="wandb.mode"):
        resolve_wandb_mode("cloud", True)


def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path, caplog):
    rows = [json.dumps({"step": s, "train/loss": 1.0 / s}) for s in (1, 2, 3)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(rows) + "\n" + '{"step": 4, "train/lo')  # killed mid-write
    with caplog.at_level(logging.WARNING, logger="mtp_train.train.logging"):
        RunLogger(enabled=True, out=tmp_path, wandb=WandbConfig(), mode="disabled", config={}, resume_step=2)
    assert metrics.read_text() == "\n".join(rows[:2]) + "\n"
    assert f"{metrics}:4: dropping a torn last line" in caplog.text
    # A bad line that is not the last one is damage, named by line.
    metrics.write_text(rows[0] + "\nnot json\n" + rows[1] + "\n")
    with pytest.raises(ValueError, match=rf"{metrics}:2: not a metrics record"):
        RunLogger(enabled=True, out=tmp_path, wandb=WandbConfig(), mode="disabled", config={}, resume_step=2)
