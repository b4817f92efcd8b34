"""Typed model arguments read from a checkpoint's `config.json`.

One dataclass covers the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3). It accepts both the
classic keys (`rope_theta`, `rope_scaling`) and the newer `rope_parameters` form, and rejects
anything it cannot run with a message that names the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtp_train.layers.attention.base import KVLayout
from mtp_train.layers.rotary import RopeConfig

# model_type → what differs inside the family
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class ModelConfigError(ValueError):
    """A model folder or config.json that the project cannot load; the message says what to do."""


@dataclass
class ModelArgs:
    """Shape and options of a Llama-family decoder."""

    model_type: str  # llama | mistral | qwen2 | qwen3
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
    sliding_window: int | None = None  # Mistral-style local attention window (tokens, incl. itself)
    hidden_act: str = "silu"
    torch_dtype: str | None = None  # the checkpoint's dtype name, e.g. "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the config.json as read

    @property
    def kv_layout(self) -> KVLayout:
        """What a layer's KV pool holds per token: K and V of Hkv heads of D."""
        return KVLayout(self.num_kv_heads, self.head_dim)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
        """Parse a `transformers` config dict; `source` names it in error messages."""
        model_type = cfg.get("model_type")
        if model_type == "deepseek_v2" and cls is ModelArgs:
            return DeepseekV2Args.from_hf_config(cfg, source)
        if model_type not in FAMILIES:
            archs = cfg.get("architectures")
            raise ModelConfigError(
                f"{source}: model_type {model_type!r} (architectures {archs}) is not supported; "
                f"supported: {', '.join(FAMILIES)}"
            )
        missing = [k for k in REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ModelConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        fam = FAMILIES[model_type]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rope = _rope_from_config(cfg, head_dim, source)
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size that is only used when switched on
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=fam.get("qkv_bias", False) or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=fam.get("qk_norm", False),
            sliding_window=int(sliding) if sliding else None,
            hidden_act=act,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=dict(cfg),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArgs:
        """Read `<path>/config.json` with clear errors for a missing folder or file."""
        path = Path(path)
        if not path.is_dir():
            raise ModelConfigError(
                f"model folder {path} does not exist; for the default model run `mtp-model fetch smollm2-135m` "
                "(or `make model`), or point `model.path` at a Hugging Face model folder"
            )
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(f"{cfg_file} is missing: {path} is not a Hugging Face model folder")
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
        return cls.from_hf_config(cfg, source=str(cfg_file))


def _rope_from_config(cfg: dict[str, Any], head_dim: int, source: str) -> RopeConfig:
    """Accept `rope_theta` + `rope_scaling` (classic) or `rope_parameters` (newer transformers)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**params, **scaling}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    try:
        return RopeConfig(head_dim=head_dim, theta=theta, rope_type=rope_type, scaling=merged)
    except ValueError as e:
        raise ModelConfigError(f"{source}: {e}") from None


@dataclass
class DeepseekV2Args(ModelArgs):
    """DeepSeek-V2: multi-head latent attention (MLA) with a compressed KV cache, decoupled RoPE, and MoE layers.

    The engine's KV cache holds one latent row per token and layer, nothing else (`kv_layout`, latent): num_kv_heads
    = 1 and head_dim = kv_lora_rank + qk_rope_head_dim (the normed compressed KV c and the shared RoPE key k_pe).
    `rope` covers the RoPE part only.
    """

    q_lora_rank: int | None = None  # None: a plain q_proj (V2-Lite); else q_a_proj → norm → q_b_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    moe_intermediate_size: int = 1408
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    first_k_dense_replace: int = 1  # layers before this one have a dense MLP
    topk_method: str = "greedy"  # greedy | group_limited_greedy
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    softmax_scale: float = 0.0  # (qk_nope + qk_rope)^-0.5

    @property
    def kv_layout(self) -> KVLayout:
        """MLA's latent-only cache: one [c ; k_pe] row of kv_lora_rank + qk_rope_head_dim per token."""
        return KVLayout(1, self.kv_lora_rank + self.qk_rope_head_dim, latent=True)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> DeepseekV2Args:
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                               "intermediate_size") if cfg.get(k) is None]
        if missing:
            raise ModelConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        rope_dim = int(cfg["qk_rope_head_dim"])
        rope = _rope_from_config(cfg, rope_dim, source)
        if rope.rope_type not in ("default", "yarn"):
            raise ModelConfigError(f"{source}: DeepSeek-V2 rope type {rope.rope_type!r} is not supported "
                                   "(default, yarn)")
        scale = (int(cfg["qk_nope_head_dim"]) + rope_dim) ** -0.5
        if rope.rope_type == "yarn" and rope.scaling.get("mscale_all_dim"):
            # YaRN's softmax correction, applied to the whole score (transformers' yarn_apply_mscale)
            factor, m = float(rope.scaling["factor"]), float(rope.scaling["mscale_all_dim"])
            mscale = 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
            scale *= mscale * mscale
        topk = cfg.get("topk_method", "greedy")
        if topk not in ("greedy", "group_limited_greedy"):
            raise ModelConfigError(f"{source}: topk_method {topk!r} is not supported (greedy, group_limited_greedy)")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        kv_lora = int(cfg["kv_lora_rank"])
        nope = int(cfg["qk_nope_head_dim"])
        q_lora = cfg.get("q_lora_rank")
        return cls(
            model_type="deepseek_v2", hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]), num_kv_heads=1, head_dim=kv_lora + rope_dim,
            vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            o_bias=bool(cfg.get("attention_bias", False)), qkv_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)), hidden_act=act,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids, raw=dict(cfg),
            q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim, v_head_dim=int(cfg["v_head_dim"]),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            n_routed_experts=int(cfg.get("n_routed_experts") or 0),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0), topk_method=topk,
            n_group=cfg.get("n_group"), topk_group=cfg.get("topk_group"),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            softmax_scale=scale,
        )
