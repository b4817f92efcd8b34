"""The P-EAGLE layout vLLM serves with `parallel_drafting` (`format=speculators-peagle`): speculators' EAGLE-3
layout (`head_types/eagle3/export.py`) with the placeholder's hidden state and token.

Tensors: `to_speculators`'s (fc, `layers.0.*` split, norm, lm_head, d2t, t2d) plus `mask_hidden` [1, 1, k·H] (ours
`mask_hidden` [k·H], speculators' `PEagleDraftModel` shape; vLLM's `Eagle3LlamaForCausalLM.load_weights` reads any
shape `.view(1, -1)` into its `mask_hidden` buffer and refuses a folder without it when parallel drafting is on).

config.json: `speculators_config`'s with `speculators_model_type: peagle` and `mask_token_id`. vLLM's
`SpeculatorsConfig` turns `peagle` into `method: eagle3, parallel_drafting: true` (`configs/speculators/base.py`)
and `update_peagle` (`algos.py`) maps `mask_token_id` to the draft config's `pard_token`, the placeholder token its
proposer reads (`_init_parallel_drafting_params`), and the architecture to `PeagleLlamaForCausalLM` (registered as
`llama_eagle3.Eagle3LlamaForCausalLM`). Unlike `update_eagle3`, `update_peagle` copies neither `fc_norm` nor
`norm_output`, so a head with head.aux_norm (EAGLE-3.1's per-layer norms) is refused here; it also defaults
`norm_before_residual` to False, ours, and writes it out anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mtp_train.head_types.eagle3 import export as eagle3

MODEL_TYPE = "peagle"  # speculators_model_type
ARCH = "PEagleSpeculator"  # the class speculators registers; vLLM replaces `architectures` with its own
MASK_HIDDEN = "mask_hidden"


def problems(spec: eagle3.Eagle3Spec) -> list[str]:
    """Why a head does not fit `format=speculators-peagle` (empty: it fits)."""
    # the speculators layout's checks, as for the eagle3 head this one extends (the exporter checks the format)
    out = eagle3.speculators_problems(dataclasses.replace(spec, head_type="eagle3"))
    if spec.aux_norm:
        out.append("head.aux_norm=true: vLLM's peagle config reader does not pass fc_norm on (EAGLE-3.1's per-layer "
                   "norms); retrain with head.aux_norm=false or export native")
    return out


def to_layout(state: dict[str, torch.Tensor], spec: eagle3.Eagle3Spec) -> dict[str, torch.Tensor]:
    """Our peagle state dict → the layout's tensors."""
    out = eagle3.to_speculators({k: v for k, v in state.items() if k != MASK_HIDDEN}, spec)
    out[MASK_HIDDEN] = state[MASK_HIDDEN].reshape(1, 1, -1)
    return out


def from_layout(tensors: dict[str, torch.Tensor], spec: eagle3.Eagle3Spec) -> dict[str, torch.Tensor]:
    """The inverse of `to_layout`."""
    state = eagle3.from_speculators({k: v for k, v in tensors.items() if k != MASK_HIDDEN}, spec)
    state[MASK_HIDDEN] = tensors[MASK_HIDDEN].reshape(-1)
    return state


def config(spec: eagle3.Eagle3Spec, target: dict[str, Any], mask_token_id: int) -> dict[str, Any]:
    """config.json of `format=speculators-peagle`: the speculators EAGLE-3 config, typed peagle, with the
    placeholder token."""
    cfg = eagle3.speculators_config(spec, target)
    cfg.update({"speculators_model_type": MODEL_TYPE, "architectures": [ARCH], "mask_token_id": mask_token_id})
    cfg.pop("fc_norm")  # vLLM's peagle reader has neither (module docstring): a head that needs them is refused
    cfg.pop("norm_output")
    cfg["speculators_config"]["algorithm"] = MODEL_TYPE
    return cfg


# --- reading a speculators P-EAGLE folder (`import_from=speculators-peagle`, `layouts.py`) ---------------

# config.json keys whose non-default value our head cannot compute: speculators' and vLLM's switches that ours fixes
FIXED_KEYS = {"norm_before_fc": False, "norm_before_residual": False, "fc_norm": False, "norm_output": False}


def head_fields(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A speculators P-EAGLE config.json (and its d2t) → our HeadConfig's fields, the folder's placeholder token
    (`mask_token_id`, head.mask_token_id; absent or null: ours, the target's last vocabulary id) among them;
    ValueError naming the key of a layout our head does not compute."""
    off = [f"{k}={cfg.get(k)!r} (ours: {v!r})" for k, v in FIXED_KEYS.items() if cfg.get(k, v) != v]
    layer = cfg.get("transformer_layer_config") or {}
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        off.append(f"transformer_layer_config.num_hidden_layers={layers!r} (ours: one layer)")
    mask, vocab = cfg.get("mask_token_id"), layer.get("vocab_size")
    if mask is not None and (not isinstance(mask, int) or isinstance(mask, bool) or mask < 0):
        off.append(f"mask_token_id={mask!r} (a token id >= 0, or null)")
    elif isinstance(mask, int) and isinstance(vocab, int) and mask >= vocab:
        off.append(f"mask_token_id={mask} (not a token of transformer_layer_config.vocab_size={vocab})")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in ids):
        off.append(f"eagle_aux_hidden_state_layer_ids={ids!r} (a list of layer ids)")
    if "d2t" not in tensors or "t2d" not in tensors:
        off.append("no d2t / t2d tensors (the head drafts over its own draft vocabulary)")
    if off:
        raise ValueError("a P-EAGLE drafter this head cannot compute: " + "; ".join(off))
    # vLLM's aux ids are ours (transformers' hidden_states[j] numbering, `head_types/eagle3/export.py`)
    return {"aux_layers": [int(j) for j in ids], "draft_vocab_size": int(tensors["d2t"].numel()),
            "mask_token_id": mask}


def fit_problems(tensors: dict[str, torch.Tensor], embed: torch.Tensor) -> list[str]:
    """What a speculators P-EAGLE folder holds that the head built for it would silently change: a trained embedding
    (`embed_tokens.weight`) other than the target's `embed` (V, H), which the head reads frozen (the placeholder
    token's row among them)."""
    out = []
    mine = tensors.get("embed_tokens.weight")
    if mine is not None and (mine.shape != embed.shape
                             or not torch.allclose(mine.float(), embed.detach().to("cpu", torch.float32),
                                                   rtol=1e-2, atol=1e-2)):
        out.append("embed_tokens.weight is not the target's embedding (a trained one): our head reads the target's, "
                   "frozen")
    return out
