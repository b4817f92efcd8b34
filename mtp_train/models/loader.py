"""Loading a target checkpoint from (sharded) safetensors onto a meta-initialised model of its family.

The model is built on the meta device (no memory, no random init), then every parameter is
assigned from the checkpoint: tensors already in the wanted dtype are taken as they come from
safetensors' memory map; the family's fused projections (e.g. q/k/v, gate/up) are concatenated
from their parts (`mtp_train.models.fusing`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mtp_train.layers.attention import AttentionBackend, MLABackend
from mtp_train.layers.linear import prepack_linears
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.families import args_from_dir, family_of
from mtp_train.models.fusing import fuse, fusion_plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _checkpoint_dtype(args: ModelArgs | None) -> torch.dtype:
    name = (args.torch_dtype if args else None) or "float32"
    return DTYPES.get(str(name).replace("torch.", ""), torch.float32)


# A dtype setting → the dtype it means for a target: `auto` the checkpoint's own (float32 if it names none),
# every other name its fixed dtype.
DTYPE_NAMES: dict[str, Callable[[ModelArgs | None], torch.dtype]] = {
    "auto": _checkpoint_dtype, **{name: (lambda args, dt=dt: dt) for name, dt in DTYPES.items()}}

# checkpoint tensors that carry no weights we need
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype, args: ModelArgs | None = None) -> torch.dtype:
    """'auto' → the checkpoint's dtype (float32 if it names none); names or torch dtypes accepted."""
    if isinstance(dtype, torch.dtype):
        return dtype
    rule = DTYPE_NAMES.get(dtype)
    if rule is None:
        raise ValueError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPE_NAMES)}")
    return rule(args)


@contextlib.contextmanager
def open_safetensors(path: str | Path, device: str = "cpu") -> Iterator[Any]:
    """`safe_open(path)`, with a ModelConfigError naming the file when it is missing, truncated or not safetensors
    (the library's own error names no file)."""
    try:
        handle = safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise ModelConfigError(f"{path}: not a readable safetensors file ({exc}); it is truncated or damaged: "
                               "copy, fetch or save it again") from None
    with handle as f:
        yield f


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelConfigError(f"{index}: not a valid safetensors index ({e})") from None
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise ModelConfigError(f"{index} names {f.name}, which is missing from {path}")
        return files
    if single.is_file():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    raise ModelConfigError(
        f"no model.safetensors or model.safetensors.index.json in {path}; only safetensors checkpoints "
        "are supported (convert .bin files with transformers' save_pretrained(safe_serialization=True))"
    )


def names_by_file(files: dict[str, Path]) -> dict[Path, list[str]]:
    """{tensor name: file} → {file: its tensor names}, so that each file is opened once."""
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    return by_file


def iter_tensors(files: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) file by file, each file opened once through safetensors' mmap."""
    for f, names in names_by_file(files).items():
        with open_safetensors(f) as fh:
            for name in names:
                yield name, fh.get_tensor(name)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    backend: str = "auto",
    cpu_prepack: bool = True,
) -> CausalLM:
    """Load a Hugging Face folder (config.json + safetensors) of any supported family for inference.

    dtype: auto | float32 | bfloat16 | float16; device: where the weights go; backend: attention backend
    (auto | torch | flashinfer, as the family offers it, see `attention_for`). cpu_prepack: on CPU in float32,
    keep an MKL-packed copy of each projection for faster decode (`mtp_train.layers.linear`; doubles the weights'
    memory).
    The model is in eval mode with gradients off.
    """
    path = Path(path)
    args = args_from_dir(path)
    dt = resolve_dtype(dtype, args)
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(args)(args)
    expected = {n: p for n, p in model.named_parameters()}
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight")

    # Fused parameters and the checkpoint tensors concatenated into them, in order; every other
    # parameter is read under its own name.
    fused_parts = fusion_plan(expected, family_of(args).fusings)
    fused_target = {src: full for full, parts in fused_parts.items() for src in parts}

    files = checkpoint_files(path)
    state: dict[str, torch.Tensor] = {}
    fused_got: dict[str, torch.Tensor] = {}  # checkpoint name → tensor, for the fused parameters
    for name, tensor in iter_tensors(files):
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and args.tie_word_embeddings):
            continue
        if name in fused_target:
            fused_got[name] = tensor.to(dt)
            continue
        if name not in expected or name in fused_parts:
            raise ModelConfigError(f"{files[name]}: unexpected tensor {name!r} for a {args.model_type} model")
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ModelConfigError(
                f"{files[name]}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {want}"
            )
        state[name] = tensor.to(device=device, dtype=dt)

    for target, full in fuse(fused_got, fused_parts).items():  # a fusion with a part missing is reported below
        want = tuple(expected[target].shape)
        if tuple(full.shape) != want:
            raise ModelConfigError(
                f"{path}: {', '.join(fused_parts[target])} concatenate to {tuple(full.shape)}, config.json implies "
                f"{want}"
            )
        state[target] = full.to(device)

    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelConfigError(f"{path}: checkpoint lacks {len(missing)} tensor(s): {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    # Buffers created on meta (rotary frequencies) are recomputed on the target device.
    model.rotary = type(model.rotary)(args.rope, device=device)
    model.attn = attention_for(args, backend, device, dt, source=path)
    model.eval().requires_grad_(False)
    if cpu_prepack:
        prepack_linears(model)
    return model


def attention_for(args: ModelArgs, backend: str, device: torch.device, dtype: torch.dtype,
                  source: str | Path = "config.json") -> AttentionBackend | MLABackend:
    """The family's attention backend for a model (`Family.attention`): paged attention, or MLA for DeepSeek-V2.

    Under `auto` each family picks its fastest backend that runs here (e.g. FlashInfer on CUDA). An explicit
    backend that cannot run is a ModelConfigError naming `source` and the constraint.
    """
    try:
        return family_of(args).attention(args, backend, device, dtype)
    except ValueError as e:
        raise ModelConfigError(f"{source}: {e}") from None


def model_class(args: ModelArgs) -> type[CausalLM]:
    """The implementation of a parsed config: its family's `CausalLM` subclass."""
    return family_of(args).model
