"""Registering the schemas with Hydra's ConfigStore (the root YAMLs name them first in their defaults)."""

from __future__ import annotations

from mtp_train.config.checks import hydra_schema
from mtp_train.config.data import DataConfig
from mtp_train.config.eval import EvalConfig
from mtp_train.config.export import ExportConfig
from mtp_train.config.model import ModelConfig
from mtp_train.config.precompute import PrecomputeConfig
from mtp_train.config.regenerate import RegenerateConfig
from mtp_train.config.serve import ServeConfig
from mtp_train.config.train import DeepSpeedConfig, TrainConfig


def register_configs() -> None:
    """Register the schemas with Hydra (idempotent); `<command>_schema`, plus the model/data/deepspeed groups. The head
    is composed as a flat mapping (`hydra_schema`: its keys depend on its type), checked by `config.checks`."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="precompute_schema", node=PrecomputeConfig)
    cs.store(name="regenerate_schema", node=RegenerateConfig)
    cs.store(name="serve_schema", node=ServeConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="export_schema", node=ExportConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(name="train_schema", node=hydra_schema(TrainConfig))
    cs.store(group="deepspeed", name="deepspeed_schema", node=DeepSpeedConfig)
