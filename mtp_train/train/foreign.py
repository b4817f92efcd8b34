"""What `mtp-train` refuses for a target no family here implements (`models.foreign`): anything that runs it.

Such a target trains an eagle3 head from a folder captured inside vLLM (`mtp-precompute backend=vllm`,
`data.source=offline`); the trainer then reads only its config keys, embedding and lm_head. A data source that
computes hidden states with our engine, our engine's speculative validation (`spec_eval`) or another head type (a
head over the family's own layers) would need the family's implementation: each is refused by name, in one line,
before anything is built or written. (eagle3 starts from scratch only: no `head.init` reads a target layer.)
"""

from __future__ import annotations

from pathlib import Path

from mtp_train.config import ConfigError, TrainConfig
from mtp_train.models.foreign import FOREIGN_HEAD_TYPES, foreign_dir, refusal
from mtp_train.train.sources import source_class


def check_foreign_target(cfg: TrainConfig) -> None:
    """Raise ConfigError when `cfg` asks for something a foreign target at `model.path` cannot give; nothing for a
    target a family here runs."""
    path = Path(cfg.model.path)
    if not foreign_dir(path):
        return
    if source_class(cfg.data.source).runs_target:
        raise ConfigError(refusal(path, f"data.source={cfg.data.source} (hidden states from our engine)"))
    if cfg.spec_eval.prompts:
        raise ConfigError(refusal(path, "spec_eval.prompts (validation by our engine's speculative decoding: set "
                                        "spec_eval.prompts=[])"))
    if cfg.head.type not in FOREIGN_HEAD_TYPES:
        raise ConfigError(refusal(path, f"head={cfg.head.type} (a head over the family's own layers; such a target "
                                        f"takes head={' | '.join(FOREIGN_HEAD_TYPES)})"))
