"""Where conversations come from and how they are read (`conf/data/*.yaml`), and the training data folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtp_train.config.endpoints import EndpointsConfig
from mtp_train.config.errors import ConfigError
from mtp_train.config.registry import Registry

OVER_CONTEXT = ("error", "split", "truncate")  # what a sample longer than the target's context becomes
HISTORY_TURNS = ("mask", "split")  # what a turn rendered otherwise in later history becomes


@dataclass
class DataConfig:
    """Where conversations come from and how they are read (`conf/data/*.yaml`)."""

    name: str = "custom"  # short name recorded in manifests
    paths: list[str] = field(default_factory=list)  # .jsonl/.json/.parquet/.csv files, folders, globs, HF datasets
    format: str = "auto"  # auto | sharegpt | messages | prompt
    field_map: dict[str, str] = field(default_factory=dict)  # our field name → the file's field name
    system_prompt: str | None = None  # added to every conversation that has no system turn
    on_bad_row: str = "error"  # error (stop, naming file:line) | skip (count and report)
    # A sample longer than the target's context (after the max_seq_len cut): error (refused, naming file:line,
    # id and length) | split (consecutive windows of at most the context, each its own sample, positions from 0)
    # | truncate (its first context tokens)
    over_context: str = "error"
    # An assistant turn the conversation renders otherwise than when the target produced it (its reasoning dropped
    # from later history, as Qwen3's and GPT-OSS's templates do): mask (out of the loss) | split (also a sample of
    # its own: the conversation up to that turn)
    history_turns: str = "mask"

    def __post_init__(self) -> None:
        if self.over_context not in OVER_CONTEXT:
            raise ConfigError(f"data.over_context={self.over_context!r}: choose one of {' | '.join(OVER_CONTEXT)} "
                              "(what a sample longer than the target's context becomes: docs/stages.md)")
        if self.history_turns not in HISTORY_TURNS:
            raise ConfigError(f"data.history_turns={self.history_turns!r}: choose one of "
                              f"{' | '.join(HISTORY_TURNS)} (what a turn whose reasoning the template drops from "
                              "later history becomes: docs/stages.md)")


# Where training's target hidden states come from (`data.source`): the `DataSource` classes, one module of
# mtp_train.train.sources each, every one added where it is defined; the first read imports that package (by
# computed name: this floor imports nothing of the project at import time).
DATA_SOURCES: Registry[Any] = Registry("data source", "mtp_train.train.sources")
TRANSPORTS = ("spool",)  # how a fleet's captures reach the trainer (`data.fleet.transport`)


@dataclass
class OnlineDataConfig:
    """How `data.source=online|hybrid` turns the conversations of `data.paths` into samples, with the names and
    meaning of `mtp-precompute`'s settings (`conf/precompute.yaml`): the same settings give the same samples, split
    and (hybrid) shards as that command."""

    max_seq_len: int = 2048  # longer samples are truncated (keeping the start)
    limit: int | None = None  # use only the first N conversations
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    val_fraction: float = 0.02  # share of samples in the validation split (by the id rule precompute records)
    seed: int = 0  # seeds the train/val split
    # The hidden states the head sees, as a precompute folder would store them (bfloat16 | float16 | float32 |
    # float8_e4m3); hybrid writes them so.
    hidden_dtype: str = "bfloat16"
    shard_tokens: int = 131072  # hybrid: most tokens per shard written during epoch 0


@dataclass
class FleetConfig(EndpointsConfig):
    """`data.source=fleet`: the running `vllm serve` processes (started with our capture connector) whose captures
    training consumes as they land, and the bound on the spool folder they write to (docs/training.md).
    EndpointsConfig's keys (endpoints, served_model, concurrency, timeout, retries, backoff, dead_after: those of
    mtp-regenerate and of mtp-precompute's vllm.) name the servers and the client's rules."""

    spool_dir: str | None = None  # the folder the servers write captures to, as this machine sees it (one per run)
    max_spool_bytes: int = 20 * 2**30  # most bytes of captures on disk or on their way at any moment
    window: int = 64  # most requests sent at once (a part; the next part goes once it is answered)
    transport: str = "spool"  # how captures reach the trainer: spool (files in spool_dir)
    capture_timeout: float = 120.0  # seconds a capture file may take to appear once its request is answered

    def endpoint_key(self, name: str) -> str:
        """EndpointsConfig's keys sit under `data.fleet.` in mtp-train."""
        return f"data.fleet.{name}"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"data.fleet.transport={self.transport!r}: choose one of {' | '.join(TRANSPORTS)} "
                              "(docs/serving.md says where Mooncake stands)")


@dataclass
class TrainDataConfig(DataConfig):
    """Training data: where the target's hidden states come from (`source`) and the precompute folder `dir`.

    offline: read the precompute folder `dir` (`mtp-precompute`'s out); the inherited fields (the `data=` group:
    name, paths, ...) name the conversations it was made from and are recorded with the run. online: the trainer
    holds the target and computes each micro-batch's hidden states from the conversations of `paths` (samples as
    `online` says), writing nothing. hybrid: epoch 0 as online, writing `dir` as a precompute folder on the way;
    later epochs read it.
    """

    source: str = "offline"  # offline | online | hybrid | fleet (DATA_SOURCES)
    dir: str = "runs/precompute"  # precompute folder: shards + manifest.json for this target (hybrid writes it)
    num_workers: int = 0  # DataLoader worker processes per rank (0 = read in the training process)
    verify: str = "first_open"  # shard checksums: first_open | always (before training) | never (sizes only)
    online: OnlineDataConfig = field(default_factory=OnlineDataConfig)  # samples of online, hybrid and fleet runs
    fleet: FleetConfig = field(default_factory=FleetConfig)  # the servers and spool of a fleet run

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source not in DATA_SOURCES:
            raise ConfigError(f"{unknown_source(self.source)} (offline reads the precompute folder data.dir, online "
                              "computes hidden states from data.paths, hybrid does epoch 0 online and writes data.dir "
                              "for the later epochs, fleet trains from running vLLM servers' captures)")


def unknown_source(name: str) -> str:
    """The refusal of `data.source=name`, naming the registered sources."""
    return f"data.source={name!r}: choose one of {' | '.join(sorted(DATA_SOURCES.names()))}"
