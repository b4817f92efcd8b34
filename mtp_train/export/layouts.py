"""Checkpoint layouts of draft heads that serving engines load, as name maps over our head's state dict.

Our head stores its family's fused projections (e.g. `qkv_proj`, `gate_up_proj`, as the target loader fuses
them: `Family.fusings`); every other layout stores them split. A layout is a pair of functions:
`to_layout(state, head) → {name: tensor}` and `from_layout(tensors, head) → state`, exact inverses of each other
(tensors are moved, never changed), plus the config.json it writes, the checks a head must pass first, the
serving engines that load it (`serves`) and, for a layout drafters trained elsewhere come in, how
`mtp-export import_from=` reads such a folder (`reader`).

Each layout is built in the folder of the head type it belongs to (`mtp_train/head_types/<type>/layouts.py`, named
by its `HeadType.layouts`); `LAYOUTS` is filled from the registered head types on its first read. This module
holds what they share: the `Layout` and `Reader` records, the fused / split maps of a decoder layer, the checks
of a final-hidden layout (no fc bias, no aux layers), the d2t / t2d draft-vocabulary maps and a config.json built
on the target's.

`native` (our own `save_head`: fused, `draft_vocab` kept) takes any head; every other format is a layout some head
type brings (docs/exports.md lists them with their names and config keys).

The concatenation order inside fc / eh_proj is the same everywhere: [embedding ; hidden].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mtp_train.config.head import HEAD_TYPES
from mtp_train.config.registry import Registry
from mtp_train.heads.base import DraftHead
from mtp_train.models.families import family_of
from mtp_train.models.fusing import fuse, fusion_plan, unfuse

if TYPE_CHECKING:
    from mtp_train.config.head import HeadConfig


class LayoutError(ValueError):
    """A head that does not fit a layout (wrong head type, a norm the layout has no place for, ...)."""


def unfuse_layer(layer: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    """Decoder-layer tensors with fused names → split as the checkpoint has them (e.g. q/k/v and gate/up)."""
    return unfuse(layer, family_of(head.args).fusings, head.args)


def fuse_layer(layer: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    """The inverse of `unfuse_layer`: fuses what the head's block fuses (a DeepSeek block fuses nothing)."""
    out = dict(layer)
    out.update(fuse(out, fusion_plan(head.layers[0].state_dict(), family_of(head.args).fusings)))
    return out


def layer_items(state: dict[str, torch.Tensor], prefix: str = "layers.0.") -> dict[str, torch.Tensor]:
    """The tensors of the decoder layer under `prefix`, named inside the layer."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


@dataclass(frozen=True)
class Reader:
    """How `mtp-export import_from=<layout>` reads a folder of that layout (a drafter trained elsewhere) into one of
    our heads (`export/importer.py` `import_drafter`)."""

    noun: str  # the drafter's name in messages
    origin: str  # whose layout, in messages
    recognises: Callable[[dict[str, Any]], bool]  # config.json → whether it is this layout
    expected: str  # what `recognises` looks for, in messages
    head_config: Callable[[dict[str, Any], dict[str, torch.Tensor]], HeadConfig]  # (config.json, tensors) → ours
    layer_key: str | None = None  # where config.json keeps the draft layers' fields (None: at the top)
    keep: tuple[str, ...] = ()  # shared-looking tensors that are the layout's own (checked, not skipped)
    trained_lm_head: bool = False  # its lm_head.weight is the head's own (not the target's rows, which are checked)
    # (config.json, tensors, the head built) → what the head would silently change (refused); None: nothing
    fit: Callable[[dict[str, Any], dict[str, torch.Tensor], DraftHead], list[str]] | None = None


@dataclass(frozen=True)
class Layout:
    """One export format, built by the head type it belongs to (`HeadType.layouts`)."""

    name: str
    check: Callable[[DraftHead], list[str]]  # problems that make the head unfit (empty = fits)
    to_layout: Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]
    from_layout: Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]
    config: Callable[[DraftHead, dict[str, Any]], dict[str, Any]]  # (head, target config.json) → config.json
    needs_frozen: bool = False  # the layout carries the embedding / lm_head itself
    keeps_draft_vocab: bool = False  # the layout carries the draft vocabulary (else: drafts over all of V)
    exact: bool = True  # from_layout(to_layout(state)) == state bit for bit (Qwen3-Next's w − 1 rounds)
    # Serving engine → the keys of its speculative settings that load this layout as the head's drafter, as
    # checked against the engine (`make check-vllm`), e.g. {"vllm": {"method": "eagle3"}}; {} = none known.
    serves: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    reader: Reader | None = None  # how `mtp-export import_from=<name>` reads such a folder; None: not read back

    @property
    def head_types(self) -> tuple[str, ...]:
        """The head types that bring this layout (`HeadType.layouts`)."""
        return tuple(name for name, t in HEAD_TYPES.items() if any(lo.name == self.name for lo in t.layouts))


# --- what several layouts check and write ----------------------------------------------------------------------


def no_fc_bias(head: DraftHead) -> list[str]:
    """A layout whose fc has no bias: a head trained with one does not fit."""
    return ["fc_bias=True: the layout's fc has no bias (retrain with head.fc_bias=false, or export native / "
            "sglang-eagle)"] if head.cfg.fc_bias else []


def no_aux(head: DraftHead, layouts: str) -> list[str]:
    """What a final-hidden layout (one fc over [E(t); h]) cannot carry of an aux-layer head: `aux_fc` (the engines
    would feed the final hidden state instead) and EAGLE-3.1's per-aux-layer norms (speculators' only,
    `head_types/eagle3/export.py`)."""
    c = head.cfg
    return ([f"head.aux_norm=true: {layouts} have no per-aux-layer norms (EAGLE-3.1); export native"]
            if c.aux_norm else []) + \
        ([f"head.features=aux: {layouts} read the target's final hidden state, with no fc over its aux layers; "
          f"export native"] if c.features == "aux" else [])


def drop_vocab(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state without `draft_vocab` (a layout that drafts over the whole vocabulary)."""
    return {k: v for k, v in state.items() if k != "draft_vocab"}


