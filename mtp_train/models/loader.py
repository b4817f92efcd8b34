"""Loading a target checkpoint from (sharded) safetensors onto a meta-initialised model of its family.

The model is built on the meta device (no memory, no random init), then every parameter is
assigned from the checkpoint: tensors already in the wanted dtype are taken as they come from
safetensors' memory map; the family's fused projections (e.g. q/k/v, gate/up) are concatenated
from their parts (`mtp_train.models.fusing`). A block-scaled FP8 checkpoint (`quantization_config` with
`quant_method: fp8`) has each FP8 weight dequantised to the compute dtype as it is read, with its
`weight_scale_inv` (`mtp_train.models.fp8`), before any fusing.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mtp_train.fileio import file_problem
from mtp_train.layers.attention import AttentionBackend, MLABackend
from mtp_train.layers.linear import prepack_linears
from mtp_train.models.base import CausalLM
from mtp_train.models.config import ModelArgs, ModelConfigError
from mtp_train.models.families import args_from_dir, family_of
from mtp_train.models.fp8 import BlockFP8, block_fp8, covering, dequantize, plan_fp8
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


def mtp_layer_prefixes(args: ModelArgs) -> tuple[str, ...]:
    """`model.layers.{L}.` ... `model.layers.{L+n-1}.`: the checkpoint's own MTP layers, stored after the L decoder
    layers by a family whose args declare `num_nextn_predict_layers` = n (DeepSeek-V3 / Kimi-K2); () for the rest.

    They are no part of the target (a draft head reads them: `head.init=target_mtp`), so the loaders skip them.
    """
    n = int(getattr(args, "num_nextn_predict_layers", 0) or 0)
    return tuple(f"model.layers.{args.num_layers + i}." for i in range(n))


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
    problem = file_problem(path)  # before opening: a FIFO would block the open
    if problem:
        raise ModelConfigError(f"{path} {problem}: the weights must be a safetensors file; copy, fetch or save "
                               "them again")
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
            problem = file_problem(f)
            if problem:
                raise ModelConfigError(f"{index} names {f.name}, which {problem} in {path}: copy, fetch or save "
                                       "the model again")
        return files
    if single.is_file() or os.path.lexists(single):  # something that is not a file is named, not "missing"
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


class CheckpointReader:
    """A checkpoint's tensors by name, each safetensors file opened once; FP8 weights dequantised as they are read.

    Use as a context manager (the files stay open until it exits). `names` lists the tensors a model consumes,
    file by file: every tensor but the FP8 scales, each of which is read with its weight. Opening checks the
    FP8 weights and scales against `quant` (`mtp_train.models.fp8.plan_fp8`), from the headers alone.
    """

    def __init__(self, files: Mapping[str, Path], quant: BlockFP8 | None = None,
                 source: str | Path = "checkpoint") -> None:
        self.files, self.quant = dict(files), quant
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}
        headers: dict[str, tuple[str, list[int]]] = {}
        try:
            for f, names in names_by_file(self.files).items():
                fh = self._handle_of(f)
                for name in names:
                    sl = fh.get_slice(name)
                    headers[name] = (sl.get_dtype(), list(sl.get_shape()))
            self.fp8 = plan_fp8(headers, quant, source)  # {weight: scale}
        except BaseException:
            self._stack.close()
            raise
        self.shapes = {n: tuple(shape) for n, (_, shape) in headers.items()}
        scales = set(self.fp8.values())
        self.names = [n for names in names_by_file(self.files).values() for n in names if n not in scales]

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle_of(self, f: Path) -> Any:
        if f not in self._handles:
            self._handles[f] = self._stack.enter_context(open_safetensors(f))
        return self._handles[f]

    def read(self, name: str, dtype: torch.dtype, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor `name` in `dtype`, or only its part `index` (one slice per leading dimension; nothing else is read).

        An FP8 weight's part is dequantised from its FP8 rows and columns and the scale blocks that cover them, so
        a part need not start or end on a block boundary.
        """
        fh = self._handle_of(self.files[name])
        if name not in self.fp8:
            return (fh.get_slice(name)[index] if index else fh.get_tensor(name)).to(dtype)
        assert self.quant is not None
        (bm, bn), shape = self.quant.block, self.shapes[name]
        rows, cols = (tuple(index) + (slice(None), slice(None)))[:2]
        r0, r1, step_r = rows.indices(shape[0])
        c0, c1, step_c = cols.indices(shape[1])
        assert step_r == step_c == 1, "parts are contiguous ranges"
        weight = fh.get_slice(name)[r0:r1, c0:c1]
        scale = self.fp8[name]
        blocks = self._handle_of(self.files[scale]).get_slice(scale)[covering(r0, r1, bm), covering(c0, c1, bn)]
        return dequantize(weight, blocks, (bm, bn), dtype, offset=(r0 % bm, c0 % bn))


def open_checkpoint(path: Path, args: ModelArgs, files: Mapping[str, Path] | None = None) -> CheckpointReader:
    """A `CheckpointReader` over a model folder's safetensors (or only `files`, a part of its `checkpoint_files`
    that holds each FP8 weight's scale with it), with the FP8 format of its config (if any)."""
    files = checkpoint_files(path) if files is None else files
    return CheckpointReader(files, block_fp8(args.raw, path / "config.json"), path)


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

    state: dict[str, torch.Tensor] = {}
    fused_got: dict[str, torch.Tensor] = {}  # checkpoint name → tensor, for the fused parameters
    mtp = mtp_layer_prefixes(args)  # the checkpoint's MTP layers: read by a head, never by the target
    with open_checkpoint(path, args) as ckpt:
        files = ckpt.files
        for name in ckpt.names:
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and args.tie_word_embeddings):
                continue
            if mtp and name.startswith(mtp):
                continue
            if name in fused_target:
                fused_got[name] = ckpt.read(name, dt)
                continue
            if name not in expected or name in fused_parts:
                raise ModelConfigError(f"{files[name]}: unexpected tensor {name!r} for a {args.model_type} model")
            want = tuple(expected[name].shape)
            if ckpt.shapes[name] != want:
                raise ModelConfigError(
                    f"{files[name]}: tensor {name} has shape {ckpt.shapes[name]}, config.json implies {want}"
                )
            state[name] = ckpt.read(name, dt).to(device)

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
