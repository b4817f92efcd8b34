"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3): config parsing, the model, its family entry.

The args are `ModelArgs` itself; what differs inside the family (Qwen2's q/k/v bias, Qwen3's q/k norms, which
layers slide a window) is the `VARIANTS` table. Windows are per layer as transformers derives them: none for
Llama, `sliding_window` on every layer for Mistral, and for Qwen2 / Qwen3 with `use_sliding_window` the layers
from `max_window_layers` on (or those `layer_types` names); per-layer keys a type does not read are refused by
name (`models/layer_switches.py`). Layers of different windows run on a `LayerWindowAttention`. q/k/v and
gate/up projections are fused into one matmul each (`FUSINGS`); a draft head's block is the target's
`DecoderLayer`, optionally without its input norm, with the model-wide window.

Tensor parallelism (`TP`, Megatron-style, see models/tensor_parallel.py):

| tensor (HF name)                         | split                        | forward                          |
|------------------------------------------|------------------------------|----------------------------------|
| `self_attn.{q,k,v}_proj` (weight, bias)  | rows, by heads (column)      | local heads attend locally       |
| `self_attn.o_proj.weight`                | columns (row-parallel)       | partial sums → all-reduce, +bias |
| `mlp.{gate,up}_proj`                     | rows (column)                | local                            |
| `mlp.down_proj.weight`                   | columns (row-parallel)       | partial sums → all-reduce, +bias |
| norms, q/k norms                         | replicated                   |                                  |
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    LayerWindowAttention,
    make_attention_backend,
)
from mtp_train.layers.attention.torch_backend import TorchBackend
from mtp_train.layers.linear import Linear, gemv_avx512, gemv_weight, padded_t, takes_small_m
from mtp_train.layers.norm import RMSNorm
from mtp_train.layers.rotary import apply_rotary
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelArgs, ModelConfigError, rope_from_config, shared_fields
from mtp_train.models.families import Family, TPRules
from mtp_train.models.fusing import Fusing
from mtp_train.models.layer_switches import (
    DEFAULT_WINDOW,
    check_layer_switches,
    qwen_windows,
    window_size,
    windows_everywhere,
)


def _llama_windows(cfg: dict[str, Any], n: int, source: str) -> list[int | None]:
    """Llama: full attention on every layer. transformers' Llama ignores a `sliding_window` where other engines and
    the checkpoint's training may not, so anything but null is refused by name."""
    if cfg.get("sliding_window") is not None:
        raise ModelConfigError(
            f"{source}: sliding_window={cfg['sliding_window']!r} in a llama config: transformers' Llama ignores it "
            "and attends over every token; set it to null for full attention, or model_type to mistral for this "
            "window on every layer")
    return [None] * n


def _mistral_windows(cfg: dict[str, Any], n: int, source: str) -> list[int | None]:
    """Mistral: `sliding_window` (MistralConfig's 4096 when absent, none when null) on every layer."""
    return windows_everywhere(n, window_size(cfg, source, DEFAULT_WINDOW))


QWEN_KEYS = ("layer_types", "use_sliding_window", "max_window_layers")  # the per-layer keys Qwen2 / Qwen3 read

# model_type → what differs inside the family: biases, norms, the per-layer window rule and the per-layer keys it
# reads (transformers' config class of the type derives the same windows; `layer_switches` has the rules), and the
# name messages give transformers' model of the type
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"windows": _llama_windows, "title": "transformers' Llama"},
    "mistral": {"windows": _mistral_windows, "title": "transformers' Mistral"},
    "qwen2": {"qkv_bias": True, "windows": qwen_windows, "honours": QWEN_KEYS, "title": "transformers' Qwen2"},
    "qwen3": {"qk_norm": True, "windows": qwen_windows, "honours": QWEN_KEYS, "title": "transformers' Qwen3"},
}


def parse_variant(cfg: dict[str, Any], source: str, variant: dict[str, Any]) -> ModelArgs:
    """A Llama-family config.json dict → ModelArgs under `variant` (a `VARIANTS` entry), the per-layer windows
    applied but not yet audited (`check_layer_switches`); `source` names the file in error messages."""
    fields = shared_fields(cfg, source)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or fields["hidden_size"] // heads)
    rope = rope_from_config(cfg, head_dim, source)
    attention_bias = bool(cfg.get("attention_bias", False))
    windows = variant["windows"](cfg, fields["num_layers"], source)
    uniform = len(set(windows)) <= 1  # one window (or none) everywhere: one plain backend, the head's block alike
    return ModelArgs(
        **fields,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope=rope,
        qkv_bias=variant.get("qkv_bias", False) or attention_bias,
        o_bias=attention_bias,
        qk_norm=variant.get("qk_norm", False),
        sliding_window=windows[0] if uniform and windows else None,
        layer_windows=[] if uniform else windows,
    )


