"""Where conversations come from and how they are read (`conf/data/*.yaml`), and the training data folder."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    """Where conversations come from and how they are read (`conf/data/*.yaml`)."""

    name: str = "custom"  # short name recorded in manifests
    paths: list[str] = field(default_factory=list)  # .jsonl/.json/.parquet/.csv files, folders, globs, HF datasets
    format: str = "auto"  # auto | sharegpt | messages | prompt
    field_map: dict[str, str] = field(default_factory=dict)  # our field name → the file's field name
    system_prompt: str | None = None  # added to every conversation that has no system turn
    on_bad_row: str = "error"  # error (stop, naming file:line) | skip (count and report)


@dataclass
class TrainDataConfig(DataConfig):
    """Training data: the precompute folder `dir` (`mtp-precompute`'s `out`).

    The inherited fields (the `data=` group: name, paths, ...) name the conversations that folder was made
    from; training reads only `dir` and records the rest with the run.
    """

    dir: str = "runs/precompute"  # precompute folder: shards + manifest.json for this target
    num_workers: int = 0  # DataLoader worker processes per rank (0 = read in the training process)
    verify: str = "first_open"  # shard checksums: first_open | always (before training) | never (sizes only)
