"""Checkpoint layouts of draft heads that serving engines load, as name maps over our head's state dict.

Our head stores its family's fused projections (e.g. `qkv_proj`, `gate_up_proj`, as the target loader fuses
them: `Family.fusings`); every other layout stores them split. A layout is a pair of functions:
`to_layout(state, head) → {name: tensor}` and `from_layout(tensors, head) → state`, exact inverses of each other
(tensors are moved, never changed), plus the config.json it writes and the checks a head must pass first.

| format          | heads   | names (config.json)                                                          |
|-----------------|---------|------------------------------------------------------------------------------|
| native          | any     | our own (`save_head`): fused, `draft_vocab` kept                             |
| vllm-eagle      | eagle1  | `fc.weight` (no bias), `layers.0.*` split, no layer-0 input norm, no final    |
|                 |         | norm, no embed / lm_head (the target's are shared) ("LlamaForCausalLM")      |
| sglang-eagle    | eagle1  | as vllm-eagle plus `fc.bias` (zeros for a bias-free head); the engine adds   |
|                 |         | the `model.` prefix itself ("LlamaForCausalLMEagle")                         |
| deepseek-mtp    | mtp     | `model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,    |
|                 |         | embed_tokens}` + the block under the same prefix, L = the target's layer     |
|                 |         | count (`num_nextn_predict_layers: 1`)                                        |
| qwen3-next-mtp  | mtp     | `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,layers.0.*,norm}`; every   |
|                 |         | RMSNorm weight stored as w − 1 (Qwen3-Next norms compute x·(1 + w))          |
| speculators     | eagle3  | `fc.weight`, `layers.0.*` split, `norm.weight`, `lm_head.weight` (draft      |
|                 |         | rows), `d2t`, `t2d`; config: `speculators_model_type: eagle3`,               |
|                 |         | `transformer_layer_config`, aux ids in vLLM's numbering (vLLM loads it)      |
| sglang-eagle3   | eagle3  | as speculators with `midlayer.*` for `layers.0.*`; config: Llama fields,     |
|                 |         | `draft_vocab_size`, `eagle_config` aux ids in SGLang's numbering             |
|                 |         | ("LlamaForCausalLMEagle3")                                                   |
| dflash          | dflash  | our names (z-lab's): `fc`, `hidden_norm`, `layers.N.*`, `norm`; config: Qwen3 |
|                 |         | fields, `dflash_config` with target_layer_ids = aux_layers − 1               |
|                 |         | ("DFlashDraftModel", `export/dflash.py`)                                     |
| speculators-    | dflash  | z-lab's tensors + `lm_head.weight` (draft rows), `d2t`, `t2d` for a draft    |
|   dflash        |         | vocabulary; config: `speculators_model_type: dflash`,                        |
|                 |         | `transformer_layer_config`, aux ids ours (`export/speculators_dflash.py`)    |
| dspark          | dspark  | dflash's plus `markov_head.markov_w{1,2}`, `confidence_head.proj`; config:   |
|                 |         | dflash's with `markov_rank`, `enable_confidence_head`, `sample_from_anchor`  |
|                 |         | ("Qwen3DSparkModel", `export/dspark.py`)                                     |
| speculators-    | peagle  | speculators' + `mask_hidden` [1, 1, k·H]; config: speculators' with          |
|   peagle        |         | `speculators_model_type: peagle`, `mask_token_id` (vLLM serves it as eagle3  |
|                 |         | with parallel_drafting, `export/peagle.py`)                                  |

Fit: vLLM's EAGLE-1 and both MTP layouts have no fc bias, so a head trained with `fc_bias` only exports to
native / sglang-eagle. Two differences an engine brings, not the file: DeepSeek-V3's MTP module feeds the
*un-normed* block output to its next step (ours feeds the final-normed feature, as Qwen3-Next does), so chained
drafts from the second on differ there; and engines' DeepSeek MTP blocks are MLA, so a Llama-family head (plain
q/k/v attention) in that layout loads where the engine accepts a dense attention block. Qwen3-Next's attention
has an output gate by default: the config sets `attn_output_gate: false` for our ungated layer.
The concatenation order inside fc / eh_proj is the same everywhere: [embedding ; hidden]. The EAGLE-3 layouts
(`export/eagle3.py`, with the engines' facts they rest on) keep the draft vocabulary, as `d2t` / `t2d`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mtp_train.config.head import HEAD_TYPES
from mtp_train.config.registry import Registry
from mtp_train.export import dflash, dspark, eagle3, peagle, speculators_dflash
from mtp_train.heads.base import DraftHead
from mtp_train.models.families import family_of
from mtp_train.models.fusing import fuse, fusion_plan, unfuse


class LayoutError(ValueError):
    """A head that does not fit a layout (wrong head type, a norm the layout has no place for, ...)."""


def unfuse_layer(layer: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    """Decoder-layer tensors with fused names → split as the checkpoint has them (e.g. q/k/v and gate/up)."""
    return unfuse(layer, family_of(head.args).fusings, head.args)


def fuse_layer(layer: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    """The inverse of `unfuse_layer`: fuses what the head's block fuses (a DeepSeek block fuses nothing)."""
    out = dict(layer)
    out.update(fuse(out, fusion_plan(head.layers[0].state_dict(), family_of(head.args).fusings)))
    return out


