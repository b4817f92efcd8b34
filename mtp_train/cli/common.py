"""Helpers shared by the Hydra entry points: config folder, device, target loading, config saving, clean errors.

Every command follows the same shape:

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="<command>")
    def _hydra_main(cfg): run_command("mtp-<command>", <command>_main, cfg)

`run_command` turns the errors a user can fix (a missing model folder, a bad data row, a wrong setting) into one
line on stderr and exit code 2; anything else keeps its traceback. `HYDRA_FULL_ERROR=1`, Hydra's own switch for
full tracebacks, also shows them for our errors.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from mtp_train.config import CONF_DIR, ModelConfig, register_configs, resolve_device
from mtp_train.data.chat import ChatTemplateError, load_tokenizer
from mtp_train.data.readers import DataError
from mtp_train.dist import DistInfo
from mtp_train.fileio import atomic_write_text
from mtp_train.models.config import ModelConfigError
from mtp_train.models.fetch import REGISTRY, ModelFetchError, fetch_model

log = logging.getLogger(__name__)

# The repository's conf/ folder. An absolute path: a relative `config_path` is resolved by Hydra against the
# calling module's package (`pkg://conf`), which does not exist when the command runs as a console script.

# Errors whose message tells the user what to change; shown as one line instead of a traceback. ValueError covers
# invalid settings (SamplingParams, dtype, ...), DataError and ModelConfigError (both subclass it).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ModelConfigError, ModelFetchError, DataError, ChatTemplateError, FileNotFoundError, ValueError,
)
EXIT_USER_ERROR = 2


def to_dict(cfg: DictConfig | dict[str, Any] | None) -> dict[str, Any]:
    """A (resolved) DictConfig as plain Python containers, for library code and JSON; dicts are copied."""
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def save_config(cfg: DictConfig, path: str | Path) -> Path:
    """Save the resolved config as YAML at `path` (atomically); return the path."""
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
    return Path(path)


def run_device(model_cfg: ModelConfig | DictConfig, info: DistInfo) -> torch.device:
    """The device this process computes on: `model.device` (auto → cuda when available), per rank under torchrun.

    With several ranks each one takes `cuda:<local_rank>` (set up by `init_distributed`); a single process honours
    an explicit `cuda:N`.
    """
    device = resolve_device(model_cfg.device)
    if info.world > 1 and device.startswith("cuda"):
        return info.device
    return torch.device(device)


def dist_device_kind(model_cfg: ModelConfig | DictConfig) -> str:
    """`cpu` or `cuda`, what `init_distributed` takes, from `model.device` (which may name `cuda:N`)."""
    return "cuda" if resolve_device(model_cfg.device).startswith("cuda") else "cpu"


def ensure_model(model_cfg: ModelConfig | DictConfig) -> Path:
    """The target folder of `model_cfg`; fetched first when `path` is missing and `fetch` names a known model.

    Under torchrun call this on rank 0 alone, then barrier, so that ranks do not convert the model side by side.
    """
    path = Path(model_cfg.path)
    if (path / "config.json").is_file():
        return path
    name = model_cfg.fetch
    if name and name in REGISTRY:
        # fetch_model refuses a non-empty folder it did not make, so a mistyped path is never overwritten.
        log.info("model folder %s is missing; fetching %s into it (`model.fetch`)", path, name)
        return fetch_model(name, out=path)
    hint = f"`fetch` names no known model ({name!r}); known: {', '.join(sorted(REGISTRY))}" if name else \
        "set `model.fetch` to a known model name to create it"
    raise ModelConfigError(f"model folder {path} does not exist (or has no config.json); point `model.path` at a "
                           f"Hugging Face folder, or {hint}")


def load_target(model_cfg: ModelConfig | DictConfig, device: torch.device | str,
                with_tokenizer: bool = True) -> tuple[Any, Any, Path]:
    """(model, tokenizer or None, folder) of the target named by `model_cfg`, on `device`.

    The folder must exist (see `ensure_model`).
    """
    from mtp_train.models.loader import load_model

    path = Path(model_cfg.path)
    model = load_model(path, dtype=model_cfg.dtype, device=device, backend=model_cfg.backend)
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return model, tokenizer, path


def run_command(prog: str, fn: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Call `fn(cfg)`; a user error (see USER_ERRORS) becomes `prog: error: <message>` on stderr and exit code 2."""
    try:
        return fn(cfg)
    except USER_ERRORS as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        msg = str(exc) if not isinstance(exc, FileNotFoundError) or not exc.filename else \
            f"{exc.strerror or 'not found'}: {exc.filename}"
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)


def hydra_entry(prog: str, config_name: str, fn: Callable[[DictConfig], Any]) -> Callable[[], None]:
    """The console entry point of a Hydra command: register the schemas, parse the command line with the
    root config `conf/<config_name>.yaml`, then `run_command(prog, fn, cfg)`."""

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=config_name)
    def _hydra_main(cfg: DictConfig) -> None:
        run_command(prog, fn, cfg)

    def main() -> None:
        register_configs()
        _hydra_main()

    return main
