"""The DeepSeek-V2 (and V2-Lite) family: multi-head latent attention with a compressed KV cache, decoupled RoPE,
and mixture-of-experts layers with shared experts; its args, model and family entry.

MLA, as the engine runs it (weight absorption): per token and layer the cache holds one latent row [c ; k_pe] of
kv_lora_rank + qk_rope_head_dim values and nothing else (`KVLayout` latent: (num_pages, page_size, C + R) per layer),
where c = RMSNorm(kv_a(x)[:kv_lora]) and k_pe is the RoPE'd shared key. kv_b_proj splits per head into W_UK
(kv_lora → qk_nope) and W_UV (kv_lora → v_head). A query becomes [q_nope · W_UK ; q_pe] so that its dot product with
[c ; k_pe] equals q_nope·k_nope + q_pe·k_pe of the expanded form; the attention output over values c is then mapped
through W_UV. Every head attends to the same single latent row (multi-query attention over the paged cache), with
the softmax scale of the expanded head dimension. The attention itself is an `MLABackend`
(`mtp_train.layers.attention.mla`): torch on any device, FlashInfer's MLA kernels on CUDA.

RoPE here rotates consecutive pairs (x[2i], x[2i+1]) (DeepSeek's complex-number form), not halves. The forward
has the `CausalLM` signature and outputs, so the engine, precompute and speculative decoding drive it alike.

A draft head over this target takes DeepSeek's own MTP block (MLA + a dense MLP, or the MoE with head.moe=true)
over a latent-only pool of its own; only mtp heads fit. Nothing is fused (the checkpoint's names are ours).

Tensor parallelism (`TP`, see models/tensor_parallel.py): MLA split by heads, the latent path replicated, so every
rank caches the whole latent row of each token (it is shared by all heads) and absorbs its own heads' W_UK / W_UV
(the rank's rows of kv_b_proj); the MoE split by tensor (every rank holds every expert's slice):

| tensor (HF name)                                     | split                  | forward                            |
|------------------------------------------------------|------------------------|------------------------------------|
| `self_attn.q_proj` or `q_b_proj` (H·(nope+rope) rows)| rows, by heads (column)| local heads                        |
| `self_attn.q_a_proj`, `q_a_layernorm`                | replicated             |                                    |
| `self_attn.kv_a_proj_with_mqa`, `kv_a_layernorm`     | replicated             | the latent row, cached on each rank|
| `self_attn.kv_b_proj` (H·(nope+v) rows)              | rows, by heads (column)| the rank's heads' W_UK, W_UV       |
| `self_attn.o_proj.weight`                            | columns (row-parallel) | partial sums → all-reduce, +bias   |
| dense `mlp.{gate,up}_proj` / `mlp.down_proj`         | rows / columns (row)   | all-reduce                         |
| `mlp.gate.weight` (router)                           | replicated             | every rank routes alike            |
| `mlp.{experts.{e},shared_experts}.{gate,up}_proj`    | rows (column)          | local                              |
| `mlp.{experts.{e},shared_experts}.down_proj`         | columns (partial)      | partial sums, not reduced each     |
| the MoE block (`mlp`)                                | (reduced)              | one all-reduce of routed + shared  |

Per layer: two all-reduces (o_proj, then the MLP or the MoE); num_heads, intermediate_size and
moe_intermediate_size must be divisible by tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.config.head import HeadTypesWhere
from mtp_train.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVLayout,
    LatentAsOneHead,
    MLABackend,
    make_mla_backend,
)
from mtp_train.layers.linear import Linear
from mtp_train.layers.norm import RMSNorm
from mtp_train.layers.rotary import RotaryEmbedding
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelArgs, ModelConfigError, rope_from_config, shared_fields
from mtp_train.models.families import Family, TPRules
from mtp_train.models.layer_switches import check_layer_switches

REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")


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
    topk_method: str = "greedy"  # a TOPK_METHODS name: greedy | group_limited_greedy
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    softmax_scale: float = 0.0  # (qk_nope + qk_rope)^-0.5

    @property
    def kv_layout(self) -> KVLayout:
        """MLA's latent-only cache: one [c ; k_pe] row of kv_lora_rank + qk_rope_head_dim per token."""
        return KVLayout(1, self.kv_lora_rank + self.qk_rope_head_dim, latent=True)