def _layer_items(state: dict[str, torch.Tensor], prefix: str = "layers.0.") -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


@dataclass(frozen=True)
class Layout:
    """One export format."""

    name: str
    check: Callable[[DraftHead], list[str]]  # problems that make the head unfit (empty = fits)
    to_layout: Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]
    from_layout: Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]
    config: Callable[[DraftHead, dict[str, Any]], dict[str, Any]]  # (head, target config.json) → config.json
    needs_frozen: bool = False  # the layout carries the embedding / lm_head itself
    keeps_draft_vocab: bool = False  # the layout carries the draft vocabulary (else: drafts over all of V)
    exact: bool = True  # from_layout(to_layout(state)) == state bit for bit (Qwen3-Next's w − 1 rounds)

    @property
    def head_types(self) -> tuple[str, ...]:
        """The head types whose spec (`HEAD_TYPES`) names this format."""
        return tuple(name for name, t in HEAD_TYPES.items() if self.name in t.spec.formats)


def _no_draft_vocab(head: DraftHead) -> list[str]:
    # Layouts without a draft vocabulary still fit: they carry or share the full lm_head, whose rows include
    # the draft vocabulary's, so the engine drafts over the whole vocabulary.
    return []


def _no_fc_bias(head: DraftHead) -> list[str]:
    return ["fc_bias=True: the layout's fc has no bias (retrain with head.fc_bias=false, or export native / "
            "sglang-eagle)"] if head.cfg.fc_bias else []


def _no_aux(head: DraftHead, layouts: str) -> list[str]:
    """What a final-hidden layout (one fc over [E(t); h]) cannot carry of an aux-layer head: `aux_fc` (the engines
    would feed the final hidden state instead) and EAGLE-3.1's per-aux-layer norms (speculators' only,
    `export/eagle3.py`)."""
    c = head.cfg
    return ([f"head.aux_norm=true: {layouts} have no per-aux-layer norms (EAGLE-3.1); export native"]
            if c.aux_norm else []) + \
        ([f"head.features=aux: {layouts} read the target's final hidden state, with no fc over its aux layers; "
          f"export native"] if c.features == "aux" else [])


def _eagle_check(bias_ok: bool) -> Callable[[DraftHead], list[str]]:
    def check(head: DraftHead) -> list[str]:
        c = head.cfg
        problems = [f"{flag}=True: the EAGLE-1 layout has no place for it"
                    for flag in ("enorm", "hnorm", "final_norm") if getattr(c, flag)]
        if c.input_norm:
            problems.append("input_norm=True: EAGLE-1's first decoder layer has no input_layernorm")
        return (problems + ([] if bias_ok else _no_fc_bias(head)) + _no_draft_vocab(head)
                + _no_aux(head, "the EAGLE-1 layouts (vllm-eagle, sglang-eagle)"))

    return check


def _mtp_check(head: DraftHead) -> list[str]:
    c = head.cfg
    return [f"{flag}=False: the layout requires it (an RMSNorm weight is always present)"
            for flag in ("enorm", "hnorm", "input_norm", "final_norm") if not getattr(c, flag)] + _no_fc_bias(head) \
        + _no_aux(head, "the MTP layouts (deepseek-mtp, qwen3-next-mtp)")