def parse_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """A Llama-family config.json dict → ModelArgs; `source` names it in error messages."""
    variant = VARIANTS[cfg["model_type"]]
    args = parse_variant(cfg, source, variant)
    check_layer_switches(cfg, source, variant["title"], args.windows, [False] * args.num_layers,
                         honoured=variant.get("honours", ()))
    return args


class Attention(nn.Module):
    """Self-attention of one layer: fused q/k/v, optional q/k norms, RoPE, its window, o_proj.

    `layer` is the decoder layer's index, whose window (`ModelArgs.window`) the layer attends with; None (a draft
    head's block) takes the model-wide `sliding_window`. A model whose layers' windows differ runs on a
    `LayerWindowAttention`, which each layer asks for its own window; any other backend must have the layer's.
    """

    def __init__(self, args: ModelArgs, layer: int | None = None) -> None:
        super().__init__()
        self.window = args.sliding_window if layer is None else args.window(layer)
        self.sinks: torch.Tensor | None = None  # (Hq,) attention-sink logits of a family that has them (GPT-OSS)
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        native_rope = self.q_norm is None and cpu_kernels.serves(qkv, cos)
        if native_rope:  # CPU inference: rotate q and k (adjacent in the fused output) in one native pass
            cpu_kernels.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not native_rope:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attend(attn, q, k, v, kv_cache, meta)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.q_size))

    def attend(self, attn: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D) → (T, Hq, D) through `attn` with this layer's window and sinks."""
        if isinstance(attn, LayerWindowAttention):
            return attn.attend(q, k, v, kv_cache, meta, self.window, self.sinks)
        if attn.sliding_window != self.window or self.sinks is not None:
            # a backend of one window for a layer of another would attend over other tokens without a word
            raise ValueError(f"a layer with window {self.window} (sinks: {self.sinks is not None}) cannot run on "
                             f"the {attn.name} backend of window {attn.sliding_window}; it needs its family's "
                             "per-layer backend (LayerWindowAttention)")
        return attn.forward(q, k, v, kv_cache, meta)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) → (T, H): down(silu(gate(x)) * up(x))."""
        gu, down = self.gate_up_proj, self.down_proj
        # Plain Linears only: under tensor parallelism down_proj is a RowParallelLinear (its sum over ranks).
        if (isinstance(gu, Linear) and isinstance(down, Linear) and gu.bias is None and down.bias is None
                and takes_small_m(x, gu.weight, gu.w16)):
            # Decode batches on CPU: (W @ xᵀ) end to end, gate and up are row blocks of the (2I, T') product and
            # their product feeds down_proj as it is; the same GEMMs as `linear`, without its copies back to (T, ·).
            gate, up = torch.mm(gu.weight, padded_t(x)).split(self.inter, dim=0)  # (I, T') each
            return torch.mm(down.weight, F.silu(gate).mul_(up))[:, :x.shape[0]].t().contiguous()
        gate, up = gu(x).split(self.inter, dim=-1)
        return down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder block; `input_layernorm` can be dropped (the original EAGLE head does); `layer`: its index in
    the target (its window), None for a draft head's block."""

    def __init__(self, args: ModelArgs, input_norm: bool = True, layer: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)
        self._plans = cpu_kernels.LayerPlans()  # the layer as `native` runs it, per set of weights

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        out = self.native(x, cos, sin, attn, kv_cache, meta)
        if out is not None:
            return out
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, attn, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
               kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor | None:
        """The whole layer in one native call (`cpu_kernels.decoder_layer`) for the few rows of a CPU decode or
        verify step whose every part would take its native kernel anyway (each projection's gemv as `Linear` would
        choose it, the paged attention writing the new K/V), else None: the layer then runs op by op. The same
        arithmetic, without ~20 dispatches of a few microseconds each per layer and step."""
        plan = self.native_plan(x, attn, kv_cache, meta)
        if plan is None:
            return None
        m = x.shape[0]
        return cpu_kernels.decoder_layer(plan, x, cos, sin, kv_cache, meta.backend_state["native_args"],
                                         gemv_avx512(m))

    def native_plan(self, x: torch.Tensor, attn: AttentionBackend, kv_cache: torch.Tensor | None,
                    meta: AttentionMetadata) -> cpu_kernels.LayerPlan | None:
        """The `LayerPlan` that `native` runs x's rows through in this step (made at first use of its weights), or
        None where the layer runs op by op; also what a head's step in one native call runs its layer with."""
        return native_layer_plan(self, x, attn, kv_cache, meta, self.input_layernorm)


