"""The DeepSpeed engine's training state as safetensors and JSON, saved and loaded without pickle.

DeepSpeed's own `save_checkpoint` / `load_checkpoint` write `torch.save` pickles and read them back with
`torch.load(weights_only=False)`, which runs whatever code a file names. Here the same state goes to files that
hold data only, and is handed back to DeepSpeed's own `load_state_dict` methods, so a resume is exactly what
DeepSpeed's checkpoints gave:

    model.safetensors          rank 0: the engine module's weights (the head's trainable tensors, compute dtype)
    optim-rank{r}.safetensors  rank r: its optimizer tensors; under ZeRO-1/2 its partition of the fp32 master
                               weights (`single_partition_of_fp32_groups`) and AdamW's exp_avg / exp_avg_sq / step
                               of that partition (ZeRO-0: the whole optimizer, on every rank)
    optim-rank{r}.json         rank r: the rest of the optimizer's state_dict (hyperparameters, paddings, partition
                               counts, clip, the loss scaler, DeepSpeed's version), naming its tensors in the file above
    state.json                 rank 0: the engine's counters, the LR schedule's state, the ZeRO stage and world size,
                               the head's config, and the trainer's client state (step, data position, ...)

An optimizer's state_dict is a tree of dicts, lists, tuples, tensors, numbers and strings (plus DeepSpeed's loss
scaler object). `encode` writes it as JSON, each tensor replaced by {"$tensor": name} and stored under that name;
`decode` builds back only those types, and for the loss scaler sets the numeric fields of the engine's own one:
nothing a file holds can name a class to build or code to run.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from mtp_train.fileio import atomic_write, atomic_write_text

STATE = "state.json"
MODEL = "model.safetensors"
STATE_FORMAT = "mtp_train.train_state"
STATE_VERSION = 1
TENSOR, TUPLE, ITEMS, SCALER = "$tensor", "$tuple", "$items", "$loss_scaler"
TODO = "resume from another checkpoint (resume=<out>/checkpoints/step-N), or start afresh with resume=none"


class CheckpointError(RuntimeError):
    """A training checkpoint that cannot be resumed from; the message names the file and what to do."""


def optim_files(rank: int) -> tuple[str, str]:
    """(tensors, structure) file names of rank `rank`'s optimizer state in a checkpoint tag folder."""
    return f"optim-rank{rank}.safetensors", f"optim-rank{rank}.json"


# --- the codec ----------------------------------------------------------------------------------------------------


def encode(node: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """`node` as JSON-able data; its tensors go to `tensors` under their dotted path (copied to the CPU)."""
    if isinstance(node, torch.Tensor):
        # A copy of its own: safetensors refuses tensors that share storage (views of one flat partition).
        tensors[path] = node.detach().to("cpu", copy=True).contiguous()
        return {TENSOR: path}
    if isinstance(node, enum.Enum):  # DeepSpeed's ZeroStageEnum
        return encode(node.value, tensors, path)
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(node)]
    if isinstance(node, tuple):  # betas, torch.Size: read back as plain tuples
        return {TUPLE: [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(node)]}
    if isinstance(node, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in node):
            return {k: encode(v, tensors, f"{path}.{k}" if path else k) for k, v in node.items()}
        return {ITEMS: [[encode(k, tensors), encode(v, tensors, f"{path}.{k}")] for k, v in node.items()]}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        # DeepSpeed's fragment addresses (`param_slice_mappings`, for its offline conversion tools; no load reads
        # them): kept as their fields, read back as a plain dict.
        return encode({f.name: getattr(node, f.name) for f in dataclasses.fields(node)}, tensors, path)
    if type(node).__name__ == "LossScaler" or hasattr(node, "cur_scale"):  # DeepSpeed's static or dynamic scaler
        return {SCALER: {k: v for k, v in vars(node).items() if isinstance(v, (bool, int, float)) or v is None}}
    raise TypeError(f"{path}: cannot save a {type(node).__name__} without pickle")


def decode(node: Any, tensors: dict[str, torch.Tensor], loss_scaler: Any = None) -> Any:
    """What `encode` wrote, back; a loss scaler's fields are set on `loss_scaler` (the engine's), then returned."""
    if isinstance(node, list):
        return [decode(v, tensors, loss_scaler) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, value), = node.items()
        if tag == TENSOR:
            if value not in tensors:
                raise KeyError(f"tensor {value!r} is missing")
            return tensors[value]
        if tag == TUPLE:
            return tuple(decode(v, tensors, loss_scaler) for v in value)
        if tag == ITEMS:
            return {decode(k, tensors): decode(v, tensors, loss_scaler) for k, v in value}
        if tag == SCALER:
            if loss_scaler is None:
                raise KeyError("a loss scaler, but the engine has none")
            for k, v in value.items():
                if hasattr(loss_scaler, k) and (isinstance(v, (bool, int, float)) or v is None):
                    setattr(loss_scaler, k, v)
            return loss_scaler
    return {k: decode(v, tensors, loss_scaler) for k, v in node.items()}


