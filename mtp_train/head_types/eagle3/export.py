"""EAGLE-3 serving layouts: speculators (what vLLM loads) and SGLang's `LlamaForCausalLMEagle3`.

Pure functions over a head's state dict and an `Eagle3Spec` (the few facts of the head and its target they
need), so they run without a head object; `Eagle3Spec.of(head)` reads them off an eagle3 `DraftHead`. The
`Layout`s built from them are in `layouts.py`; the d2t / t2d maps are `mtp_train.export.layouts`'.

Our names (the eagle3 head's state dict) → the layouts' names:

| ours                               | speculators (vLLM)                 | sglang-eagle3                   |
|------------------------------------|------------------------------------|---------------------------------|
| `fc.weight` [H, 3H]                | `fc.weight`                        | `fc.weight`                     |
| `layers.0.<x>` (qkv, gate_up fused)| `layers.0.<x>` split q/k/v, gate/up| `midlayer.<x>` split            |
| `norm.weight`, `lm_head.weight`    | same                               | same                            |
| `aux_norm.{i}.weight` [H] (3.1)    | `fc_norm.{i}.weight`               | refused                         |
| `fc_input_norm.weight` [3H]        | `input_norm.weight`                | refused                         |
| `draft_vocab` [V_d] int64          | `d2t` [V_d] int64, `t2d` [V] bool  | `d2t`, `t2d`                    |

`d2t[i] = draft_vocab[i] - i` (both engines add `arange(V_d)` back: vLLM's `Eagle3LlamaForCausalLM.compute_logits`,
SGLang's `hot_token_id = d2t + arange`), `t2d` marks the draft tokens in the target vocabulary (speculators'
`DraftVocabMixin` checks `t2d.sum() == draft_vocab_size`; both engines skip it at load). The embedding is not
written: both engines share the target's when the draft has none.

Facts the maps and configs rest on (files read in the engines' sources):

* Aux-layer numbering. Ours is transformers' `hidden_states[j]` (0 = the embeddings, j = decoder layer j-1's
  output). vLLM (`vllm/model_executor/models/llama.py`, `LlamaModel.forward`) appends `hidden_states + residual`
  *before* running layer `idx` when `idx in aux_hidden_state_layers`: id k is the stream entering layer k, i.e.
  `hidden_states[k]` — the same number. SGLang (`python/sglang/srt/models/llama.py`,
  `set_eagle3_layers_to_capture`) sets `layers_to_capture = [id + 1 for id in layer_ids]` and captures before
  layer i the same way: id k is `hidden_states[k + 1]`, one less than ours. Both engines' defaults
  (2, L//2, L-3) are in vLLM's numbering (SGLang applies its default without the +1), as is EAGLE-3's reference
  (SafeAILab/EAGLE `modeling_llama_kv.py` keeps the input of decoder layers 2, L//2 and L-3).
* vLLM's `update_eagle3` (`vllm/transformers_utils/configs/speculators/algos.py`) defaults `norm_before_residual`
  to True, speculators' `Eagle3SpeculatorConfig` (`src/speculators/models/eagle3/config.py`) to False (its
  trainer's `--norm-before-residual` to True), so the config always writes it: head.norm_before_residual, whose
  residual is hidden_norm(g) (vLLM's `_norm_before_residual`, speculators' `Eagle3FirstLayerMixin.forward`);
  SGLang's `llama_eagle3.py` takes the un-normed g and has no flag, so `format=sglang-eagle3` refuses it.
* `norm_before_fc` (speculators' trainer default for eagle3): ONE RMSNorm over the whole k·H aux input before fc,
  `input_norm.weight` [k·H] in both speculators (`Eagle3DraftModel.input_norm`) and vLLM (its loader maps
  `input_norm.` to `model.input_norm`, built from `norm_before_fc`, and drops the tensor when the flag is off);
  ours is head.fc_input_norm (`fc_input_norm.weight`). Both apply it before `fc_norm`'s per-layer norms, and
  speculators' config refuses the two together, so the speculators layout does; SGLang has neither (refused).
* A frozen lm_head (head.train_lm_head=false) changes no tensor name or config field: the layouts write the rows.
* EAGLE-3.1. speculators' `Eagle3SpeculatorConfig` has `fc_norm` (one RMSNorm per aux layer on its H-slice before
  fc: `fc_norm.{i}.weight`, ModuleList over the aux layers, `Eagle3DraftModel.forward` in `core.py`) and
  `norm_output` (the TTT steps feed the post-norm output); vLLM's `update_eagle3` copies both into the draft's
  config and `llama_eagle3.py` builds `model.fc_norm` (applied in `combine_hidden_states`) and returns the normed
  stream as the next step's hidden when `norm_output`. Ours: `head.aux_norm` = `fc_norm`, `head.norm_output` =
  `norm_output`. SGLang's `LlamaForCausalLMEagle3` as stored here reads neither and skips weights it has no
  parameter for, so a 3.1 head would load there silently changed: `format=sglang-eagle3` refuses both flags.
* vLLM's `Eagle3LlamaForCausalLM` (`llama_eagle3.py`) returns (final-normed, pre-norm) and its proposer
  (`vllm/v1/spec_decode/eagle.py`) samples from the first and feeds the second to the next draft step; SGLang's
  `LlamaModel.forward` returns the pre-norm stream as the next step's hidden ("capture the hidden state before
  norm"). The fc runs only on the target's aux states.
* vLLM's qkv bias follows `attention_bias`, which also puts a bias on o_proj (`llama_eagle3.py`), so a head with
  q/k/v bias only gets a zero o_proj bias in the speculators layout; SGLang's draft layer has no q/k/v bias and
  a bias-free MLP, and its `fc` bias key (`bias`) also switches on o_proj's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mtp_train.config.head import head_spec, head_types_taking
from mtp_train.export.layouts import LayoutError, draft_vocab_from, vocab_maps, with_target_fields
from mtp_train.models.config import ModelArgs
from mtp_train.models.families import family_of
from mtp_train.models.fusing import Fusing, fuse, parts_plan, unfuse

if TYPE_CHECKING:
    from mtp_train.heads.base import DraftHead

# The `speculative_tokens` of the greedy proposal written into a speculators config; vLLM takes it as the
# default `num_speculative_tokens` (`vllm/transformers_utils/configs/speculators/base.py`) and a
# `--speculative-config` overrides it. speculators' converter writes 3 as well.
SPECULATIVE_TOKENS = 3
# The class speculators registers for `speculators_model_type: eagle3` (`src/speculators/models/eagle3/core.py`);
# vLLM replaces `architectures` with its own (`Eagle3LlamaForCausalLM`) when it reads the config.
SPECULATORS_ARCH = "Eagle3DraftModel"
SGLANG_ARCH = "LlamaForCausalLMEagle3"
NUM_AUX = 3  # both engines build fc over exactly three target layers (3 · target_hidden_size inputs)


@dataclass(frozen=True)
class Eagle3Spec:
    """What the EAGLE-3 layouts need to know about a head besides its tensors."""

    args: ModelArgs  # the target's shapes (H, heads, kv heads, head_dim, intermediate, V, eps, rope, L, biases)
    aux_layers: tuple[int, ...]  # target layers read, in transformers' hidden_states[j] numbering
    draft_vocab_size: int  # V_d (0 = no draft vocabulary: refused)
    fusings: tuple[Fusing, ...]  # the family's fused projections (the head's block fuses as its target does)
    fc_bias: bool = False
    head_type: str = "eagle3"
    aux_norm: bool = False  # EAGLE-3.1: an RMSNorm per aux layer before fc (speculators' `fc_norm`)
    norm_output: bool = False  # EAGLE-3.1: the next step reads the normed output (speculators' `norm_output`)
    fc_input_norm: bool = False  # one RMSNorm over the whole k·H input before fc (speculators' `norm_before_fc`)
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(g) (`norm_before_residual`)

    @classmethod
    def of(cls, head: DraftHead) -> Eagle3Spec:
        c = head.cfg

        def own(key: str) -> bool:  # eagle3's own settings; a type without them (peagle) has each switch off
            return bool(getattr(c.settings, key, False))

        return cls(args=head.target_args, aux_layers=tuple(c.aux_layers), draft_vocab_size=c.draft_vocab_size,
                   fusings=tuple(family_of(head.target_args).fusings), fc_bias=c.fc_bias, head_type=c.type,
                   aux_norm=c.aux_norm, norm_output=own("norm_output"), fc_input_norm=own("fc_input_norm"),
                   norm_before_residual=own("norm_before_residual"))


class Eagle3LayoutError(LayoutError):
    """A tensor file that is not what an EAGLE-3 layout writes (e.g. d2t and t2d disagree)."""


# --- aux-layer numbering (see the module docstring for the sources) -----------------------------------------


def vllm_aux_ids(aux_layers: tuple[int, ...] | list[int]) -> list[int]:
    """Our hidden_states[j] numbering → vLLM's `eagle_aux_hidden_state_layer_ids` (the same numbers)."""
    return [int(j) for j in aux_layers]


