"""Per-layer switches of a config.json: which layers slide a window, which have a sparse MoE block.

transformers derives them per model type, and each family's parser applies its own rule here
(`qwen_windows`, `windows_everywhere`, `typed_windows`). A config can also carry a switch its model type does not
read — `layer_types` in a Mistral config, `max_window_layers` in a Qwen3-MoE one, `mlp_only_layers` in a GPT-OSS one
— which transformers then drops while another engine may follow it. `check_layer_switches` reads every such key
the way the families that define it do, and refuses the config by the key's name when that would give other layers
than the family's own rule: a per-layer switch is honoured or refused, never ignored.

| key (family that defines it)                      | what it switches per layer                                   |
|---------------------------------------------------|--------------------------------------------------------------|
| `layer_types` (qwen2, qwen3, gpt_oss)             | `sliding_attention` or `full_attention`                      |
| `use_sliding_window`, `max_window_layers` (qwen2, | a window on layers max_window_layers.. when the switch is on |
| qwen3)                                            |                                                              |
| `mlp_only_layers`, `decoder_sparse_step`          | sparse when not listed and (i + 1) % step == 0               |
| (qwen3_moe)                                       |                                                              |
| `first_k_dense_replace`, `moe_layer_freq`         | sparse from layer k on (every freq-th, DeepSeek's own code)  |
| (deepseek_v2, deepseek_v3)                        |                                                              |
| `mlp_layer_types` (transformers' generic key)     | `sparse` or `dense`                                          |
| `no_rope_layers` (smollm3)                        | 0 = the layer skips RoPE                                     |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mtp_train.models.config import ModelConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
LEGACY_LAYER_TYPES = {"attention": FULL}  # transformers' remap of old names (remap_legacy_layer_types)
DEFAULT_WINDOW = 4096  # MistralConfig / Qwen2Config / Qwen3Config / Qwen3MoeConfig: sliding_window when absent
QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config: max_window_layers when absent


def window_size(cfg: dict[str, Any], source: str, default: int | None) -> int | None:
    """config.json's `sliding_window` (`default` when the key is absent, None when it is null), checked positive."""
    window = cfg.get("sliding_window", default)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelConfigError(f"{source}: sliding_window={window!r} must be a positive integer (tokens the query "
                               "sees, itself included) or null")
    return window


