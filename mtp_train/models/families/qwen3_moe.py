"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k norms) with sparse MoE layers.

A layer is sparse when it is not in `mlp_only_layers` and (index + 1) is a multiple of `decoder_sparse_step`;
the others keep Qwen3's dense MLP (`intermediate_size`). The router is a softmax over `num_experts` logits,
top-`num_experts_per_tok` of them kept, renormalised to sum 1 when `norm_topk_prob` (Qwen3-MoE's released configs
set it; transformers' default does not). Experts are SiLU-gated MLPs of `moe_intermediate_size`, stored as the
checkpoint's `mlp.experts.{e}.{gate,up,down}_proj`, and run as grouped products: the step's (token, expert) pairs
are sorted by expert once, and each expert that was hit multiplies its contiguous block of rows in one GEMM
(`grouped_experts`), so the work is one product per active expert, never one per token.

Attention, RoPE, norms and the fused q/k/v are the Llama family's (`families/llama.py`, Qwen3 variant); a draft
head's block is a dense Qwen3 layer (`head.moe=true` gives it a sparse MoE block of the target's shape).

Tensor parallelism (`TP`, see models/tensor_parallel.py): attention and dense layers as the Llama family's; a sparse
block split by tensor, every rank holding every expert's slice:

| tensor (HF name)                             | split                     | forward                               |
|----------------------------------------------|---------------------------|---------------------------------------|
| `mlp.gate.weight` (router)                   | replicated                | every rank routes alike               |
| `mlp.experts.{e}.{gate,up}_proj.weight`      | rows (column)             | local                                 |
| `mlp.experts.{e}.down_proj.weight`           | columns (partial)         | partial sums, not reduced per expert  |
| the block (`mlp`)                            | (reduced)                 | one all-reduce of the weighted sum    |

Per sparse layer: two all-reduces (o_proj, the MoE); moe_intermediate_size must be divisible by tp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.layers.attention import AttentionBackend, AttentionMetadata
from mtp_train.layers.linear import Linear
from mtp_train.layers.norm import RMSNorm
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.families import Family, TPRules
from mtp_train.models.families.llama import FUSINGS, MLP, Attention, attention, parse_variant
from mtp_train.models.families.llama import TP as LLAMA_TP
from mtp_train.models.layer_switches import DEFAULT_WINDOW, check_layer_switches, window_size, windows_everywhere


@dataclass
class Qwen3MoeArgs(ModelArgs):
    """Qwen3 arguments plus the sparse MoE layers' shape and routing."""

    num_experts: int = 0  # routed experts E per sparse layer
    num_experts_per_tok: int = 1  # experts k each token is routed to
    moe_intermediate_size: int = 0  # inner width of one expert
    norm_topk_prob: bool = False  # renormalise the k kept router probabilities to sum 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has the MoE block (transformers' rule)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def _windows(cfg: dict[str, Any], n: int, source: str) -> list[int | None]:
    """transformers' Qwen3-MoE: with `use_sliding_window` on, `sliding_window` (4096 when absent) on every layer
    (unlike dense Qwen3 it reads no `max_window_layers` or `layer_types`: those are refused when they disagree)."""
    return windows_everywhere(n, window_size(cfg, source, DEFAULT_WINDOW) if cfg.get("use_sliding_window") else None)


VARIANT = {"qk_norm": True, "windows": _windows}  # Qwen3's attention, this family's window rule


