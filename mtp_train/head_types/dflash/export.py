"""The z-lab DFlash layout (`format=dflash`): what vLLM's `method=dflash` loads (`qwen3_dflash.py`,
`DFlashQwen3ForCausalLM`), z-lab's `DFlashDraftModel` and SGLang's DFlash drafter read.

Tensors: our dflash head's state dict as it is, the names being z-lab's already: `fc.weight` [H, k·H],
`hidden_norm.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.self_attn.{q,k}_norm.weight` [D],
`layers.N.mlp.{gate,up,down}_proj.weight`, `layers.N.{input,post_attention}_layernorm.weight`, `norm.weight`. No
embedding and no lm_head: vLLM shares the target's when the draft has none.

config.json: a Qwen3 config of the draft layers (`architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`,
`num_hidden_layers` = head.layers, the target's shapes, rope and vocabulary), `num_target_layers` (the target's
layer count), `block_size` and `dflash_config: {block_size, mask_token_id, target_layer_ids}`.

Layer numbering. Ours (head.aux_layers) is transformers' `hidden_states[j]` (0 = the embeddings, j = decoder layer
j-1's output). z-lab's `target_layer_ids` name decoder layers whose OUTPUT is taken (its code reads
`hidden_states[id + 1]`), and vLLM reads them the same way: its DFlash adapter for speculators' configs writes
`target_layer_ids = [i - 1 for i in aux_hidden_state_layer_ids]`, the speculators ids being vLLM's EAGLE aux ids,
which equal ours (`head_types/eagle3/export.py`). So `target_layer_ids = aux_layers - 1`, and hidden_states[0] (the
embeddings) has no id: such a head is refused. `make check-vllm` proves the numbering by vLLM's acceptance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mtp_train.export.layouts import with_target_fields
from mtp_train.models.families import family_of

if TYPE_CHECKING:
    from mtp_train.heads.base import DraftHead

ARCH = "DFlashDraftModel"  # z-lab's class; vLLM maps it to DFlashQwen3ForCausalLM


def target_layer_ids(aux_layers: list[int] | tuple[int, ...]) -> list[int]:
    """Our hidden_states[j] numbering → z-lab / vLLM `dflash_config.target_layer_ids` (j - 1)."""
    return [int(j) - 1 for j in aux_layers]


def aux_layers_of(ids: list[int] | tuple[int, ...]) -> list[int]:
    """The inverse of `target_layer_ids`."""
    return [int(i) + 1 for i in ids]


def problems(head: DraftHead) -> list[str]:
    """What keeps a dflash head out of the z-lab layout (empty = it fits)."""
    out = common_problems(head)
    if head.cfg.draft_vocab_size:
        out.append("head.draft_vocab_size > 0: this layout is written over the whole vocabulary; export "
                   "format=speculators-dflash (it carries d2t / t2d) or native")
    return out


def common_problems(head: DraftHead) -> list[str]:
    """What keeps a dflash head out of every DFlash layout vLLM loads (z-lab's and speculators')."""
    c, a = head.cfg, head.target_args
    out = []
    if c.aux_norm:
        out.append("head.aux_norm=true: the DFlash layouts have no per-aux-layer norms before fc; export native")
    bad = [j for j in c.aux_layers if not 1 <= j <= a.num_layers - 1]
    if bad:  # vLLM captures the stream entering a decoder layer: the output of one that another layer follows
        out.append(f"aux_layers {bad}: vLLM reads the outputs of decoder layers that another layer follows, "
                   f"hidden_states[1..{a.num_layers - 1}]")
    if family_of(a).name != "llama":
        out.append(f"target model_type {a.model_type!r}: vLLM's DFlash reads Llama-family targets' aux layers")
    return out


def to_layout(state: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    """Our names are z-lab's: the tensors as they are."""
    return dict(state)


def from_layout(tensors: dict[str, torch.Tensor], head: DraftHead) -> dict[str, torch.Tensor]:
    return dict(tensors)


def config(head: DraftHead, target: dict[str, Any]) -> dict[str, Any]:
    """config.json of `format=dflash` (fields read by vLLM's `qwen3_dflash.py` and z-lab's `DFlashDraftModel`)."""
    a, c, s = head.target_args, head.cfg, head.cfg.settings
    mask = getattr(head, "mask_token_id", s.mask_token_id)
    cfg: dict[str, Any] = {
        "architectures": [ARCH], "model_type": "qwen3", "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size, "num_hidden_layers": s.layers, "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim, "hidden_act": "silu",
        "rms_norm_eps": a.rms_norm_eps, "vocab_size": a.vocab_size,
        "max_position_embeddings": a.max_position_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "num_target_layers": a.num_layers, "block_size": s.block_size,
        "dflash_config": {"block_size": s.block_size, "mask_token_id": mask,
                          "target_layer_ids": target_layer_ids(c.aux_layers)},
    }
    return with_target_fields(cfg, target, a.rope.theta)