def parse_config(cfg: dict[str, Any], source: str = "config.json",
                 title: str = "transformers' DeepSeek-V2") -> DeepseekV2Args:
    """A DeepSeek-V2 config.json dict → DeepseekV2Args; `source` names it in error messages, `title` the model that
    reads it (DeepSeek-V3's parser passes its own)."""
    fields = shared_fields(cfg, source, REQUIRED_KEYS)
    rope_dim = int(cfg["qk_rope_head_dim"])
    rope = rope_from_config(cfg, rope_dim, source)
    if rope.rope_type not in ("default", "yarn"):
        raise ModelConfigError(f"{source}: DeepSeek-V2 rope type {rope.rope_type!r} is not supported "
                               "(default, yarn)")
    scale = (int(cfg["qk_nope_head_dim"]) + rope_dim) ** -0.5
    # YaRN's softmax correction, applied to the whole score (transformers' yarn_get_mscale(factor, mscale_all_dim))
    mscale = rope.scaling_kind.score_mscale(rope)
    scale *= mscale * mscale
    topk = cfg.get("topk_method", "greedy")
    if topk not in TOPK_METHODS:
        raise ModelConfigError(f"{source}: topk_method {topk!r} is not supported ({', '.join(TOPK_METHODS)})")
    kv_lora = int(cfg["kv_lora_rank"])
    q_lora = cfg.get("q_lora_rank")
    attention_bias = bool(cfg.get("attention_bias", False))
    n, experts = fields["num_layers"], int(cfg.get("n_routed_experts") or 0)
    first_dense = cfg.get("first_k_dense_replace", 0)
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise ModelConfigError(f"{source}: first_k_dense_replace={first_dense!r} must be an integer >= 0")
    # transformers' rule: sparse from first_k_dense_replace on; DeepSeek's own code also reads moe_layer_freq
    check_layer_switches(cfg, source, title, [None] * n,
                         [experts > 0 and i >= first_dense for i in range(n)], honoured=("first_k_dense_replace",))
    return DeepseekV2Args(
        **fields, num_heads=int(cfg["num_attention_heads"]), num_kv_heads=1, head_dim=kv_lora + rope_dim, rope=rope,
        o_bias=attention_bias, qkv_bias=attention_bias,
        q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=kv_lora,
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=rope_dim, v_head_dim=int(cfg["v_head_dim"]),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        n_routed_experts=int(cfg.get("n_routed_experts") or 0),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
        first_k_dense_replace=first_dense, topk_method=topk,
        n_group=cfg.get("n_group"), topk_group=cfg.get("topk_group"),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        softmax_scale=scale,
    )


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, R); cos/sin: (T, 1, R/2) → x with pairs (x[2i], x[2i+1]) rotated by angle i."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos.float(), sin.float()
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention over a compressed paged cache (one latent head per token)."""

    def __init__(self, a: DeepseekV2Args) -> None:
        super().__init__()
        self.a = a
        h, qk = a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank is None:
            self.q_proj = Linear(a.hidden_size, h * qk, bias=False)
        else:
            self.q_a_proj = Linear(a.hidden_size, a.q_lora_rank, bias=a.qkv_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(a.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, bias=a.qkv_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.o_proj = Linear(h * a.v_head_dim, a.hidden_size, bias=a.o_bias)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, nope, kv_lora) and W_UV (H, v, kv_lora) views of kv_b_proj."""
        a = self.a
        w = self.kv_b_proj.weight.view(a.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        return w[:, :a.qk_nope_head_dim], w[:, a.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: MLABackend,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """x: (T, H) → (T, H); kv_cache: this layer's (num_pages, page_size, C + R) latent rows, or None."""
        a, t = self.a, x.shape[0]
        q = self.q_proj(x) if a.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim)
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_pe = ckv.split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)  # (T, kv_lora)
        q_pe = rotate_pairs(q_pe, cos, sin)  # (T, Hq, R)
        k_pe = rotate_pairs(k_pe.unsqueeze(1), cos, sin).squeeze(1)  # (T, R)
        w_uk, w_uv = self._absorbed()
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # (T, Hq, kv_lora)
        out = attn.forward(q_lat, q_pe, c, k_pe, kv_cache, meta)  # (T, Hq, kv_lora): sums of c
        out = torch.einsum("thc,hvc->thv", out, w_uv)  # (T, Hq, v_head)
        return self.o_proj(out.reshape(t, a.num_heads * a.v_head_dim))