def native_layer_plan(layer: nn.Module, x: torch.Tensor, attn: AttentionBackend, kv_cache: torch.Tensor | None,
                      meta: AttentionMetadata, ln1: RMSNorm | None,
                      qkv_in: int | None = None) -> cpu_kernels.LayerPlan | None:
    """`DecoderLayer.native_plan` for any block with its parts (`self_attn`, `mlp`, `post_attention_layernorm` and a
    `_plans` memo): ln1 the norm q/k/v read x through (None: none, or applied by the caller), qkv_in the columns
    q/k/v read (None: H; EAGLE-3's layer 2H, in a head step). x: (M, H) stands for the rows; None where the layer
    runs op by op."""
    m = x.shape[0]
    st = meta.backend_state
    a, mlp = layer.self_attn, layer.mlp
    if (kv_cache is None or not st.get("native") or type(attn) is not TorchBackend
            or attn.sliding_window != a.window or not cpu_kernels.serves(x, kv_cache) or x.dim() != 2
            or not x.is_contiguous() or not kv_cache.is_contiguous() or st["native_args"].slots is None
            or type(mlp) is not MLP or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None):
        return None
    ws = [gemv_weight(lin, m) for lin in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(w is None for w in ws):
        return None
    key = tuple(w.data_ptr() for w in ws)  # type: ignore[union-attr]
    plan = layer._plans.get(key)
    if plan is None:
        norms = (ln1, layer.post_attention_layernorm, a.q_norm, a.k_norm)
        eps = layer.post_attention_layernorm.eps  # the kernel's one eps: every norm's here
        if any(n is not None and (type(n) is not RMSNorm or n.eps != eps) for n in norms):
            return None
        w1, ln2, qn, kn = (None if n is None else n.weight.detach().contiguous() for n in norms)
        wqkv, wo, wgu, wd = (w.detach() for w in ws)  # type: ignore[union-attr]
        bias = [None if b is None else b.detach().contiguous() for b in (a.qkv_proj.bias, a.o_proj.bias)]
        sinks = None if a.sinks is None else a.sinks.detach().to(torch.float32).contiguous()
        plan = layer._plans.add(key, cpu_kernels.LayerPlan(
            cpu_kernels.LayerWeights(w1, ln2, qn, kn, wqkv, wo, wgu, wd, *bias, sinks),
            (a.num_heads, a.num_kv_heads, a.head_dim), eps, attn.scale, a.window, qkv_in))
    return plan


class LlamaBackbone(nn.Module):
    """Embeddings, decoder layers and final norm (the HF `model.*` prefix)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, layer=i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """A Llama-family target. Build with `mtp_train.models.load_model`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, LlamaBackbone(args))


def attention(args: ModelArgs, backend: str, device: torch.device | str,
              dtype: torch.dtype | None) -> AttentionBackend:
    """The backend `backend` (auto | torch | flashinfer) for Hq query heads over Hkv K/V heads of D: one of the
    model's window, or with per-layer windows (`args.layer_windows`) one per distinct window behind a
    `LayerWindowAttention`."""
    def make(window: int | None) -> AttentionBackend:
        return make_attention_backend(backend, args.num_heads, args.num_kv_heads, args.head_dim, window, device=device)

    if args.layer_windows:
        return LayerWindowAttention(make, set(args.layer_windows))
    return make(args.sliding_window)


def head_block(args: ModelArgs, input_norm: bool, moe: bool) -> DecoderLayer:
    """A draft head's layer: the target's decoder layer (no MoE in this family; `head_moe` is off)."""
    return DecoderLayer(args, input_norm=input_norm)


def _qkv_rows(a: ModelArgs) -> list[int]:
    return [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]


def _gate_up_rows(a: ModelArgs) -> list[int]:
    return [a.intermediate_size, a.intermediate_size]


FUSINGS = (
    Fusing("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), _qkv_rows),
    Fusing("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), _gate_up_rows),
)
TP = TPRules(
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
    divided=("num_heads", "num_kv_heads", "intermediate_size"),
)
FAMILY = Family(name="llama", title="Llama-family", model_types=tuple(VARIANTS), parse=parse_config,
                model=LlamaForCausalLM, attention=attention, head_block=head_block, fusings=FUSINGS, tp=TP)