def hf_config(target: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The target's config.json (its private `_` keys left out) with the layout's keys `extra`."""
    cfg = {k: v for k, v in target.items() if not k.startswith("_")}
    cfg.update(extra)
    return cfg


_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def with_target_fields(cfg: dict[str, Any], target: dict[str, Any], rope_theta: float) -> dict[str, Any]:
    """`cfg` (a draft's config.json) with what it takes from the target's config.json as it is: the RoPE keys (or
    `rope_theta` alone when the target names none), torch_dtype and the bos / eos token ids."""
    rope = {k: target[k] for k in _ROPE_KEYS if target.get(k) is not None}
    cfg.update(rope or {"rope_theta": rope_theta})
    for key in ("torch_dtype", "bos_token_id", "eos_token_id"):
        if target.get(key) is not None:
            cfg[key] = target[key]
    return cfg


# --- the draft vocabulary as d2t / t2d (EAGLE-3's maps, which speculators' layouts keep too) -----------------------


def vocab_maps(draft_vocab: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_vocab [V_d] (ascending target ids) → (d2t [V_d] int64 offsets, t2d [V] bool mask)."""
    dv = draft_vocab.to(torch.int64)
    d2t = dv - torch.arange(dv.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[dv] = True
    return d2t, t2d


def draft_vocab_from(d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """The inverse of `vocab_maps`: d2t + arange, checked against t2d (both must name the same tokens); a
    LayoutError when they do not describe one draft vocabulary."""
    dv = d2t.to(torch.int64) + torch.arange(d2t.numel(), dtype=torch.int64)
    if dv.numel() and (int(dv.min()) < 0 or int(dv.max()) >= t2d.numel()):
        raise LayoutError(f"d2t points outside the target vocabulary [0, {t2d.numel()})")
    _, check = vocab_maps(dv, t2d.numel())
    if not torch.equal(check, t2d.to(torch.bool)):
        raise LayoutError("d2t and t2d name different draft tokens")
    if dv.numel() > 1 and not bool((dv[1:] > dv[:-1]).all()):
        raise LayoutError("d2t + arange is not ascending: lm_head rows must follow the target ids' order")
    return dv


# --- the registry ----------------------------------------------------------------------------------------------


def sync_layouts() -> None:
    """Register the layouts of every registered head type not registered yet (`HeadType.layouts`, built in its
    folder): the registry's discovery, and again wherever a head type registered since may bring one. Read through
    the head-type registry, which finds the plug-ins by computed name, so this floor imports none of them; two
    layouts of one name are refused by the registry."""
    for t in HEAD_TYPES.values():
        for layout in t.layouts:
            if LAYOUTS.registered(layout.name) is not layout:
                LAYOUTS.add(layout)


# Export formats by name, filled from the head types' layouts on the first read (and by `sync_layouts` when a head
# type is registered later); a layout registered at run time (`LAYOUTS.add`) joins them. `unmatched_formats` is the
# cross-check.
LAYOUTS: Registry[Layout] = Registry("export format", discover=sync_layouts)


def layout_named(name: str) -> Layout:
    """The layout `name`, a head type registered since the first read included; RegistryError naming the known
    ones otherwise."""
    sync_layouts()
    return LAYOUTS.get(name)


def export_formats() -> tuple[str, ...]:
    """Every `mtp-export format=` value: native and each registered layout."""
    sync_layouts()
    return ("native", *LAYOUTS.names())


def import_layouts() -> tuple[str, ...]:
    """Every `mtp-export import_from=` value: the registered layouts that have a reader."""
    sync_layouts()
    return tuple(name for name, layout in LAYOUTS.items() if layout.reader is not None)


def unmatched_formats() -> tuple[list[str], list[str]]:
    """(formats some head type names without a layout, layouts no head type takes): both empty when the head
    types' layouts and the registry agree (a test checks it)."""
    named = {f for t in HEAD_TYPES.values() for f in t.formats}
    return sorted(named - set(export_formats())), sorted(set(export_formats()) - named)
