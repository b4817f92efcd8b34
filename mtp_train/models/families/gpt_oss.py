"""The GPT-OSS family (gpt-oss-20b, gpt-oss-120b): attention sinks, alternating sliding / full layers, sparse MoE.

What differs from a Llama layer (transformers' `modeling_gpt_oss` is the reference):

* attention: biases on q/k/v/o; one learned sink logit per query head (`self_attn.sinks`, (Hq,)) that joins the
  softmax denominator and carries no value, so a query may give its real keys less than all of its weight;
  `layer_types` says per layer `sliding_attention` (a window of `sliding_window` tokens, the query included) or
  `full_attention` (transformers' default alternates them, sliding first);
* RoPE: YaRN (`rope_type: yarn`, `truncate: false` in the released configs), rotating halves as Llama does;
* MoE on every layer: the router (`mlp.router`, with bias) keeps the top-k logits and softmaxes over those k; each
  expert is a clamped SwiGLU with biases, gate and up interleaved in one product (columns 0, 2, ... are the gate):
  gate = min(gate, limit), up = clamp(up, ±limit), out = (up + 1) · gate · σ(α · gate), α = 1.702, limit = 7.
  The experts are stored fused, as the checkpoint stores them: `mlp.experts.gate_up_proj` (E, H, 2I) and
  `down_proj` (E, I, H), plus `_bias` (E, 2I) / (E, H); they run as grouped products (`grouped_experts`).

The attention backend is one per distinct window (`LayerWindowAttention`), each with its own step state; a
layer hands it its window and sinks. Sinks run on the torch backend (an explicit softmax over [scores ; sink]) and
in the native CPU decode kernel. FlashInfer is refused: its batch prefill / decode wrappers that this project plans
take no sinks (sink support there is a separate JIT variant of the paged prefill only), so `auto` picks torch.

A draft head's block is a full-attention GPT-OSS layer without sinks (the heads' training attention, the chained
unroll included, is plain SDPA) with a dense clamped-SwiGLU MLP of `intermediate_size`, or with `head.moe` the
target's MoE. MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`, the released weights) are refused by
name: a bf16 copy of the model loads. Tensor parallelism splits attention by heads (the sinks with them) and the
MoE by tensor, one all-reduce per block (`TP`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, LayerWindowAttention, make_attention_backend
from mtp_train.layers.linear import Linear
from mtp_train.layers.norm import RMSNorm
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelArgs, ModelConfigError, rope_from_config, shared_fields
from mtp_train.models.families import Family, TPRules, llama
from mtp_train.models.families.qwen3_moe import grouped_experts
from mtp_train.models.layer_switches import FULL, SLIDING, check_layer_switches, layer_types, typed_windows, window_size

LAYER_TYPES = (SLIDING, FULL)  # transformers' default alternates them, sliding first
DEFAULT_WINDOW = 128  # GptOssConfig's sliding_window when absent


@dataclass
class GptOssArgs(ModelArgs):
    """GPT-OSS arguments: per-layer windows, the sinks, and the MoE's shape and activation.

    `sliding_window` (the model-wide field) stays None and `layer_windows` always lists every layer's window, even
    when they are all the same: what reads the model-wide field (a draft head's block, the chained training
    attention) sees full attention, as it is.
    """

    num_experts: int = 0  # routed experts E per layer
    num_experts_per_tok: int = 1  # experts k each token is routed to
    swiglu_alpha: float = 1.702  # sigmoid gain of the experts' clamped SwiGLU
    swiglu_limit: float = 7.0  # clamp of the gate (above) and of up (both sides)

    @property
    def moe_intermediate_size(self) -> int:
        """One expert's inner width: `intermediate_size` (GPT-OSS has no dense layers), as other MoE args name it."""
        return self.intermediate_size


