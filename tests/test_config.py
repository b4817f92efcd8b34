"""The config floor: every YAML config under conf/ matches its typed schema; the floor imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from mtp_train.config import (
    ConfigError,
    EvalConfig,
    ModelConfig,
    RegenerateConfig,
    ServeConfig,
    TrainConfig,
    bf16_enabled,
    device_kind,
    rank_device,
    resolve_device,
    typed,
)
from mtp_train.config.head import FEATURES, HEAD_TYPES, NORM_FLAGS, HeadConfig, HeadTypeSpec, head_spec

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("path", sorted((CONF / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_model_configs_match_schema(path):
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    assert cfg.name == path.stem
    assert cfg.dtype in ("auto", "float32", "bfloat16", "float16")


def test_unknown_key_is_refused():
    with pytest.raises(ConfigKeyError, match="pagesize"):
        OmegaConf.merge(OmegaConf.structured(ModelConfig), {"pagesize": 8})


def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda")


def test_device_names():
    import torch

    assert device_kind("cuda:1") == "cuda" and device_kind("cpu") == "cpu"
    with pytest.raises(ValueError, match="auto|cpu|cuda"):
        device_kind("tpu")
    assert rank_device("cpu", world=4, local_rank=3) == torch.device("cpu")
    assert rank_device("cuda", world=4, local_rank=3) == torch.device("cuda", 3)
    assert rank_device("cuda:1") == torch.device("cuda", 1)  # a single process honours an explicit index
    assert not bf16_enabled(torch.device("cpu"))


def test_importing_the_config_floor_loads_nothing_heavy():
    # The floor imports nothing of the project; torch, Hydra and OmegaConf load only when a function needs them.
    code = ("import sys, mtp_train.config\n"
            "heavy = [m for m in ('torch', 'hydra', 'omegaconf', 'transformers') if m in sys.modules]\n"
            "ours = sorted(m for m in sys.modules if m.startswith('mtp_train.')\n"
            "               and not m.startswith('mtp_train.config'))\n"
            "print(heavy, ours)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "[] []"


def test_typed_runs_the_schemas_own_checks():
    cfg = typed({"head": {"type": "eagle1"}, "loss": {"steps": 2}}, TrainConfig)
    assert isinstance(cfg, TrainConfig) and cfg.head.type == "eagle1" and cfg.loss.weights() == [1.0, 0.8]
    assert typed(cfg, TrainConfig) is cfg
    with pytest.raises(ValueError, match="unknown head type"):
        typed({"head": {"type": "medusa"}}, TrainConfig)
    with pytest.raises(ConfigError, match="temperature > 0"):
        typed({"n": 2}, RegenerateConfig)
    assert EvalConfig(k=[1, 2]).grid("k") == [1, 2] and EvalConfig(k=3).grid("k") == [3]


def test_eval_grid_axes_are_lists_of_their_kind():
    cfg = typed({"k": [1, 3], "temperature": [0, 1], "draft_threshold": 0.4, "catch_up": ["target", "own"]},
                EvalConfig)
    assert cfg.grid("k") == [1, 3] and cfg.grid("temperature") == [0.0, 1.0]
    assert cfg.grid("draft_threshold") == [0.4] and cfg.grid("catch_up") == ["target", "own"]
    with pytest.raises(ConfigError, match="k must be >= 1"):
        EvalConfig(k=[0, 2])
    with pytest.raises(ConfigError, match="`k` must be a int"):
        EvalConfig(k="four")
    with pytest.raises(ConfigError, match="`temperature` is empty"):
        EvalConfig(temperature=[])


def test_head_weights_take_bf16_int8_or_fp32_only():
    assert EvalConfig().head_weights == "bf16" and ServeConfig().head_weights == "bf16"
    for cls in (EvalConfig, ServeConfig):
        for kind in ("fp32", "int8"):
            assert cls(head_weights=kind).head_weights == kind
        with pytest.raises(ConfigError, match=r"head_weights='fp16': choose one of bf16 \| int8 \| fp32"):
            cls(head_weights="fp16")


@pytest.mark.parametrize("name", list(HEAD_TYPES))
def test_each_head_type_spec_drives_its_config(name):
    """A HeadConfig takes every default from its type's spec, and refuses what the spec fixes."""
    spec = head_spec(name)
    vocab = 8 if spec.draft_vocab_required else 0
    cfg = HeadConfig(type=name, draft_vocab_size=vocab).resolved(num_layers=12)
    assert {k: getattr(cfg, k) for k in NORM_FLAGS} == spec.norms and cfg.features == spec.features
    assert cfg.to_dict()["features"] == spec.features and "native" in spec.formats
    for flag in spec.fixed_norms:
        with pytest.raises(ValueError, match=f"fixed norms; {flag}"):
            HeadConfig.of(type=name, draft_vocab_size=vocab, **{flag: not spec.norms[flag]})
    other = next(f for f in FEATURES if f != spec.features)
    if spec.fixed_features:
        with pytest.raises(ValueError, match=f"head.features={spec.features}"):
            HeadConfig(type=name, draft_vocab_size=vocab, features=other)
    else:  # e.g. an mtp head over the aux layers: the spec's width rule follows the features, not the type
        aux = HeadConfig(type=name, features="aux").resolved(num_layers=12)
        assert aux.aux_layers == [2, 6, 9] and spec.input_width(aux.features, len(aux.aux_layers), 16) == 48
    if spec.draft_vocab_required:
        with pytest.raises(ValueError, match="draft vocabulary"):
            HeadConfig(type=name)
    assert spec.input_width("final", 0, 16) == 16


def test_an_unknown_head_type_or_a_malformed_spec_is_refused():
    with pytest.raises(ValueError,
                       match="unknown head type 'medusa'; choose one of dflash, dspark, eagle1, eagle3, mtp"):
        HeadConfig(type="medusa")
    with pytest.raises(ValueError, match="norms must set exactly"):
        HeadTypeSpec("half", "norms missing", {"enorm": True})
    with pytest.raises(ValueError, match="unknown fixed norm or features"):
        HeadTypeSpec("odd", "bad features", dict.fromkeys(NORM_FLAGS, True), features="both")


