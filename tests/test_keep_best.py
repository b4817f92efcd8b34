"""`train.keep_best`: heads/best is the best evaluated head by a logged validation metric, and resume keeps it.

Tiny runs on test_trainer.py's random target and precompute folder (its module-scoped `setup` fixture).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtp_train.cli.train import train_main
from mtp_train.config import ConfigError
from mtp_train.export import export_head, verify_round_trip
from mtp_train.heads import load_head
from mtp_train.train.checkpoint import latest_tag
from tests.conftest import metrics_by_step
from tests.test_trainer import SimulatedCrash, _cfg, _overrides, _train, setup  # noqa: F401 (setup: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _best_of(out: Path, metric: str, mode: str) -> tuple[int, float]:
    """(step, value) of the best `metric` in metrics.jsonl (the earliest on a tie)."""
    logged = [(s, row[metric]) for s, row in sorted(metrics_by_step(out).items()) if metric in row]
    assert len(logged) >= 3, logged  # enough evaluations for the choice to mean something
    pick = min if mode == "min" else max
    value = pick(v for _, v in logged)
    return next(s for s, v in logged if v == value), value


def _assert_best_is(out: Path, target: Path, metric: str, mode: str) -> int:
    """heads/best is a loadable copy of the head of the step metrics.jsonl says was best; returns that step."""
    step, value = _best_of(out, metric, mode)
    best, source = out / "heads" / "best", out / "heads" / f"step-{step}"
    record = json.loads((best / "best.json").read_text())
    assert record == {"metric": metric, "mode": mode, "value": value, "step": step, "head": f"step-{step}"}
    for name in ("model.safetensors", "config.json", "train_config.yaml"):  # byte for byte: checksums hold
        assert (best / name).read_bytes() == (source / name).read_bytes(), name
    head = load_head(best, target)  # checks the weights' sha256 and the target's fingerprint
    for k, v in load_head(source, target).state_dict().items():
        torch.testing.assert_close(head.state_dict()[k], v, rtol=0, atol=0)
    return step


def _improvements(out: Path, metric: str) -> list[tuple[int, float, float]]:
    """(step, best/<metric>, best/step) of every improvement logged."""
    return [(s, row[f"best/{metric}"], row["best/step"]) for s, row in sorted(metrics_by_step(out).items())
            if f"best/{metric}" in row]


def test_heads_best_is_the_head_of_the_lowest_eval_loss(setup, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    run = _train(setup, out, "train.max_steps=8", "train.eval_every=2", "train.eval_batches=2",
                 "train.keep_best=eval/loss")
    step = _assert_best_is(out, setup.target, "eval/loss", "min")
    # best/eval/loss is logged at every improvement, as the running minimum of the evaluations up to it
    m = metrics_by_step(out)
    running, expected = float("inf"), []
    for s in sorted(m):
        if "eval/loss" in m[s] and m[s]["eval/loss"] < running:
            running = m[s]["eval/loss"]
            expected.append((s, running, float(s)))
    assert _improvements(out, "eval/loss") == expected and expected[-1][0] == step
    assert run.result["head_dir"].endswith("step-8")
    exported = export_head(out / "heads" / "best", setup.target, "deepseek-mtp", tmp_path / "export")  # mtp-export's
    assert verify_round_trip(out / "heads" / "best", exported, setup.target) == 0.0
    state = json.loads((out / "checkpoints" / "step-8" / "state.json").read_text())["client"]["best"]
    assert state == {"metric": "eval/loss", "mode": "min", "value": expected[-1][1], "step": step}


def test_resume_compares_against_the_checkpointed_best_and_keeps_heads_best(setup, tmp_path):  # noqa: F811
    # Mode max on eval/loss: the best is an early evaluation (the loss falls as the head learns), made before the
    # step-3 checkpoint; a resumed run that forgot it would take its first evaluation after resuming as the best.
    common = ["train.max_steps=8", "train.eval_every=2", "train.eval_batches=2", "train.save_every=3",
              "train.keep_best=eval/loss", "train.keep_best_mode=max"]
    full = _train(setup, tmp_path / "full", *common)
    with pytest.raises(SimulatedCrash):
        _train(setup, tmp_path / "killed", *common, stop_after=5)
    assert latest_tag(tmp_path / "killed" / "checkpoints") == "step-3"
    resumed = _train(setup, tmp_path / "killed", *common)  # resume=auto
    step = _assert_best_is(resumed.out, setup.target, "eval/loss", "max")
    assert step < 3 and step == _assert_best_is(full.out, setup.target, "eval/loss", "max")
    assert step % 3 != 0  # not a save step: heads/step-N was exported for heads/best alone
    assert _improvements(resumed.out, "eval/loss") == _improvements(full.out, "eval/loss")
    assert all(s < 3 for s, _, _ in _improvements(resumed.out, "eval/loss"))


def test_a_metric_no_evaluation_logs_is_refused_at_start_with_the_valid_names(setup, tmp_path):  # noqa: F811
    cases = {"spec/tau": r"spec_eval.prompts.*valid names: eval/loss, eval/feat_loss",
             "eval/los": r"train.keep_best=eval/los is not a validation metric.*eval/loss.*eval/step0/top1",
             "train/loss": r"valid names: eval/loss"}
    for metric, pattern in cases.items():
        out = tmp_path / metric.replace("/", "-")
        with pytest.raises(ConfigError, match=pattern):
            train_main(_cfg(_overrides(setup, out, f"train.keep_best={metric}")))
        assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()
    with pytest.raises(ConfigError, match=r"eval_batches=0"):
        train_main(_cfg(_overrides(setup, tmp_path / "e0", "train.keep_best=eval/top1", "train.eval_batches=0")))
