"""The mtp head type's serving layouts: DeepSeek-V3 MTP and Qwen3-Next MTP, as name maps over the head's state dict
(`mtp_train.export.layouts` has the `Layout` record and the maps they share).

| format          | names (config.json)                                                                      |
|-----------------|------------------------------------------------------------------------------------------|
| deepseek-mtp    | `model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens}` + |
|                 | the block under the same prefix, L = the target's layer count (`num_nextn_predict_layers: |
|                 | 1`)                                                                                      |
| qwen3-next-mtp  | `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,layers.0.*,norm}`; every RMSNorm weight |
|                 | stored as w − 1 (Qwen3-Next norms compute x·(1 + w))                                     |

Fit: both layouts have no fc bias and every RMSNorm in a fixed place, so a head needs all four norms and no fc
bias. Two differences an engine brings, not the file: DeepSeek-V3's MTP module feeds the *un-normed* block output to
its next step (ours feeds the final-normed feature, as Qwen3-Next does), so chained drafts from the second on differ
there; and engines' DeepSeek MTP blocks are MLA, so a Llama-family head (plain q/k/v attention) in that layout
loads where the engine accepts a dense attention block. Qwen3-Next's attention has an output gate by default: the
config sets `attn_output_gate: false` for our ungated layer. Engines load an MTP layer from the target's own
checkpoint (`stitch=`, `export/stitch.py`), so no layout here names a drafter method of its own (`Layout.serves`).
"""

from __future__ import annotations

from typing import Any

import torch

from mtp_train.config.head import NORM_FLAGS
from mtp_train.export.layouts import (
    Layout,
    drop_vocab,
    fuse_layer,
    hf_config,
    layer_items,
    no_aux,
    no_fc_bias,
    unfuse_layer,
)
from mtp_train.heads.base import DraftHead


def mtp_check(head: DraftHead) -> list[str]:
    """What keeps a head out of the MTP layouts (empty = it fits)."""
    c = head.cfg
    return [f"{flag}=False: the layout requires it (an RMSNorm weight is always present)"
            for flag in NORM_FLAGS if not getattr(c, flag)] + no_fc_bias(head) \
        + no_aux(head, "the MTP layouts (deepseek-mtp, qwen3-next-mtp)")


# --- DeepSeek-V3 MTP -------------------------------------------------------------------------------------------


def _ds_prefix(head: DraftHead) -> str:
    return f"model.layers.{head.target_args.num_layers}."


def _ds_to(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    state = drop_vocab(state)
    p = _ds_prefix(head)
    frozen = head.require_frozen()
    out = {f"{p}enorm.weight": state["enorm.weight"], f"{p}hnorm.weight": state["hnorm.weight"],
           f"{p}eh_proj.weight": state["fc.weight"], f"{p}shared_head.norm.weight": state["norm.weight"],
           # Copies: a tied target shares one tensor, which safetensors refuses to store under two names.
           f"{p}shared_head.head.weight": frozen.lm_head.detach().to("cpu").clone(),
           f"{p}embed_tokens.weight": frozen.embed.detach().to("cpu").clone()}
    out.update({f"{p}{k}": v for k, v in unfuse_layer(layer_items(state), head).items()})
    return out


def _ds_from(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    p = _ds_prefix(head)
    state = {"enorm.weight": tensors[f"{p}enorm.weight"], "hnorm.weight": tensors[f"{p}hnorm.weight"],
             "fc.weight": tensors[f"{p}eh_proj.weight"], "norm.weight": tensors[f"{p}shared_head.norm.weight"]}
    skip = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    layer = {k: v for k, v in layer_items(tensors, p).items() if not k.startswith(skip)}
    state.update({f"layers.0.{k}": v for k, v in fuse_layer(layer, head).items()})
    return state


def _ds_config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    return hf_config(target, num_nextn_predict_layers=1)


# --- Qwen3-Next MTP --------------------------------------------------------------------------------------------


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _gemma(tensors: dict[str, torch.Tensor], shift: float) -> dict[str, torch.Tensor]:
    """Qwen3-Next RMSNorms compute x·(1 + w): store w − 1 (shift −1) and read back w + 1 (shift +1)."""
    return {k: v + shift if _is_norm(k) else v for k, v in tensors.items()}


def _qn_to(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    state = drop_vocab(state)
    out = {"mtp.pre_fc_norm_embedding.weight": state["enorm.weight"],
           "mtp.pre_fc_norm_hidden.weight": state["hnorm.weight"], "mtp.fc.weight": state["fc.weight"],
           "mtp.norm.weight": state["norm.weight"]}
    out.update({f"mtp.layers.0.{k}": v for k, v in unfuse_layer(layer_items(state), head).items()})
    return _gemma(out, -1.0)


def _qn_from(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    tensors = _gemma(tensors, 1.0)
    state = {"enorm.weight": tensors["mtp.pre_fc_norm_embedding.weight"],
             "hnorm.weight": tensors["mtp.pre_fc_norm_hidden.weight"], "fc.weight": tensors["mtp.fc.weight"],
             "norm.weight": tensors["mtp.norm.weight"]}
    state.update({f"layers.0.{k}": v for k, v in fuse_layer(layer_items(tensors, "mtp.layers.0."), head).items()})
    return state


def _qn_config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    return hf_config(target, num_nextn_predict_layers=1, attn_output_gate=False)


TYPE_LAYOUTS = (
    Layout("deepseek-mtp", mtp_check, _ds_to, _ds_from, _ds_config, needs_frozen=True),
    Layout("qwen3-next-mtp", mtp_check, _qn_to, _qn_from, _qn_config, exact=False),
)
