"""The DeepSeek-V3 family (DeepSeek-V3, DeepSeek-R1, Kimi-K2): DeepSeek-V2's multi-head latent attention over a
latent-only paged cache, with V3's sigmoid router over the MoE layers. config.json `model_type`: deepseek_v3, or
kimi_k2 (Kimi-K2's checkpoints are DeepSeek-V3's architecture under their own model_type).

Attention, RoPE (consecutive pairs rotated, transformers' `rope_interleave=true`), the MLA backends, the dense MLP
and the args are DeepSeek-V2's (`families/deepseek_v2.py`); layers before `first_k_dense_replace` keep the dense MLP,
every later one is an MoE layer. The V3 router (transformers' `DeepseekV3TopkRouter`), per token x:

    s = sigmoid(W_gate · x)                     (E,) in float32: the expert scores
    c = s + e_score_correction_bias             the biased scores, used only to *choose* experts
    group score = sum of the top-2 c in each of the n_group groups of E / n_group experts; only the topk_group best
    groups stay eligible (the others' c become -inf), and the num_experts_per_tok best eligible c are the experts
    w = s[chosen]                               the weights are the un-biased scores
    w = w / (Σ w + 1e-20) when norm_topk_prob, then w · routed_scaling_factor

The routed experts run as grouped products (`qwen3_moe.grouped_experts`: one GEMM per expert that was hit) and the
shared experts (one MLP of n_shared_experts · moe_intermediate_size) are added for every token. The checkpoint's
names are ours: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.{gate,up,down}_proj.weight`
and `mlp.shared_experts.*`. The bias is a frozen parameter (requires_grad false: DeepSeek adjusts it by a balancing
rule, not by gradients, and no gradient reaches it through the top-k).

A draft head over this target takes DeepSeek's own MTP block (MLA + a dense MLP, or the V3 MoE with head.moe=true)
over a latent-only pool of its own; only mtp heads fit. The checkpoint's own MTP layers
(`num_nextn_predict_layers`, `model.layers.{L}.*`) are skipped by the loader and start such a head with
`head.init=target_mtp` (head_types/mtp/head.py). The released FP8 block-scaled weights load dequantised
(`mtp_train/models/fp8.py`); other quantisations are refused.

Tensor parallelism: DeepSeek-V2's rules (`deepseek_v2.TP`: MLA by heads with the latent cache replicated, the MoE
split by tensor with one all-reduce per block); the router's weight and correction bias are replicated, so every
rank chooses the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.layers.attention import MLABackend, make_mla_backend
from mtp_train.layers.norm import RMSNorm
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelConfigError
from mtp_train.models.families import Family
from mtp_train.models.families.deepseek_v2 import (
    MTP_SHAPED,
    TP,
    DeepseekV2Args,
    DeepseekV2ForCausalLM,
    DeepseekV2Layer,
    DenseMLP,
    MLAttention,
    latent_attention,
    pair_angles,
)
from mtp_train.models.families.deepseek_v2 import parse_config as parse_v2
from mtp_train.models.families.qwen3_moe import grouped_experts


@dataclass
class DeepseekV3Args(DeepseekV2Args):
    """DeepSeek-V2's MLA arguments plus V3's router: sigmoid scores, a correction bias, group-limited top-k.

    `topk_method` is "noaux_tc" (the only V3 routing); n_group / topk_group are always set (1 / 1: no group limit).
    """

    norm_topk_prob: bool = True  # renormalise the kept (un-biased) scores to sum 1 before the scaling factor
    num_nextn_predict_layers: int = 0  # the checkpoint's own MTP layers (model.layers.{L}...), not part of the target


def _int(cfg: dict[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    return default if value is None else int(value)


def parse_config(cfg: dict[str, Any], source: str = "config.json") -> DeepseekV3Args:
    """A deepseek_v3 (or kimi_k2) config.json dict → DeepseekV3Args; anything this family does not run is a
    ModelConfigError naming the key."""
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant and method != "fp8":  # block-scaled fp8 is read by the loader (models/fp8.py), which checks the rest
        raise ModelConfigError(f"{source}: quantization_config (quant_method {method!r}) is not supported: only "
                               "the released block-scaled fp8 weights load; use a bf16 or fp8 copy of the checkpoint")
    checks = {"scoring_func": ("sigmoid", "sigmoid"), "topk_method": ("noaux_tc", "noaux_tc"),
              "moe_layer_freq": (1, 1), "rope_interleave": (True, True)}
    for key, (default, wanted) in checks.items():
        if cfg.get(key, default) != wanted:
            raise ModelConfigError(f"{source}: {key}={cfg[key]!r} is not supported by the DeepSeek-V3 family "
                                   f"(only {wanted!r})")
    # V2's parser reads the attention, RoPE and expert shapes; its topk_method names V2's softmax routings
    # DeepseekV3Config's first_k_dense_replace is 3 when absent (V2's is 0)
    v2 = parse_v2({**cfg, "topk_method": "greedy", "first_k_dense_replace": cfg.get("first_k_dense_replace", 3)},
                  source, "transformers' DeepSeek-V3")
    experts, k = v2.n_routed_experts, v2.num_experts_per_tok
    if experts < 1 or cfg.get("moe_intermediate_size") is None:
        raise ModelConfigError(f"{source}: a deepseek_v3 config needs n_routed_experts > 0 and moe_intermediate_size")
    n_group, topk_group = _int(cfg, "n_group", 1), _int(cfg, "topk_group", 1)
    if n_group < 1 or experts % n_group:
        raise ModelConfigError(f"{source}: n_group={n_group} must divide n_routed_experts={experts}")
    if not 1 <= topk_group <= n_group:
        raise ModelConfigError(f"{source}: topk_group={topk_group} must be in 1..n_group ({n_group})")
    if topk_group < n_group and experts // n_group < 2:
        raise ModelConfigError(f"{source}: n_group={n_group} leaves {experts // n_group} expert(s) per group; a "
                               "group's score is the sum of its best 2")
    if not 1 <= k <= topk_group * (experts // n_group):
        raise ModelConfigError(f"{source}: num_experts_per_tok={k} must be in 1..{topk_group * (experts // n_group)} "
                               f"(the experts of topk_group={topk_group} groups)")
    values = {f.name: getattr(v2, f.name) for f in fields(DeepseekV2Args)}
    values.update(raw=dict(cfg), topk_method="noaux_tc", n_group=n_group, topk_group=topk_group)
    return DeepseekV3Args(**values, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                          num_nextn_predict_layers=_int(cfg, "num_nextn_predict_layers", 0))


class TopkRouter(nn.Module):
    """V3's router (see the module docstring): sigmoid scores, biased choice over the best groups, un-biased weights.

    Computed in float32 whatever the model's dtype (transformers keeps the gate and bias in float32).
    """

    def __init__(self, a: DeepseekV3Args) -> None:
        super().__init__()
        self.a = a
        self.weight = nn.Parameter(torch.empty(a.n_routed_experts, a.hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Linear's init: a head's MoE block built from scratch
        self.e_score_correction_bias = nn.Parameter(torch.zeros(a.n_routed_experts), requires_grad=False)

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (T, E) float32 → the biased scores the experts are chosen by, -inf outside the kept groups."""
        a = self.a
        choice = scores + self.e_score_correction_bias.float()
        g = int(a.n_group)
        if int(a.topk_group) >= g:  # every group kept (e.g. Kimi-K2's n_group = topk_group = 1)
            return choice
        per = a.n_routed_experts // g
        group_scores = choice.view(-1, g, per).topk(2, dim=-1).values.sum(-1)  # (T, G)
        kept = group_scores.topk(int(a.topk_group), dim=-1).indices  # (T, topk_group)
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, H) → (weights (T, k) float32, expert ids (T, k))."""
        a = self.a
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        idx = self.choice_scores(scores).topk(a.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, idx)  # the un-biased scores of the chosen experts
        if a.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * a.routed_scaling_factor, idx


class MoE(nn.Module):
    """V3's MoE: the sigmoid router (`gate`), routed experts as grouped products, plus the shared experts."""

    def __init__(self, a: DeepseekV3Args) -> None:
        super().__init__()
        self.gate = TopkRouter(a)
        self.experts = nn.ModuleList(DenseMLP(a.hidden_size, a.moe_intermediate_size)
                                     for _ in range(a.n_routed_experts))
        self.shared_experts = (DenseMLP(a.hidden_size, a.moe_intermediate_size * a.n_shared_experts)
                               if a.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        w, idx = self.gate(x)
        out = grouped_experts(x, w, idx, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV3Layer(DeepseekV2Layer):
    """V2's pre-norm block (MLA, then the MLP; its forward) with V3's MoE on MoE layers; also an MTP head's block."""

    def __init__(self, a: DeepseekV3Args, moe: bool) -> None:
        nn.Module.__init__(self)  # not V2's __init__: it would build V2's softmax-routed MoE
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = MLAttention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp: nn.Module = MoE(a) if moe else DenseMLP(a.hidden_size, a.intermediate_size, a.mlp_bias)


class DeepseekV3Backbone(nn.Module):
    """Embeddings, decoder layers (dense before first_k_dense_replace, MoE after) and the final norm (`model.*`)."""

    def __init__(self, a: DeepseekV3Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3Layer(a, moe=i >= a.first_k_dense_replace)
                                    for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """A DeepSeek-V3 / Kimi-K2 target with the `CausalLM` interface (build with `mtp_train.models.load_model`).

    As V2's: kv_caches are (num_pages, page_size, kv_lora + rope) latent rows per layer, `attn` an MLABackend, and
    `rope` one float32 angle per rotated pair.
    """

    def __init__(self, args: DeepseekV3Args) -> None:
        CausalLM.__init__(self, args, DeepseekV3Backbone(args))  # not V2's __init__: V3's layers
        self.attn: MLABackend | None = None  # set by the loader: MLA has its own backend interface


def attention(args: DeepseekV3Args, backend: str, device: torch.device | str,
              dtype: torch.dtype | None) -> MLABackend:
    """The MLA backend (auto | torch | flashinfer) for this shape and dtype, as for DeepSeek-V2 (FlashInfer's MLA
    kernels fit V3's kv_lora_rank 512 and qk_rope_head_dim 64 in fp16/bf16 on CUDA)."""
    try:
        return make_mla_backend(backend, args.num_heads, args.kv_lora_rank, args.qk_rope_head_dim,
                                args.softmax_scale, device=device, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"DeepSeek-V3 (MLA): {e}") from None


def head_block(args: DeepseekV3Args, input_norm: bool, moe: bool) -> DeepseekV3Layer:
    """DeepSeek's own MTP block: MLA (an MLABackend, over a latent-only pool) + a dense MLP, or V3's MoE."""
    if not input_norm:
        raise ValueError("a DeepSeek-V3 block always has its input norm (input_norm must stay on)")
    return DeepseekV3Layer(args, moe=moe)


FAMILY = Family(
    name="deepseek_v3", title="DeepSeek-V3", model_types=("deepseek_v3", "kimi_k2"), parse=parse_config,
    model=DeepseekV3ForCausalLM, attention=attention, head_block=head_block,
    adapt_attention=latent_attention,  # the chained training attention over the latent row
    rope=pair_angles,  # pairwise RoPE: one float32 angle per pair
    head_types=MTP_SHAPED,
    head_note="its block is DeepSeek's: MLA + a dense MLP, or V3's MoE with head.moe=true; EAGLE heads use Llama "
              "layers",
    head_moe=True,
    tp=TP,
)
