"""Tensor parallelism for targets whose family gives TP rules (`Family.tp`), applied from outside the model file.

Megatron-style sharding over a `torch.distributed` group of `tp` ranks (NCCL on GPU, gloo on CPU). The family's
rules name, per decoder layer, the column-parallel modules (split by output rows; attention by heads: local heads
attend locally), the row-parallel ones (split by input columns: partial sums → all-reduce, then the bias) and the
args fields each rank holds 1/tp of; everything else (norms) is replicated. For every family alike:

| tensor (HF name)                         | split                        | forward                          |
|------------------------------------------|------------------------------|----------------------------------|
| `model.embed_tokens.weight`              | vocabulary rows              | masked lookup → all-reduce       |
| `lm_head.weight`                         | vocabulary rows              | local logits → all-gather        |

(the Llama family's table is in `families/llama.py`, MLA's in `families/deepseek_v2.py`).

Mixture-of-experts blocks are split by tensor, not by expert: every rank holds every expert, with gate / up split
by intermediate rows and down by input columns (the `partial` rules; the shared experts alike), and the router and
norms replicated. Each rank routes its (replicated) tokens identically, runs the same grouped products on its
slices, and sums the routed and shared experts' partial outputs locally; the block (a `reduced` rule, the MoE
`mlp`) is then all-reduced once (`ReducedSum`), so an MoE layer costs two all-reduces like a dense one (attention's
o_proj, the MoE), not one per expert. An expert's bias is added on rank 0 only (the others hold zeros), so the sum
counts it once. Why tensor split rather than expert split (E/tp whole experts per rank, also one all-reduce): both
hold 1/tp of the expert weights, but the tensor split is balanced whatever the routing (every rank does 1/tp of
every hit expert's work, where an expert split waits for the rank whose experts were hit most) and needs no
expert-to-rank map. Its cost is narrower products at large tp (moe_intermediate_size / tp rows per expert) and the
divisibility of moe_intermediate_size by tp. Experts stored as fused tensors ((E, H, 2I) gate_up, (E, I, H) down)
opt in by `tensors` rules (a tensor name and the dimension split) and `once` rules (a fused down bias: rank 0's);
so do other per-head tensors (attention sinks, split along heads).

Each rank builds the model with its local shapes (`local_args`), reads only its slices of every checkpoint tensor
(safetensors `get_slice`; an FP8 weight's slice is dequantised from the scale blocks covering it,
`mtp_train.models.fp8`), fuses them as the single-process loader does, and then has its row-parallel projections,
reduced blocks, embedding and lm_head wrapped (`parallelize`). The model file itself is unchanged: the attention
backend and the KV cache see the local head counts, so each rank caches only its KV heads (MLA: the whole latent row,
which all heads share). Hidden states and logits are replicated on every rank after each step, equal to the
single-process model's up to summation order.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from mtp_train.layers.linear import Linear, prepack_linears
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.families import TPRules, args_from_dir, family_of, titles
from mtp_train.models.fusing import fuse, fusion_plan
from mtp_train.models.loader import (
    IGNORED_SUFFIXES,
    CheckpointReader,
    attention_for,
    mtp_layer_prefixes,
    open_checkpoint,
    resolve_dtype,
)

VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group."""

    rank: int  # rank inside the group, 0..size-1
    size: int
    group: tdist.ProcessGroup | None = None  # None: the default group (when it is exactly the TP group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            tdist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's x (same shape everywhere) along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        tdist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def tp_groups(tp: int) -> tuple[TPGroup, int, int]:
    """Split the initialised world into consecutive TP groups of `tp` ranks (inside a node when tp ≤ GPUs per node).

    Returns (this rank's TPGroup, data-parallel rank, data-parallel world): group g holds ranks g·tp..g·tp+tp-1,
    and the groups are the data-parallel replicas. Every rank must call this (new_group is collective).
    """
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    if tp < 1 or world % tp:
        raise ValueError(f"model.tp={tp} must divide the number of processes ({world})")
    if tp == 1:
        return TPGroup(0, 1), rank, world
    mine = None
    for g in range(world // tp):
        ranks = list(range(g * tp, (g + 1) * tp))
        pg = tdist.new_group(ranks) if world > tp else None
        if rank in ranks:
            mine = TPGroup(rank - g * tp, tp, pg)
    assert mine is not None
    return mine, rank // tp, world // tp


def tp_rules(args: ModelArgs, source: str | Path = "config.json") -> TPRules:
    """The family's TP rules; a ModelConfigError naming `source` when the family runs with tp=1 only."""
    family = family_of(args)
    if family.tp is None:
        raise ModelConfigError(f"{source}: tensor parallelism covers {titles(lambda f: f.tp is not None)} targets; "
                               f"run {family.title} with model.tp=1 (data parallel over ranks)")
    return family.tp


def local_args(args: ModelArgs, tp: int) -> ModelArgs:
    """The shapes one rank of `tp` holds: the family's divided fields (heads, KV heads, intermediate size) / tp."""
    divided = tp_rules(args).divided
    problems = [f"{name}={getattr(args, name)}" for name in divided if getattr(args, name) % tp]
    if problems:
        raise ModelConfigError(f"tensor parallelism tp={tp} needs {', '.join(problems)} divisible by {tp}")
    return dataclasses.replace(args, **{name: getattr(args, name) // tp for name in divided})


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(first id, end id, padded rows per rank) of this rank's vocabulary shard (the last one may be short)."""
    per = -(-vocab // tp)
    lo = min(rank * per, vocab)
    return lo, min(lo + per, vocab), per


@functools.cache
def _pattern(rules: tuple[str, ...]) -> re.Pattern[str]:
    """A regex matching module paths that end, at a dot boundary, with one of `rules` (`*`: one path component)."""
    alts = "|".join(re.escape(r).replace(r"\*", r"[^.]+") for r in rules)
    return re.compile(rf"(?:^|\.)(?:{alts})$" if rules else r"(?!)")


def matches(module: str, rules: tuple[str, ...]) -> bool:
    """Whether module path `module` (a checkpoint name without its last part, or relative to a layer) is one of
    the TP `rules`' modules."""
    return _pattern(rules).search(module) is not None


def rank_part(name: str, shape: tuple[int, ...], tp: TPGroup, rules: TPRules) -> tuple[tuple[slice, ...], int]:
    """This rank's part of checkpoint tensor `name` of `shape`: one slice per leading dimension (empty: all of it),
    and the rows of zeros to append so that every rank's vocabulary shard has the same shape."""
    module = name.rsplit(".", 1)[0]
    for pattern, dim in rules.tensors:
        if matches(name, (pattern,)):
            n = shape[dim] // tp.size
            return (slice(None),) * dim + (slice(tp.rank * n, (tp.rank + 1) * n),), 0
    if matches(module, rules.column):
        n = shape[0] // tp.size
        return (slice(tp.rank * n, (tp.rank + 1) * n),), 0
    if matches(module, rules.row + rules.partial) and name.endswith(".weight"):
        n = shape[1] // tp.size
        return (slice(None), slice(tp.rank * n, (tp.rank + 1) * n)), 0
    if name in VOCAB:
        lo, hi, per = vocab_range(shape[0], tp.size, tp.rank)
        return (slice(lo, hi),), per - (hi - lo)
    return (), 0


def added_once(name: str, rules: TPRules) -> bool:
    """Whether tensor `name` is one a reduced block adds once over the group (held by rank 0, zeros elsewhere): a
    partial module's bias, or a `once` tensor."""
    return matches(name, rules.once) or (name.endswith(".bias") and matches(name.rsplit(".", 1)[0], rules.partial))


def _read_part(ckpt: CheckpointReader, name: str, tp: TPGroup, rules: TPRules, dtype: torch.dtype) -> torch.Tensor:
    """Read only this rank's part of `name` (an FP8 weight: its part dequantised from the scale blocks covering it,
    a part boundary need not fall on a block boundary); the short last vocabulary shard padded with zeros; a
    partial module's bias on rank 0 only (zeros elsewhere: the block's all-reduce adds it once)."""
    if tp.rank and added_once(name, rules):
        return torch.zeros(ckpt.shapes[name], dtype=dtype)
    index, pad = rank_part(name, ckpt.shapes[name], tp, rules)
    part = ckpt.read(name, dtype, index)
    if pad:
        part = torch.cat([part, part.new_zeros(pad, *part.shape[1:])])
    return part


class RowParallelLinear(nn.Module):
    """A projection whose input features are split over the group: local partial product, all-reduce, then bias."""

    def __init__(self, inner: Linear, tp: TPGroup) -> None:
        super().__init__()
        self.bias = inner.bias
        inner.bias = None
        self.inner, self.tp = inner, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.inner(x))
        return y if self.bias is None else y + self.bias


class ReducedSum(nn.Module):
    """A block whose output is a sum over the group of partial outputs (an MoE split by tensor, its experts'
    down_proj slices not reduced themselves): the block's forward, then one all-reduce."""

    def __init__(self, inner: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.inner, self.tp = inner, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) replicated → (T, H) replicated."""
        return self.tp.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [lo, hi) on this rank: ids outside give zeros, and the all-reduce fills them in."""

    def __init__(self, weight: torch.Tensor, lo: int, hi: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.lo, self.hi, self.tp = lo, hi, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        out = F.embedding(torch.where(mine, ids - self.lo, torch.zeros_like(ids)), self.weight)
        return self.tp.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class VocabParallelLMHead(nn.Module):
    """lm_head rows of this rank's vocabulary shard: local logits, gathered over the group, padding dropped."""

    def __init__(self, weight: torch.Tensor, vocab: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab, self.tp = vocab, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(hidden, self.weight))[..., :self.vocab]


def parallelize(model: CausalLM, tp: TPGroup, vocab: int) -> CausalLM:
    """Wrap a model holding this rank's slices (see `rank_part`) so that its forward is the full model's: in every
    layer, the `row` modules it has as RowParallelLinears, and the `reduced` blocks that hold `partial` modules or
    `tensors` (a sparse layer's MoE; a dense layer's MLP has a row-parallel down_proj instead) as ReducedSums."""
    rules = tp_rules(model.args)
    split_tensors = tuple(pattern for pattern, _ in rules.tensors)
    for layer in model.model.layers:
        names = [n for n, _ in layer.named_modules() if n]
        rows = [n for n in names if matches(n, rules.row)]
        parts = [n for n in names if matches(n, rules.partial)]
        parts += [n for n, _ in layer.named_parameters() if matches(n, split_tensors)]
        blocks = [n for n in names if matches(n, rules.reduced) and any(p.startswith(n + ".") for p in parts)]
        if any(r.startswith(b + ".") for r in rows for b in blocks):
            raise ValueError(f"TP rules of {model.args.model_type}: a row-parallel module inside a reduced block "
                             "would be all-reduced twice")
        for path, wrap in [(n, RowParallelLinear) for n in rows] + [(n, ReducedSum) for n in blocks]:
            parent, _, attr = path.rpartition(".")
            owner = layer.get_submodule(parent)
            setattr(owner, attr, wrap(getattr(owner, attr), tp))
    lo, hi, _ = vocab_range(vocab, tp.size, tp.rank)
    embed = model.model.embed_tokens.weight
    model.model.embed_tokens = VocabParallelEmbedding(embed.data, lo, hi, tp)
    head = model.model.embed_tokens.weight if model.args.tie_word_embeddings else model.lm_head.weight
    model.lm_head = VocabParallelLMHead(head, vocab, tp)  # type: ignore[assignment]
    model.tp = tp  # type: ignore[attr-defined]
    return model


def load_model_tp(path: str | Path, tp: TPGroup, dtype: str | torch.dtype = "auto",
                  device: str | torch.device = "cpu", backend: str = "auto",
                  cpu_prepack: bool = True) -> CausalLM:
    """`load_model` for one rank of a tensor-parallel group: local shapes, only this rank's slices read."""
    path = Path(path)
    full = args_from_dir(path)
    rules = tp_rules(full, path)
    args = local_args(full, tp.size)
    dt = resolve_dtype(dtype, full)
    device = torch.device(device)
    per = vocab_range(full.vocab_size, tp.size, tp.rank)[2]
    with torch.device("meta"):  # the vocabulary dimension is this rank's (padded) shard
        model = family_of(args).model(dataclasses.replace(args, vocab_size=per))
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    raw: dict[str, torch.Tensor] = {}
    with open_checkpoint(path, full) as ckpt:
        for name in ckpt.names:
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and args.tie_word_embeddings):
                continue
            if name.startswith(mtp_layer_prefixes(full)):  # the checkpoint's MTP layers: a head's to read
                continue
            raw[name] = _read_part(ckpt, name, tp, rules, dt)
    state = fuse(raw, fusion_plan(expected, family_of(args).fusings))
    state.update({name: raw.pop(name) for name in expected if name in raw})
    problems = [f"{n}: missing" for n in sorted(expected.keys() - state.keys())]
    problems += [f"{n}: rank slice {tuple(state[n].shape)}, expected {expected[n]}"
                 for n in sorted(expected.keys() & state.keys()) if tuple(state[n].shape) != expected[n]]
    if problems:
        raise ModelConfigError(f"{path} (tp rank {tp.rank}/{tp.size}):\n  " + "\n  ".join(problems[:8]))
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    model.rotary = type(model.rotary)(args.rope, device=device)
    model.attn = attention_for(args, backend, device, dt, source=path)
    model.eval().requires_grad_(False)
    model.args = dataclasses.replace(args, vocab_size=full.vocab_size)
    parallelize(model, tp, full.vocab_size)
    if cpu_prepack:
        prepack_linears(model)
    return model
