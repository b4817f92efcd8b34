"""Inference implementation of the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3).

Inputs are the packed new tokens of a step, (T,), with no batch dimension and no padding; the
attention backend and its per-step metadata say which sequence each token belongs to and where its
K/V live in the paged cache. q/k/v and gate/up projections are fused into one matmul each.

The forward returns the hidden state after the final norm (what `lm_head` sees), optionally chosen
intermediate layers in `transformers`' `hidden_states[j]` numbering (0 = embeddings, j = output of
layer j-1, L = after the final norm), and logits only at the positions asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata
from mtp_train.layers.linear import Linear
from mtp_train.layers.norm import RMSNorm
from mtp_train.layers.rotary import RotaryEmbedding, apply_rotary
from mtp_train.models.config import ModelArgs


@dataclass
class ForwardOutput:
    """What a forward returns (T = new tokens of the step, N = requested logit positions)."""

    hidden: torch.Tensor  # (T, H) after the final norm
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # j → (T, H), HF hidden_states[j]
    logits: torch.Tensor | None = None  # (N, V) at the requested positions, else None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
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
        out = attn.forward(q, k, v, kv_cache, meta)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) → (T, H): down(silu(gate(x)) * up(x))."""
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder block; `input_layernorm` can be dropped (the original EAGLE head does)."""

    def __init__(self, args: ModelArgs, input_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """x: (T, H) → (T, H)."""
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, attn, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    """Embeddings, decoder layers and final norm (the HF `model.*` prefix)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """What every target family shares: `model.{embed_tokens, layers, norm}`, `lm_head`, RoPE and the step loop.

    A family passes its backbone and may override `rope` (how RoPE angles reach its layers).
    """

    def __init__(self, args: ModelArgs, backbone: nn.Module) -> None:
        super().__init__()
        self.args = args
        self.model = backbone
        self.lm_head: nn.Module = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(args.rope)
        self.attn: AttentionBackend | None = None  # set by the loader / engine

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, H) after the final norm → (N, V)."""
        return self.lm_head(hidden)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) → cos, sin (T, 1, D) in the rotate-half layout."""
        return self.rotary(positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor] | None = None,
        *,
        logits_indices: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run the step.

        input_ids: (T,) packed new tokens; meta: the step's attention metadata (positions included);
        kv_caches: one (num_pages, 2, page_size, Hkv, D) tensor per layer, or None for a cache-free
        prefill; logits_indices: (N,) token indices whose logits are wanted (None = no lm_head);
        hidden_layers: HF `hidden_states` indices to return as well.
        """
        if self.attn is None:
            raise RuntimeError("no attention backend set; load the model with mtp_train.models.load_model")
        n_layers = self.args.num_layers
        wanted = set(hidden_layers)
        bad = [j for j in wanted if not 0 <= j <= n_layers]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range 0..{n_layers}")
        if kv_caches is not None and len(kv_caches) != n_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {n_layers} layers")

        self.attn.prepare(meta)
        x = self.model.embed_tokens(input_ids)  # (T, H)
        cos, sin = self.rope(meta.positions, x.dtype)
        layers: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in wanted:
                layers[i] = x
            x = layer(x, cos, sin, self.attn, None if kv_caches is None else kv_caches[i], meta)
        hidden = self.model.norm(x)
        if n_layers in wanted:
            layers[n_layers] = hidden
        logits = None if logits_indices is None else self.compute_logits(hidden[logits_indices])
        return ForwardOutput(hidden=hidden, layers=layers, logits=logits)


class LlamaForCausalLM(CausalLM):
    """A Llama-family target. Build with `mtp_train.models.load_model`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, LlamaBackbone(args))