def sglang_aux_ids(aux_layers: tuple[int, ...] | list[int]) -> list[int]:
    """Our hidden_states[j] numbering → SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` (j - 1)."""
    return [int(j) - 1 for j in aux_layers]


# --- checks ---------------------------------------------------------------------------------------------------


def _common_problems(spec: Eagle3Spec, fmt: str) -> list[str]:
    a = spec.args
    problems = []
    if fmt not in head_spec(spec.head_type).formats:  # the head type's spec names the formats that take it
        takes = "/".join(head_types_taking(lambda s: fmt in s.formats))
        problems.append(f"head type {spec.head_type!r}: the EAGLE-3 layouts take {takes} heads")
    if spec.draft_vocab_size <= 0:
        problems.append("draft_vocab_size=0: the layout's lm_head is over a draft vocabulary (d2t / t2d); "
                        "train with head.draft_vocab_size > 0")
    if spec.fc_bias:
        problems.append("fc_bias=True: the engines' EAGLE-3 fc has no bias (retrain with head.fc_bias=false, or "
                        "export native)")
    if len(spec.aux_layers) != NUM_AUX:
        problems.append(f"aux_layers={list(spec.aux_layers)}: the engines read exactly {NUM_AUX} target layers")
    bad = [j for j in spec.aux_layers if not 1 <= j <= a.num_layers - 1]
    if bad:  # both engines capture the stream entering a decoder layer: hidden_states[1..L-1]
        problems.append(f"aux_layers {bad}: the engines can read hidden_states[1..{a.num_layers - 1}] only "
                        "(the output of a decoder layer that another layer follows)")
    if family_of(a).name != "llama":
        problems.append(f"target model_type {a.model_type!r}: the engines' EAGLE-3 draft layer is a Llama layer")
    if a.qk_norm:
        problems.append("the target has q/k norms (Qwen3): the engines' Llama EAGLE-3 layer has none")
    if a.sliding_window is not None:
        problems.append(f"sliding_window={a.sliding_window}: the engines' EAGLE-3 layer attends to the full "
                        "context")
    return problems


