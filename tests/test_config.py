"""Every YAML config under conf/ matches its typed schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from mtp_train.config import ModelConfig, resolve_device

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
