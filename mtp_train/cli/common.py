"""Helpers shared by the Hydra entry points: config folder, device, target loading, config saving, clean errors.

Every command follows the same shape:

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="<command>")
    def _hydra_main(cfg): run_command("mtp-<command>", <command>_main, cfg)

`run_command` turns the errors a user can fix (a missing model folder, a bad data row, a wrong setting, a damaged
shard or checkpoint, an output another run holds) into one line on stderr and exit code 2; anything else keeps its
traceback. `HYDRA_FULL_ERROR=1`, Hydra's own switch for full tracebacks, also shows them for our errors.
`hydra_entry` also refuses, the same way, command-line keys and values the command's schema does not have
(`mtp_train.config.check_overrides` / `check_config`), and any config that does not compose (a config file of the
user's given with `--config-path` / `--config-name` included: the error names the file and the line or key, never
its content), before anything is loaded or written. Hydra writes nothing (no run or sweep folder, no `.hydra`, no
job log: `HYDRA_NO_OUTPUTS`); `-m` (a sweep) is refused, since every run writes one `out`.

The environment is read here, by the commands, and handed to the library as settings (library code reads none):
torchrun's RANK / WORLD_SIZE / LOCAL_RANK (`launch_env`), and the native CPU kernels' switch, build folder and
compiler, instruction set and native-or-torch choice (`kernel_settings_from_env`: MTP_TRAIN_CPU_KERNELS,
MTP_TRAIN_KERNEL_DIR, CC, MTP_TRAIN_KERNEL_ISA, MTP_TRAIN_KERNEL_CHOICE), applied once at start-up
by every command (`configure_from_env`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import netrc
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from omegaconf import DictConfig, OmegaConf

from mtp_train import dist
from mtp_train.config import (
    CONF_DIR,
    ConfigError,
    Interrupted,
    ModelConfig,
    check_config,
    check_overrides,
    rank_device,
    register_configs,
)
from mtp_train.config.checks import parse_overrides
from mtp_train.data.chat import ChatTemplateError, load_tokenizer
from mtp_train.data.readers import DataError
from mtp_train.dist import DistInfo, Launch
from mtp_train.fetch import REGISTRY, ModelFetchError, fetch_model
from mtp_train.fileio import DiskFullError, OutputLockedError, atomic_write_text, disk_errno, file_problem
from mtp_train.layers import cpu_kernels
from mtp_train.models.config import ModelConfigError
from mtp_train.precompute.reader import ShardError
from mtp_train.precompute.writer import PrecomputeError
from mtp_train.remote.http import RemoteError
from mtp_train.train.checkpoint import CheckpointError

log = logging.getLogger(__name__)

# The repository's conf/ folder. An absolute path: a relative `config_path` is resolved by Hydra against the
# calling module's package (`pkg://conf`), which does not exist when the command runs as a console script.

# Errors whose message tells the user what to change; shown as one line instead of a traceback. ValueError covers
# invalid settings (SamplingParams, dtype, ConfigError, ...), DataError, ManifestError and ModelConfigError (all
# subclass it); the RuntimeErrors listed carry messages that name the file and what to do.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ModelConfigError, ModelFetchError, DataError, ChatTemplateError, FileNotFoundError, ValueError,
    ShardError, PrecomputeError, CheckpointError, OutputLockedError, DiskFullError, RemoteError,
)
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 2  # Ctrl-C ends a command as every other stop does: one line, exit 2 (non-zero: scripts stop)

# The native CPU kernels' environment (see `kernel_settings_from_env`).
ENV_CPU_KERNELS = "MTP_TRAIN_CPU_KERNELS"
ENV_KERNEL_DIR = "MTP_TRAIN_KERNEL_DIR"
ENV_CC = "CC"
ENV_KERNEL_ISA = "MTP_TRAIN_KERNEL_ISA"
ENV_KERNEL_CHOICE = "MTP_TRAIN_KERNEL_CHOICE"

# Hydra's own outputs, none of which the commands need (each writes only into its `out`): the run folder, the
# `.hydra` copy of the config and the job's log file. conf/ sets them so; a primary config of the user's
# (--config-name, --config-path) gets them from the command line. A user's own `hydra.run.dir=...` stays.
HYDRA_NO_OUTPUTS = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra.job.chdir=false",
                    "hydra/job_logging=stdout")
_SETTING_NAME = re.compile(r"[A-Za-z_][\w-]{0,63}")
_MESSAGE_CHARS = 300  # what one error line quotes of a message Hydra or YAML wrote


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


def launch_env() -> Launch:
    """This process's place in a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK); rank 0 of 1 without torchrun."""
    env = os.environ
    return Launch(rank=int(env.get("RANK", "0")), world=int(env.get("WORLD_SIZE", "1")),
                  local_rank=int(env.get("LOCAL_RANK", "0")))


