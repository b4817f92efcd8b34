"""What every target family shares: the `CausalLM` base class, its step loop, and what a forward returns.

Inputs are the packed new tokens of a step, (T,), with no batch dimension and no padding; the attention backend
and its per-step metadata say which sequence each token belongs to and where its K/V live in the paged cache.

The forward returns the hidden state after the final norm (what `lm_head` sees), optionally chosen intermediate
layers in `transformers`' `hidden_states[j]` numbering (0 = embeddings, j = output of layer j-1, L = after the
final norm), and logits only at the positions asked for. A family (`mtp_train.models.families`) supplies the
backbone's decoder layers and, where its RoPE differs, `rope`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, MLABackend
from mtp_train.layers.linear import Linear, PlanMemo, gemv_avx512, streaming_generation
from mtp_train.layers.rotary import RotaryEmbedding
from mtp_train.models.config import ModelArgs


@dataclass
class ForwardOutput:
    """What a forward returns (T = new tokens of the step, N = requested logit positions)."""

    hidden: torch.Tensor  # (T, H) after the final norm
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # j → (T, H), HF hidden_states[j]
    logits: torch.Tensor | None = None  # (N, V) at the requested positions, else None


def rotate_half_rope(rotary: RotaryEmbedding, positions: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (T,) → cos, sin (T, 1, D) in the rotate-half layout, in `dtype` (most families' RoPE)."""
    return rotary(positions, dtype)


class CausalLM(nn.Module):
    """Any target: `model.{embed_tokens, layers, norm}`, `lm_head`, RoPE and the step loop.

    A family passes its backbone (an nn.Module with `embed_tokens`, `layers`, `norm`) and may override `rope`
    (how RoPE angles reach its layers). Build one with `mtp_train.models.load_model`.
    """

    def __init__(self, args: ModelArgs, backbone: nn.Module) -> None:
        super().__init__()
        self.args = args
        self.model = backbone
        self.lm_head: nn.Module = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(args.rope)
        self.attn: AttentionBackend | MLABackend | None = None  # set by the loader / engine
        self._stack_memo: PlanMemo | None = None  # the last step's layer plans (`_native_plans`)

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
        return rotate_half_rope(self.rotary, positions, dtype)

    def _native_plans(self, x: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                      meta: AttentionMetadata) -> list[cpu_kernels.LayerPlan] | None:
        """Each decoder layer's `LayerPlan` where every layer would run in one native call in this step
        (`native_plan`: a family's layer that has one, a CPU decode or verify step of a few rows), so that the
        stack runs in one (`cpu_kernels.decoder_stack`); else None. Decided before any layer runs, while the
        modules it reads are still in cache."""
        st = meta.backend_state
        if not st.get("native"):
            return None
        if not (st["native_args"].slots is not None and x.dim() == 2 and x.is_contiguous()
                and cpu_kernels.serves(x, kv_caches[0]) and all(c.is_contiguous() for c in kv_caches)):
            return None  # the step-wide conditions of every layer's native_plan
        key = (cpu_kernels.generation(), streaming_generation(), torch.is_grad_enabled(), id(self.attn))
        memo = self._stack_memo
        if memo is None or memo.key != key or not memo.valid():
            copied = [m for m in self.model.layers.modules() if isinstance(m, Linear) and m.w16 is not None]
            memo = self._stack_memo = PlanMemo(key, list(self.model.layers.parameters()), [m.weight for m in copied])
        m = x.shape[0]
        plans = memo.plans.get(m)
        if plans is not None:
            return plans  # what every layer's native_plan would decide again: same rows, kernels and weights
        plans = []
        for layer, kv in zip(self.model.layers, kv_caches):
            native_plan = getattr(layer, "native_plan", None)
            plan = None if native_plan is None else native_plan(x, self.attn, kv, meta)
            if plan is None:
                return None
            plans.append(plan)
        memo.plans[m] = plans
        return plans

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
        kv_caches: one pool per layer in the family's layout (`args.kv_layout`; e.g. (num_pages, 2, page_size,
        Hkv, D)), or None for a cache-free prefill; logits_indices: (N,) token indices whose logits are wanted
        (None = no lm_head); hidden_layers: HF `hidden_states` indices to return as well.
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
        cos, sin = self.rope(meta.rotary_positions, x.dtype)
        layers: dict[int, torch.Tensor] = {}
        plans = None if kv_caches is None else self._native_plans(x, kv_caches, meta)
        if plans is not None:
            x, layers = cpu_kernels.decoder_stack(plans, x, cos, sin, kv_caches, meta.backend_state["native_args"],
                                                  gemv_avx512(x.shape[0]), wanted)
        else:
            for i, layer in enumerate(self.model.layers):
                if i in wanted:
                    layers[i] = x
                x = layer(x, cos, sin, self.attn, None if kv_caches is None else kv_caches[i], meta)
        hidden = self.model.norm(x)
        if n_layers in wanted:
            layers[n_layers] = hidden
        logits = None if logits_indices is None else self.compute_logits(hidden[logits_indices])
        return ForwardOutput(hidden=hidden, layers=layers, logits=logits)