def parse_config(cfg: dict[str, Any], source: str = "config.json") -> Qwen3MoeArgs:
    """A qwen3_moe config.json dict → Qwen3MoeArgs; `source` names it in error messages."""
    dense = parse_variant(cfg, source, VARIANT)
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 saves the latter
    if not experts or not cfg.get("moe_intermediate_size"):
        raise ModelConfigError(f"{source}: a qwen3_moe config needs num_experts and moe_intermediate_size")
    k = int(cfg.get("num_experts_per_tok") or 1)  # null: one, as for DeepSeek
    if not 1 <= k <= int(experts):
        raise ModelConfigError(f"{source}: num_experts_per_tok={k} must be in 1..num_experts ({experts})")
    step = cfg.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelConfigError(f"{source}: decoder_sparse_step={step!r} must be an integer >= 1")
    only = cfg.get("mlp_only_layers") or []
    n = dense.num_layers
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                                         for i in only):
        raise ModelConfigError(f"{source}: mlp_only_layers={only!r} must list layer indices in 0..{n - 1}")
    fields = {f: getattr(dense, f) for f in ModelArgs.__dataclass_fields__}
    fields.update(model_type=cfg["model_type"], raw=dict(cfg))
    args = Qwen3MoeArgs(**fields, num_experts=int(experts), num_experts_per_tok=k,
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), decoder_sparse_step=step,
                        mlp_only_layers=list(only))
    check_layer_switches(cfg, source, "transformers' Qwen3-MoE", args.windows, [args.is_sparse(i) for i in range(n)],
                         honoured=("use_sliding_window", "mlp_only_layers", "decoder_sparse_step"))
    return args


class Expert(nn.Module):
    """One SiLU-gated expert with the checkpoint's separate gate / up / down projections."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, H) → (N, H)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: nn.ModuleList) -> torch.Tensor:
    """Σ_j weights[t, j] · experts[ids[t, j]](x[t]) for every token t, one GEMM per expert that was hit.

    x: (T, H); weights: (T, k) float32; ids: (T, k) expert ids. The T·k (token, expert) pairs are sorted by expert
    once; each hit expert reads its contiguous block of rows, and the weighted outputs are summed back per token
    with one index_add. Returns (T, H) in x's dtype (the weighting in float32, as transformers does it).
    """
    t, k = ids.shape
    flat = ids.reshape(-1)  # (T·k,)
    order = torch.argsort(flat, stable=True)
    tokens = order // k  # the token of each sorted pair
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # one host sync per layer
    rows = x[tokens]  # (T·k, H), grouped by expert
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = experts[e](rows[start:start + n])
            start += n
    scaled = out.float() * weights.reshape(-1)[order, None]
    return torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tokens, scaled).to(x.dtype)


class SparseMoE(nn.Module):
    """Qwen3-MoE's sparse block: softmax router (`gate`), top-k, optional renormalisation, grouped experts."""

    def __init__(self, a: Qwen3MoeArgs) -> None:
        super().__init__()
        self.k, self.norm_topk = a.num_experts_per_tok, a.norm_topk_prob
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(a.hidden_size, a.moe_intermediate_size) for _ in range(a.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, H) → (weights (T, k) float32, expert ids (T, k))."""
        probs = F.linear(x, self.gate.weight).float().softmax(-1)  # (T, E)
        w, idx = probs.topk(self.k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return w.to(x.dtype).float(), idx  # rounded to x's dtype as transformers' router output is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        w, idx = self.route(x)
        return grouped_experts(x, w, idx, self.experts)


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 block whose MLP is the sparse MoE on sparse layers (also a draft head's block)."""

    def __init__(self, args: Qwen3MoeArgs, sparse: bool, input_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(args) if sparse else MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, attn, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeBackbone(nn.Module):
    """Embeddings, decoder layers and final norm (the HF `model.*` prefix)."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, args.is_sparse(i)) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Qwen3MoeForCausalLM(CausalLM):
    """A Qwen3-MoE target. Build with `mtp_train.models.load_model`."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args, Qwen3MoeBackbone(args))


def head_block(args: Qwen3MoeArgs, input_norm: bool, moe: bool) -> DecoderLayer:
    """A draft head's layer: a dense Qwen3 layer, or with `moe` a sparse one of the target's expert shape."""
    return DecoderLayer(args, sparse=moe, input_norm=input_norm)


TP = TPRules(
    column=(*LLAMA_TP.column, "mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"),
    row=LLAMA_TP.row,  # attention's o_proj; a dense layer's down_proj
    divided=(*LLAMA_TP.divided, "moe_intermediate_size"),
    partial=("mlp.experts.*.down_proj",),
    reduced=("mlp",),
)
FAMILY = Family(name="qwen3_moe", title="Qwen3-MoE", model_types=("qwen3_moe",), parse=parse_config,
                model=Qwen3MoeForCausalLM, attention=attention, head_block=head_block, head_moe=True,
                fusings=FUSINGS, tp=TP)
