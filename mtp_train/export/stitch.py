"""Put a fine-tuned MTP head back into its target's checkpoint: `mtp-export format=deepseek-mtp stitch=TARGET_DIR`.

The stitched folder is a loadable copy of the target's checkpoint folder that copies no weights of the target:

    config.json                       the target's, with num_nextn_predict_layers >= 1 and an `mtp_train` block
                                      (head config, dims, fingerprint, the new shard's sha256, the file's own
                                      config_sha256) engines ignore
    tokenizer*, generation_config.json, chat_template.jinja, *.py ...   copied (every other top-level file)
    model-mtp.safetensors             NEW: the head as `model.layers.{L}.*` (the deepseek-mtp layout, with its
                                      embed_tokens / shared_head.head copies, as the release stores them)
    <the target's shard files>        symlinks to the target's own files (absolute, resolved), never copies
    model.safetensors.index.json      weight_map: every target tensor but the old `model.layers.{L}.*` at its own
                                      shard, the new layer at model-mtp.safetensors

A single-file target (`model.safetensors`) is linked as `model-target.safetensors` and gets an index: a folder
holding both `model.safetensors` and an index is read from the single file by transformers, so that name is never
used here. A target shard that holds only the old MTP layer is not linked at all (nothing else points at it).

Why absolute links: the export usually lives in a run folder and the target in a model store, and either moves
without the other (a run folder copied to another place on the same machine keeps working); the target is resolved
first, so a link into a Hugging Face cache snapshot points at the blob itself. A relative link would break as
soon as the export folder moves. Copying the folder to another machine needs `cp -L` (or the target at the same
path there).

Index-driven loaders (transformers, this project's) read exactly the weight map. A loader that reads every tensor of
every file the index names (vLLM's safetensors iterator does) also meets the old MTP tensors of a target shard that
mixes them with other tensors; `stitch` returns those shards (`StitchResult.mixed`) and the CLI warns about them.
Not offered: stitching into a quantised (FP8) target (the new shard would hold unquantised weights under a
`quantization_config` that says otherwise: refused by name), and Qwen3-Next's `mtp.*` layout (its target, a
linear-attention model, is not a family here).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mtp_train.config.head import HeadConfig
from mtp_train.export.exporter import export_digest, head_sha256, layout_tensors
from mtp_train.export.layouts import LayoutError
from mtp_train.fileio import atomic_write, atomic_write_text, tensor_bytes
from mtp_train.heads.base import DraftHead
from mtp_train.heads.checkpoint import CONFIG_DIGEST, file_checksums, head_dims, load_head, read_head_config
from mtp_train.heads.registry import build_head
from mtp_train.layers.attention import AttentionMetadata
from mtp_train.models.families import family_of
from mtp_train.models.loader import checkpoint_files, mtp_layer_prefixes

STITCH_FORMATS = ("deepseek-mtp",)  # layouts `stitch` writes into a target checkpoint
NEW_SHARD = "model-mtp.safetensors"  # the fine-tuned MTP layer
SINGLE_LINK = "model-target.safetensors"  # a single-file target's model.safetensors, linked under this name
INDEX = "model.safetensors.index.json"
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # never copied from the target (weights)


@dataclass
class StitchResult:
    """What `stitch` wrote."""

    out: Path
    links: dict[str, Path] = field(default_factory=dict)  # link name in `out` → the target file it points at
    copied: list[str] = field(default_factory=list)  # the target's non-weight files copied
    new_tensors: int = 0  # tensors in the new shard
    mixed: list[str] = field(default_factory=list)  # linked target shards that also hold old MTP tensors


def stitch(head: DraftHead, target_dir: str | Path, out: str | Path, fmt: str = "deepseek-mtp",
           head_meta: dict[str, Any] | None = None) -> StitchResult:
    """Write the stitched copy of `target_dir` with `head` (an mtp head trained for it) as its MTP layer into `out`.

    head_meta: recorded in config.json's `mtp_train` block (e.g. the head's target fingerprint). Refuses by name
    a format it cannot stitch, a quantised target, and an `out` that is the target folder itself.
    """
    if fmt not in STITCH_FORMATS:
        why = (" (Qwen3-Next's target is not a family here: export its mtp.* layout without stitch)"
               if fmt == "qwen3-next-mtp" else "")
        raise LayoutError(f"stitch=TARGET_DIR writes {'/'.join(STITCH_FORMATS)} only, not format={fmt}{why}")
    target = Path(target_dir).resolve()
    out = Path(out)
    if out.resolve() == target:
        raise LayoutError(f"stitch: out={out} is the target folder itself; choose a new folder")
    if (out / "model.safetensors").exists():  # transformers would read that file and never the index
        raise LayoutError(f"stitch: {out} holds a model.safetensors (an earlier export?); choose a new folder")
    config = json.loads((target / "config.json").read_text())
    if config.get("quantization_config"):
        raise LayoutError(f"stitch: {target / 'config.json'} declares quantization_config: the fine-tuned MTP layer "
                          "would be stored unquantised where the config says otherwise; stitch into a bf16 copy")
    args = head.target_args
    if not hasattr(args, "num_nextn_predict_layers"):  # the family's loaders would refuse the new layer's tensors
        raise LayoutError(f"stitch: a {family_of(args).title} target declares no MTP layers "
                          "(num_nextn_predict_layers); stitch into a DeepSeek-V3 / Kimi-K2 checkpoint, or export the "
                          "head on its own (without stitch)")
    tensors = layout_tensors(head, fmt)  # model.layers.{L}.* (checked to give the head back exactly)
    new_prefix = f"model.layers.{args.num_layers}."
    files = checkpoint_files(target)
    # The target's own copy of the layer being replaced; its other MTP layers (if any) stay referenced.
    weight_map = {name: f for name, f in files.items() if not name.startswith(new_prefix)}
    single = not (target / INDEX).is_file()
    link_of = {f: (SINGLE_LINK if single else f.name) for f in set(files.values())}
    if NEW_SHARD in link_of.values():
        raise LayoutError(f"stitch: {target} already has a file named {NEW_SHARD}")

    out.mkdir(parents=True, exist_ok=True)
    result = StitchResult(out=out, new_tensors=len(tensors))
    atomic_write(out / NEW_SHARD, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt",
                                                                                      "layout": fmt}),
                 size=tensor_bytes(tensors))
    old = set(files.values()) - set(weight_map.values())  # target shards holding only the replaced layer
    for f in sorted(set(weight_map.values())):
        _link(out / link_of[f], f.resolve())
        result.links[link_of[f]] = f.resolve()
        if any(n.startswith(new_prefix) for n, g in files.items() if g == f):
            result.mixed.append(link_of[f])
    for f in sorted(old):  # a stale link from an earlier stitch must not outlive its purpose
        if (out / link_of[f]).is_symlink():
            (out / link_of[f]).unlink()
    for src in sorted(target.iterdir()):
        if src.is_file() and src.name not in ("config.json", INDEX) and not src.name.endswith(WEIGHT_FILES):
            shutil.copy2(src, out / src.name)
            result.copied.append(src.name)

    index = {"metadata": {"stitched_from": str(target), "mtp_layer": new_prefix.rstrip(".")},
             "weight_map": {**{n: link_of[f] for n, f in sorted(weight_map.items())},
                            **dict.fromkeys(sorted(tensors), NEW_SHARD)}}
    atomic_write_text(out / INDEX, json.dumps(index, indent=2) + "\n")
    n_mtp = max(1, len(mtp_layer_prefixes(args)))
    config.update(num_nextn_predict_layers=n_mtp)
    config["mtp_train"] = {"format": fmt, "stitched": True, "head": head.cfg.to_dict(),
                           "dims": head_dims(args), "num_params": head.num_params(), **(head_meta or {}),
                           "files": file_checksums(out, [NEW_SHARD])}
    config["mtp_train"][CONFIG_DIGEST] = export_digest(config)  # as every export's config.json records itself
    atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return result


def _link(path: Path, to: Path) -> None:
    """Make `path` a symlink to `to` (absolute), replacing whatever link or file was there, atomically."""
    tmp = path.with_name(f".{path.name}.link-tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(to, tmp)
    os.replace(tmp, path)


def stitch_head(head_dir: str | Path, target_dir: str | Path, out: str | Path, fmt: str = "deepseek-mtp", *,
                verify_fingerprint: bool = True) -> StitchResult:
    """`stitch` the head saved in `head_dir` (trained for the target in `target_dir`) into that target's copy."""
    meta = read_head_config(head_dir)
    head = load_head(head_dir, target_dir, verify_fingerprint=verify_fingerprint)
    return stitch(head, target_dir, out, fmt, head_meta={"target_fingerprint": meta.get("target_fingerprint"),
                                                          "head_sha256": head_sha256(meta)})


def verify_stitched(head_dir: str | Path, stitched_dir: str | Path, target_dir: str | Path, rows: int = 8) -> float:
    """Max |Δ| between the trained head's output features and those of the head that `head.init=target_mtp` builds
    from the stitched folder (0.0 = identical), on `rows` random input rows and tokens, one prefill step each."""
    a = load_head(head_dir, target_dir, verify_fingerprint=False)
    cfg = HeadConfig.from_dict({**a.cfg.to_dict(), "init": "target_mtp", "draft_vocab_size": 0})
    b = build_head(cfg, stitched_dir, dtype=a.dtype).eval()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, a.input_width, generator=g, dtype=a.dtype)  # (rows, H)
    tokens = torch.randint(0, a.args.vocab_size, (rows,), generator=g)  # (rows,)
    meta = AttentionMetadata.build([rows])
    with torch.no_grad():
        fa = a(hidden, tokens, meta, from_target=True).hidden  # (rows, H)
        fb = b(hidden, tokens, meta, from_target=True).hidden
    return float((fa - fb).abs().max())
