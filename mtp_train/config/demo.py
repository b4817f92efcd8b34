"""`mtp-demo` (`conf/demo.yaml`): the whole pipeline on the default model."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DemoConfig:
    """`mtp-demo` (`conf/demo.yaml`): the pipeline's output folder and each stage's Hydra overrides."""

    out: str = "runs/demo"
    model_path: str = "models/smollm2-135m-instruct"  # fetched on first use when it is the default folder
    # The prompt set (conf/data/<name>.yaml) the target answers for the head's training data: demo-960 (the 320
    # demo prompts and 640 more of the same mix; at the same steps τ +0.08 from 320 to 640 and +0.03 from 640 to 960
    # at k = 3, docs/results.md)
    data: str = "demo-960"
    regenerate: list[str] = field(default_factory=list)
    precompute: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    export: list[str] = field(default_factory=list)
