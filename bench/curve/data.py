"""The learning curve's precompute folders: made (or resumed) here from the shared self-distilled set or the demo's
own conversations, or given, and checked to hold what its heads read."""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import REGEN_DATA, ROOT, compose
from bench.curve.config import CurveConfig


def data_overrides(cfg: CurveConfig, check: bool = True) -> list[str]:
    """The mtp-precompute / mtp-train data overrides of the config's own conversations (`data:` with paths):
    `data=<name> data.paths=[...]`; [] without paths. With `check`, a missing file is refused by its key."""
    if not cfg.data.paths:
        return []
    missing = [p for p in cfg.data.paths if not Path(p).is_file()]
    if check and missing:
        raise SystemExit(f"curve: data.paths {missing} not found (relative to {Path.cwd()}): make them first "
                         "(e.g. mtp-regenerate ... out=<path>), or run from the checkout's root")
    return [f"data={cfg.data.name}", f"data.paths=[{','.join(str(p) for p in cfg.data.paths)}]"]


def prepare_data(cfg: CurveConfig, out: Path, model: str, aux_layers: list[int],
                 name: str | None = None) -> tuple[Path, str, str]:
    """The precompute folder (made or resumed here), holding `aux_layers` besides the final hidden state when
    given (`name`, default `precompute-aux`, else `precompute`); returns (folder, data name, description).

    The conversations: the config's `data.paths` when given, else the shared self-distilled set when
    ../shared/data has it, else the demo's own (regenerated here as `make demo` does)."""
    from mtp_train.cli.precompute import precompute_main

    name = name or ("precompute-aux" if aux_layers else "precompute")
    aux = [f"aux_layers=[{','.join(str(j) for j in aux_layers)}]"] if aux_layers else []
    if cfg.data.paths:
        pc = out / name
        precompute_main(compose("precompute", [f"model.path={model}", *data_overrides(cfg), f"out={pc}",
                                               *cfg.precompute, *aux]))
        return pc, cfg.data.name, (f"{', '.join(cfg.data.paths)} (data={cfg.data.name}), "
                                   f"{' '.join(cfg.precompute)}")
    if REGEN_DATA.is_file():
        pc = out / name
        precompute_main(compose("precompute", [f"model.path={model}", "data=shared-regen", f"out={pc}",
                                               *cfg.precompute, *aux]))
        return pc, "shared-regen", f"shared self-distilled set ({REGEN_DATA.name}), {' '.join(cfg.precompute)}"
    from omegaconf import OmegaConf

    from mtp_train.cli.demo import stage_overrides
    from mtp_train.cli.regenerate import regenerate_main
    from mtp_train.config import DemoConfig

    demo = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DemoConfig),
                                               OmegaConf.load(ROOT / "conf" / "demo.yaml")))
    demo.model_path = model
    stages = stage_overrides(demo, out / "demo")
    regenerate_main(compose("regenerate", stages["regenerate"]))
    pc = out / "demo" / name
    precompute_main(compose("precompute", [o for o in stages["precompute"] if not o.startswith("out=")]
                            + [f"out={pc}", *aux]))
    kind = "the demo's own conversations (data/demo_prompts.jsonl answered by the target)"
    return pc, "demo-regen", kind


def check_folder(data_dir: Path, aux_layers: list[int]) -> None:
    """A given --data-dir must hold the layers a head reads (it may hold more: a head reads its own columns, so one
    folder can serve heads of different layers)."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    have = [int(j) for j in manifest["hidden"].get("aux_layers", [])]
    missing = [j for j in aux_layers if j not in have]
    if missing:
        raise SystemExit(f"curve: {data_dir}/manifest.json holds aux_layers {have}, but a head of the curve reads "
                         f"{list(aux_layers)} (lacking {missing}): precompute a folder with `mtp-precompute "
                         "aux_layers=[...]` for it, or drop --data-dir to let the curve make both folders")


def same_samples(a: Path, b: Path) -> None:
    """Two precompute folders of one curve must hold the same training samples (so the same batch plan)."""
    from mtp_train.precompute import PrecomputedDataset

    la = list(PrecomputedDataset(a, split="train", verify="never").lengths)
    lb = list(PrecomputedDataset(b, split="train", verify="never").lengths)
    if la != lb:
        raise SystemExit(f"curve: {a} and {b} hold different training samples ({len(la)} vs {len(lb)}); "
                         f"precompute both with the same data and precompute overrides")