def kernel_settings_from_env(env: Mapping[str, str] | None = None) -> cpu_kernels.KernelSettings:
    """The native CPU kernels' settings (`mtp_train.layers.cpu_kernels`) from `env` (default: this process's):

    * `MTP_TRAIN_CPU_KERNELS=0` switches them off: decode and verify steps run on torch's operators (and
      one-row products on MKL's pre-packed GEMM);
    * `MTP_TRAIN_KERNEL_DIR` is the folder they are built into and shared from (default
      `~/.cache/mtp_train/kernels`);
    * `CC` is the C compiler tried first (then cc, gcc, clang on PATH);
    * `MTP_TRAIN_KERNEL_ISA=auto|avx2|avx512`: the gemv's instruction set (auto: AVX-512 where the CPU has it);
    * `MTP_TRAIN_KERNEL_CHOICE=measure|native|torch`: each op's path measured on the machine (the default), or
      forced (`mtp_train.layers.kernel_choice`).

    Unset or empty variables keep the library's defaults; a value outside those listed raises ValueError.
    """
    env = os.environ if env is None else env
    cache_dir = env.get(ENV_KERNEL_DIR)
    return cpu_kernels.KernelSettings(enabled=env.get(ENV_CPU_KERNELS, "1") != "0",
                                      cache_dir=Path(cache_dir) if cache_dir else None,
                                      compiler=env.get(ENV_CC) or None, off_reason=f"{ENV_CPU_KERNELS}=0",
                                      isa=env.get(ENV_KERNEL_ISA) or "auto",
                                      choice=env.get(ENV_KERNEL_CHOICE) or "measure")


def configure_from_env() -> None:
    """Hand the library the settings the commands take from the environment (the CPU kernels'); once, at start."""
    cpu_kernels.configure(kernel_settings_from_env())


@contextlib.contextmanager
def distributed(model_cfg: ModelConfig) -> Iterator[tuple[DistInfo, contextlib.ExitStack]]:
    """A stage's process set-up: `init_distributed` for `model.device` and torchrun's environment, and an
    ExitStack for what the stage holds (its output lock); the stack closes, then the process group goes, however
    the stage exits."""
    info = dist.init_distributed(model_cfg.device, launch_env())
    try:
        with contextlib.ExitStack() as stack:
            yield info, stack
    finally:
        dist.destroy()


def run_device(model_cfg: ModelConfig, info: DistInfo) -> torch.device:
    """The device this process computes on: `model.device`, per rank under torchrun (`rank_device`)."""
    return rank_device(model_cfg.device, info.world, info.local_rank)


