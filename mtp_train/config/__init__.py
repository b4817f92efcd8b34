"""The settings of every command: typed dataclasses, each defined once, mirrored by the YAML files under `conf/`.

This floor imports nothing else of the project (and neither torch nor Hydra at import time). One module per
concern: `model`, `data`, `head`, `loss`, one per stage (`precompute`, `regenerate`, `train`, `eval`, `export`,
`demo`, `serve`), `device` (the one resolver of a device name), `checks` (unknown keys, ranges, `typed`), `store`
(Hydra's ConfigStore). Every command's Hydra config is validated against these schemas (`<command>_schema`), so
a misspelt key fails at start-up with the key's name; the CLI converts the composed config to its dataclass once
(`typed`) and library functions take the dataclasses.
"""

from mtp_train.config.checks import (
    CONF_DIR,
    LOWER_BOUNDS,
    SCHEMAS,
    check_config,
    check_overrides,
    is_schema_key,
    schema_keys,
    typed,
    unknown_key_error,
)
from mtp_train.config.data import DATA_SOURCES, DataConfig, OnlineDataConfig, TrainDataConfig
from mtp_train.config.demo import DemoConfig
from mtp_train.config.device import bf16_enabled, device_kind, rank_device, resolve_device
from mtp_train.config.errors import ConfigError, Interrupted
from mtp_train.config.eval import GRID_AXES, EvalConfig, NgramConfig
from mtp_train.config.export import ExportConfig
from mtp_train.config.head import HEAD_TYPES, INITS, HeadConfig, HeadType, HeadTypeSpec, head_spec, head_type
from mtp_train.config.loss import CE_IMPLS, UNROLL_ATTENTION, LossConfig
from mtp_train.config.model import ModelConfig
from mtp_train.config.precompute import PrecomputeConfig
from mtp_train.config.regenerate import GENERATORS, RegenerateConfig
from mtp_train.config.serve import ServeConfig
from mtp_train.config.store import register_configs
from mtp_train.config.train import (
    DeepSpeedConfig,
    LoopConfig,
    OptimConfig,
    SpecEvalConfig,
    TrainConfig,
    WandbConfig,
)

__all__ = [
    "CE_IMPLS", "CONF_DIR", "DATA_SOURCES", "GENERATORS", "GRID_AXES", "HEAD_TYPES", "INITS", "LOWER_BOUNDS",
    "SCHEMAS",
    "UNROLL_ATTENTION",
    "ConfigError", "DataConfig", "DeepSpeedConfig", "DemoConfig", "EvalConfig", "ExportConfig", "HeadConfig",
    "HeadType", "HeadTypeSpec", "Interrupted",
    "LoopConfig", "LossConfig", "ModelConfig", "NgramConfig", "OnlineDataConfig", "OptimConfig", "PrecomputeConfig",
    "RegenerateConfig", "ServeConfig", "SpecEvalConfig", "TrainConfig", "TrainDataConfig", "WandbConfig",
    "bf16_enabled",
    "check_config", "check_overrides", "device_kind", "head_spec", "head_type", "is_schema_key", "rank_device",
    "register_configs",
    "resolve_device", "schema_keys", "typed", "unknown_key_error",
]