def speculators_problems(spec: Eagle3Spec) -> list[str]:
    """Why a head does not fit `format=speculators` (empty: it fits)."""
    problems = _common_problems(spec, "speculators")
    if spec.args.o_bias and not spec.args.qkv_bias:
        problems.append("o_proj bias without q/k/v bias: vLLM's `attention_bias` switches both on")
    if spec.fc_input_norm and spec.aux_norm:
        problems.append("head.fc_input_norm=true with head.aux_norm=true: speculators' config refuses "
                        "norm_before_fc with fc_norm (retrain with one of them, or export native)")
    return problems


def sglang_problems(spec: Eagle3Spec) -> list[str]:
    """Why a head does not fit `format=sglang-eagle3` (empty: it fits)."""
    a = spec.args
    problems = _common_problems(spec, "sglang-eagle3")
    problems += [f"head.{flag}=true: SGLang's LlamaForCausalLMEagle3 layout has no {flag} ({what}); it would "
                 "load the head without it (export format=speculators)"
                 for flag, on, what in (("aux_norm", spec.aux_norm, "EAGLE-3.1"),
                                        ("norm_output", spec.norm_output, "EAGLE-3.1"),
                                        ("fc_input_norm", spec.fc_input_norm, "speculators' norm_before_fc"),
                                        ("norm_before_residual", spec.norm_before_residual,
                                         "speculators' norm_before_residual")) if on]
    problems += [f"{name}: SGLang's LlamaForCausalLMEagle3 layer has no such bias (export format=speculators)"
                 for name, on in (("qkv_bias", a.qkv_bias), ("o_bias", a.o_bias), ("mlp_bias", a.mlp_bias)) if on]
    return problems


# --- weights ---------------------------------------------------------------------------------------------------

_O_BIAS = "self_attn.o_proj.bias"
# Outside the decoder layer, the same names in every layout; anything else of a head is left out (and then
# reported by the exporter's coverage check).
_TOP = ("fc.weight", "norm.weight", "lm_head.weight")
# EAGLE-3.1's per-aux-layer norms: ours `aux_norm.{i}.*`, speculators' (and vLLM's) `fc_norm.{i}.*`; the one norm
# over the whole k·H input (speculators' norm_before_fc): ours `fc_input_norm.*`, theirs `input_norm.*`.
_AUX_NORM, _FC_NORM = "aux_norm.", "fc_norm."
_FC_INPUT_NORM, _INPUT_NORM = "fc_input_norm.", "input_norm."


