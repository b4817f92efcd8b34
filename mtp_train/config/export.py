"""`mtp-export`: a trained head in a layout serving engines load."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtp_train.config.model import ModelConfig


@dataclass
class ExportConfig:
    """`mtp-export`: a trained head in a layout serving engines load."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the target the head was trained for
    head_ckpt: str | None = None  # head folder (mtp-train's heads/step-N)
    # native (any head) | vllm-eagle, sglang-eagle (eagle1) | deepseek-mtp, qwen3-next-mtp (mtp) |
    # speculators, sglang-eagle3 (eagle3)
    format: str = "native"
    out: str = "runs/export"
    # Replace an export of another head or a trained head in `out`, and remove links found there (else refused).
    overwrite: bool = False
    # TARGET_DIR: write a loadable copy of that target checkpoint folder with the head as its own MTP layer
    # (format=deepseek-mtp; shards linked, not copied: mtp_train/export/stitch.py); the head is loaded against it
    stitch: str | None = None
    verify_fingerprint: bool = True  # refuse a head trained for other target weights
