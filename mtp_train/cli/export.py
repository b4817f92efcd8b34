"""`mtp-export`: write a trained head in a layout serving engines load.

    mtp-export head_ckpt=runs/train/heads/step-1000 format=deepseek-mtp out=runs/export/deepseek-mtp
    mtp-export head_ckpt=runs/ablation/eagle1/heads/step-16 format=vllm-eagle out=runs/export/eagle  # eagle1 heads
    mtp-export head_ckpt=runs/eagle3/heads/step-1000 format=speculators out=runs/export/eagle3  # eagle3 heads
    mtp-export head_ckpt=runs/ds3/heads/step-1000 format=deepseek-mtp stitch=models/deepseek-v3 out=runs/ds3-mtp
        # the target's checkpoint folder with the fine-tuned head as its MTP layer (shards linked, not copied)
    mtp-export import_from=dflash head_ckpt=downloads/dflash-drafter model.path=models/Qwen3-8B out=runs/imported
        # the command in reverse: a DFlash drafter trained elsewhere (z-lab's layout) as a native head for mtp-eval
        # and mtp-train (model.path required: such a drafter records no target of ours)
    mtp-export import_from=dspark head_ckpt=downloads/dspark-drafter model.path=models/Qwen3-8B out=runs/imported
    formats: native and each head type's layouts (vllm-eagle | sglang-eagle | deepseek-mtp | qwen3-next-mtp |
        speculators | sglang-eagle3 | dflash | speculators-dflash | dspark | speculators-peagle today); import_from:
        the layouts with a reader (dflash | speculators-dflash | dspark | speculators-peagle today)

The target is the one the head records (its train_config.yaml, or the config.json of a head mtp-export wrote),
resolved to an absolute path and named on the console; `model.path=DIR` exports for another folder. The
speculators formats name the verifier by that folder, or by `verifier_name` (the model id a server serves it as).
The export is loaded back and its logits compared with the trained head's before the command reports success.
See `mtp_train.export.layouts` for each layout's tensor names. `out` is never the head itself; an `out` holding an
export of another head, or a head mtp-train saved, is replaced only with `overwrite=true`, and then as a whole:
the new export is written beside it and swapped in once it has been read back (`mtp_train.cli.outputs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mtp_train.cli.common import ensure_model, hydra_entry
from mtp_train.cli.outputs import EXPORT, claim_output, staged_folder
from mtp_train.config import check_config
from mtp_train.config.export import check_import
from mtp_train.export import describe, export_head, import_layouts, stitch_head, verify_round_trip, verify_stitched
from mtp_train.fileio import file_problem
from mtp_train.heads.checkpoint import TARGET_KEY, recorded_target
from mtp_train.models.config import ModelConfigError

PROG = "mtp-export"


def export_main(cfg: DictConfig) -> dict[str, Any]:
    """Run `mtp-export`; returns {"out", "format", "tensors", "max_abs_diff"}."""
    check_config(cfg, "export")
    check_import(cfg.get("import_from"), cfg.format, cfg.get("stitch"), import_layouts())
    # Refuses `out` holding the head itself, another head's export or a trained head (unless overwrite=true),
    # then holds its lock.
    # An imported folder is not one of our heads: an earlier export in `out` is replaced only with overwrite=true.
    head = None if cfg.get("import_from") else (cfg.head_ckpt or None)
    with claim_output(cfg.out, EXPORT, head_ckpt=head, overwrite=cfg.overwrite) as claim:
        if not claim.replaces:
            return _export_main(cfg, cfg.out)
        with staged_folder(cfg.out) as stage:  # the old folder goes only once the new one has been read back
            result = _export_main(cfg, str(stage))
        return {**result, "out": cfg.out}


def _export_main(cfg: DictConfig, out_dir: str) -> dict[str, Any]:
    """The export of `cfg` written into `out_dir`."""
    if not cfg.head_ckpt:
        raise ValueError("head_ckpt=DIR is required (a head folder written by mtp-train)")
    if cfg.stitch:
        return _stitch_main(cfg, out_dir)
    if cfg.get("import_from"):
        return _import_main(cfg, out_dir)
    target_dir = export_target(cfg)
    out = export_head(cfg.head_ckpt, target_dir, cfg.format, out_dir, verify_fingerprint=cfg.verify_fingerprint,
                      verifier_name=cfg.get("verifier_name"))
    diff = verify_round_trip(cfg.head_ckpt, out, target_dir)
    # Exact for every layout but Qwen3-Next's, whose norm weights are stored as w − 1 (one rounding at most);
    # the EAGLE-3 layouts also give the draft vocabulary back (d2t / t2d), so the draft logits match too.
    if diff > 1e-5:
        raise RuntimeError(f"{out}: the loaded export differs from the head by {diff:g}")
    info = describe(out)
    print(f"{PROG}: {info['head']} head → {cfg.format} ({info['tensors']} tensors) in {cfg.out}; loaded back: "
          f"features within {diff:.1e}", flush=True)
    return {"out": str(out), **info, "max_abs_diff": diff}


def export_target(cfg: DictConfig) -> Path:
    """The target folder of an export or import, absolute: `model.path` when given (a missing default folder
    fetched, `ensure_model`), else the one the head records (`recorded_target`), said on the console."""
    if cfg.model.path:
        config = Path(cfg.model.path) / "config.json"
        problem = file_problem(config)  # a FIFO or a link loop is no missing folder to fetch
        if problem and problem != "does not exist":
            raise ModelConfigError(f"{config} {problem}; put the model's config.json file there (copy or fetch the "
                                   "model folder again)")
        return ensure_model(cfg.model).resolve()
    if cfg.get("import_from"):
        raise ModelConfigError(f"import_from={cfg.import_from} needs model.path=<the target's folder>: a drafter "
                               "trained elsewhere records no target this command can read")
    record = recorded_target(cfg.head_ckpt)
    if record is None:
        raise ModelConfigError(f"{cfg.head_ckpt} records no target (no train_config.yaml beside it, no "
                               f"extra.{TARGET_KEY} in its config.json): pass model.path=<the folder of the target "
                               "it was trained on>")
    target = record.path.resolve()
    problem = file_problem(target / "config.json")
    if problem:
        raise ModelConfigError(f"the head's target {target}, as {record.source} records it: {target / 'config.json'} "
                               f"{problem}; pass model.path=<the target's folder> if it has moved")
    print(f"{PROG}: target {target}, as the head records it ({record.source}); model.path=DIR exports for "
          "another", flush=True)
    return target


def _import_main(cfg: DictConfig, out_dir: str) -> dict[str, Any]:
    """`import_from=<a layout with a reader>`: the drafter in head_ckpt (e.g. z-lab's or speculators' DFlash layout,
    vLLM's DSpark layout) as a native head in `out_dir`, loaded back and compared with the drafter read from the
    folder before success is reported."""
    import torch

    from mtp_train.export.exporter import probe_difference
    from mtp_train.export.importer import import_drafter
    from mtp_train.heads import load_head, save_head
    from mtp_train.models.fingerprint import weights_fingerprint

    target_dir = export_target(cfg)
    head = import_drafter(cfg.import_from, cfg.head_ckpt, target_dir, dtype=torch.float32)
    save_head(head, out_dir, extra_config={"imported_from": str(cfg.head_ckpt), "layout": cfg.import_from,
                                           TARGET_KEY: str(target_dir)},
              target_fingerprint=weights_fingerprint(target_dir))
    diff = probe_difference(head, load_head(out_dir, target_dir, dtype=torch.float32))
    if diff > 0:
        raise RuntimeError(f"{out_dir}: the saved head differs from the drafter read from {cfg.head_ckpt} by {diff:g}")
    print(f"{PROG}: {cfg.import_from} drafter {cfg.head_ckpt} → native {head.cfg.type} head in {cfg.out} "
          f"({head.num_params() / 1e6:.2f}M parameters, aux layers {head.aux_layers}); "
          "loaded back exactly", flush=True)
    return {"out": cfg.out, "format": "native", "imported_from": cfg.import_from, "max_abs_diff": diff}


def _stitch_main(cfg: DictConfig, out_dir: str) -> dict[str, Any]:
    """`stitch=TARGET_DIR`: the target's checkpoint with the head as its MTP layer, read back through
    head.init=target_mtp and compared with the head before success is reported."""
    res = stitch_head(cfg.head_ckpt, cfg.stitch, out_dir, cfg.format, verify_fingerprint=cfg.verify_fingerprint)
    diff = verify_stitched(cfg.head_ckpt, res.out, cfg.stitch)
    if diff > 0:  # the layer's tensors are moved, never changed
        raise RuntimeError(f"{res.out}: the MTP layer read back differs from the head by {diff:g}")
    for name in res.mixed:
        print(f"{PROG}: warning: {name} (linked from the target) also holds the replaced MTP tensors; loaders that "
              "follow the index skip them, one that reads every tensor of every file would not", flush=True)
    print(f"{PROG}: mtp head → {cfg.stitch} stitched into {cfg.out} ({res.new_tensors} tensors in the new shard, "
          f"{len(res.links)} shard(s) linked, {len(res.copied)} file(s) copied); read back exactly", flush=True)
    return {"out": str(res.out), "format": cfg.format, "stitched": cfg.stitch, "tensors": res.new_tensors,
            "links": sorted(res.links), "mixed": res.mixed, "max_abs_diff": diff}


main = hydra_entry(PROG, "export", export_main)

if __name__ == "__main__":
    main()
