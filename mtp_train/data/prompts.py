"""Prompt sets (evaluation, the training run's speculative validation): `conf/data/<name>.yaml` names or prompt
files, read into conversations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from mtp_train.config import CONF_DIR, DataConfig
from mtp_train.data.readers import Conversation, DataError, read_conversations


@dataclass
class PromptSet:
    """A named list of conversations whose user turns are the prompts (assistant turns are ignored)."""

    name: str
    convs: list[Conversation]


def data_config(entry: str, conf_dir: str | Path = CONF_DIR) -> DataConfig:
    """A prompt-set entry → DataConfig: an existing file/folder, else `<conf_dir>/data/<entry>.yaml`."""
    if Path(entry).exists():
        return DataConfig(name=Path(entry).stem, paths=[entry])
    yaml = Path(conf_dir) / "data" / f"{entry}.yaml"
    if not yaml.is_file():
        known = sorted(p.stem for p in (Path(conf_dir) / "data").glob("*.yaml"))
        raise DataError(f"prompts entry {entry!r}", None, "neither a file nor a data config",
                        f"known configs: {', '.join(known)}")
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(yaml))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def load_prompt_sets(entries: Sequence[str], limit: int | None = None,
                     conf_dir: str | Path = CONF_DIR) -> list[PromptSet]:
    """Read every entry (the first `limit` conversations of each); conversations without a user turn are dropped."""
    sets = []
    for entry in entries:
        d = data_config(entry, conf_dir)
        missing = [p for p in d.paths if not Path(p).exists() and not any(Path().glob(p))]
        if missing:
            raise DataError(f"prompt set {entry!r}", None, f"{', '.join(missing)} not found",
                            "paths are relative to the working directory")
        convs, _ = read_conversations(d, limit=limit)
        convs = [c for c in convs if any(m["role"] == "user" for m in c.messages)]
        if not convs:
            raise DataError(f"prompt set {entry!r}", None, "no user turns", ", ".join(d.paths))
        sets.append(PromptSet(d.name, convs))
    return sets