def has_wandb_key() -> bool:
    """True when W&B can authenticate: WANDB_API_KEY is set, or the netrc has an entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def ensure_model(model_cfg: ModelConfig | DictConfig) -> Path:
    """The target folder of `model_cfg`; fetched first when it is missing and is the default folder of the model
    `fetch` names (e.g. models/smollm2-135m-instruct for smollm2-135m).

    Any other missing folder is an error naming the path and the command that fetches a model into it: a
    mistyped `model.path` must not become a download of the default model into the typo. Under torchrun call
    this on rank 0 alone, then barrier, so that ranks do not convert the model side by side.
    """
    path = Path(model_cfg.path)
    if (path / "config.json").is_file():
        return path
    name = model_cfg.fetch
    spec = REGISTRY.get(name) if name else None
    if spec is not None and path.absolute() == Path(spec.default_dir).absolute():
        # fetch_model refuses a non-empty folder it did not make, so nothing of the user's is overwritten.
        log.info("model folder %s is missing; fetching %s into it (`model.fetch`)", path, name)
        return fetch_model(name, out=path)
    config_problem = file_problem(path / "config.json")
    if not path.exists():
        what = "does not exist"
    elif config_problem and config_problem != "does not exist":  # a FIFO or a link loop is not "missing"
        what = f"has a config.json that {config_problem}"
    else:
        what = "has no config.json"
    if spec is not None:
        todo = (f"check `model.path`, or fetch {name} there with `mtp-model fetch {name} --out {path}` "
                f"(it is fetched by itself only into its default folder, {spec.default_dir})")
    else:
        known = ", ".join(sorted(REGISTRY))
        todo = (f"point `model.path` at a Hugging Face folder, or fetch a known model ({known}) there with "
                f"`mtp-model fetch NAME --out {path}`")
    raise ModelConfigError(f"model folder {path} {what}: {todo}")


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


def _fail(prog: str, msg: str) -> None:
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def run_command(prog: str, fn: Callable[[DictConfig], Any], cfg: DictConfig | None) -> Any:
    """Call `fn(cfg)`; a user error (see USER_ERRORS, and a write that found no room) becomes
    `prog: error: <message>` on stderr and exit code 2; SIGINT becomes `prog: interrupted <where and how to go on>`
    and exit code 2 (the stage says where it stopped by raising `Interrupted`)."""
    try:
        return fn(cfg)
    except KeyboardInterrupt as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        where = str(exc) if isinstance(exc, Interrupted) and str(exc) else \
            "before it finished; re-run the same command to do it again"
        print(f"{prog}: interrupted {where}", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    except USER_ERRORS as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        msg = str(exc) if not isinstance(exc, FileNotFoundError) or not exc.filename else \
            f"{exc.strerror or 'not found'}: {exc.filename}"
        if "\nOriginal Traceback" in msg:
            # Re-raised from a DataLoader worker, with the worker's traceback as the message: its last line holds
            # the error itself ("mtp_train....CorruptShardError: <message>").
            last = msg.rstrip().splitlines()[-1]
            msg = last.split(": ", 1)[1] if ": " in last else last
        _fail(prog, msg)
    except OSError as exc:
        # A write outside `atomic_write` (an appended log line) that found no room: no bytes count to give.
        if disk_errno(exc) is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        _fail(prog, f"{exc.strerror}{where}; free some space (or raise the file size limit, ulimit -f), then "
                    f"re-run the same command: it goes on from what was finished")


def _primary_config(args: argparse.Namespace, config_name: str) -> str:
    """The file the primary config is read from, for error messages (a `pkg://` folder stays as written)."""
    name = args.config_name or config_name
    return f"{args.config_path.rstrip('/')}/{name if name.endswith('.yaml') else name + '.yaml'}"


def _composition_error(exc: BaseException, args: argparse.Namespace, config_name: str) -> str:
    """One line for a config that does not compose: the file and line (YAML), the file (unreadable, not text) or
    Hydra's first sentence (a defaults entry, a group choice: the names it quotes are keys, not content).

    Args:
        exc: what composing raised (YAML's, Hydra's, OmegaConf's or the file system's error).
        args: the checked parse of the command line (`hydra_args`), for the primary config's file.
        config_name: the command's root config, when the command line names none.
    """
    import yaml

    primary = _primary_config(args, config_name)
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        context = (f" ({exc.context} at line {exc.context_mark.line + 1})"
                   if exc.context and exc.context_mark is not None else "")
        return (f"{mark.name}: not YAML that can be read: {exc.problem} at line {mark.line + 1}, column "
                f"{mark.column + 1}{context}; fix the file")
    if isinstance(exc, UnicodeDecodeError):
        return (f"{primary} (or a config its defaults list names) is not UTF-8 text ({exc.reason} at byte "
                f"{exc.start}): a config is a YAML text file; check --config-path and --config-name")
    if "://" not in primary and not os.path.isfile(primary) and "Cannot find primary config" in str(exc):
        return f"{primary}: no such file (or a link to none); check --config-path and --config-name"
    if isinstance(exc, OSError) and exc.filename:  # unreadable (permissions), a folder
        return f"{exc.filename}: {exc.strerror}; check --config-path and --config-name"
    first = " ".join(str(exc).split("Config search path")[0].split()) or type(exc).__name__
    if len(first) > _MESSAGE_CHARS:
        first = first[:_MESSAGE_CHARS] + "…"
    return (f"the config does not compose ({first}); check --config-path, --config-name, the files they name and "
            f"the overrides")


def _compose(args: argparse.Namespace, config_name: str) -> DictConfig:
    """The config `args` describe, composed as Hydra's run composes it (same search path and overrides), or a
    ConfigError naming the file and line or key of what fails (`_composition_error`)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    search_path = create_automatic_config_search_path(None, None, args.config_path)
    if args.config_dir is not None:
        extra = os.path.abspath(args.config_dir)
        if not os.path.isdir(extra):
            raise ConfigError(f"--config-dir {args.config_dir}: no such folder")
        search_path.prepend(provider="command-line", path=f"file://{extra}", anchor=SearchPathQuery(provider="schema"))
    try:
        hydra = Hydra.create_main_hydra2(task_name=config_name, config_search_path=search_path)
        try:
            return hydra.compose_config(args.config_name or config_name, args.overrides, run_mode=RunMode.RUN,
                                        with_log_configuration=False)
        finally:
            GlobalHydra.instance().clear()
    except Exception as exc:  # YAML's, Hydra's, OmegaConf's and the file system's errors: one line each
        raise ConfigError(_composition_error(exc, args, config_name)) from exc


