"""The eagle1 head type's serving layouts: vLLM's and SGLang's EAGLE-1, as name maps over the head's state dict
(`mtp_train.export.layouts` has the `Layout` record and the maps they share).

| format          | names (config.json)                                                                      |
|-----------------|------------------------------------------------------------------------------------------|
| vllm-eagle      | `fc.weight` (no bias), `layers.0.*` split, no layer-0 input norm, no final norm, no embed / |
|                 | lm_head (the target's are shared) ("LlamaForCausalLM"; vLLM's `method=eagle`)             |
| sglang-eagle    | as vllm-eagle plus `fc.bias` (zeros for a bias-free head); the engine adds the `model.`   |
|                 | prefix itself ("LlamaForCausalLMEagle"; SGLang's `speculative_algorithm=EAGLE`)           |

Fit: vLLM's EAGLE-1 layout has no fc bias, so a head trained with `fc_bias` only exports to native / sglang-eagle;
neither has a place for enorm, hnorm, the final norm or the first layer's input norm, nor for aux layers. Neither
carries a draft vocabulary: the engine drafts over the target's whole lm_head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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


def _eagle_check(bias_ok: bool) -> Callable[[DraftHead], list[str]]:
    def check(head: DraftHead) -> list[str]:
        c = head.cfg
        problems = [f"{flag}=True: the EAGLE-1 layout has no place for it"
                    for flag in ("enorm", "hnorm", "final_norm") if getattr(c, flag)]
        if c.input_norm:
            problems.append("input_norm=True: EAGLE-1's first decoder layer has no input_layernorm")
        # No draft vocabulary is no problem: the layouts share the full lm_head, whose rows include the draft
        # vocabulary's, so the engine drafts over the whole vocabulary.
        return (problems + ([] if bias_ok else no_fc_bias(head))
                + no_aux(head, "the EAGLE-1 layouts (vllm-eagle, sglang-eagle)"))

    return check


def _eagle_to(prefix: str, bias: bool) -> Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]:
    def to(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
        state = drop_vocab(state)
        out = {f"{prefix}fc.weight": state["fc.weight"]}
        if "fc.bias" in state:
            out[f"{prefix}fc.bias"] = state["fc.bias"]
        elif bias:  # the layout always has one: a zero bias is the same function
            out[f"{prefix}fc.bias"] = torch.zeros(state["fc.weight"].shape[0], dtype=state["fc.weight"].dtype)
        out.update({f"{prefix}layers.0.{k}": v for k, v in unfuse_layer(layer_items(state), head).items()})
        return out

    return to


def _eagle_from(prefix: str) -> Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]:
    def frm(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
        state = {"fc.weight": tensors[f"{prefix}fc.weight"]}
        if head.cfg.fc_bias:
            state["fc.bias"] = tensors[f"{prefix}fc.bias"]
        layer = fuse_layer(layer_items(tensors, f"{prefix}layers.0."), head)
        state.update({f"layers.0.{k}": v for k, v in layer.items()})
        return state

    return frm


def _eagle_config(arch: str) -> Callable[[DraftHead, dict[str, Any]], dict[str, Any]]:
    def config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
        return hf_config(target, architectures=[arch], model_type="llama", num_hidden_layers=1)

    return config


TYPE_LAYOUTS = (
    Layout("vllm-eagle", _eagle_check(bias_ok=False), _eagle_to("", bias=False), _eagle_from(""),
           _eagle_config("LlamaForCausalLM"), serves={"vllm": {"method": "eagle"}}),
    Layout("sglang-eagle", _eagle_check(bias_ok=True), _eagle_to("", bias=True), _eagle_from(""),
           _eagle_config("LlamaForCausalLMEagle"), serves={"sglang": {"speculative_algorithm": "EAGLE"}}),
)
