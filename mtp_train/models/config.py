"""Typed model arguments read from a checkpoint's `config.json`.

`ModelArgs` holds what every target has (the Llama family's arguments are exactly these; a family with more
subclasses it, e.g. `DeepseekV2Args`). The family registry (`mtp_train.models.families.args_from_dir` /
`args_from_hf_config`) hands the dict to the family that owns its `model_type`; this module imports no family,
so that every family can import it. Here are the parsing pieces families share: reading config.json
(`read_config_json`), the keys every family reads (`shared_fields`), and RoPE in both the classic (`rope_theta`,
`rope_scaling`) and the newer `rope_parameters` form. Anything a family cannot run is rejected with a message
that names the key. The JSON type of every key a family reads is checked in one place (`FIELD_TYPES`,
`check_field_types`) before any of them is converted: `"hidden_size": "576"` would pass our `int()` and then fail
inside transformers' strict config classes with a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtp_train.fileio import file_problem
from mtp_train.layers.attention.base import KVLayout
from mtp_train.layers.rotary import RopeConfig

# keys every family needs in config.json
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class ModelConfigError(ValueError):
    """A model folder or config.json that the project cannot load; the message says what to do."""


# The JSON type of each config.json key some family reads (`int` never accepts a bool or a float, `float` takes an
# integer too): (kinds, whether null stands for "absent"). Keys a reader turns with `int(...)` or `float(...)`
# without an `or` fallback are not nullable.
_INT, _NUM, _BOOL, _STR, _OBJ, _LIST = "int", "float", "bool", "str", "dict", "list"
SHARED_FIELD_TYPES: dict[str, tuple[tuple[str, ...], bool]] = {
    # every target, ours or one only vLLM runs (`shared_fields`, `rope_from_config`, models/foreign.py)
    "model_type": ((_STR,), True), "hidden_size": ((_INT,), True), "intermediate_size": ((_INT,), True),
    "num_hidden_layers": ((_INT,), True), "num_attention_heads": ((_INT,), True), "vocab_size": ((_INT,), True),
    "num_key_value_heads": ((_INT,), True), "head_dim": ((_INT,), True), "rms_norm_eps": ((_NUM,), False),
    "max_position_embeddings": ((_INT,), False), "tie_word_embeddings": ((_BOOL,), True),
    "hidden_act": ((_STR,), True), "torch_dtype": ((_STR,), True), "dtype": ((_STR,), True),
    "bos_token_id": ((_INT,), True), "eos_token_id": ((_INT, _LIST), True), "rope_theta": ((_NUM,), True),
    "rope_scaling": ((_OBJ,), True), "rope_parameters": ((_OBJ,), True),
}
FIELD_TYPES: dict[str, tuple[tuple[str, ...], bool]] = {
    **SHARED_FIELD_TYPES,
    # the families' own keys (models/families/*.py)
    "mlp_bias": ((_BOOL,), True), "attention_bias": ((_BOOL,), True), "partial_rotary_factor": ((_NUM,), True),
    "sliding_window": ((_INT,), True), "use_sliding_window": ((_BOOL,), True), "max_window_layers": ((_INT,), True),
    "layer_types": ((_LIST,), True),
    "qk_rope_head_dim": ((_INT,), True), "qk_nope_head_dim": ((_INT,), True), "v_head_dim": ((_INT,), True),
    "kv_lora_rank": ((_INT,), True), "q_lora_rank": ((_INT,), True), "moe_intermediate_size": ((_INT,), True),
    "n_routed_experts": ((_INT,), True), "n_shared_experts": ((_INT,), True), "num_experts_per_tok": ((_INT,), True),
    "first_k_dense_replace": ((_INT,), False), "n_group": ((_INT,), True), "topk_group": ((_INT,), True),
    "routed_scaling_factor": ((_NUM,), False), "norm_topk_prob": ((_BOOL,), True),
    "num_nextn_predict_layers": ((_INT,), True), "topk_method": ((_STR,), False),
    "num_local_experts": ((_INT,), True), "num_experts": ((_INT,), True), "swiglu_alpha": ((_NUM,), False),
    "swiglu_limit": ((_NUM,), False), "decoder_sparse_step": ((_INT,), False), "mlp_only_layers": ((_LIST,), True),
}
_KIND_WORDS = {_INT: "an integer", _NUM: "a number", _BOOL: "true or false", _STR: "a string", _OBJ: "an object",
               _LIST: "a list"}


def _json_kind(value: Any) -> str:
    """The JSON type of a parsed value, in the words of `FIELD_TYPES`."""
    return (_BOOL if isinstance(value, bool) else _INT if isinstance(value, int) else
            _NUM if isinstance(value, float) else _STR if isinstance(value, str) else
            _OBJ if isinstance(value, dict) else _LIST if isinstance(value, list) else "null")


def check_field_types(cfg: dict[str, Any], source: str, types: dict[str, tuple[tuple[str, ...], bool]] = FIELD_TYPES
                      ) -> None:
    """Refuse, naming the file and the key, a key of `types` whose value in `cfg` has another JSON type.

    Args:
        cfg: the config.json as read.
        source: the file, named in the message.
        types: key → (the kinds it may have, whether it may be null); `FIELD_TYPES` by default.
    """
    for key, (kinds, nullable) in types.items():
        if key not in cfg:
            continue
        value = cfg[key]
        kind = _json_kind(value)
        if kind in kinds or (kind == "null" and nullable) or (kind == _INT and _NUM in kinds):
            if kind == _LIST and key == "eos_token_id" and not all(_json_kind(v) == _INT for v in value):
                kind = "list holding something other than integers"
            else:
                continue
        want = " or a list of integers" if key == "eos_token_id" else ""
        shown = json.dumps(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        is_ = "null" if kind == "null" else f"{shown} ({_KIND_WORDS.get(kind, kind)})"
        fix = (f"write it without quotes ({json.dumps(key)}: {value})" if kind == _STR and _looks_numeric(value)
               and (_INT in kinds or _NUM in kinds) else f"write {_KIND_WORDS[kinds[0]]}{want} there")
        raise ModelConfigError(f"{source}: {key} is {is_}, not {_KIND_WORDS[kinds[0]]}{want}; {fix}, or copy or "
                               "fetch the model folder again")


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass
class ModelArgs:
    """Shape and options of a target decoder (all a Llama-family one has; other families add fields)."""

    model_type: str  # config.json's model_type, e.g. llama | mistral | qwen2 | qwen3 | deepseek_v2
    hidden_size: int  # H
    intermediate_size: int  # MLP inner width
    num_layers: int  # decoder layers L
    num_heads: int  # query heads Hq
    num_kv_heads: int  # key/value heads Hkv (GQA when < Hq)
    head_dim: int  # D
    vocab_size: int  # V
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(head_dim=64))
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False  # lm_head shares the input embedding
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama `attention_bias` also puts a bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # the attention window (tokens, the query included) of every layer when `layer_windows` is empty, and of a draft
    # head's block; None: full attention
    sliding_window: int | None = None
    # per layer, when the layers' windows differ (Qwen2/Qwen3 from max_window_layers on, GPT-OSS's layer_types): the
    # window or None; empty when every layer has `sliding_window`
    layer_windows: list[int | None] = field(default_factory=list)
    hidden_act: str = "silu"
    torch_dtype: str | None = None  # the checkpoint's dtype name, e.g. "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the config.json as read

    @property
    def kv_layout(self) -> KVLayout:
        """What a layer's KV pool holds per token: K and V of Hkv heads of D."""
        return KVLayout(self.num_kv_heads, self.head_dim)

    def window(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer` (0-based), None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def windows(self) -> list[int | None]:
        """The window of each decoder layer (None: full attention)."""
        return [self.window(i) for i in range(self.num_layers)]


def read_config_json(path: str | Path) -> dict[str, Any]:
    """`<path>/config.json` as a dict, with clear errors for a missing folder or file and invalid JSON.

    The family that parses it is the registry's business (`mtp_train.models.families.args_from_dir`).
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelConfigError(
            f"model folder {path} does not exist; for the default model run `mtp-model fetch smollm2-135m` "
            "(or `make model`), or point `model.path` at a Hugging Face model folder"
        )
    cfg_file = path / "config.json"
    problem = file_problem(cfg_file)  # before it is opened: a FIFO would block the read
    if problem == "does not exist":
        raise ModelConfigError(f"{cfg_file} is missing: {path} is not a Hugging Face model folder")
    if problem:
        raise ModelConfigError(f"{cfg_file} {problem}; put the model's config.json file there (copy or fetch the "
                               "model folder again)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else \
            f"not UTF-8 ({e.reason} at byte {e.start})"
        raise ModelConfigError(f"{cfg_file}: invalid JSON at {where}; repair the file, or copy or fetch the "
                               "model folder again") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{cfg_file}: expected a JSON object, found {type(cfg).__name__}; repair the "
                               "file, or copy or fetch the model folder again")
    check_field_types(cfg, str(cfg_file), SHARED_FIELD_TYPES)  # every target's; a family's own in `shared_fields`
    return cfg


def rope_from_config(cfg: dict[str, Any], head_dim: int, source: str) -> RopeConfig:
    """Accept `rope_theta` + `rope_scaling` (classic) or `rope_parameters` (newer transformers)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**params, **scaling}
    # null is absent here (its type is checked by `check_field_types`)
    theta = float(next((t for t in (merged.get("rope_theta"), cfg.get("rope_theta")) if t is not None), 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    try:
        return RopeConfig(head_dim=head_dim, theta=theta, rope_type=rope_type, scaling=merged)
    except ValueError as e:
        raise ModelConfigError(f"{source}: {e}") from None


def shared_fields(cfg: dict[str, Any], source: str, required: Sequence[str] = REQUIRED_KEYS) -> dict[str, Any]:
    """The `ModelArgs` fields every family reads the same way, after checking `required` keys and the activation.

    Returns keyword arguments for the args class: model_type, hidden_size, intermediate_size, num_layers,
    vocab_size, rms_norm_eps, max_position_embeddings, tie_word_embeddings, mlp_bias, hidden_act, torch_dtype,
    bos_token_id, eos_token_ids, raw.
    """
    check_field_types(cfg, source)
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    return dict(
        model_type=cfg["model_type"],
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=act,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        raw=dict(cfg),
    )
