"""optim.schedule: the learning rate's decay after the warmup, cosine (the default) or linear (speculators' default
scheduler): its multipliers, the rates a real optimiser gets through the trainer's `make_lr_scheduler`, its state
in a checkpoint, and the key's check."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from mtp_train.config import CONF_DIR, ConfigError, OptimConfig, TrainConfig, register_configs, typed
from mtp_train.train.deepspeed_config import WarmupCosine, WarmupDecay, make_lr_scheduler


def test_linear_decay_values():
    fn = WarmupDecay(warmup_steps=4, total_steps=14, min_ratio=0.0, shape="linear")
    assert [fn(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the same warmup as the cosine's
    assert [fn(s) for s in (4, 6, 9, 13, 14, 100)] == pytest.approx([1.0, 0.8, 0.5, 0.1, 0.0, 0.0])
    floor = WarmupDecay(4, 14, 0.2, "linear")  # a floor: min_ratio + (1 - min_ratio)(1 - p)
    assert [floor(s) for s in (4, 9, 14, 50)] == pytest.approx([1.0, 0.6, 0.2, 0.2])
    assert WarmupDecay(0, 10, 0.0, "linear")(0) == pytest.approx(1.0)
    cosine = WarmupDecay(4, 14, 0.1)  # the default shape is the cosine, as before
    assert [cosine(s) for s in range(20)] == [WarmupCosine(4, 14, 0.1)(s) for s in range(20)]
    with pytest.raises(ValueError, match="optim.schedule='step'"):
        WarmupDecay(4, 14, 0.0, "step")


def test_linear_decay_is_transformers_linear_schedule_after_the_warmup():
    """speculators' trainer builds `get_linear_schedule_with_warmup(optimizer, warmup, total)`: after the warmup
    ours gives the same rate at every step (its warmup starts at lr / warmup where theirs starts at 0)."""
    from transformers import get_linear_schedule_with_warmup

    theirs = get_linear_schedule_with_warmup(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 5, 40)
    ours = WarmupDecay(5, 40, 0.0, "linear")
    for s in range(45):
        if s >= 5:
            assert ours(s) == pytest.approx(theirs.lr_lambdas[0](s), abs=1e-12), s


def _rates(optim: OptimConfig, steps: int, max_steps: int) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=optim.lr)
    sched = make_lr_scheduler(optim, max_steps)(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def test_the_trainers_scheduler_follows_optim_schedule():
    linear = _rates(OptimConfig(lr=1e-3, warmup_steps=2, min_lr_ratio=0.0, schedule="linear"), 12, 10)
    assert linear == pytest.approx([5e-4, 1e-3, 1e-3, 8.75e-4, 7.5e-4, 6.25e-4, 5e-4, 3.75e-4, 2.5e-4, 1.25e-4, 0.0,
                                    0.0])
    cosine = _rates(OptimConfig(lr=1e-3, warmup_steps=2, min_lr_ratio=0.0), 12, 10)
    assert cosine[:3] == linear[:3] and cosine[6] == pytest.approx(5e-4) and cosine[4] > linear[4]


def test_the_schedule_shape_is_kept_in_the_schedulers_state():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=1e-3)
    state = make_lr_scheduler(OptimConfig(schedule="linear"), 10)(opt).state_dict()
    assert state["lr_lambdas"][0]["shape"] == "linear"


def test_optim_schedule_is_checked_and_composes():
    with pytest.raises(ConfigError, match=r"optim.schedule='step': give one of cosine \| linear"):
        OptimConfig(schedule="step")
    assert OptimConfig().schedule == "cosine"
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["optim.schedule=linear"])
        default = compose("train")
    assert typed(cfg, TrainConfig).optim.schedule == "linear" and typed(default, TrainConfig).optim.schedule == "cosine"
