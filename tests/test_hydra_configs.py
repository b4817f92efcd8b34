"""Every Hydra root config composes with every model and data choice; wrong keys are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from mtp_train.cli.common import CONF_DIR
from mtp_train.config import TrainConfig, register_configs, typed

CONF = Path(CONF_DIR)
ROOTS = sorted(p.stem for p in CONF.glob("*.yaml") if p.stem != "demo")  # demo.yaml lists overrides of the others
DATA_ROOTS = [r for r in ROOTS if "- data:" in (CONF / f"{r}.yaml").read_text()]
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
DATAS = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))


@pytest.fixture(scope="module", autouse=True)
def _hydra():
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield


@pytest.mark.parametrize("root", ROOTS)
@pytest.mark.parametrize("model", MODELS)
def test_root_composes_with_every_model(root, model):
    cfg = compose(root, overrides=[f"model={model}"])
    assert cfg.model.name == model
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


@pytest.mark.parametrize("root", DATA_ROOTS)
@pytest.mark.parametrize("data", DATAS)
def test_root_composes_with_every_data(root, data):
    cfg = compose(root, overrides=[f"data={data}"])
    assert cfg.data.name == data


@pytest.mark.parametrize("root", ROOTS)
def test_wrong_key_is_refused_by_name(root):
    with pytest.raises(ConfigCompositionException, match="max_seq_lenn|max_new_tokenz"):
        compose(root, overrides=["max_seq_lenn=3" if root == "precompute" else "max_new_tokenz=3"])
    with pytest.raises(ConfigCompositionException, match="pagesize"):
        compose(root, overrides=["model.pagesize=3"])


def test_command_line_overrides_reach_the_config():
    cfg = compose("precompute", overrides=["data.paths=[a.jsonl,b.jsonl]", "out=/tmp/x", "max_seq_len=128",
                                           "limit=5", "aux_layers=[2,15]"])
    assert list(cfg.data.paths) == ["a.jsonl", "b.jsonl"] and cfg.max_seq_len == 128 and cfg.limit == 5
    assert list(cfg.aux_layers) == [2, 15]


def test_demo_config_is_typed_and_its_stage_overrides_compose():
    from mtp_train.cli.demo import stage_overrides
    from mtp_train.config import DemoConfig

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DemoConfig), OmegaConf.load(CONF / "demo.yaml")))
    for stage, overrides in stage_overrides(cfg, Path("runs/demo")).items():
        name = "train" if stage == "train" else stage
        extra = ["head_ckpt=x"] if stage in ("eval", "export") else []
        compose(name, overrides=extra + overrides)
    # The prompt set the target answers (the demo's data= key, demo-960): its three files reach regenerate.
    regen = compose("regenerate", overrides=stage_overrides(cfg, Path("runs/demo"))["regenerate"])
    assert [Path(p).name for p in regen.data.paths] == ["demo_prompts.jsonl", "demo_prompts_extra.jsonl",
                                                        "demo_prompts_more.jsonl"]
    cfg.data = "demo"
    regen = compose("regenerate", overrides=stage_overrides(cfg, Path("runs/demo"))["regenerate"])
    assert [Path(p).name for p in regen.data.paths] == ["demo_prompts.jsonl"]
    with pytest.raises(Exception, match="trian"):
        OmegaConf.merge(OmegaConf.structured(DemoConfig), OmegaConf.create({"trian": []}))


@pytest.mark.parametrize(("head", "steps", "weights"), [("mtp", 1, "decay"), ("eagle1", 3, "dpace"),
                                                         ("eagle3", 3, "decay")])
def test_each_head_group_brings_its_measured_recipe_and_the_ablation_pins_its_own(head, steps, weights):
    """conf/head/<type>.yaml's defaults are the learning curve's best per head type (docs/curve.md); a
    command-line override still wins, and the norm ablation compares every head at its one recipe."""
    cfg = typed(compose("train", overrides=[f"head={head}"]), TrainConfig)  # loss.steps: null = the head's, else 1
    assert (cfg.head.type, cfg.loss.steps, cfg.loss.position_weights) == (head, steps, weights)
    assert compose("train", overrides=[f"head={head}", "loss.steps=2"]).loss.steps == 2
    ablation = compose("train", overrides=["+experiment=ablation_norms", f"head={head}"])
    assert (ablation.loss.steps, ablation.loss.position_weights) == (2, "decay")
