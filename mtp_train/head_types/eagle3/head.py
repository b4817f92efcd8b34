"""The EAGLE-3 head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"), as vLLM's `llama_eagle3` and SGLang's `LlamaForCausalLMEagle3` run it.

    g = fc(a_i)                       step 0: a_i (3H) = the target's aux layers at i, concatenated (no bias)
    g = x_{j-1}                       step j > 0: the head's previous output, BEFORE the final norm
                                      (EAGLE-3.1's head.norm_output: norm(x_{j-1}); head.aux_norm: fc reads
                                      [n_1(a_i^1) ; ... ; n_k(a_i^k)], one RMSNorm per aux layer)
    u = [ input_layernorm(E(t_{i+1})) ; hidden_norm(g) ]      (2H: embedding first)
    r = g + o_proj(attention(qkv_proj(u)))                    (q/k/v read 2H; the residual is g itself)
    x = r + mlp(post_attention_layernorm(r))                  (the output feature, fed to the next step)
    logits = lm_head(norm(x))                                 (the head's OWN lm_head over the draft vocabulary)

State dict: fc.weight (H, 3H); layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
layers.0.self_attn.{qkv_proj (fused q/k/v of input 2H, bias with qkv_bias), o_proj}; layers.0.mlp.{gate_up_proj,
down_proj}; norm.weight; lm_head.weight (Vd, H); the draft_vocab buffer (Vd,) of ascending target ids;
aux_norm.{0..k-1}.weight (H,) with head.aux_norm. The
lm_head rows start as the target's lm_head rows of the draft tokens (re-copied whenever the draft vocabulary is
set) and train. The block is the Llama family's (attention with q/k norms or qkv bias as the variant has them);
targets whose family lists its head types (DeepSeek-V2) refuse it by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mtp_train.config import HeadConfig
from mtp_train.heads.base import ChainHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, MLABackend
from mtp_train.layers.linear import Linear
from mtp_train.layers.norm import RMSNorm
from mtp_train.models.config import ModelArgs
from mtp_train.models.families.llama import MLP, Attention, native_layer_plan


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [norm(embedding) ; norm(g)] (2H → q/k/v), residual from g."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)  # on the embedding
        self.hidden_norm = RMSNorm(h, eps)  # on g
        self.self_attn = Attention(args)
        a = self.self_attn
        a.qkv_proj = Linear(2 * h, a.q_size + 2 * a.kv_size, bias=args.qkv_bias)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(args)
        self._plans = cpu_kernels.LayerPlans()  # the layer as a head step's one native call runs it

    def native_plan(self, g: torch.Tensor, attn: AttentionBackend, kv_cache: torch.Tensor | None,
                    meta: AttentionMetadata) -> cpu_kernels.LayerPlan | None:
        """The layer's `LayerPlan` for a head step's one native call (`cpu_kernels.head_step`, which norms the
        embedding and g itself: q/k/v read those 2H columns, g is the residual), or None; g: (M, H) the rows."""
        return native_layer_plan(self, g, attn, kv_cache, meta, None, qkv_in=2 * g.shape[-1])

    def forward(self, embeds: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend, kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """embeds, g: (T, H) → (T, H) the layer output before any final norm."""
        u = torch.cat([self.input_layernorm(embeds), self.hidden_norm(g)], dim=-1)  # (T, 2H)
        r = g + self.self_attn(u, cos, sin, attn, kv_cache, meta)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(ChainHead):
    """fc over the aux layers → one EAGLE-3 layer → final norm → its own lm_head over the draft vocabulary."""

    type_name = "eagle3"

    @property
    def norm_output(self) -> bool:
        """EAGLE-3.1's head.norm_output (eagle3's own setting): the next step reads the final-normed output."""
        return bool(self.cfg.settings.norm_output)

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        a = self.args
        h = a.hidden_size
        self.fc = Linear(self.input_width, h, bias=self.cfg.fc_bias)
        self.layers = nn.ModuleList([Eagle3Layer(a)])  # `layers.0.*`, as the serving layouts name it
        self.norm = RMSNorm(h, a.rms_norm_eps)
        self.lm_head = Linear(h, self.vocab_size, bias=False)
        if frozen is not None:
            self._copy_target_rows()

    def _copy_target_rows(self) -> None:
        """lm_head ← the target's lm_head rows of the draft vocabulary (the starting point of training)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(self.lm_head_weight().to(self.lm_head.weight))

    def set_draft_vocab(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Set the draft vocabulary and restart the head's lm_head from the target's rows of those tokens."""
        super().set_draft_vocab(token_ids)
        if self.frozen is not None:
            self._copy_target_rows()

    def logit_input(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.norm_output else self.norm(out)  # norm_output: `features` has normed it already

    def target_fc(self) -> Linear | None:
        return self.fc  # a step from the target reads its k aux layers through the fc

    def _native_head_plan(self, hidden: torch.Tensor, attn: AttentionBackend | MLABackend,
                          kv_cache: torch.Tensor, meta: AttentionMetadata,
                          n: int) -> tuple[cpu_kernels.HeadPlan, bool, bool] | tuple[()]:
        """No fc in the call (a step from the target took it first): the layer over [input_layernorm(e) ;
        hidden_norm(g)] with g its residual, the final norm, the head's own lm_head rows; the features the layer's
        output before the final norm (after it with head.norm_output)."""
        layer = self.layers[0]
        if type(layer) is not Eagle3Layer or self.dtype != torch.float32:
            return ()
        plan = layer.native_plan(hidden, attn, kv_cache, meta)
        if plan is None:
            return ()
        return self._head_plan(plan, (layer.input_layernorm, layer.hidden_norm, self.norm),
                               layer.post_attention_layernorm.eps, None, hidden.shape[0], n,
                               raw_out=not self.norm_output)

    def draft_lm_head(self) -> torch.Tensor:
        return self.lm_head.weight

    def features(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor | None, attn: AttentionBackend, *, from_target: bool) -> torch.Tensor:
        """(T, k·H) aux features (from the target) or (T, H) the previous output + (T,) next tokens → (T, H) the output
        feature: the layer output before the final norm, or after it with head.norm_output (EAGLE-3.1)."""
        e = self.embed(token_ids)  # (T, H)
        g = hidden.to(e.dtype)
        if from_target:
            g = self.fc(self.aux_input(g))  # the target's k aux layers: (T, k·H) → (T, H), sliced norms with aux_norm
        cos, sin = self.rope(meta.rotary_positions, g.dtype)  # a tree step rotates to depths
        x = self.layers[0](e, g, cos, sin, attn, kv_cache, meta)
        return self.norm(x) if self.norm_output else x
