"""The RMSNorm-restored MTP head (DeepSeek-V3 MTP shape), with every norm behind a HeadConfig switch.

    x = fc [ enorm(E(t_{i+1})) ; hnorm(h_i) ]     (2H → H, embedding first)
    x = DecoderLayer(x)                          (input norm, attention, post-attention norm, MLP, residuals)
    ĥ_{i+1} = norm(x)                            (the predicted feature, and the hidden of the next draft step)
    logits = lm_head(ĥ_{i+1})                    (frozen target lm_head)

Why the norms: the embedding and lm_head are frozen, so the layer must map into the space the lm_head
expects (the target's post-final-norm hidden states). Without a final norm one MLP has to learn "MLP followed
by a norm"; without the input norms the fc sees an embedding and a hidden state on very different scales.
With every switch off this is the original EAGLE head (see `eagle1.py`), so ablations are one flag at a time.

`head.features=aux` (EAGLE-3's fused input, for the comparison with `eagle3.py` one flag at a time): step 0 reads
the target's k aux layers at i, concatenated (T, k·H), through `aux_fc` (k·H → H, no bias) in place of h_i; steps
j > 0 read the head's own (final-normed) output as before, and the targets stay the final hidden h_{i+1}. Nothing
else changes. `head.aux_norm` (EAGLE-3.1) norms each aux layer's slice before `aux_fc` (`DraftHead.aux_input`).
What still separates it from eagle3: eagle3 has no 2H → H fc (its attention reads [E ; g] at 2H, the residual is
g), it feeds the next step its output before the final norm, and it trains its own lm_head rows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mtp_train.config import HeadConfig
from mtp_train.heads.base import ChainHead
from mtp_train.heads.frozen import FrozenTargetParts, read_decoder_layer, read_mtp_layer
from mtp_train.layers import cpu_kernels
from mtp_train.layers.attention import AttentionBackend, AttentionMetadata, MLABackend
from mtp_train.layers.linear import Linear
from mtp_train.layers.norm import RMSNorm
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.families import family_of, titles


class MTPHead(ChainHead):
    """fc over [embedding ; hidden] → one decoder layer of the target's family and shapes → optional norm."""

    type_name = "mtp"

    def __init__(self, cfg: HeadConfig, target_args: ModelArgs, frozen: FrozenTargetParts | None = None,
                 backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        c, a = self.cfg, self.args
        h, eps = a.hidden_size, a.rms_norm_eps
        self.enorm = RMSNorm(h, eps) if c.enorm else None
        self.hnorm = RMSNorm(h, eps) if c.hnorm else None
        self.fc = Linear(2 * h, h, bias=c.fc_bias)
        self.aux_fc = Linear(self.input_width, h, bias=False) if self.aux_layers else None
        # A list of one, so that names read `layers.0.*` as in EAGLE / vLLM / Qwen3-Next MTP checkpoints.
        # The block is the family's: e.g. a Llama decoder layer, or DeepSeek's MTP block (MLA + dense MLP or MoE).
        family = family_of(a)
        if c.moe and not family.head_moe:
            raise ValueError(f"head.moe=true needs a {titles(lambda f: f.head_moe)} target ({family.title} blocks "
                             "have no MoE)")
        self.layers = nn.ModuleList([family.head_block(a, c.input_norm, c.moe)])
        self.norm = RMSNorm(h, eps) if c.final_norm else None

    def features(self, hidden: torch.Tensor, token_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor | None, attn: AttentionBackend | MLABackend, *,
                 from_target: bool) -> torch.Tensor:
        """(T, H) hidden (or (T, k·H) aux features from the target) + (T,) next tokens → (T, H) predicted next
        hidden (see DraftHead.features)."""
        e = self.embed(token_ids)  # (T, H)
        h = hidden.to(e.dtype)  # stored features are bf16; the head may train in fp32
        if self.aux_fc is not None and from_target:
            h = self.aux_fc(self.aux_input(h))  # an aux head's target input: (T, k·H) → (T, H) (aux_norm first)
        if self.enorm is not None:
            e = self.enorm(e)
        if self.hnorm is not None:
            h = self.hnorm(h)
        x = self.fc(torch.cat([e, h], dim=-1))  # (T, 2H) → (T, H)
        cos, sin = self.rope(meta.rotary_positions, x.dtype)  # a tree step rotates to depths
        x = self.layers[0](x, cos, sin, attn, kv_cache, meta)
        return x if self.norm is None else self.norm(x)

    def target_fc(self) -> Linear | None:
        return self.aux_fc  # an aux head's step from the target: (T, k·H) → (T, H) through its aux fc

    def _native_head_plan(self, hidden: torch.Tensor, attn: AttentionBackend | MLABackend,
                          kv_cache: torch.Tensor, meta: AttentionMetadata,
                          n: int) -> tuple[cpu_kernels.HeadPlan, bool, bool] | tuple[()]:
        """The fc over [enorm(e) ; hnorm(h)], the family's layer with its input norm, the final norm, the frozen
        (draft-vocabulary) lm_head rows; an aux head's step from the target takes its aux fc first."""
        layer = self.layers[0]
        native_plan = getattr(layer, "native_plan", None)
        if (native_plan is None or self.dtype != torch.float32
                or type(self).logit_input is not ChainHead.logit_input):
            return ()
        # hidden stands for the layer's input (the same rows): native_plan checks its shape, dtype and layout, and
        # gemv_weight (in `_head_plan`) the fc's weight and bias
        plan = native_plan(hidden, attn, kv_cache, meta)
        if plan is None:
            return ()
        return self._head_plan(plan, (self.enorm, self.hnorm, self.norm), layer.post_attention_layernorm.eps,
                               self.fc, hidden.shape[0], n)

    def init_from_target(self, target_dir: str | Path) -> None:
        """Copy target weights into the head, as `head.init` says: `last_layer` or `target_mtp`."""
        if self.cfg.init == "target_mtp":
            self._init_from_mtp_layer(target_dir)
        else:
            self._init_from_last_layer(target_dir)

    def _init_from_last_layer(self, target_dir: str | Path) -> None:
        """Copy the target's last decoder layer (fused as the loader fuses it, e.g. q/k/v and gate/up) into ours.

        A head without the layer's input norm simply does not take the target's input_layernorm.
        """
        state = read_decoder_layer(target_dir, -1)
        layer = self.layers[0]
        if layer.input_layernorm is None:
            state.pop("input_layernorm.weight", None)
        self._copy(layer, state, f"{target_dir}: last layer")

    def _init_from_mtp_layer(self, target_dir: str | Path) -> None:
        """Copy the checkpoint's own MTP layer `model.layers.{L}.*` (DeepSeek-V3 / Kimi-K2) into the head, 1:1:

            enorm → enorm,  hnorm → hnorm,  eh_proj → fc  (its [enorm(E) ; hnorm(h)] input is ours, embedding first),
            input_layernorm, self_attn.*, post_attention_layernorm, mlp.* → layers.0.* (the family's block, names
            as the target loader reads them),  shared_head.norm → norm (the final norm before the lm_head).

        Its `embed_tokens` and `shared_head.head` are copies of the target's embedding and lm_head, which the head
        reads frozen. The layer's MLP decides `head.moe`: a mismatch is refused naming the key.
        """
        raw = read_mtp_layer(target_dir)
        prefix = f"model.layers.{self.target_args.num_layers}."
        moe_layer = any(k.startswith("mlp.experts.") for k in raw)
        if moe_layer != self.cfg.moe:
            kind = "an MoE MLP (mlp.gate, mlp.experts.*)" if moe_layer else "a dense MLP (mlp.gate_proj, ...)"
            raise ModelConfigError(f"head.init=target_mtp: the MTP layer {prefix}* of {target_dir} has {kind}: set "
                                   f"head.moe={str(moe_layer).lower()}")
        top = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "eh_proj.weight": "fc",
               "shared_head.norm.weight": "norm"}  # checkpoint name → our module
        for name, ours in top.items():
            if name not in raw:
                raise ModelConfigError(f"head.init=target_mtp: {target_dir} lacks {prefix}{name}")
            self._copy(getattr(self, ours), {"weight": raw.pop(name)}, f"{target_dir}: {prefix}{name}")
        self._copy(self.layers[0], raw, f"{target_dir}: MTP layer {prefix}*")

    @staticmethod
    def _copy(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
        """Copy `state` into `module`'s state dict: exactly its keys, each of its shape (else the names)."""
        own = module.state_dict()
        bad = [f"{k}: target {tuple(v.shape)}, head {tuple(own[k].shape)}"
               for k, v in state.items() if k in own and v.shape != own[k].shape]
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        if bad or missing or unexpected:
            raise ModelConfigError(f"{source} does not fit the head: mismatched {bad}, missing {missing}, "
                                   f"unexpected {unexpected}")
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)