def parse_config(cfg: dict[str, Any], source: str = "config.json") -> GptOssArgs:
    """A gpt_oss config.json dict → GptOssArgs; `source` names it in error messages."""
    quant = cfg.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ModelConfigError(
            f"{source}: quantization_config.quant_method={method!r} cannot be loaded (the released GPT-OSS weights are "
            "MXFP4; mixture-of-experts FP4 blocks are not dequantised here): use a bf16 copy of the model")
    fields = shared_fields(cfg, source)
    n = fields["num_layers"]
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or fields["hidden_size"] // heads)
    # transformers' default: sliding first, then alternating; GptOssConfig's window when absent is 128
    types = layer_types(cfg, n, source) or [LAYER_TYPES[i % 2] for i in range(n)]
    window = window_size(cfg, source, DEFAULT_WINDOW)
    if SLIDING in types and window is None:
        raise ModelConfigError(f"{source}: sliding_window=None must be a positive integer for the "
                               "sliding_attention layers")
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if not experts:
        raise ModelConfigError(f"{source}: a gpt_oss config needs num_local_experts")
    k = int(cfg.get("num_experts_per_tok") or 1)  # null: one, as for DeepSeek
    if not 1 <= k <= int(experts):
        raise ModelConfigError(f"{source}: num_experts_per_tok={k} must be in 1..num_local_experts ({experts})")
    bias = bool(cfg.get("attention_bias", True))
    windows = typed_windows(types, window)
    check_layer_switches(cfg, source, "transformers' GPT-OSS", windows, [True] * n, honoured=("layer_types",))
    return GptOssArgs(
        **fields,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope=rope_from_config(cfg, head_dim, source),
        qkv_bias=bias,
        o_bias=bias,
        num_experts=int(experts),
        num_experts_per_tok=k,
        layer_windows=windows,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )


# ---------------------------------------------------------------------------------------------------------------
# attention: the layer's window and its sinks


class Attention(llama.Attention):
    """Llama attention (fused q/k/v with bias, o bias, rotate-half RoPE, the layer's window) with optional sinks."""

    def __init__(self, args: GptOssArgs, layer: int | None, sinks: bool) -> None:
        super().__init__(args, layer)
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(args.num_heads))  # (Hq,) logits


