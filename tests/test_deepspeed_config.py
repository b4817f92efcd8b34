"""The DeepSpeed config of a run (every preset × head composes; what the trainer cannot honour is refused) and the
learning-rate schedule."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mtp_train.config import CONF_DIR, TrainConfig, register_configs, typed
from mtp_train.train.deepspeed_config import WarmupCosine, build_ds_config

CONF = Path(CONF_DIR)


def _cfg(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=overrides)


def test_warmup_cosine_schedule():
    fn = WarmupCosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [fn(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert fn(4) == pytest.approx(1.0) and fn(9) == pytest.approx(0.55) and fn(14) == pytest.approx(0.1)
    assert fn(100) == pytest.approx(0.1)
    assert WarmupCosine(0, 10, 0.0)(0) == pytest.approx(1.0)


@pytest.mark.parametrize("head", sorted(p.stem for p in (CONF / "head").glob("*.yaml")))
@pytest.mark.parametrize("zero", sorted(p.stem for p in (CONF / "deepspeed").glob("*.yaml")))
def test_every_head_and_deepspeed_preset_composes_into_a_deepspeed_config(head, zero):
    cfg = _cfg([f"head={head}", f"deepspeed={zero}", "train.grad_accum=4", "optim.grad_clip=0.7"])
    assert cfg.head.type == head and cfg.data.dir and cfg.deepspeed.name == zero
    c = typed(cfg, TrainConfig)
    ds = build_ds_config(c.deepspeed, optim=c.optim, grad_accum=c.train.grad_accum, bf16=False)
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.7
    assert ds["bf16"]["enabled"] is False and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["zero_optimization"]["stage"] == int(zero.removeprefix("zero"))
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["lr"] == cfg.optim.lr
    assert "auto" not in json.dumps(ds) and "name" not in ds and "extra" not in ds


def test_deepspeed_settings_the_trainer_cannot_honour_are_refused():
    c = typed(_cfg([]), TrainConfig)

    def build(**change):
        return build_ds_config(dataclasses.replace(c.deepspeed, **change), optim=c.optim,
                               grad_accum=c.train.grad_accum, bf16=False)

    with pytest.raises(ValueError, match="stage 3"):
        build(zero_optimization={"stage": 3})
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        build(train_micro_batch_size_per_gpu=4)
    with pytest.raises(ValueError, match="scheduler"):
        build(extra={"scheduler": {"type": "WarmupLR"}})
    with pytest.raises(ValueError, match="deepspeed.steps_per_print"):
        build(steps_per_print="auto")
