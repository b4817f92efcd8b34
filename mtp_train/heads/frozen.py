"""The target tensors a draft head uses but never trains: `embed_tokens`, `lm_head`, and (for init) a decoder layer
or the checkpoint's own MTP layer.

Only the named tensors are read from the target's safetensors, never the whole model. The frozen
embedding and lm_head live in a plain object, not in the head's `nn.Module` tree, so that a training
engine that casts, shards, optimises or saves the head's module never sees them: their dtype and
device stay the caller's choice and head checkpoints never contain them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.families import args_from_dir, family_of
from mtp_train.models.foreign import embedding_names, head_target_args

# The family's fusings are the loader's, so that a fused head layer reads a checkpoint exactly as the target does.
from mtp_train.models.fusing import fuse, parts_plan
from mtp_train.models.loader import (
    IGNORED_SUFFIXES,
    checkpoint_files,
    iter_tensors,
    mtp_layer_prefixes,
    open_checkpoint,
    resolve_dtype,
)


@dataclass(eq=False)
class FrozenTargetParts:
    """The target's input embedding and output projection, frozen (requires_grad False).

    embed: (V, H); lm_head: (V, H), the same tensor as `embed` when the target ties them.
    """

    embed: torch.Tensor  # (V, H)
    lm_head: torch.Tensor  # (V, H)
    args: ModelArgs  # the target's shape (vocab, hidden size, ...)

    def __post_init__(self) -> None:
        # Detached views: whatever they came from, no gradient can ever reach them. A tied pair stays one object.
        same = self.lm_head is self.embed or self.lm_head.data_ptr() == self.embed.data_ptr()
        self.embed = self.embed.detach()
        self.lm_head = self.embed if same else self.lm_head.detach()

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: str | torch.dtype = "auto") -> FrozenTargetParts:
        """Read only the embedding and the lm_head (tied: the embedding) from a target folder, by the names
        `models.foreign` tries (`model.embed_tokens.weight` and `lm_head.weight` first), whether or not a family
        here runs the target (`head_target_args`)."""
        path = Path(path)
        args = head_target_args(path)
        dt = resolve_dtype(dtype, args)
        files = checkpoint_files(path)
        embed_name, head_name = embedding_names(files, args.tie_word_embeddings, path)
        names = list(dict.fromkeys([embed_name, head_name]))
        want = (args.vocab_size, args.hidden_size)
        got: dict[str, torch.Tensor] = {}
        for name, t in iter_tensors({n: files[n] for n in names}):
            if tuple(t.shape) != want:
                raise ModelConfigError(f"{files[name]}: tensor {name} has shape {tuple(t.shape)}, "
                                       f"config.json implies {want}")
            got[name] = t.to(device=device, dtype=dt)
        embed = got[embed_name]
        return cls(embed=embed, lm_head=got[head_name], args=args)

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> FrozenTargetParts:
        """A copy on `device` / in `dtype`; a tied pair stays one tensor."""
        embed = self.embed.to(device=device, dtype=dtype)
        lm_head = embed if self.tied else self.lm_head.to(device=device, dtype=dtype)
        return FrozenTargetParts(embed=embed, lm_head=lm_head, args=self.args)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: (T,) int → (T, H) in the frozen dtype."""
        return F.embedding(token_ids, self.embed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, H) → (N, V) in the frozen dtype (hidden is cast to it)."""
        return F.linear(hidden.to(self.lm_head.dtype), self.lm_head)


def read_decoder_layer(path: str | Path, index: int = -1, dtype: str | torch.dtype = "auto") -> dict[str, torch.Tensor]:
    """The weights of target layer `index` (negative counts from the end), named as the family's layer names them.

    The family's projections are fused exactly as `load_model` fuses them (e.g. q/k/v and gate/up for the Llama
    family; a DeepSeek-V2 layer keeps the checkpoint's names); only that layer's tensors are read.
    Returns e.g. {"self_attn.qkv_proj.weight": ((Hq+2Hkv)·D, H), "mlp.gate_up_proj.weight": (2I, H), ...} on CPU.
    """
    path = Path(path)
    args = args_from_dir(path)
    if not -args.num_layers <= index < args.num_layers:
        raise ValueError(f"layer index {index} out of range for a target with {args.num_layers} layers")
    idx = index % args.num_layers
    prefix = f"model.layers.{idx}."
    files = {n: f for n, f in checkpoint_files(path).items() if n.startswith(prefix)}
    if not files:
        raise ModelConfigError(f"{path}: checkpoint has no tensors under {prefix}*")
    raw = _read_prefixed(path, args, files, prefix, dtype)
    plan = parts_plan(raw, family_of(args).fusings)
    for parts in plan.values():
        present = [n for n in parts if n in raw]
        if len(present) != len(parts):
            absent = sorted(set(parts) - set(present))
            raise ModelConfigError(f"{path}: layer {idx} has {', '.join(present)} but lacks {', '.join(absent)}")
    state = fuse(raw, plan)
    state.update(raw)
    return state


def _read_prefixed(path: Path, args: ModelArgs, files: dict[str, Path], prefix: str,
                   dtype: str | torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors `files` names (all under `prefix`), in `dtype`, named without the prefix."""
    dt = resolve_dtype(dtype, args)
    # block-scaled FP8 weights are dequantised as the full loader does (their scales share the layer's prefix)
    with open_checkpoint(path, args, files) as ckpt:
        return {n[len(prefix):]: ckpt.read(n, dt) for n in ckpt.names if not n.endswith(IGNORED_SUFFIXES)}


# The MTP layer's tensors that are copies of the target's own (its embedding and lm_head): a head reads the
# target's frozen ones (`FrozenTargetParts`), so these are not read.
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def read_mtp_layer(path: str | Path, dtype: str | torch.dtype = "auto") -> dict[str, torch.Tensor]:
    """The target checkpoint's first MTP layer `model.layers.{L}.*` (L = num_hidden_layers; DeepSeek-V3 / Kimi-K2),
    named without that prefix and with its embedding / lm_head copies (`MTP_SHARED`) left out, FP8 dequantised.

    Returns e.g. {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2H), "shared_head.norm.weight":
    (H,), "input_layernorm.weight": (H,), "self_attn.kv_a_proj_with_mqa.weight": ..., "mlp.gate.weight": (E, H),
    ...} on CPU. A family without MTP layers, or a checkpoint lacking them, is a ModelConfigError naming the folder.
    """
    path = Path(path)
    args = args_from_dir(path)
    prefixes = mtp_layer_prefixes(args)
    n = int(getattr(args, "num_nextn_predict_layers", 0) or 0)
    prefix = prefixes[0] if prefixes else f"model.layers.{args.num_layers}."
    files = {k: f for k, f in checkpoint_files(path).items()
             if k.startswith(prefix) and k[len(prefix):] not in MTP_SHARED}
    if not prefixes or not files:
        raise ModelConfigError(f"head.init=target_mtp: {path} holds no {prefix}* MTP layer "
                               f"(num_nextn_predict_layers={n})")
    return _read_prefixed(path, args, files, prefix, dtype)
