"""`mtp-export`: a trained head in a layout serving engines load."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtp_train.config.model import ModelConfig

# The layouts `mtp-export import_from=` reads back into one of our heads.
IMPORT_LAYOUTS = ("dflash", "speculators-dflash", "dspark", "speculators-peagle")


@dataclass
class ExportConfig:
    """`mtp-export`: a trained head in a layout serving engines load."""

    # The target the head was trained for. model.path empty (conf/export.yaml): the target the head records
    # (`heads.checkpoint.recorded_target`: its train_config.yaml or config.json), resolved; set it to use another.
    model: ModelConfig = field(default_factory=ModelConfig)
    head_ckpt: str | None = None  # head folder (mtp-train's heads/step-N)
    # native (any head) | vllm-eagle, sglang-eagle (eagle1) | deepseek-mtp, qwen3-next-mtp (mtp) |
    # speculators, sglang-eagle3 (eagle3) | dflash (dflash) | dspark (dspark)
    format: str = "native"
    out: str = "runs/export"
    # Replace an export of another head or a trained head in `out`, and remove links found there (else refused).
    overwrite: bool = False
    # TARGET_DIR: write a loadable copy of that target checkpoint folder with the head as its own MTP layer
    # (format=deepseek-mtp; shards linked, not copied: mtp_train/export/stitch.py); the head is loaded against it
    stitch: str | None = None
    verify_fingerprint: bool = True  # refuse a head trained for other target weights
    # The model id a server serves the target under (e.g. `vllm serve ... --served-model-name`), written as the
    # verifier's name (speculators formats: speculators_config.verifier.name_or_path); null = the target's folder
    verifier_name: str | None = None
    # The command in reverse: dflash = head_ckpt is a DFlash drafter in z-lab's layout, dspark = a DSpark drafter
    # in vLLM's Qwen3 layout (trained elsewhere, as vLLM loads them), read into our dflash / dspark head and written
    # as a native head (format=native) that mtp-eval evaluates and mtp-train fine-tunes; null = one of our heads
    import_from: str | None = None

    def __post_init__(self) -> None:
        check_import(self.import_from, self.format, self.stitch)


def check_import(import_from: str | None, fmt: str, stitch: str | None) -> None:
    """Refuse, by key, an `import_from` that is unknown or combined with a layout or a stitch."""
    if import_from is None:
        return
    if import_from not in IMPORT_LAYOUTS:
        raise ValueError(f"import_from={import_from!r}: choose one of {', '.join(IMPORT_LAYOUTS)} (or null)")
    if fmt != "native":
        raise ValueError(f"import_from={import_from} writes a native head: drop format={fmt} (export the native "
                         "head afterwards if another layout is wanted)")
    if stitch:
        raise ValueError("import_from and stitch do not go together: import first, then stitch the native head")
