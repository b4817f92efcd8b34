"""Layer numbering between our shards and vLLM's `eagle_aux_hidden_state_layer_ids`.

Our shards count layers as transformers' `hidden_states[j]` does: j = 0 is the embedding output, j in 1..L-1 the
residual stream after layer j-1, and j = L the last layer's output after the final norm (also the shard's `hidden`).
vLLM's aux id i (`EagleModelMixin._maybe_add_hidden_state`) is the residual stream (`hidden + residual`) after
layer i-1, with i = 0 the embeddings: the same for i < L, but id L is the last layer's output *before* the final
norm. vLLM also returns its aux states sorted by id with duplicates removed, whatever order they were asked in.

So a capture asks vLLM for the sorted ids {j in aux_layers, j < L} ∪ {L}, and the driver applies the target's
final norm to id L for `hidden` (and for aux j = L). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtp_train.config.head import check_aux_layers


@dataclass(frozen=True)
class LayerMap:
    """Where each stored tensor of a shard comes from in a captured [n, len(vllm_ids), H] stack.

    vllm_ids: the ids to ask vLLM for, sorted and unique (the order of its stack). hidden: (stack index, apply the
    final norm) of the shard's `hidden`. aux: the same for each of `aux_layers`, in their order.
    """

    num_layers: int
    aux_layers: tuple[int, ...]
    vllm_ids: tuple[int, ...]
    hidden: tuple[int, bool]
    aux: tuple[tuple[int, bool], ...]


def layer_map(aux_layers: Sequence[int], num_layers: int) -> LayerMap:
    """The LayerMap of a target of `num_layers` layers storing `aux_layers` (HF `hidden_states[j]` numbering).

    Raises ValueError for a j outside 0..num_layers, or one given twice (`check_aux_layers`).
    """
    aux = tuple(int(j) for j in aux_layers)
    check_aux_layers(aux, num_layers)
    # Id L is always asked for: the shard's `hidden` is its normed output.
    ids = tuple(sorted({j for j in aux if j < num_layers} | {num_layers}))
    last = ids.index(num_layers)
    return LayerMap(num_layers=num_layers, aux_layers=aux, vllm_ids=ids, hidden=(last, True),
                    aux=tuple((last, True) if j == num_layers else (ids.index(j), False) for j in aux))
