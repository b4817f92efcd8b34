"""`mtp-export`: a trained head in a layout serving engines load."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtp_train.config.model import ModelConfig


@dataclass
class ExportConfig:
    """`mtp-export`: a trained head in a layout serving engines load."""

    # The target the head was trained for. model.path empty (conf/export.yaml): the target the head records
    # (`heads.checkpoint.recorded_target`: its train_config.yaml or config.json), resolved; set it to use another.
    model: ModelConfig = field(default_factory=ModelConfig)
    head_ckpt: str | None = None  # head folder (mtp-train's heads/step-N)
    # native (any head) | a layout of the head's type (`mtp-export formats`: its `HeadType.layouts`, e.g.
    # speculators for eagle3 heads; mtp_train/export/layouts.py lists them)
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
    # The command in reverse: head_ckpt is a drafter trained elsewhere in this layout (one with a reader, e.g. z-lab's
    # dflash or vLLM's dspark, as vLLM loads them), read into our head of its type and written as a native head
    # (format=native) that mtp-eval evaluates and mtp-train fine-tunes; null = one of our heads. The name is checked
    # against the registered layouts when the command runs (`mtp_train.export.import_layouts`).
    import_from: str | None = None

    def __post_init__(self) -> None:
        check_import(self.import_from, self.format, self.stitch)


def check_import(import_from: str | None, fmt: str, stitch: str | None,
                 known: tuple[str, ...] | None = None) -> None:
    """Refuse, by key, an `import_from` combined with a layout or a stitch, or, given the layouts that can be read
    back (`known`: the export registry's, which this floor does not import), one that is not among them."""
    if import_from is None:
        return
    if known is not None and import_from not in known:
        raise ValueError(f"import_from={import_from!r}: choose one of {', '.join(known)} (or null)")
    if fmt != "native":
        raise ValueError(f"import_from={import_from} writes a native head: drop format={fmt} (export the native "
                         "head afterwards if another layout is wanted)")
    if stitch:
        raise ValueError("import_from and stitch do not go together: import first, then stitch the native head")