class DenseMLP(nn.Module):
    """SiLU-gated MLP with separate gate / up projections (DeepSeek's tensor names)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _greedy(scores: torch.Tensor, a: DeepseekV2Args) -> torch.Tensor:
    return scores


def _group_limited_greedy(scores: torch.Tensor, a: DeepseekV2Args) -> torch.Tensor:
    """Experts outside the topk_group groups of the best expert scores are dropped (DeepSeek-V2)."""
    g = int(a.n_group)
    group_best = scores.view(-1, g, a.n_routed_experts // g).max(-1).values  # (T, G)
    keep = torch.zeros_like(group_best).scatter_(1, group_best.topk(int(a.topk_group), -1).indices, 1.0)
    return scores.masked_fill(~keep.repeat_interleave(a.n_routed_experts // g, 1).bool(), 0.0)


# config.json's topk_method → which gate scores (T, E) the top-k may choose from
TOPK_METHODS = {"greedy": _greedy, "group_limited_greedy": _group_limited_greedy}


class MoE(nn.Module):
    """Routed experts (softmax gate, top-k, optionally group-limited) plus always-on shared experts."""

    def __init__(self, a: DeepseekV2Args) -> None:
        super().__init__()
        self.a = a
        self.gate = nn.Linear(a.hidden_size, a.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(DenseMLP(a.hidden_size, a.moe_intermediate_size, a.mlp_bias)
                                     for _ in range(a.n_routed_experts))
        self.shared_experts = (DenseMLP(a.hidden_size, a.moe_intermediate_size * a.n_shared_experts, a.mlp_bias)
                               if a.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, H) → (weights (T, k) float32, expert ids (T, k))."""
        a = self.a
        scores = TOPK_METHODS[a.topk_method](F.linear(x.float(), self.gate.weight.float()).softmax(-1), a)  # (T, E)
        w, idx = scores.topk(a.num_experts_per_tok, dim=-1)
        return w * a.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.route(x)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            y = self.experts[e](x[rows]) * w[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2Layer(nn.Module):
    """Pre-norm block: MLA, then a dense MLP or the MoE (also the block of an MTP head for this target)."""

    def __init__(self, a: DeepseekV2Args, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = MLAttention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if moe and a.n_routed_experts < 1:
            raise ValueError("an MoE block needs n_routed_experts > 0 in the config")
        self.mlp = MoE(a) if moe else DenseMLP(a.hidden_size, a.intermediate_size, a.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: MLABackend,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Backbone(nn.Module):
    def __init__(self, a: DeepseekV2Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2Layer(a, moe=a.n_routed_experts > 0 and i >= a.first_k_dense_replace)
                                    for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class DeepseekV2ForCausalLM(CausalLM):
    """A DeepSeek-V2 target with the `CausalLM` interface (build with `mtp_train.models.load_model`).

    kv_caches are (num_pages, page_size, kv_lora + rope) per layer: the latent rows (`args.kv_layout`); `attn` is
    an MLABackend (`attention`).
    """

    def __init__(self, args: DeepseekV2Args) -> None:
        super().__init__(args, DeepseekV2Backbone(args))
        self.attn: MLABackend | None = None  # set by the loader: MLA has its own backend interface

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, R/2) in float32: one angle per rotated pair."""
        return pair_angles(self.rotary, positions, dtype)


def pair_angles(rotary: RotaryEmbedding, positions: torch.Tensor,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (T,) → cos, sin (T, 1, R/2) in float32 whatever `dtype`, one angle per pair `rotate_pairs` rotates.

    `rotary` gives the rotate-half layout (the R/2 angles twice); its first half is the pairs' angles.
    """
    cos, sin = rotary(positions, torch.float32)
    half = rotary.cfg.head_dim // 2
    return cos[..., :half], sin[..., :half]


def attention(args: DeepseekV2Args, backend: str, device: torch.device | str,
              dtype: torch.dtype | None) -> MLABackend:
    """The MLA backend (auto | torch | flashinfer) for a DeepSeek-V2 model or block of this shape and dtype.

    Scores are scaled by the expanded head's softmax scale (YaRN's mscale included), not by the latent width's.
    `auto`: FlashInfer's MLA kernels on CUDA when FlashInfer imports and the shape and dtype fit (kv_lora_rank 512,
    qk_rope_head_dim 64, fp16/bf16), else torch. An explicit flashinfer that cannot run is a ValueError naming the
    constraint.
    """
    try:
        return make_mla_backend(backend, args.num_heads, args.kv_lora_rank, args.qk_rope_head_dim,
                                args.softmax_scale, device=device, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"DeepSeek-V2 (MLA): {e}") from None


def latent_attention(attn: AttentionBackend, args: DeepseekV2Args) -> MLABackend:
    """MLA through a generic cache-free backend over (Hq, 1, C + R): the latent row is its one KV head, scored
    with the expanded head's softmax scale (the heads' chained training attention)."""
    attn.scale = args.softmax_scale
    return LatentAsOneHead(attn, args.kv_lora_rank)


def head_block(args: DeepseekV2Args, input_norm: bool, moe: bool) -> DeepseekV2Layer:
    """DeepSeek's own MTP block: MLA (an MLABackend, over a latent-only pool) + a dense MLP, or the MoE."""
    if not input_norm:
        raise ValueError("a DeepSeek-V2 block always has its input norm (input_norm must stay on)")
    return DeepseekV2Layer(args, moe=moe)


# The head types this family's head block fits: those in the shape of DeepSeek's own MTP layer (enorm, hnorm,
# eh_proj, the block, shared_head.norm), i.e. the types that can start from a checkpoint's MTP layer
# (`head.init=target_mtp`); EAGLE heads use Llama layers.
MTP_SHAPED = HeadTypesWhere(lambda t: "target_mtp" in t.spec.inits)

TP = TPRules(
    column=("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "mlp.gate_proj", "mlp.up_proj",
            "mlp.experts.*.gate_proj", "mlp.experts.*.up_proj",
            "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
    divided=("num_heads", "intermediate_size", "moe_intermediate_size"),  # the latent (num_kv_heads = 1) is whole
    partial=("mlp.experts.*.down_proj", "mlp.shared_experts.down_proj"),
    reduced=("mlp",),
)
FAMILY = Family(
    name="deepseek_v2", title="DeepSeek-V2", model_types=("deepseek_v2",), parse=parse_config,
    model=DeepseekV2ForCausalLM, attention=attention, head_block=head_block,
    adapt_attention=latent_attention,  # the chained training attention over the latent row
    rope=pair_angles,  # pairwise RoPE: one float32 angle per pair
    head_types=MTP_SHAPED,
    head_note="its block is DeepSeek's: MLA + a dense MLP, or MoE with head.moe=true; EAGLE heads use Llama layers",
    head_moe=True,
    tp=TP,
)