# ---------------------------------------------------------------------------------------------------------------
# MLP: the clamped SwiGLU, dense (a head's block) or as routed experts


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation: (clamp(up, ±limit) + 1) · g · σ(α · g) with g = min(gate, limit). Shapes broadcast."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Experts(nn.Module):
    """The E experts of a layer in the checkpoint's fused layout (interleaved gate / up columns, with biases)."""

    def __init__(self, a: GptOssArgs) -> None:
        super().__init__()
        e, h, i = a.num_experts, a.hidden_size, a.intermediate_size
        self.alpha, self.limit = a.swiglu_alpha, a.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i))  # x @ W: columns 2j gate, 2j+1 up
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))

    def __len__(self) -> int:
        return self.gate_up_proj.shape[0]

    def __getitem__(self, e: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Expert e as a function (N, H) → (N, H), what `grouped_experts` calls on its block of rows."""
        return lambda x: self.expert(e, x)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x: (N, H) → (N, H) through expert e."""
        gu = torch.addmm(self.gate_up_proj_bias[e], x, self.gate_up_proj[e])  # (N, 2I)
        act = clamped_swiglu(gu[:, ::2], gu[:, 1::2], self.alpha, self.limit)  # (N, I)
        return torch.addmm(self.down_proj_bias[e], act, self.down_proj[e])


class Router(nn.Module):
    """Top-k over the router logits (with bias), then a softmax over the k kept ones."""

    def __init__(self, a: GptOssArgs) -> None:
        super().__init__()
        self.k = a.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(a.num_experts, a.hidden_size))
        self.bias = nn.Parameter(torch.zeros(a.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, H) → (weights (T, k) float32, expert ids (T, k))."""
        top, idx = F.linear(x, self.weight, self.bias).topk(self.k, dim=-1)  # (T, k) each
        return top.softmax(-1).float(), idx  # in the logits' dtype, as transformers does


class MoE(nn.Module):
    """A GPT-OSS MLP: router, then the weighted sum of the k chosen experts, run as grouped products."""

    def __init__(self, a: GptOssArgs) -> None:
        super().__init__()
        self.router = Router(a)
        self.experts = Experts(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        w, idx = self.router(x)
        return grouped_experts(x, w, idx, self.experts)  # type: ignore[arg-type]  # indexable like a ModuleList


class DenseMLP(nn.Module):
    """One clamped-SwiGLU MLP of the experts' width with biases (a draft head's dense block): [gate ; up] rows."""

    def __init__(self, a: GptOssArgs) -> None:
        super().__init__()
        self.inter, self.alpha, self.limit = a.intermediate_size, a.swiglu_alpha, a.swiglu_limit
        self.gate_up_proj = Linear(a.hidden_size, 2 * a.intermediate_size, bias=True)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(clamped_swiglu(gate, up, self.alpha, self.limit))


# ---------------------------------------------------------------------------------------------------------------
# the model


class DecoderLayer(nn.Module):
    """Pre-norm GPT-OSS block (the target's layer `layer`: its window, sinks, MoE; a head's, layer None: full, no
    sinks, dense or MoE)."""

    def __init__(self, args: GptOssArgs, layer: int | None, sinks: bool, moe: bool, input_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(args, layer, sinks)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp: nn.Module = MoE(args) if moe else DenseMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, attn, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssBackbone(nn.Module):
    """Embeddings, decoder layers and final norm (the HF `model.*` prefix)."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, sinks=True, moe=True) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class GptOssForCausalLM(CausalLM):
    """A GPT-OSS target. Build with `mtp_train.models.load_model`."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args, GptOssBackbone(args))


FLASHINFER_REFUSAL = ("GPT-OSS layers have attention sinks, which the FlashInfer prefill / decode wrappers this "
                      "project plans do not take; use backend=torch (or auto, which picks it)")


def attention(args: GptOssArgs, backend: str, device: torch.device | str,
              dtype: torch.dtype | None) -> LayerWindowAttention:
    """One backend per window of the model's layers: `auto` and `torch` give the torch backend; flashinfer is refused
    (ValueError naming the sinks)."""
    if backend == "flashinfer":
        raise ValueError(FLASHINFER_REFUSAL)
    name = "torch" if backend == "auto" else backend

    def make(window: int | None) -> AttentionBackend:
        return make_attention_backend(name, args.num_heads, args.num_kv_heads, args.head_dim, window, device=device)

    return LayerWindowAttention(make, set(args.layer_windows))


def head_block(args: GptOssArgs, input_norm: bool, moe: bool) -> DecoderLayer:
    """A draft head's layer: full attention without sinks, a dense clamped-SwiGLU MLP or with `moe` the target's MoE."""
    return DecoderLayer(args, None, sinks=False, moe=moe, input_norm=input_norm)


# Attention by heads (fused q/k/v as for Llama, the sinks with their heads), the MoE by tensor: every expert's
# interleaved gate/up columns and down rows split over the ranks, the block all-reduced once, its down bias on rank 0.
TP = TPRules(column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), row=("self_attn.o_proj",),
             divided=("num_heads", "num_kv_heads", "intermediate_size"), reduced=("mlp",),
             tensors=(("self_attn.sinks", 0), ("mlp.experts.gate_up_proj", 2),
                      ("mlp.experts.gate_up_proj_bias", 1), ("mlp.experts.down_proj", 1)),
             once=("mlp.experts.down_proj_bias",))
FAMILY = Family(name="gpt_oss", title="GPT-OSS", model_types=("gpt_oss",), parse=parse_config,
                model=GptOssForCausalLM, attention=attention, head_block=head_block, head_moe=True,
                fusings=llama.FUSINGS[:1], tp=TP)