# --- files --------------------------------------------------------------------------------------------------------


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` as a safetensors file, atomically."""
    data = save(tensors)
    atomic_write(path, lambda tmp: tmp.write_bytes(data), size=len(data))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (on the CPU); CheckpointError naming it when it is not one."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; {TODO}")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); {TODO}") from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; CheckpointError naming it when it is missing or not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {TODO}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({type(exc).__name__}: {exc}); {TODO}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(doc).__name__}; {TODO}")
    return doc


def read_state(tag_dir: str | Path) -> dict[str, Any]:
    """`state.json` of a checkpoint, its format checked."""
    path = Path(tag_dir) / STATE
    doc = read_json(path)
    if doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
        raise CheckpointError(f"{path}: format {doc.get('format')!r} version {doc.get('version')!r} is not "
                              f"{STATE_FORMAT!r} version {STATE_VERSION}; {TODO}")
    return doc


# --- saving and loading the engine --------------------------------------------------------------------------------


def zero_stage(engine: Any) -> int:
    """The engine's ZeRO stage (0 when ZeRO is off)."""
    return int(engine.zero_optimization_stage()) if engine.zero_optimization() else 0


def save_engine(engine: Any, tag_dir: str | Path, rank: int, world: int, client_state: dict[str, Any],
                head_config: dict[str, Any]) -> None:
    """Every rank: write its optimizer files; rank 0 also the module's weights and `state.json`.

    client_state: the trainer's JSON-able state (step, data position, ...); head_config: the head's config, checked
    against the run's on resume. Call from every rank, then (after a barrier) write the checksums on rank 0.
    """
    tag_dir = Path(tag_dir)
    tensors: dict[str, torch.Tensor] = {}
    structure = encode(engine.optimizer.state_dict(), tensors)
    tensor_file, json_file = optim_files(rank)
    write_tensors(tag_dir / tensor_file, tensors)
    atomic_write_text(tag_dir / json_file, json.dumps({"format": STATE_FORMAT, "rank": rank,
                                                       "optimizer": structure}) + "\n")
    if rank != 0:
        return
    write_tensors(tag_dir / MODEL, {k: v.detach().to("cpu", copy=True).contiguous()
                                    for k, v in engine.module.state_dict().items()})
    scheduler: dict[str, torch.Tensor] = {}
    doc = {
        "format": STATE_FORMAT, "version": STATE_VERSION, "world": world, "zero_stage": zero_stage(engine),
        "head": head_config, "client": client_state,
        "engine": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                   "skipped_steps": int(engine.skipped_steps)},
        "lr_scheduler": encode(engine.lr_scheduler.state_dict(), scheduler) if engine.lr_scheduler else None,
    }
    if scheduler:
        raise TypeError("the LR schedule's state holds tensors; state.json cannot")
    atomic_write_text(tag_dir / STATE, json.dumps(doc, indent=1) + "\n")


def check_module(path: Path, saved: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
    """Refuse weights whose names or shapes are not the module's, naming the file and the first tensor."""
    want = module.state_dict()
    missing, extra = sorted(want.keys() - saved.keys()), sorted(saved.keys() - want.keys())
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which this head does not have"
        raise CheckpointError(f"{path} {what} ({len(missing)} missing, {len(extra)} extra): it was saved for "
                              f"another head; {TODO}")
    for k, v in want.items():
        if tuple(saved[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{path}: {k} has shape {tuple(saved[k].shape)}, this head's is "
                                  f"{tuple(v.shape)}: it was saved for another head config; {TODO}")


def load_engine(engine: Any, tag_dir: str | Path, rank: int, world: int) -> dict[str, Any]:
    """Every rank: restore what `save_engine` wrote (module, optimizer, LR schedule, counters); return the client
    state. In DeepSpeed's order: the module first, then the optimizer (ZeRO's fp32 master partitions from the
    file, not rounded from the module's weights)."""
    tag_dir = Path(tag_dir)
    state = read_state(tag_dir)
    if state.get("world") != world:
        raise CheckpointError(f"{tag_dir / STATE} was written by {state.get('world')} ranks, this run has {world}: "
                              "resume with the same number of processes, or start afresh with resume=none")
    stage = zero_stage(engine)
    if state.get("zero_stage") != stage:
        raise CheckpointError(f"{tag_dir / STATE} holds ZeRO-{state.get('zero_stage')} optimizer state, this run "
                              f"uses ZeRO-{stage}: resume with deepspeed=zero{state.get('zero_stage')}, or start "
                              "afresh with resume=none")
    weights = read_tensors(tag_dir / MODEL)
    check_module(tag_dir / MODEL, weights, engine.module)
    engine.module.load_state_dict(weights, strict=True)

    tensor_file, json_file = optim_files(rank)
    tensors = read_tensors(tag_dir / tensor_file)
    try:
        optim = decode(read_json(tag_dir / json_file)["optimizer"], tensors,
                       getattr(engine.optimizer, "loss_scaler", None))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{tag_dir / json_file}: not an optimizer state of this run ({exc}); {TODO}") from None
    if stage > 0:
        # DeepSpeed's ZeRO optimizers index the list by data-parallel rank; only this rank's entry is read.
        optim_list: list[Any] = [None] * world
        optim_list[rank] = optim
        engine.optimizer.load_state_dict(state_dict_list=optim_list, load_optimizer_states=True,
                                         load_from_fp32_weights=engine.zero_load_from_fp32_weights(),
                                         checkpoint_folder=None)
    else:
        engine.optimizer.load_state_dict(optim)
    if engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(decode(state["lr_scheduler"], {}))
    counters = state.get("engine") or {}
    engine.global_steps = int(counters.get("global_steps", 0))
    engine.global_samples = int(counters.get("global_samples", 0))
    engine.skipped_steps = int(counters.get("skipped_steps", 0))
    return dict(state.get("client") or {})