def layer_types(cfg: dict[str, Any], n: int, source: str) -> list[str] | None:
    """config.json's `layer_types` as n of sliding_attention / full_attention (legacy names mapped as transformers
    maps them), or None when absent. Any other type (chunked, linear, ...) is refused by name."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list):
        raise ModelConfigError(f"{source}: layer_types must be a list of {n} of {', '.join(LAYER_TYPES)}")
    types = [LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in types]
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad or len(types) != n:
        raise ModelConfigError(f"{source}: layer_types must list {n} of {', '.join(LAYER_TYPES)} (one per layer, "
                               f"num_hidden_layers={n}); got {types}")
    return types


def typed_windows(types: Sequence[str], window: int | None) -> list[int | None]:
    """Per layer: `window` on a sliding_attention layer (None when the window is off), None on a full one."""
    return [window if t == SLIDING else None for t in types]


def windows_everywhere(n: int, window: int | None) -> list[int | None]:
    """The same window (or none) on each of n layers (Mistral; Qwen3-MoE, whose transformers model slides every
    layer when `use_sliding_window` is on)."""
    return [window] * n


def _int(cfg: dict[str, Any], key: str, default: int, source: str, least: int = 0) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ModelConfigError(f"{source}: {key}={value!r} must be an integer >= {least}")
    return value


def qwen_windows(cfg: dict[str, Any], n: int, source: str) -> list[int | None]:
    """transformers' Qwen2 / Qwen3 rule: with `use_sliding_window` on, layers from `max_window_layers` on slide a
    window of `sliding_window` tokens (absent keys take the config class's defaults, 4096 and 28). An explicit
    `layer_types` names the sliding layers instead, as in transformers, which writes it next to max_window_layers
    (28 unless set) into every config.json it saves, so the two need not agree; with the switch off no layer
    slides."""
    window = window_size(cfg, source, DEFAULT_WINDOW) if cfg.get("use_sliding_window", False) else None
    types = layer_types(cfg, n, source)
    if types is None:  # max_window_layers is read only here, as transformers reads it
        mwl = _int(cfg, "max_window_layers", QWEN_MAX_WINDOW_LAYERS, source) if window is not None else n
        types = [SLIDING if i >= mwl else FULL for i in range(n)]
    return typed_windows(types, window)


@dataclass(frozen=True)
class Switch:
    """One per-layer switch as the families that define it read it."""

    keys: tuple[str, ...]  # the config keys; the switch is checked when one is present and not honoured
    kind: str  # "attention" (sliding per layer), "mlp" (sparse per layer) or "rope" (RoPE per layer)
    # (cfg, n layers, whether any layer has routed experts, source) → per layer: True = sliding, sparse or without
    # RoPE
    implied: Callable[[dict[str, Any], int, bool, str], list[bool]]
    meaning: str  # for the message: how the key is read


def _by_types(cfg: dict[str, Any], n: int, experts: bool, source: str) -> list[bool]:
    types = layer_types(cfg, n, source)
    assert types is not None  # checked only when present
    return [t == SLIDING for t in types]


def _by_max_window_layers(cfg: dict[str, Any], n: int, experts: bool, source: str) -> list[bool]:
    return [w is not None for w in qwen_windows({k: v for k, v in cfg.items() if k != "layer_types"}, n, source)]


def _by_sparse_step(cfg: dict[str, Any], n: int, experts: bool, source: str) -> list[bool]:
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise ModelConfigError(f"{source}: mlp_only_layers={only!r} must be a list of layer indices")
    step = _int(cfg, "decoder_sparse_step", 1, source, least=1)
    return [experts and i not in only and (i + 1) % step == 0 for i in range(n)]


def _by_first_dense(cfg: dict[str, Any], n: int, experts: bool, source: str) -> list[bool]:
    k = _int(cfg, "first_k_dense_replace", 0, source)
    freq = _int(cfg, "moe_layer_freq", 1, source, least=1)
    return [experts and i >= k and i % freq == 0 for i in range(n)]


def _by_mlp_types(cfg: dict[str, Any], n: int, experts: bool, source: str) -> list[bool]:
    types = cfg["mlp_layer_types"]
    if not isinstance(types, list) or len(types) != n or any(t not in ("sparse", "dense") for t in types):
        raise ModelConfigError(f"{source}: mlp_layer_types must list {n} of sparse, dense; got {types!r}")
    return [t == "sparse" for t in types]


def _by_no_rope(cfg: dict[str, Any], n: int, experts: bool, source: str) -> list[bool]:
    flags = cfg["no_rope_layers"]
    if not isinstance(flags, list) or len(flags) != n:
        raise ModelConfigError(f"{source}: no_rope_layers must list {n} flags (1 = RoPE); got {flags!r}")
    return [not f for f in flags]


SWITCHES = (
    Switch(("layer_types",), "attention", _by_types, "sliding_attention layers slide a window"),
    Switch(("use_sliding_window", "max_window_layers"), "attention", _by_max_window_layers,
           "with use_sliding_window on, layers from max_window_layers (absent: 28) on slide a window, as Qwen2 "
           "reads it"),
    Switch(("mlp_only_layers", "decoder_sparse_step"), "mlp", _by_sparse_step,
           "a layer is sparse unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0, as "
           "Qwen3-MoE reads it"),
    Switch(("first_k_dense_replace", "moe_layer_freq"), "mlp", _by_first_dense,
           "layers from first_k_dense_replace on are sparse, every moe_layer_freq-th of them, as DeepSeek's own "
           "modelling code reads it"),
    Switch(("mlp_layer_types",), "mlp", _by_mlp_types, "sparse layers have the MoE block"),
    Switch(("no_rope_layers",), "rope", _by_no_rope, "a 0 entry turns RoPE off on that layer"),
)
_WHAT = {"attention": "a sliding window", "mlp": "the sparse MoE block", "rope": "no RoPE"}


def _slid(flags: Sequence[object]) -> str:
    on = [i for i, f in enumerate(flags) if f is not None and f is not False]
    return "[" + ", ".join(map(str, on)) + "]" if on else "none"


def check_layer_switches(cfg: dict[str, Any], source: str, title: str, windows: Sequence[int | None],
                         sparse: Sequence[bool], honoured: Sequence[str] = ()) -> None:
    """Refuse, naming the key, every per-layer switch in `cfg` that the family does not read (`honoured`) and that
    read as its own family reads it would give other layers than the family's rule.

    Args:
        cfg: the config.json dict.
        source: names the file in messages.
        title: the family as transformers runs it, in messages (e.g. "transformers' Mistral").
        windows: per layer, the window the family applies (None: full attention).
        sparse: per layer, whether the family gives it the sparse MoE block.
        honoured: the keys the family's own rule has applied (they are not checked again; a rule over another key
            reads them from cfg, so a family whose default differs from the key's puts its value there).
    """
    n = len(windows)
    mine = {"attention": [w is not None for w in windows], "mlp": list(sparse), "rope": [False] * n}
    experts = any(sparse)
    for switch in SWITCHES:
        present = [k for k in switch.keys if k in cfg and k not in honoured]
        if all(cfg[k] is None for k in present):  # none present, or only nulls: the key's default
            continue
        implied = switch.implied(cfg, n, experts, source)
        if implied != mine[switch.kind]:
            what = _WHAT[switch.kind]
            keys = ", ".join(f"{k}={cfg[k]!r}" for k in present)
            raise ModelConfigError(
                f"{source}: {keys} would give {what} to layers {_slid(implied)} ({switch.meaning}); {title} "
                f"ignores {'them' if len(present) > 1 else 'it'} and gives it to layers {_slid(mine[switch.kind])}: "
                "remove the key or make it agree")
