"""Export a trained head in a layout a serving engine loads, and load such an export back (round trips).

An export folder holds `model.safetensors` (the layout's names) and `config.json`: for `native` our own head
config (`save_head`); for the other layouts the layout's config.json (the target's with the layout's keys, e.g.
`architectures`, `num_nextn_predict_layers`; for EAGLE-3 one built from the head's shapes) plus an `mtp_train`
block (head type, norms, dims, target fingerprint, format, the sha256 of the head's weights) that engines ignore
and `load_export` reads back.

Like a native head's, the config.json of every layout records a checksum of itself, `mtp_train.config_sha256`
(the sha256 of the file without that key, `export_digest`), checked by `load_export`. It sits in the `mtp_train`
block, the one key of ours a layout's config already carries, so the layouts' own keys stay exactly the engines':
vLLM and SGLang read configs through transformers' `PretrainedConfig`, which keeps unknown keys as attributes,
and vLLM's speculators config picks out the keys it knows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtp_train.config.head import HeadConfig, head_spec
from mtp_train.export.layouts import Layout, LayoutError, export_formats, layout_named
from mtp_train.fileio import atomic_write, atomic_write_text, tensor_bytes
from mtp_train.heads.base import DraftHead
from mtp_train.heads.checkpoint import (
    CONFIG_DIGEST,
    TARGET_KEY,
    config_digest,
    file_checksums,
    head_dims,
    load_head,
    read_head_config,
    read_json_config,
    save_head,
    verify_files,
)
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.registry import new_head
from mtp_train.models.config import ModelConfigError, read_config_json
from mtp_train.models.foreign import head_target_args

log = logging.getLogger(__name__)
META = "mtp_train"  # the block of an export's config.json that is ours (engines ignore it)
META_KEYS = ("format", "head", "dims")  # what `load_export` needs from it


def _layout(fmt: str) -> Layout:
    if fmt not in export_formats():
        raise LayoutError(f"unknown export format {fmt!r}; choose one of {', '.join(export_formats())}")
    return layout_named(fmt)


def check_fits(head: DraftHead, fmt: str) -> None:
    """Raise LayoutError naming every reason the head does not fit `fmt`."""
    if fmt == "native":
        return
    layout = _layout(fmt)
    spec = head_spec(head.cfg.type)
    if fmt not in spec.formats:
        raise LayoutError(f"format {fmt} takes {'/'.join(layout.head_types)} heads; this head is "
                          f"{head.cfg.type!r} (use a format for {head.cfg.type} heads: {', '.join(spec.formats)})")
    problems = layout.check(head)
    if problems:
        raise LayoutError(f"this {head.cfg.type} head does not fit format {fmt}:\n  " + "\n  ".join(problems))


def layout_tensors(head: DraftHead, fmt: str) -> dict[str, torch.Tensor]:
    """The head's tensors under the names of `fmt` (CPU, contiguous), after checking that the map is exact."""
    check_fits(head, fmt)
    layout = _layout(fmt)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    tensors = {k: v.contiguous() for k, v in layout.to_layout(state, head).items()}
    back = layout.from_layout(tensors, head)
    own = {k: tuple(v.shape) for k, v in state.items() if k != "draft_vocab" or layout.keeps_draft_vocab}
    got = {k: tuple(v.shape) for k, v in back.items()}
    if own != got:  # every tensor of the head must land in the layout and come back with its shape
        raise LayoutError(f"format {fmt} does not cover the head: missing {sorted(own.keys() - got.keys())}, "
                          f"extra {sorted(got.keys() - own.keys())}, shapes "
                          f"{ {k: (own[k], got[k]) for k in own.keys() & got.keys() if own[k] != got[k]} }")
    changed = [k for k in own if layout.exact and not torch.equal(back[k], state[k])]
    if changed:  # an exact layout only renames, splits and concatenates
        raise LayoutError(f"format {fmt} does not give the head's tensors back unchanged: {changed}")
    return tensors


