"""conf/recipe/: the peers' published training recipes as presets (`recipe=<name>`). Each composes to the values
its file says the peer uses, names its source (project, file, version), leaves command-line overrides the last
word, and trains a tiny head end to end."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mtp_train.cli.common import CONF_DIR
from mtp_train.config import TrainConfig
from tests.conftest import metrics_by_step
from tests.test_trainer import AUX, _cfg, _overrides, _train, aux_data, setup  # noqa: F401 (module fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPES = Path(CONF_DIR) / "recipe"
MUON = {"train.optimizer": "muon", "deepspeed.zero_optimization.stage": 0, "optim.lr": 1e-4,
        "optim.weight_decay": 0.01, "optim.betas": [0.9, 0.999], "optim.min_lr_ratio": 0.0, "optim.grad_clip": 1.0,
        "optim.muon_lr": None, "optim.muon_momentum": 0.95, "optim.muon_weight_decay": 0.1, "optim.muon_ns_steps": 5,
        "optim.muon_adjust_lr_fn": "match_rms_adamw", "optim.muon_nesterov": True}
# recipe → the settings its file maps the peer's defaults to (the file's comments say which default each one is)
EXPECTED: dict[str, dict[str, object]] = {
    "speculators-eagle3": {
        "head.type": "eagle3", "head.norm_output": True, "head.aux_norm": False, "head.draft_vocab_size": 32000,
        "head.fc_input_norm": True, "head.norm_before_residual": True, "head.train_lm_head": False,
        "optim.schedule": "linear", "loss.kind": "soft_ce", "loss.steps": 3, "loss.position_weights": "decay",
        "loss.step_decay": 1.0,
        "loss.w_feat": 0.0, "loss.w_tok": 1.0, "loss.mask_out_of_draft": False, "loss.noise_std": 0.05, **MUON},
    "dflash-reference": {
        "head.type": "dflash", "head.layers": 5, "head.block_size": 16, "head.max_anchors": 512,
        "head.mask_token_id": None, "loss.kind": "argmax_ce", "loss.steps": None, "loss.position_weights": "dpace",
        "loss.dpace_alpha": 0.5, "loss.w_feat": 0.0, "loss.w_tok": 1.0, "loss.noise_std": 0.05, **MUON},
    "specforge-dflash": {
        "head.type": "dflash", "head.layers": 5, "head.block_size": 16, "head.max_anchors": 512,
        "loss.kind": "argmax_ce", "loss.steps": None, "loss.position_weights": "decay",
        "loss.step_decay": pytest.approx(math.exp(-1 / 7), abs=1e-6), "loss.noise_std": 0.0, "loss.w_feat": 0.0,
        "train.optimizer": "adamw", "optim.lr": 6e-4, "optim.weight_decay": 0.0, "optim.betas": [0.9, 0.999],
        "optim.min_lr_ratio": 0.0, "optim.grad_clip": 1.0, "deepspeed.zero_optimization.stage": 2},
}


def _compose(*overrides: str):
    return _cfg(["model.device=cpu", *overrides])


def test_the_recipe_group_holds_the_listed_presets():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_recipe_composes_to_the_peers_values_and_builds_a_train_config(name):
    cfg = _compose(f"recipe={name}")
    for key, want in EXPECTED[name].items():
        got = OmegaConf.select(cfg, key)
        got = list(got) if OmegaConf.is_list(got) else got
        assert got == want, (name, key, got)
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, TrainConfig)  # every check of the settings passes
    if typed.head.type == "dflash":  # the block drafters' steps follow their block (block_size - 1)
        assert typed.loss.steps == typed.head.settings.block_size - 1 == 15


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_recipe_names_its_source_project_files_and_version(name):
    text = (RECIPES / f"{name}.yaml").read_text(encoding="utf-8")
    source = re.search(r"^# Source: (\S+/\S+) (.*?)^#\s*$", text, re.M | re.S)  # the comment's Source paragraph
    assert source and source.group(1) in ("vllm-project/speculators", "sgl-project/SpecForge"), name
    block = source.group(2)
    assert re.search(r"\b[0-9a-f]{7}\b", block) and re.search(r"\bv?\d+\.\d+\.\d+\b", block), name  # commit, version
    assert re.search(r"(specforge|src/speculators)/\S+\.py", block), name  # the files the defaults were read in
    assert "What differs" in text, name  # what has no setting here is said, not silently dropped


def test_command_line_overrides_win_over_a_recipe():
    cfg = _compose("recipe=dflash-reference", "head.block_size=8", "optim.muon_lr=2e-3")
    assert (cfg.head.block_size, cfg.optim.muon_lr, cfg.head.layers) == (8, 2e-3, 5)
    assert OmegaConf.to_object(cfg).loss.steps == 7  # derived from the smaller block
    assert _compose("recipe=speculators-eagle3", "head=eagle1").head.type == "eagle1"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_recipe_trains_a_tiny_head(setup, aux_data, tmp_path, name):  # noqa: F811
    """A few steps of each preset on the tiny target's aux-layer folder: the run finishes and its loss is finite."""
    small = ["head.draft_vocab_size=32"] if name == "speculators-eagle3" else ["head.max_anchors=64"]
    run = _train(setup, tmp_path / name, f"recipe={name}", f"data.dir={aux_data}",
                 f"head.aux_layers=[{','.join(map(str, AUX))}]", "train.max_steps=4", "optim.warmup_steps=1",
                 "train.eval_batches=1", *small)
    m = metrics_by_step(run.out)
    assert sorted(s for s in m if "train/loss" in m[s]) == [1, 2, 3, 4]
    assert all(math.isfinite(m[s]["train/loss"]) and math.isfinite(m[s]["train/grad_norm"]) for s in range(1, 5))
    assert run.result["head_dir"].endswith("step-4")
    if name == "speculators-eagle3":  # the frozen draft lm_head: after 4 Muon steps still the target's rows
        from mtp_train.heads import load_head

        head = load_head(run.result["head_dir"], setup.target, dtype="float32")
        assert not head.train_lm_head and not head.lm_head.weight.requires_grad
        assert torch.equal(head.lm_head.weight, head.frozen.lm_head[head.draft_vocab])
        assert head.fc_input_norm is not None and head.norm_before_residual
