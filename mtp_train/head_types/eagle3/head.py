"""The EAGLE-3 head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"), as vLLM's `llama_eagle3` and SGLang's `LlamaForCausalLMEagle3` run it.

    g = fc(a_i)                       step 0: a_i (3H) = the target's aux layers at i, concatenated (no bias)
    g = x_{j-1}                       step j > 0: the head's previous output, BEFORE the final norm
                                      (EAGLE-3.1's head.norm_output: norm(x_{j-1}); head.aux_norm: fc reads
                                      [n_1(a_i^1) ; ... ; n_k(a_i^k)], one RMSNorm per aux layer;
                                      head.fc_input_norm: fc reads n(a_i), ONE RMSNorm over the whole k·H)
    u = [ input_layernorm(E(t_{i+1})) ; hidden_norm(g) ]      (2H: embedding first)
    r = g + o_proj(attention(qkv_proj(u)))                    (q/k/v read 2H; the residual is g itself,
                                                               hidden_norm(g) with head.norm_before_residual)
    x = r + mlp(post_attention_layernorm(r))                  (the output feature, fed to the next step)
    logits = lm_head(norm(x))                                 (the head's OWN lm_head over the draft vocabulary)

State dict: fc.weight (H, 3H); layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
layers.0.self_attn.{qkv_proj (fused q/k/v of input 2H, bias with qkv_bias), o_proj}; layers.0.mlp.{gate_up_proj,
down_proj}; norm.weight; lm_head.weight (Vd, H); the draft_vocab buffer (Vd,) of ascending target ids;
aux_norm.{0..k-1}.weight (H,) with head.aux_norm; fc_input_norm.weight (k·H,) with head.fc_input_norm. The
lm_head rows start as the target's lm_head rows of the draft tokens (re-copied whenever the draft vocabulary is
set) and train, or stay those rows, frozen, with head.train_lm_head=false (speculators' recipe). The block is the
Llama family's (attention with q/k norms or qkv bias as the variant has them); targets whose family lists its head
types (DeepSeek-V2) refuse it by name.

speculators' variants (`Eagle3SpeculatorConfig`: `norm_before_fc`, `norm_before_residual`, its frozen lm_head)
act inside `features` and `aux_input`, so training (`unroll`), the engine's op-by-op steps and its native step
(`native_step`) see them alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mtp_train.config import HeadConfig
from mtp_train.config.device import on_cpu
from mtp_train.heads.base import ChainHead, HeadOutput
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, MLABackend
from mtp_train.layers.linear import Linear
from mtp_train.layers.norm import RMSNorm
from mtp_train.models.config import ModelArgs
from mtp_train.models.families.llama import MLP, Attention, native_layer_plan


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [norm(embedding) ; norm(g)] (2H → q/k/v), residual from g (from
    norm(g) with `norm_before_residual`, speculators' and vLLM's flag)."""

    def __init__(self, args: ModelArgs, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
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
        gn = self.hidden_norm(g)
        u = torch.cat([self.input_layernorm(embeds), gn], dim=-1)  # (T, 2H)
        r = (gn if self.norm_before_residual else g) + self.self_attn(u, cos, sin, attn, kv_cache, meta)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(ChainHead):
    """fc over the aux layers → one EAGLE-3 layer → final norm → its own lm_head over the draft vocabulary."""

    type_name = "eagle3"

    @property
    def norm_output(self) -> bool:
        """EAGLE-3.1's head.norm_output (eagle3's own setting): the next step reads the final-normed output."""
        return bool(self.cfg.settings.norm_output)

    def _setting(self, key: str, default: bool) -> bool:
        """eagle3's own switch `key`, or `default` for a type built on this head whose settings lack it (peagle)."""
        return bool(getattr(self.cfg.settings, key, default))

    @property
    def norm_before_residual(self) -> bool:
        """head.norm_before_residual: the layer's residual is hidden_norm(g) (speculators' default)."""
        return self._setting("norm_before_residual", False)

    @property
    def train_lm_head(self) -> bool:
        """head.train_lm_head: the lm_head rows train (true) or stay the target's rows, frozen (false)."""
        return self._setting("train_lm_head", True)

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        a = self.args
        h = a.hidden_size
        # speculators' norm_before_fc (head.fc_input_norm): ONE RMSNorm over the whole (T, k·H) aux input
        self.fc_input_norm = (RMSNorm(self.input_width, a.rms_norm_eps) if self._setting("fc_input_norm", False)
                              else None)
        self.fc = Linear(self.input_width, h, bias=self.cfg.fc_bias)
        # `layers.0.*`, as the serving layouts name it
        self.layers = nn.ModuleList([Eagle3Layer(a, norm_before_residual=self.norm_before_residual)])
        self.norm = RMSNorm(h, a.rms_norm_eps)
        self.lm_head = Linear(h, self.vocab_size, bias=False)
        # head.train_lm_head=false: no gradient, so neither the optimiser (the trainer hands it the parameters that
        # require one) nor its weight decay ever moves the target's rows
        self.lm_head.weight.requires_grad_(self.train_lm_head)
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

    def aux_input(self, aux: torch.Tensor) -> torch.Tensor:
        """(T, k·H) step 0's aux features → (T, k·H) what the fc reads: through head.fc_input_norm's one RMSNorm
        over the whole row, then head.aux_norm's per-layer norms (vLLM's `combine_hidden_states` order)."""
        if self.fc_input_norm is not None:
            aux = self.fc_input_norm(aux)
        return super().aux_input(aux)

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
        # head.norm_before_residual: `native_step` hands the call hidden_norm(g), its residual, and no norm on it
        hnorm = None if self.norm_before_residual else layer.hidden_norm
        return self._head_plan(plan, (layer.input_layernorm, hnorm, self.norm),
                               layer.post_attention_layernorm.eps, None, hidden.shape[0], n,
                               raw_out=not self.norm_output)

    def native_step(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                    kv_cache: torch.Tensor | None, attn: AttentionBackend | MLABackend, from_target: bool,
                    logits_indices: torch.Tensor | None) -> HeadOutput | None:
        """`ChainHead.native_step`; with head.norm_before_residual the call's rows are hidden_norm(g) (after the fc
        for a step from the target): the native layer takes its rows as the residual and q/k/v's second half, which
        is then exactly the normed g (its plan has no norm on them)."""
        if not self.norm_before_residual:
            return super().native_step(hidden, token_ids, meta, kv_cache, attn, from_target, logits_indices)
        if kv_cache is None or self.dtype != torch.float32 or not on_cpu(hidden.device):
            return None  # no native call here: `forward` runs `features`, which norms g itself
        g = self.fc(self.aux_input(hidden)) if from_target else hidden
        g = self.layers[0].hidden_norm(g).contiguous()
        return super().native_step(g, token_ids, meta, kv_cache, attn, False, logits_indices)

    def draft_lm_head(self) -> torch.Tensor:
        return self.lm_head.weight

    def features(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor | None, attn: AttentionBackend, *, from_target: bool) -> torch.Tensor:
        """(T, k·H) aux features (from the target) or (T, H) the previous output + (T,) next tokens → (T, H) the output
        feature: the layer output before the final norm, or after it with head.norm_output (EAGLE-3.1)."""
        e = self.embed(token_ids)  # (T, H)
        g = hidden.to(e.dtype)
        if from_target:
            g = self.fc(self.aux_input(g))  # the k aux layers (T, k·H) → (T, H), through their norms if any
        cos, sin = self.rope(meta.rotary_positions, g.dtype)  # a tree step rotates to depths
        x = self.layers[0](e, g, cos, sin, attn, kv_cache, meta)
        return self.norm(x) if self.norm_output else x
