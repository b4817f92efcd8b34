"""One set of OpenAI-compatible client keys (`config.endpoints.EndpointsConfig`) in mtp-regenerate, mtp-precompute and
mtp-train's fleet source: the same fields, defaults and checks, at the keys the docs name (top level in regenerate,
under `vllm.` in precompute, under `data.fleet.` in train)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mtp_train.config import ConfigError, PrecomputeConfig, RegenerateConfig, typed
from mtp_train.config.data import FleetConfig
from mtp_train.config.endpoints import EndpointsConfig
from mtp_train.config.precompute import VllmCaptureConfig
from tests.conftest import compose_config

CONF = Path(__file__).resolve().parents[1] / "conf"
KEYS = [f.name for f in dataclasses.fields(EndpointsConfig)]


def _defaults(cls: type) -> dict[str, object]:
    return {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
            for f in dataclasses.fields(cls) if f.name in KEYS}


def test_both_commands_take_every_endpoint_key_with_its_default():
    assert KEYS == ["endpoints", "served_model", "concurrency", "timeout", "retries", "backoff", "dead_after"]
    for cls in (RegenerateConfig, VllmCaptureConfig, FleetConfig):
        assert issubclass(cls, EndpointsConfig)
        assert _defaults(cls) == _defaults(EndpointsConfig)
    # the command templates list them where the docs say: top level in regenerate, under vllm. in precompute,
    # under data.fleet. in train
    regen, pre = OmegaConf.load(CONF / "regenerate.yaml"), OmegaConf.load(CONF / "precompute.yaml")
    fleet = OmegaConf.load(CONF / "train.yaml").data.fleet
    for key in KEYS:
        assert key in regen and key in pre.vllm and key in fleet, key
        assert regen[key] == pre.vllm[key] == fleet[key] == _defaults(EndpointsConfig)[key], key


def test_the_keys_compose_at_their_documented_places():
    rc = typed(compose_config("regenerate", ["generator=openai", "endpoints=[http://10.0.0.1:8000]",
                                             "concurrency=3", "served_model=tiny", "dead_after=5"]), RegenerateConfig)
    assert (rc.endpoints, rc.concurrency, rc.served_model, rc.dead_after) == (["http://10.0.0.1:8000"], 3, "tiny", 5)
    pc = typed(compose_config("precompute", ["backend=vllm", "vllm.endpoints=[http://10.0.0.1:8000]",
                                             "vllm.concurrency=3", "vllm.served_model=tiny", "vllm.dead_after=5"]),
               PrecomputeConfig)
    assert (pc.vllm.endpoints, pc.vllm.concurrency, pc.vllm.served_model, pc.vllm.dead_after) == \
        (["http://10.0.0.1:8000"], 3, "tiny", 5)
    assert rc.client_kwargs() == pc.vllm.client_kwargs() == {
        "model": "tiny", "concurrency": 3, "timeout": 600.0, "retries": 8, "backoff": 1.0, "dead_after": 5}


@pytest.mark.parametrize("key,value,what", [("concurrency", 0, "a positive integer"),
                                            ("timeout", 0.0, "a positive number of seconds"),
                                            ("retries", -1, "0 \\(no retry\\) or more"),
                                            ("backoff", -0.5, "0 or more seconds"),
                                            ("dead_after", -1.0, "0 or more seconds")])
def test_an_out_of_range_setting_is_refused_by_its_key_in_either_command(key, value, what):
    with pytest.raises(ConfigError, match=f"^{key}={value} is out of range: `{key}` must be {what}"):
        RegenerateConfig(**{key: value})
    with pytest.raises(ConfigError, match=f"^vllm.{key}={value} is out of range: `vllm.{key}` must be {what}"):
        VllmCaptureConfig(**{key: value})
    with pytest.raises(ConfigError, match=f"^data.fleet.{key}={value} is out of range: `data.fleet.{key}` must be "
                                          f"{what}"):
        FleetConfig(**{key: value})
