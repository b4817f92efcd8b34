"""Registering the schemas with Hydra's ConfigStore (the root YAMLs name them first in their defaults)."""

from __future__ import annotations

import sys
from pathlib import Path

from mtp_train.config.checks import CONF_DIR, hydra_schema
from mtp_train.config.data import DataConfig
from mtp_train.config.eval import EvalConfig
from mtp_train.config.export import ExportConfig
from mtp_train.config.head import HEAD_TYPE_PACKAGE
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
    from omegaconf import OmegaConf

    for name, path in head_type_confs().items():
        cs.store(group="head", name=name, node=OmegaConf.load(path), package="_global_")


HEAD_TYPE_CONF = "conf.yaml"  # a head-type folder's own `head=<type>` option, when conf/head/ has none for it


def head_type_confs() -> dict[str, Path]:
    """Head type → the `conf.yaml` of its folder, for the types whose folder brings one and `conf/head/` has no
    `<type>.yaml` (a type shipped as one folder: everything of it in it). Read from the head-type package's search
    path (its live `__path__` once imported, which a plug-in folder may extend), without importing any type."""
    import importlib.util

    package = sys.modules.get(HEAD_TYPE_PACKAGE)
    roots = list(package.__path__) if package is not None else list(
        getattr(importlib.util.find_spec(HEAD_TYPE_PACKAGE), "submodule_search_locations", None) or [])
    found: dict[str, Path] = {}
    for root in roots:
        for conf in sorted(Path(root).glob(f"*/{HEAD_TYPE_CONF}")):
            name = conf.parent.name
            if not (Path(CONF_DIR) / "head" / f"{name}.yaml").is_file():
                found.setdefault(name, conf)
    return found