def export_digest(config: dict[str, Any]) -> str:
    """sha256 (hex) of a layout export's config.json without the digest its `mtp_train` block records."""
    meta = {k: v for k, v in config[META].items() if k != CONFIG_DIGEST}
    return config_digest({**config, META: meta})


def read_export_meta(path: Path) -> dict[str, Any] | None:
    """The `mtp_train` block of the export config `path` (None for a native head's), its checksum checked.

    Raises ModelConfigError naming the file when the file does not match the checksum it records or the block
    lacks what a loader needs; an export without a checksum (an older version's) is read with a warning.
    """
    cfg = read_json_config(path)
    meta = cfg.get(META)
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise ModelConfigError(f"{path}: `{META}` is {type(meta).__name__}, not the export's block; export the head "
                               "again")
    if CONFIG_DIGEST not in meta:
        log.warning("%s records no checksum of itself (written by an older version): it is not verified", path)
    elif meta[CONFIG_DIGEST] != export_digest(cfg):
        raise ModelConfigError(f"{path} does not match the {META}.{CONFIG_DIGEST} it records: the file is damaged "
                               "or was edited; export the head again")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ModelConfigError(f"{path}: `{META}` lacks {', '.join(missing)}; export the head again")
    return meta


def head_sha256(head_config: dict[str, Any]) -> str | None:
    """The sha256 of a head's weights as its config.json records it: which head an export is of (a re-export into
    the same `out` replaces only an export of the same head)."""
    entry = (head_config.get("files") or {}).get("model.safetensors")
    return entry.get("sha256") if isinstance(entry, dict) else None


