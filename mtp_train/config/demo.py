"""`mtp-demo` (`conf/demo.yaml`): the whole pipeline on the default model."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DemoConfig:
    """`mtp-demo` (`conf/demo.yaml`): the pipeline's output folder and each stage's Hydra overrides."""

    out: str = "runs/demo"
    model_path: str = "models/smollm2-135m-instruct"  # fetched on first use when it is the default folder
    # The prompt set (conf/data/<name>.yaml) the target answers for the head's training data: demo-640 (the 320
    # demo prompts and 320 more of the same mix; τ +0.03 to +0.07 over `demo` at the same steps, docs/results.md)
    data: str = "demo-640"
    regenerate: list[str] = field(default_factory=list)
    precompute: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    export: list[str] = field(default_factory=list)