def _renamed(tensors: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    """The tensors whose names start with `old`, under `new` instead."""
    return {new + k[len(old):]: v for k, v in tensors.items() if k.startswith(old)}


def _to(prefix: str, zero_o_bias: bool) -> Callable[[dict[str, torch.Tensor], Eagle3Spec], dict[str, torch.Tensor]]:
    def to(state: dict[str, torch.Tensor], spec: Eagle3Spec) -> dict[str, torch.Tensor]:
        layer = {k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")}
        layer = unfuse(layer, spec.fusings, spec.args)
        if zero_o_bias and spec.args.qkv_bias and _O_BIAS not in layer:
            w = layer["self_attn.o_proj.weight"]  # the engine expects it with the q/k/v bias: zero is the same map
            layer[_O_BIAS] = torch.zeros(w.shape[0], dtype=w.dtype)
        out = {k: state[k] for k in _TOP}
        out.update(_renamed(state, _AUX_NORM, _FC_NORM))
        out.update(_renamed(state, _FC_INPUT_NORM, _INPUT_NORM))
        out.update({f"{prefix}{k}": v for k, v in layer.items()})
        out["d2t"], out["t2d"] = vocab_maps(state["draft_vocab"], spec.args.vocab_size)
        return out

    return to


def _from(prefix: str, zero_o_bias: bool) -> Callable[[dict[str, torch.Tensor], Eagle3Spec], dict[str, torch.Tensor]]:
    def frm(tensors: dict[str, torch.Tensor], spec: Eagle3Spec) -> dict[str, torch.Tensor]:
        layer = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if zero_o_bias and spec.args.qkv_bias and not spec.args.o_bias and _O_BIAS in layer:
            bias = layer.pop(_O_BIAS)
            if bool(bias.any()):  # only a zero bias is ours; dropping another would change the head
                raise Eagle3LayoutError(f"{prefix}{_O_BIAS} is not zero: not an export of a head without o_proj bias")
        layer.update(fuse(layer, parts_plan(list(layer), spec.fusings)))
        state = {k: tensors[k] for k in _TOP}
        state.update(_renamed(tensors, _FC_NORM, _AUX_NORM))
        state.update(_renamed(tensors, _INPUT_NORM, _FC_INPUT_NORM))
        state.update({f"layers.0.{k}": v for k, v in layer.items()})
        state["draft_vocab"] = draft_vocab_from(tensors["d2t"], tensors["t2d"])
        return state

    return frm


to_speculators = _to("layers.0.", zero_o_bias=True)
from_speculators = _from("layers.0.", zero_o_bias=True)
to_sglang = _to("midlayer.", zero_o_bias=False)
from_sglang = _from("midlayer.", zero_o_bias=False)


# --- config.json -----------------------------------------------------------------------------------------------

def llama_layer_config(spec: Eagle3Spec, target: dict[str, Any]) -> dict[str, Any]:
    """The one draft layer as a transformers LlamaConfig dict: the target's shapes, rope and context length,
    vocab_size = the TARGET vocabulary (the engines map draft logits back into it), untied."""
    a = spec.args
    cfg: dict[str, Any] = {
        "model_type": "llama", "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim, "hidden_act": a.hidden_act, "rms_norm_eps": a.rms_norm_eps,
        "vocab_size": a.vocab_size, "max_position_embeddings": a.max_position_embeddings,
        "attention_bias": a.qkv_bias or a.o_bias, "mlp_bias": a.mlp_bias, "tie_word_embeddings": False,
    }
    return with_target_fields(cfg, target, a.rope.theta)


def speculators_config(spec: Eagle3Spec, target: dict[str, Any]) -> dict[str, Any]:
    """config.json of `format=speculators` (field names: speculators' `Eagle3SpeculatorConfig` and
    `SpeculatorsConfig` / `VerifierConfig` in `src/speculators/config.py`; read by vLLM's `SpeculatorsConfig`)."""
    return {
        "speculators_model_type": "eagle3",
        "architectures": [SPECULATORS_ARCH],
        "transformer_layer_config": llama_layer_config(spec, target),
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.args.hidden_size,
        "eagle_aux_hidden_state_layer_ids": vllm_aux_ids(spec.aux_layers),
        # Written out: vLLM and speculators default norm_before_residual differently (True / False).
        "norm_before_residual": spec.norm_before_residual, "norm_before_fc": spec.fc_input_norm,
        "fc_norm": spec.aux_norm, "norm_output": spec.norm_output,  # EAGLE-3.1 (see the module docstring)
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.get("_name_or_path"),
                         "architectures": list(target.get("architectures") or [])},
        },
    }


def sglang_config(spec: Eagle3Spec, target: dict[str, Any]) -> dict[str, Any]:
    """config.json of `format=sglang-eagle3` (read by `python/sglang/srt/models/llama_eagle3.py` and the model
    runner's `eagle_config` look-up)."""
    cfg = llama_layer_config(spec, target)
    cfg.update({
        "architectures": [SGLANG_ARCH],
        "draft_vocab_size": spec.draft_vocab_size,  # absent, SGLang would load the target's full lm_head instead
        "target_hidden_size": spec.args.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_aux_ids(spec.aux_layers),
                         "use_aux_hidden_state": True},
    })
    return cfg
