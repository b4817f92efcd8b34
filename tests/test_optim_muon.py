"""train.optimizer=muon: torch.optim.Muon on the 2-D weight matrices and AdamW on the rest, under DeepSpeed without
ZeRO (CPU fp32, and bf16 where DeepSpeed keeps fp32 masters): the split, the loss falling, the norm reported, a
checkpoint's resume continuing exactly, and the settings refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from mtp_train.config import ConfigError, DeepSpeedConfig, OptimConfig, TrainConfig
from mtp_train.config.train import LoopConfig
from mtp_train.train.checkpoint import check_resume, load_engine_state, mark_latest, save_engine_state, write_checksums
from mtp_train.train.deepspeed_config import build_ds_config, make_lr_scheduler
from mtp_train.train.deepspeed_setup import prepare_deepspeed, release_deepspeed
from mtp_train.train.optimizers import MuonWithAdamW, build_muon, split_for_muon
from tests.conftest import metrics_by_step
from tests.test_trainer import SimulatedCrash, _train, setup  # noqa: F401 (setup: the module's precompute fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


class Tiny(nn.Module):
    """A head's kinds of parameters: weight matrices, a bias, a norm, a vocabulary-indexed lm_head, a [1, N] row."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 8)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16, bias=False)
        self.lm_head = nn.Linear(16, 24, bias=False)
        self.gate = nn.Parameter(torch.ones(1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, 12) → the mean cross-entropy of (N, 24) logits against a fixed rule of x."""
        logits = self.lm_head(self.gate * torch.tanh(self.up(self.norm(self.fc(x)))))
        return nn.functional.cross_entropy(logits, (x[:, :3].sum(-1) * 4).long().remainder(24))


def test_the_split_puts_matrices_on_muon_and_the_rest_on_adamw():
    parts = split_for_muon(Tiny().named_parameters())
    names = {k: sorted(n for n, _ in v) for k, v in parts.items()}
    assert names == {"muon": ["fc.weight", "up.weight"], "vocab": ["lm_head.weight"],
                     "adamw": ["fc.bias", "gate", "norm.bias", "norm.weight"]}
    opt = build_muon(Tiny(), OptimConfig(lr=1e-3, weight_decay=0.01))
    assert [type(o).__name__ for o in opt.parts] == ["AdamW", "Muon"]
    # group 0 is AdamW's at optim.lr (train/lr); the vocabulary rows and Muon at 10 · lr with Muon's decay
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(1e-3, 0.01), (1e-2, 0.1), (1e-2, 0.1)]
    assert opt.param_groups[2]["adjust_lr_fn"] == "match_rms_adamw" and opt.param_groups[2]["momentum"] == 0.95


@pytest.fixture
def world_of_one():
    os.environ.setdefault("LOCAL_RANK", "0")
    assert prepare_deepspeed(torch.device("cpu"))
    yield
    release_deepspeed()


def _engine(seed: int, bf16: bool = False):
    import deepspeed

    torch.manual_seed(seed)
    module = Tiny()
    optim = OptimConfig(lr=3e-3, warmup_steps=2, grad_clip=1.0)
    cfg = build_ds_config(DeepSpeedConfig(zero_optimization={"stage": 0}), optim=optim, grad_accum=1, bf16=bf16,
                          client_optimizer=True)
    assert "optimizer" not in cfg and cfg["gradient_clipping"] == 0.0
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg,
                                      optimizer=build_muon(module, optim), lr_scheduler=make_lr_scheduler(optim, 40))
    return engine


def _steps(engine, n: int, seed: int, fixed: bool = False) -> list[float]:
    """n optimizer steps on batches of 32 drawn from `seed` (fixed: the same batch every step, to fit); the losses."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(32, 12, generator=g)
    losses = []
    for _ in range(n):
        loss = engine((x if fixed else torch.randn(32, 12, generator=g)).to(dtype))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_muon_under_deepspeed_lowers_the_loss_and_reports_the_norm(world_of_one, bf16):
    engine = _engine(0, bf16)
    start = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    losses = _steps(engine, 30, seed=1, fixed=True)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    norm = engine.get_global_grad_norm()
    assert norm is not None and 0 < float(norm) < float("inf")
    moved = {n for n, p in engine.module.named_parameters() if not torch.equal(p.detach().float(), start[n])}
    assert moved == set(start)  # every group steps
    basic = engine.basic_optimizer
    assert isinstance(basic, MuonWithAdamW)
    muon = basic.parts[1]
    # Muon's parameters are the matrices in their own shapes (fp32 masters under bf16), with their momentum
    assert all(p.ndim == 2 and p.dtype == torch.float32 and "momentum_buffer" in muon.state[p]
               for g in muon.param_groups for p in g["params"])


def test_a_resumed_muon_engine_continues_exactly_as_the_uninterrupted_one(world_of_one, tmp_path):
    a = _engine(0)
    _steps(a, 3, seed=1)
    tag = save_engine_state(a, tmp_path, 3, {"step": 3}, 0, 1, {"type": "tiny"})
    write_checksums(tag)
    mark_latest(tmp_path, 3)
    b = _engine(5)  # other initial weights: everything must come from the files
    assert load_engine_state(b, *check_resume("auto", tmp_path, 1, 0, head_type="tiny"), 0, 1) == {"step": 3}
    assert (b.global_steps, b.get_lr()) == (a.global_steps, a.get_lr())
    assert _steps(a, 3, seed=2) == _steps(b, 3, seed=2)
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    ma, mb = a.basic_optimizer.parts[1], b.basic_optimizer.parts[1]
    for pa, pb in zip(ma.param_groups[0]["params"], mb.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(ma.state[pa]["momentum_buffer"], mb.state[pb]["momentum_buffer"], rtol=0, atol=0)
    # an AdamW engine's checkpoint is not this optimiser's state: refused by name, not half loaded
    with pytest.raises(ValueError, match="resume with the train.optimizer"):
        b.basic_optimizer.load_state_dict(torch.optim.AdamW(Tiny().parameters()).state_dict())


def test_muon_settings_are_refused_by_key():
    with pytest.raises(ConfigError, match="train.optimizer='sgd'"):
        LoopConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match="optim.muon_adjust_lr_fn"):
        OptimConfig(muon_adjust_lr_fn="spectral")
    with pytest.raises(ConfigError, match="optim.muon_lr"):
        OptimConfig(muon_lr=0.0)
    with pytest.raises(ConfigError, match=r"stage=2.*deepspeed=zero0"):
        TrainConfig(train=LoopConfig(optimizer="muon"))
    TrainConfig(train=LoopConfig(optimizer="muon"), deepspeed=DeepSpeedConfig(zero_optimization={"stage": 0}))
    assert OptimConfig(lr=2e-4).muon_peak_lr == pytest.approx(2e-3)


def test_a_muon_run_learns_and_its_resume_reproduces_the_uninterrupted_run(setup, tmp_path):  # noqa: F811
    """mtp-train train.optimizer=muon deepspeed=zero0 on the tiny target: the loss falls, the norm is logged, and a
    run killed after a checkpoint resumes to the uninterrupted run's numbers."""
    steps = 8
    common = ["train.optimizer=muon", "deepspeed=zero0", f"train.max_steps={steps}", "train.save_every=3",
              "optim.lr=3e-3", "optim.warmup_steps=2"]
    full = _train(setup, tmp_path / "full", *common)
    m = metrics_by_step(full.out)
    losses = [m[s]["train/loss"] for s in range(1, steps + 1)]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    assert all(0 < m[s]["train/grad_norm"] < float("inf") for s in m if "train/grad_norm" in m[s])
    with pytest.raises(SimulatedCrash, match="simulated kill"):
        _train(setup, tmp_path / "killed", *common, stop_after=5)
    resumed = _train(setup, tmp_path / "killed", *common)
    b = metrics_by_step(resumed.out)
    for s in range(1, steps + 1):
        for key in ("train/loss", "train/lr", "train/grad_norm"):
            assert b[s][key] == pytest.approx(m[s][key], rel=1e-6, abs=1e-9), (s, key)