def export_head(head_dir: str | Path, target_dir: str | Path, fmt: str, out: str | Path, *,
                verify_fingerprint: bool = True, verifier_name: str | None = None) -> Path:
    """Export the head in `head_dir` (trained for the target in `target_dir`) as `fmt` into `out`.

    Args:
        head_dir: a head folder (`save_head`).
        target_dir: the target's folder; a native export records it, resolved, as `extra.target_path`.
        fmt: `export_formats()`.
        out: the export's folder.
        verify_fingerprint: refuse a target whose weights are not the ones the head records.
        verifier_name: the verifier's name in the configs that record one (speculators' `verifier.name_or_path`),
            e.g. the model id a server serves the target under; None = the target's folder, resolved (never a path
            relative to this process's working folder, which names nothing once the export is moved).
    """
    if fmt not in export_formats():
        raise LayoutError(f"unknown export format {fmt!r}; choose one of {', '.join(export_formats())}")
    cfg = read_head_config(head_dir)
    head = load_head(head_dir, target_dir, verify_fingerprint=verify_fingerprint)
    out = Path(out)
    target = Path(target_dir).resolve()
    if fmt == "native":
        extra = cfg["extra"] if isinstance(cfg.get("extra"), dict) else {}
        extra = {**extra, TARGET_KEY: str(target)}  # the export's own record of its target (`recorded_target`)
        return save_head(head, out, extra_config=extra, target_fingerprint=cfg.get("target_fingerprint"))
    tensors = layout_tensors(head, fmt)
    target_cfg = {**read_config_json(target), "_name_or_path": verifier_name or str(target)}
    config = _layout(fmt).config(head, target_cfg)
    config["mtp_train"] = {"format": fmt, "head": head.cfg.to_dict(), "dims": head_dims(head.target_args),
                           "target_fingerprint": cfg.get("target_fingerprint"), "num_params": head.num_params(),
                           "draft_vocab_size": head.cfg.draft_vocab_size, "head_sha256": head_sha256(cfg)}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model.safetensors",
                 lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt", "layout": fmt}),
                 size=tensor_bytes(tensors))
    config["mtp_train"]["files"] = file_checksums(out, ["model.safetensors"])  # `load_export` checks them
    config["mtp_train"][CONFIG_DIGEST] = export_digest(config)  # and config.json itself
    atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def load_export(export_dir: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> DraftHead:
    """Load a folder written by `export_head` (any format) back into one of our heads.

    Refuses, naming the file or the keys, a config.json that does not match its checksum and a folder whose
    tensors are not exactly those of its recorded layout.
    """
    export_dir = Path(export_dir)
    config = export_dir / "config.json"
    meta = read_export_meta(config) if config.is_file() else None
    if meta is None:  # native
        return load_head(export_dir, target_dir, device=device, dtype=dtype, verify_fingerprint=False)
    verify_files(export_dir, meta.get("files"), export_dir / "config.json")
    fmt = meta["format"]
    layout = _layout(fmt)
    args = head_target_args(target_dir)
    if meta["dims"] != head_dims(args):
        raise ModelConfigError(f"{export_dir}: exported for dims {meta['dims']}, target {target_dir} has "
                               f"{head_dims(args)}")
    # Layouts without a draft vocabulary: a loaded export drafts over the whole vocabulary.
    head_cfg = HeadConfig.from_dict({**meta["head"], **({} if layout.keeps_draft_vocab else {"draft_vocab_size": 0})})
    frozen = FrozenTargetParts.from_pretrained(target_dir, device=device)
    head = new_head(head_cfg, args, frozen)
    expected = layout_tensors(head, fmt)
    with safe_open(str(export_dir / "model.safetensors"), framework="pt", device="cpu") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    problems = [f"{k}: missing" for k in sorted(expected.keys() - tensors.keys())]
    problems += [f"{k}: not a tensor of format {fmt}" for k in sorted(tensors.keys() - expected.keys())]
    problems += [f"{k}: shape {tuple(tensors[k].shape)}, expected {tuple(expected[k].shape)}"
                 for k in sorted(expected.keys() & tensors.keys()) if tensors[k].shape != expected[k].shape]
    if problems:
        raise ModelConfigError(f"{export_dir} is not a valid {fmt} export:\n  " + "\n  ".join(problems))
    state = layout.from_layout(tensors, head)
    dt = dtype or next(iter(state.values())).dtype
    head.load_state_dict({k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()})
    head.attach(frozen.to(device=device, dtype=dt))
    return head.to(device=device, dtype=dt).eval()


def verify_round_trip(head_dir: str | Path, export_dir: str | Path, target_dir: str | Path, rows: int = 8) -> float:
    """Max |Δ| between the trained head's and the loaded export's output features on random inputs (0.0 =
    identical): `rows` random step-0 rows of the head's input width (k·H for an aux head, whatever its type) and
    random tokens, one prefill step each (a block drafter: every row's block; `DraftHead.probe_features`), no
    cache."""
    a = load_head(head_dir, target_dir, verify_fingerprint=False)
    return probe_difference(a, load_export(export_dir, target_dir, dtype=a.dtype), rows)


def probe_difference(a: DraftHead, b: DraftHead, rows: int = 8) -> float:
    """Max |Δ| between two heads' output features (`DraftHead.probe_features`) on the same `rows` random step-0
    rows of a's input width and random tokens (seeded: every call probes the same inputs)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, a.input_width, generator=g, dtype=a.dtype)  # (rows, k·H) or (rows, H)
    tokens = torch.randint(0, a.args.vocab_size, (rows,), generator=g)  # (rows,)
    with torch.no_grad():  # (rows, H) for a chain head, a block drafter's blocks side by side
        fa, fb = a.probe_features(hidden, tokens), b.probe_features(hidden, tokens)
    return float((fa - fb).abs().max())


def describe(export_dir: str | Path) -> dict[str, Any]:
    """Format, head type and tensor count of an export folder (for logs)."""
    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    meta = cfg.get("mtp_train") or {"format": "native", "head": cfg.get("head")}
    with safe_open(str(export_dir / "model.safetensors"), framework="pt", device="cpu") as f:
        n = len(list(f.keys()))
    return {"format": meta["format"], "head": (meta.get("head") or {}).get("type"), "tensors": n}