def hydra_args(argv: list[str], config_name: str) -> argparse.Namespace:
    """Hydra's parse of a command line of the command with root config `conf/<config_name>.yaml`, checked before
    Hydra runs anything: keys and values against the schema (`check_overrides`), the whole config composed
    (`_compose`), its top-level keys setting names. What Hydra would write is switched off (`HYDRA_NO_OUTPUTS`),
    and a relative `--config-path` is taken from the working folder (Hydra would look in this package).

    Raises ConfigError (one line) for `-m` / `hydra.mode=MULTIRUN` (a sweep runs the command several times into
    the same `out`), a sweep value (`k=1,2`), `--experimental-rerun` (it unpickles a file), and a config that does
    not compose.

    Args:
        argv: the command line after the program's name.
        config_name: the command's root config (`conf/<config_name>.yaml`) and schema (`SCHEMAS`).
    """
    from hydra._internal.utils import get_args_parser
    from hydra.types import RunMode

    args = get_args_parser().parse_args(argv)  # a malformed command line: argparse's usage and error, exit 2
    once = "each run writes one `out`: run the command once per setting, each with its own out="
    if args.multirun:
        raise ConfigError(f"-m/--multirun (a Hydra sweep) is not supported: {once}")
    if args.experimental_rerun is not None:
        raise ConfigError("--experimental-rerun is not supported (it loads a pickle): re-run the command with its "
                          "settings instead")
    if args.shell_completion:
        return args
    if args.config_path is None:
        args.config_path = CONF_DIR
    elif not os.path.isabs(args.config_path) and not args.config_path.startswith("pkg://"):
        args.config_path = os.path.abspath(args.config_path)
    overrides = list(args.overrides or [])
    parsed = parse_overrides(overrides)
    for arg, o in zip(overrides, parsed, strict=True):
        if o.is_sweep_override():
            raise ConfigError(f"argument {arg!r} is a sweep (one run per value), which is not supported: give a "
                              f"list as key=[a,b] where the setting takes one, quote a text holding a comma as "
                              f"key='a,b', or {once.split(': ', 1)[1]}")
    check_overrides(overrides, config_name)
    given = {o.key_or_group for o in parsed}
    args.overrides = overrides + [o for o in HYDRA_NO_OUTPUTS if o.split("=")[0] not in given]
    cfg = _compose(args, config_name)
    if cfg.hydra.mode == RunMode.MULTIRUN:
        raise ConfigError(f"hydra.mode=MULTIRUN (a Hydra sweep) is not supported: {once}")
    for key in cfg:
        if key != "hydra" and not _SETTING_NAME.fullmatch(str(key)):
            # Never quoted: a file that is not a config (a link to another file) reads as one long key.
            raise ConfigError(f"{_primary_config(args, config_name)}: a top-level key of {len(str(key))} "
                              f"characters that is not a setting name: the file is not a config of this command; "
                              f"pass one shaped like conf/{config_name}.yaml")
    return args


def hydra_entry(prog: str, config_name: str, fn: Callable[[DictConfig], Any]) -> Callable[[], None]:
    """The console entry point of a Hydra command: read the environment (`configure_from_env`), register the
    schemas, check the command line and compose it with the root config `conf/<config_name>.yaml` (`hydra_args`),
    then run Hydra, which composes it again and calls `run_command(prog, fn, cfg)` on the config `check_config`
    passes."""

    def task(cfg: DictConfig) -> None:
        run_command(prog, lambda c: fn(check_config(c, config_name)), cfg)

    def main() -> None:
        from hydra._internal.utils import _run_hydra, get_args_parser

        configure_from_env()
        register_configs()
        # Before Hydra runs: its own errors are several lines and exit 1, a mistyped key's a hint to add it with `+`.
        args = run_command(prog, lambda _: hydra_args(sys.argv[1:], config_name), None)
        # What `@hydra.main` runs, given the checked parse (and never its pickle-loading --experimental-rerun).
        _run_hydra(args=args, args_parser=get_args_parser(), task_function=task, config_path=CONF_DIR,
                   config_name=config_name)

    return main
