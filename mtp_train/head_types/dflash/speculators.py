"""speculators' DFlash layout (`format=speculators-dflash`): what `speculators` 0.7+ saves for a DFlash drafter and
vLLM loads through its speculators adapter (`vllm/transformers_utils/configs/speculators/algos.py`,
`update_dflash`), the same model class as z-lab's layout (`export.py`) behind another config.

Tensors: z-lab's names (`fc`, `hidden_norm`, `layers.N.*`, `norm`), plus, for a head with a draft vocabulary,
`lm_head.weight` [V_d, H] (the target's rows of the draft tokens, as speculators keeps a reduced-vocabulary
lm_head in the checkpoint), `d2t` [V_d] int64 and `t2d` [V] bool (EAGLE-3's maps, `export/layouts.py`). vLLM adds
`model.` to every name but lm_head and d2t, and skips t2d. No embedding: vLLM shares the target's.

config.json: `speculators_model_type: "dflash"`, `transformer_layer_config` (the draft layers as a Qwen3 config,
num_hidden_layers = head.layers), `draft_vocab_size`, `block_size`, `target_hidden_size`, `mask_token_id`,
`aux_hidden_state_layer_ids` and `speculators_config` (one greedy proposal of B − 1 speculative tokens, which vLLM
takes as `num_speculative_tokens`; the verifier's path and architectures).

Two facts of vLLM's adapter the fields rest on:
* `dflash_config.target_layer_ids = aux_hidden_state_layer_ids − 1`, so the ids are ours (hidden_states[j]
  numbering), where z-lab's layout stores j − 1. `make check-vllm` proves the numbering by vLLM's acceptance.
* `dflash_config.causal = not sliding_window_non_causal` (True when the key is absent) and it overrides every
  draft layer's mask. Our block attends to itself without a causal mask, so the file says
  `sliding_window_non_causal: true`; written False (speculators' own default), vLLM would run every layer causal.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from mtp_train.export.layouts import draft_vocab_from, vocab_maps
from mtp_train.head_types.dflash import export as dflash

if TYPE_CHECKING:
    from mtp_train.heads.base import DraftHead

MODEL_TYPE = "dflash"  # speculators_model_type
ARCH = "DFlashSpeculator"  # speculators' `DFlashSpeculatorConfig.architectures` default
VOCAB_KEYS = ("lm_head.weight", "d2t", "t2d")  # the draft vocabulary's tensors, absent over the whole vocabulary
_Z_LAB_KEYS = ("architectures", "dflash_config", "num_target_layers", "block_size")  # not a Qwen3 layer's field


def problems(head: DraftHead) -> list[str]:
    """What keeps a dflash head out of this layout (empty = it fits): z-lab's, less the draft vocabulary."""
    return dflash.common_problems(head)


def to_layout(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    """Our state → the layout's tensors: the z-lab names, and the draft vocabulary as lm_head rows, d2t and t2d."""
    out = {k: v for k, v in state.items() if k != "draft_vocab"}
    if head.draft_vocab is not None:
        # A copy: the rows are the frozen target's, which safetensors would otherwise store as a view.
        out["lm_head.weight"] = head.lm_head_weight().detach().to("cpu").clone()
        out["d2t"], out["t2d"] = vocab_maps(state["draft_vocab"], head.target_args.vocab_size)
    return out


def from_layout(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    """The inverse of `to_layout`: lm_head's rows are the target's (the importer checks them), d2t and t2d give
    the draft vocabulary back."""
    state = {k: v for k, v in tensors.items() if k not in VOCAB_KEYS}
    if "d2t" in tensors:
        state["draft_vocab"] = draft_vocab_from(tensors["d2t"], tensors["t2d"])
    return state


def layer_config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    """The draft layers as a transformers Qwen3 config dict (z-lab's config without its DFlash keys)."""
    return {k: v for k, v in dflash.config(head, target).items() if k not in _Z_LAB_KEYS}


def config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    """config.json of `format=speculators-dflash` (fields: speculators' `DFlashSpeculatorConfig` and
    `SpeculatorsConfig`; read by vLLM's `SpeculatorsConfig` and `update_dflash`)."""
    a, c = head.target_args, head.cfg
    block = int(c.settings.block_size)
    return {
        "speculators_model_type": MODEL_TYPE,
        "architectures": [ARCH],
        "transformer_layer_config": layer_config(head, target),
        "draft_vocab_size": head.vocab_size,
        "block_size": block,
        "target_hidden_size": a.hidden_size,
        "aux_hidden_state_layer_ids": [int(j) for j in c.aux_layers],
        "mask_token_id": int(getattr(head, "mask_token_id", c.settings.mask_token_id)),
        "sample_from_anchor": False,  # the anchor is the verified token: the block drafts B − 1 tokens
        "sliding_window_non_causal": True,  # see the module docstring: vLLM reads it as `causal: false`
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.get("_name_or_path"),
                         "architectures": list(target.get("architectures") or [])},
        },
    }


def head_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """A speculators DFlash config.json → the HeadConfig fields it fixes (layers, block, mask, aux layers); a
    ValueError naming what is missing when it is not one."""
    if cfg.get("speculators_model_type") != MODEL_TYPE:
        raise ValueError(f"speculators_model_type {cfg.get('speculators_model_type')!r} is not {MODEL_TYPE!r}")
    layer = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else {}
    missing = [k for k in ("block_size", "mask_token_id", "aux_hidden_state_layer_ids") if cfg.get(k) is None]
    missing += ["transformer_layer_config.num_hidden_layers"] if layer.get("num_hidden_layers") is None else []
    if missing:
        raise ValueError(f"a speculators DFlash config.json needs {', '.join(missing)}")
    if cfg.get("sample_from_anchor"):
        raise ValueError("sample_from_anchor=true: the anchor drafts too (B speculative tokens); ours verifies the "
                         "anchor and drafts B − 1")
    ints = {"transformer_layer_config.num_hidden_layers": layer["num_hidden_layers"],
            "block_size": cfg["block_size"], "mask_token_id": cfg["mask_token_id"]}
    for key, value in ints.items():  # JSON text such as "16" is not a number here, as it is not in vLLM's
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} is {json.dumps(value)}, not an integer; write an integer there")
    ids = cfg["aux_hidden_state_layer_ids"]
    if not isinstance(ids, list) or any(isinstance(j, bool) or not isinstance(j, int) for j in ids):
        raise ValueError(f"aux_hidden_state_layer_ids is {json.dumps(ids)}, not a list of integers; write a JSON "
                         "list there, e.g. [2, 8]")
    return {"layers": layer["num_hidden_layers"], "block_size": cfg["block_size"],
            "mask_token_id": cfg["mask_token_id"], "aux_layers": list(ids)}
