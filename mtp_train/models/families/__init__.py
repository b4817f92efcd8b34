"""Target families as plug-ins: one module of this package per family, and the registry everything else consults.

A family is what differs between targets. The loaders, tensor parallelism, the draft heads and the export layouts
read its `Family` entry instead of branching on `model_type`:

| entry           | what it is                                                  | read by                            |
|-----------------|-------------------------------------------------------------|------------------------------------|
| model_types     | the config.json `model_type` values it runs                 | `args_from_hf_config`              |
| parse           | config.json → its args class (`ModelArgs` or a subclass,    | `args_from_hf_config`              |
|                 | whose `kv_layout` is the attention / KV layout)             |                                    |
| model           | its `CausalLM` subclass                                     | the loaders                        |
| attention       | the inference backend for its layout (auto/torch/flashinfer)| the loaders, draft heads           |
| adapt_attention | a generic cache-free backend → its block's attention        | heads/chain_attention.py           |
| rope            | how RoPE angles reach its layers                            | draft heads                        |
| head_block      | a draft head's decoder layer over this target               | head_types/mtp/head.py             |
| head_types      | the head types that fit (None: all); head_note says why     | heads/base.py                      |
| head_moe        | whether its head block can be MoE (`head.moe`)              | head_types/mtp/head.py             |
| fusings         | checkpoint projections fused on load (q/k/v → qkv_proj, ...)| loaders, heads' init, export       |
| tp              | tensor-parallel rules (None: the family runs with tp=1)     | models/tensor_parallel.py          |

Adding a family (e.g. Qwen3-MoE) is one new module here, `<name>.py`, plus its parity test against transformers
(`tests/test_<name>.py`, as tests/test_deepseek_v2.py) and a tiny config in tests/test_families.py. The module
defines its args parsing, its `CausalLM` subclass and head block, and a module-level `FAMILY = Family(...)` named
as the module; the registry (`FAMILIES`, `config/registry.py`'s package scan) imports every module of this package
on the first look-up and registers its FAMILY, so nothing else is edited.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtp_train.config.registry import Registry
from mtp_train.layers.attention import AttentionBackend, MLABackend
from mtp_train.layers.rotary import RotaryEmbedding
from mtp_train.models.base import CausalLM, rotate_half_rope
from mtp_train.models.config import ModelArgs, ModelConfigError, read_config_json
from mtp_train.models.fusing import Fusing

Attention = AttentionBackend | MLABackend


@dataclass(frozen=True)
class TPRules:
    """How a family's tensors shard over a tensor-parallel group (Megatron-style, see models/tensor_parallel.py).

    Module names are relative to a decoder layer and name the checkpoint's (unfused) modules; a `*` stands for one
    path component (an expert's index: "mlp.experts.*.gate_proj"). A rule matches in the layers that have the module.
    """

    column: tuple[str, ...]  # split by output rows (attention by heads): each rank computes its slice locally
    row: tuple[str, ...]  # split by input columns: partial products, all-reduced, then the bias
    divided: tuple[str, ...]  # args fields each rank holds 1/tp of (e.g. num_heads, num_kv_heads, intermediate_size)
    partial: tuple[str, ...] = ()  # split by input columns, not reduced themselves (an MoE's experts' down_proj) ...
    reduced: tuple[str, ...] = ()  # ... but by the block holding them: its output all-reduced once (the MoE `mlp`)
    # tensors (names with their parameter) split along dim ≥ 0, for layouts the module rules do not fit, e.g. fused
    # (E, H, 2I) experts: ("mlp.experts.gate_up_proj", 2); part of a reduced block like a partial module
    tensors: tuple[tuple[str, int], ...] = ()
    once: tuple[str, ...] = ()  # tensors a reduced block adds once (fused experts' down bias): rank 0 holds them


def _as_is(attn: AttentionBackend, args: ModelArgs) -> Attention:
    return attn


@dataclass(frozen=True)
class Family:
    """One target family's entry (see the module docstring for who reads what)."""

    name: str  # the module's name, e.g. "llama"
    title: str  # in messages, e.g. "Llama-family"
    model_types: tuple[str, ...]
    parse: Callable[[dict[str, Any], str], ModelArgs]  # (config.json dict, source for messages) → args
    model: type[CausalLM]
    # (args, backend name, device, dtype or None) → backend; ValueError when the backend cannot run
    attention: Callable[[ModelArgs, str, torch.device | str, torch.dtype | None], Attention]
    # (args, input_norm, moe) → the decoder layer of a draft head with the target's shapes
    head_block: Callable[[ModelArgs, bool, bool], nn.Module]
    # a generic cache-free backend for (Hq, Hkv, D) of the args → what the block's attention calls
    adapt_attention: Callable[[AttentionBackend, ModelArgs], Attention] = _as_is
    # (rotary, positions (T,), dtype) → cos, sin as the family's layers take them
    rope: Callable[[RotaryEmbedding, torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = rotate_half_rope
    head_types: Collection[str] | None = None  # the names of the head types that fit (a live view of the registry)
    head_note: str = ""
    head_moe: bool = False
    fusings: tuple[Fusing, ...] = ()
    tp: TPRules | None = None


_BY_TYPE: dict[str, Family] = {}  # model_type → family, filled as FAMILIES is


def _index(family: Family) -> None:
    # A model_type runs on one family: a second claim is refused before the family is registered.
    for t in family.model_types:
        if t in _BY_TYPE:
            raise TypeError(f"model_type {t!r} is claimed by families {_BY_TYPE[t].name} and {family.name}")
    _BY_TYPE.update(dict.fromkeys(family.model_types, family))


# By name, filled on the first look-up: every module of this package is a family, its FAMILY registered under the
# module's name (a module without one is refused).
FAMILIES: Registry[Family] = Registry("target family", package=__name__, attr="FAMILY", entry_type=Family,
                                      on_add=_index)


def _registry() -> dict[str, Family]:
    FAMILIES.names()  # discovers the plug-ins on the first call
    return _BY_TYPE


def families() -> list[Family]:
    """Every registered family, once each, in module-name order."""
    return FAMILIES.values()


def supported_model_types() -> list[str]:
    """The config.json model_type values some family runs."""
    return list(_registry())


def family_for_type(model_type: str | None) -> Family | None:
    """The family that runs `model_type`, or None."""
    return _registry().get(model_type or "")


def family_of(args: ModelArgs) -> Family:
    """The family of parsed model arguments."""
    family = family_for_type(args.model_type)
    if family is None:
        raise ValueError(f"no target family runs model_type {args.model_type!r}; "
                         f"supported: {', '.join(supported_model_types())}")
    return family


def titles(accepts: Callable[[Family], bool]) -> str:
    """The titles of the families `accepts` (for messages: "Llama-family or ...")."""
    return " or ".join(f.title for f in families() if accepts(f))


def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """Parse a `transformers` config dict with its family's parser; `source` names it in error messages."""
    model_type = cfg.get("model_type")
    family = family_for_type(model_type)
    if family is None:
        raise ModelConfigError(f"{source}: model_type {model_type!r} (architectures {cfg.get('architectures')}) is "
                               f"not supported; supported: {', '.join(supported_model_types())} (a target vLLM "
                               "serves takes an eagle3 head without it: mtp-precompute backend=vllm, then "
                               "mtp-eval backend=vllm; docs/serving.md)")
    return family.parse(cfg, source)


def args_from_dir(path: str | Path) -> ModelArgs:
    """The parsed `<path>/config.json` (clear errors for a missing folder or file, invalid JSON, unknown type)."""
    return args_from_hf_config(read_config_json(path), source=str(Path(path) / "config.json"))
