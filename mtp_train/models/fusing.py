"""Fused projections, written once: checkpoint q/k/v → our qkv_proj, gate/up → gate_up_proj, and back for exports.

A family lists its fused projections (`Family.fusings`): each `Fusing` names the fused module, the checkpoint
modules concatenated into it along dim 0 (in order), and the rows each part has for a config. Names may carry any
prefix (`model.layers.3.self_attn.qkv_proj.weight`, or `self_attn.qkv_proj.bias` inside one layer); weights and
biases fuse alike. The target loader, the tensor-parallel loader, a head's init from the target's last layer and
the export layouts all go through these functions, so a fused tensor is the same wherever it is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from mtp_train.models.config import ModelArgs


@dataclass(frozen=True)
class Fusing:
    """One fused projection: the checkpoint modules `parts` concatenated along dim 0 into module `name`."""

    name: str  # e.g. "self_attn.qkv_proj"
    parts: tuple[str, ...]  # e.g. ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    sizes: Callable[[ModelArgs], list[int]]  # output rows of each part, for a config


def _prefix(name: str, module: str) -> str | None:
    """`prefix` when tensor `name` is `{prefix}{module}.{weight|bias|...}`, else None."""
    mod = name.rpartition(".")[0]
    if mod == module:
        return ""
    if mod.endswith("." + module):
        return mod[: len(mod) - len(module)]
    return None


def _kind(name: str) -> str:
    return name.rpartition(".")[2]


def fusion_plan(params: Iterable[str], fusings: Iterable[Fusing]) -> dict[str, list[str]]:
    """{fused tensor name: the checkpoint tensor names concatenated into it, in order}, for the fused ones of
    `params` (a module's parameter names); every other name is read under its own name."""
    fusings = tuple(fusings)
    plan: dict[str, list[str]] = {}
    for name in params:
        for f in fusings:
            prefix = _prefix(name, f.name)
            if prefix is not None:
                plan[name] = [f"{prefix}{part}.{_kind(name)}" for part in f.parts]
    return plan


def parts_plan(names: Iterable[str], fusings: Iterable[Fusing]) -> dict[str, list[str]]:
    """`fusion_plan` seen from the checkpoint side: every fused name of which at least one part is in `names`."""
    fusings = tuple(fusings)
    plan: dict[str, list[str]] = {}
    for name in names:
        for f in fusings:
            for part in f.parts:
                prefix = _prefix(name, part)
                if prefix is not None:
                    kind = _kind(name)
                    plan.setdefault(f"{prefix}{f.name}.{kind}", [f"{prefix}{p}.{kind}" for p in f.parts])
    return plan


def fuse(tensors: dict[str, torch.Tensor], plan: Mapping[str, list[str]]) -> dict[str, torch.Tensor]:
    """Pop the parts of every complete entry of `plan` from `tensors`; return {fused name: their concatenation}.

    Entries with a part missing are skipped and their parts left in `tensors` (callers report them).
    A part (rows_i, ...) → the fused (Σ rows_i, ...).
    """
    out: dict[str, torch.Tensor] = {}
    for target, parts in plan.items():
        if all(p in tensors for p in parts):
            out[target] = torch.cat([tensors.pop(p) for p in parts], dim=0)
    return out


def unfuse(tensors: Mapping[str, torch.Tensor], fusings: Iterable[Fusing], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The inverse of `fuse`: every fused tensor of `tensors` split into its parts (rows from `args`), the
    checkpoint's names; other tensors pass unchanged. The parts are contiguous copies of the rows."""
    fusings = tuple(fusings)
    out = dict(tensors)
    for name in list(out):
        for f in fusings:
            prefix = _prefix(name, f.name)
            if prefix is not None:
                for part, t in zip(f.parts, torch.split(out.pop(name), f.sizes(args), dim=0)):
                    out[f"{prefix}{part}.{_kind(name)}"] = t.contiguous()
                break
    return out