def _drop_vocab(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != "draft_vocab"}


# --- vLLM / SGLang EAGLE-1 -------------------------------------------------------------------------------------


def _eagle_to(prefix: str, bias: bool) -> Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]:
    def to(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
        state = _drop_vocab(state)
        out = {f"{prefix}fc.weight": state["fc.weight"]}
        if "fc.bias" in state:
            out[f"{prefix}fc.bias"] = state["fc.bias"]
        elif bias:  # the layout always has one: a zero bias is the same function
            out[f"{prefix}fc.bias"] = torch.zeros(state["fc.weight"].shape[0], dtype=state["fc.weight"].dtype)
        out.update({f"{prefix}layers.0.{k}": v for k, v in unfuse_layer(_layer_items(state), head).items()})
        return out

    return to


def _eagle_from(prefix: str) -> Callable[[dict[str, torch.Tensor], DraftHead], dict[str, torch.Tensor]]:
    def frm(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
        state = {"fc.weight": tensors[f"{prefix}fc.weight"]}
        if head.cfg.fc_bias:
            state["fc.bias"] = tensors[f"{prefix}fc.bias"]
        layer = fuse_layer(_layer_items(tensors, f"{prefix}layers.0."), head)
        state.update({f"layers.0.{k}": v for k, v in layer.items()})
        return state

    return frm


def _hf_config(target: dict[str, Any], **extra: Any) -> dict[str, Any]:
    cfg = {k: v for k, v in target.items() if not k.startswith("_")}
    cfg.update(extra)
    return cfg


def _eagle_config(arch: str) -> Callable[[DraftHead, dict[str, Any]], dict[str, Any]]:
    def config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
        return _hf_config(target, architectures=[arch], model_type="llama", num_hidden_layers=1)

    return config


# --- DeepSeek-V3 MTP -------------------------------------------------------------------------------------------


def _ds_prefix(head: DraftHead) -> str:
    return f"model.layers.{head.target_args.num_layers}."


def _ds_to(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    state = _drop_vocab(state)
    p = _ds_prefix(head)
    frozen = head.require_frozen()
    out = {f"{p}enorm.weight": state["enorm.weight"], f"{p}hnorm.weight": state["hnorm.weight"],
           f"{p}eh_proj.weight": state["fc.weight"], f"{p}shared_head.norm.weight": state["norm.weight"],
           # Copies: a tied target shares one tensor, which safetensors refuses to store under two names.
           f"{p}shared_head.head.weight": frozen.lm_head.detach().to("cpu").clone(),
           f"{p}embed_tokens.weight": frozen.embed.detach().to("cpu").clone()}
    out.update({f"{p}{k}": v for k, v in unfuse_layer(_layer_items(state), head).items()})
    return out


def _ds_from(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    p = _ds_prefix(head)
    state = {"enorm.weight": tensors[f"{p}enorm.weight"], "hnorm.weight": tensors[f"{p}hnorm.weight"],
             "fc.weight": tensors[f"{p}eh_proj.weight"], "norm.weight": tensors[f"{p}shared_head.norm.weight"]}
    skip = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    layer = {k: v for k, v in _layer_items(tensors, p).items() if not k.startswith(skip)}
    state.update({f"layers.0.{k}": v for k, v in fuse_layer(layer, head).items()})
    return state


def _ds_config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    return _hf_config(target, num_nextn_predict_layers=1)


# --- Qwen3-Next MTP --------------------------------------------------------------------------------------------


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _gemma(tensors: dict[str, torch.Tensor], shift: float) -> dict[str, torch.Tensor]:
    """Qwen3-Next RMSNorms compute x·(1 + w): store w − 1 (shift −1) and read back w + 1 (shift +1)."""
    return {k: v + shift if _is_norm(k) else v for k, v in tensors.items()}


def _qn_to(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    state = _drop_vocab(state)
    out = {"mtp.pre_fc_norm_embedding.weight": state["enorm.weight"],
           "mtp.pre_fc_norm_hidden.weight": state["hnorm.weight"], "mtp.fc.weight": state["fc.weight"],
           "mtp.norm.weight": state["norm.weight"]}
    out.update({f"mtp.layers.0.{k}": v for k, v in unfuse_layer(_layer_items(state), head).items()})
    return _gemma(out, -1.0)


def _qn_from(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    tensors = _gemma(tensors, 1.0)
    state = {"enorm.weight": tensors["mtp.pre_fc_norm_embedding.weight"],
             "hnorm.weight": tensors["mtp.pre_fc_norm_hidden.weight"], "fc.weight": tensors["mtp.fc.weight"],
             "norm.weight": tensors["mtp.norm.weight"]}
    state.update({f"layers.0.{k}": v for k, v in fuse_layer(_layer_items(tensors, "mtp.layers.0."), head).items()})
    return state


def _qn_config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    return _hf_config(target, num_nextn_predict_layers=1, attn_output_gate=False)


# --- EAGLE-3: speculators (vLLM) and SGLang ----------------------------------------------------------------


def _on_spec(fn: Callable[[Any, eagle3.Eagle3Spec], Any]) -> Callable[[Any, DraftHead], Any]:
    """A function of (x, Eagle3Spec) as one of (x, head)."""
    return lambda x, head: fn(x, eagle3.Eagle3Spec.of(head))


def _eagle3_layout(name: str, check: Callable[[eagle3.Eagle3Spec], list[str]], to: Callable[..., Any],
                   frm: Callable[..., Any], config: Callable[..., dict[str, Any]]) -> Layout:
    return Layout(name, lambda head: check(eagle3.Eagle3Spec.of(head)), _on_spec(to), _on_spec(frm),
                  lambda head, target: config(eagle3.Eagle3Spec.of(head), target), keeps_draft_vocab=True)


def _peagle_layout() -> Layout:
    """speculators' P-EAGLE layout (`export/peagle.py`): EAGLE-3's, the placeholder's hidden state and token."""
    return Layout("speculators-peagle", lambda head: peagle.problems(eagle3.Eagle3Spec.of(head)),
                  _on_spec(peagle.to_layout), _on_spec(peagle.from_layout),
                  lambda head, target: peagle.config(eagle3.Eagle3Spec.of(head), target, head.mask_token_id),
                  keeps_draft_vocab=True)


# Export formats by name. A head type's spec names the formats that take it (`HeadTypeSpec.formats`); a plug-in
# that brings a new layout registers it here (`LAYOUTS.add(Layout(...))`). `unmatched_formats` is the cross-check.
LAYOUTS: Registry[Layout] = Registry("export format")
for _layout_entry in (
    Layout("vllm-eagle", _eagle_check(bias_ok=False), _eagle_to("", bias=False), _eagle_from(""),
           _eagle_config("LlamaForCausalLM")),
    Layout("sglang-eagle", _eagle_check(bias_ok=True), _eagle_to("", bias=True), _eagle_from(""),
           _eagle_config("LlamaForCausalLMEagle")),
    Layout("deepseek-mtp", _mtp_check, _ds_to, _ds_from, _ds_config, needs_frozen=True),
    Layout("qwen3-next-mtp", _mtp_check, _qn_to, _qn_from, _qn_config, exact=False),
    _eagle3_layout("speculators", eagle3.speculators_problems, eagle3.to_speculators, eagle3.from_speculators,
                   eagle3.speculators_config),
    _eagle3_layout("sglang-eagle3", eagle3.sglang_problems, eagle3.to_sglang, eagle3.from_sglang,
                   eagle3.sglang_config),
    Layout("dflash", dflash.problems, dflash.to_layout, dflash.from_layout, dflash.config),
    Layout("speculators-dflash", speculators_dflash.problems, speculators_dflash.to_layout,
           speculators_dflash.from_layout, speculators_dflash.config, keeps_draft_vocab=True),
    Layout("dspark", dspark.problems, dspark.to_layout, dspark.from_layout, dspark.config),
    _peagle_layout(),
):
    LAYOUTS.add(_layout_entry)


def export_formats() -> tuple[str, ...]:
    """Every `mtp-export format=` value: native and each registered layout."""
    return ("native", *LAYOUTS.names())


def unmatched_formats() -> tuple[list[str], list[str]]:
    """(formats some head type names without a layout, layouts no head type takes): both empty when the head
    types' specs and the layouts agree (a test checks it)."""
    named = {f for t in HEAD_TYPES.values() for f in t.spec.formats}
    return sorted(named - set(export_formats())), sorted(set(export_formats()) - named)
