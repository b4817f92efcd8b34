"""Block-scaled FP8 checkpoints (DeepSeek-V3, Kimi-K2, Qwen3-FP8 releases), dequantised to the compute dtype on load.

The layout, as transformers' fine-grained FP8 integration reads it (`FineGrainedFP8Config`, `FP8Linear`):

- config.json `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [bm, bn]}` (bm = bn = 128 in the releases; an absent block size means 128 × 128);
- each quantized projection weight W (out, in) is stored as float8_e4m3fn, next to `<module>.weight_scale_inv`
  of shape (ceil(out / bm), ceil(in / bn)), float32 (`scale_fmt: "float"`) or powers of two (`"ue8m0"`: float32,
  float8_e8m0fnu or the exponent bytes as uint8);
- the real weight is W[i, j] · scale_inv[i // bm, j // bn]; the blocks at the right and bottom edges are partial.

Embeddings, norms, routers, lm_head and the modules of `modules_to_not_convert` are stored unquantized without a
scale. Which tensors are quantized is read from the tensors themselves (an FP8 dtype together with its scale), so
the skip list never needs interpreting. Activations are not quantized here: the weights are dequantised once at
load and the model runs in its compute dtype (what transformers does with `dequantize=True`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtp_train.models.config import ModelConfigError

SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" → "<module>.weight_scale_inv"
WEIGHT_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn, the one element format read (`fmt: e4m3`)
SCALE_DTYPES = {"float": ("F32", "BF16", "F16"), "ue8m0": ("F32", "F8_E8M0", "U8")}
DEFAULT_BLOCK = (128, 128)  # transformers' default when weight_block_size is absent


@dataclass(frozen=True)
class BlockFP8:
    """The quantization of a block-scaled FP8 checkpoint, from its `quantization_config`."""

    block: tuple[int, int]  # (bm, bn): rows and columns of weight each scale covers
    scale_fmt: str = "float"  # float | ue8m0 (power-of-two scales)

    def grid(self, shape: Sequence[int]) -> tuple[int, int]:
        """The scale grid of a weight of `shape` (out, in): (ceil(out / bm), ceil(in / bn))."""
        return -(-shape[0] // self.block[0]), -(-shape[1] // self.block[1])


def block_fp8(cfg: Mapping[str, Any], source: str | Path) -> BlockFP8 | None:
    """The FP8 format of a config.json dict, None when it has no `quantization_config`.

    Anything else than block-scaled e4m3 with dynamic activations is a ModelConfigError naming the key.
    """
    q = cfg.get("quantization_config")
    if q is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(q, dict):
        raise ModelConfigError(f"{where} must be a JSON object, found {type(q).__name__}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelConfigError(
            f"{where}.quant_method={method!r} cannot be loaded: the quantized checkpoints read are block-scaled FP8 "
            "(quant_method 'fp8', dequantised on load); use the unquantized release of this model")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelConfigError(f"{where}.fmt={fmt!r} is not supported (only 'e4m3', float8_e4m3fn weights)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelConfigError(f"{where}.activation_scheme={scheme!r} is not supported (only 'dynamic': the "
                               "static scheme's per-tensor activation scales have no equivalent in a "
                               "dequantised model)")
    block = q.get("weight_block_size", list(DEFAULT_BLOCK))
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelConfigError(f"{where}.weight_block_size={block!r} is not supported: expected two positive "
                               "integers [rows, columns] (per-tensor scales, null, are not read)")
    scale_fmt = q.get("scale_fmt", "float")
    if scale_fmt not in SCALE_DTYPES:
        raise ModelConfigError(f"{where}.scale_fmt={scale_fmt!r} is not supported (choose "
                               f"{' or '.join(SCALE_DTYPES)})")
    return BlockFP8((block[0], block[1]), scale_fmt)


def scale_name(weight: str) -> str:
    """The scale tensor that goes with FP8 weight `weight` ("x.weight" → "x.weight_scale_inv")."""
    return weight + SCALE_SUFFIX


def plan_fp8(headers: Mapping[str, tuple[str, Sequence[int]]], quant: BlockFP8 | None,
             source: str | Path) -> dict[str, str]:
    """{FP8 weight name: its scale's name} for a checkpoint, after checking every pair against `quant`.

    headers: {tensor name: (safetensors dtype name, shape)} of the whole checkpoint. A ModelConfigError names the
    tensor (and the config key) for: FP8 tensors or scales without a quantization_config, an FP8 weight without
    its scale, a scale without its weight or next to an unquantized one, an element or scale dtype the format
    does not have, and a scale grid that `weight_block_size` does not imply.
    """
    scales = {n for n in headers if n.endswith(".weight" + SCALE_SUFFIX)}
    fp8 = sorted(n for n, (dt, _) in headers.items() if dt.startswith("F8") and n not in scales)
    if quant is None:
        if fp8 or scales:
            name = fp8[0] if fp8 else sorted(scales)[0]
            raise ModelConfigError(f"{source}: tensor {name} ({headers[name][0]}) is block-scaled FP8, but "
                                   "config.json has no quantization_config; restore the checkpoint's config.json")
        return {}
    for s in sorted(scales):
        w = s[: -len(SCALE_SUFFIX)]
        if w not in headers:
            raise ModelConfigError(f"{source}: scale {s} has no weight {w} in the checkpoint")
        if not headers[w][0].startswith("F8"):
            raise ModelConfigError(f"{source}: {w} has a scale {s} but is stored as {headers[w][0]}, not "
                                   f"{WEIGHT_DTYPE} (quantization_config.fmt 'e4m3')")
    pairs: dict[str, str] = {}
    for w in fp8:
        dt, shape = headers[w]
        if dt != WEIGHT_DTYPE:
            raise ModelConfigError(f"{source}: {w} is stored as {dt}; quantization_config.fmt 'e4m3' stores "
                                   f"{WEIGHT_DTYPE} (float8_e4m3fn)")
        s = scale_name(w)
        if s not in headers:
            raise ModelConfigError(f"{source}: {w} is {WEIGHT_DTYPE} but the checkpoint lacks its scale {s}")
        if len(shape) != 2:
            raise ModelConfigError(f"{source}: {w} has shape {tuple(shape)}; block-scaled FP8 weights are "
                                   "2-D (out, in)")
        sdt, sshape = headers[s]
        if sdt not in SCALE_DTYPES[quant.scale_fmt]:
            raise ModelConfigError(f"{source}: scale {s} is stored as {sdt}; quantization_config.scale_fmt "
                                   f"{quant.scale_fmt!r} stores {' / '.join(SCALE_DTYPES[quant.scale_fmt])}")
        want = quant.grid(shape)
        if tuple(sshape) != want:
            implied = [-(-n // max(g, 1)) for n, g in zip(shape, sshape)] if len(sshape) == 2 else "?"
            raise ModelConfigError(
                f"{source}: scale {s} has shape {tuple(sshape)}, but quantization_config.weight_block_size "
                f"{list(quant.block)} implies {want} for {w} {tuple(shape)} (the scales suggest blocks of about "
                f"{implied}); the config's block size does not match the tensors")
        pairs[w] = s
    return pairs


def covering(lo: int, hi: int, block: int) -> slice:
    """The blocks (of `block` rows) that cover rows [lo, hi): [lo // block, ceil(hi / block))."""
    return slice(lo // block, -(-hi // block))


def scales_as_float(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32; ue8m0 exponent bytes (uint8) are 2 ** (byte - 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
               offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """weight.float() · its block's scale, cast to `dtype`, one block row at a time.

    weight: (r, c) float8_e4m3fn, rows [r0, r0 + r) and columns [c0, c0 + c) of a stored weight (all of it, or a
    tensor-parallel rank's part); scale: the blocks covering that part (`covering` on both dimensions, or the whole
    grid for the whole weight); offset: (r0 % bm, c0 % bn), where the part starts inside its first block.
    Returns (r, c) in `dtype`. Only one block row is ever held in float32, so a weight costs its output plus a
    strip, never a float32 copy.
    """
    bm, bn = block
    r, c = weight.shape
    orow, ocol = offset
    s = scales_as_float(scale)
    s_cols = s.repeat_interleave(bn, dim=1)[:, ocol:ocol + c]  # (blocks covering the rows, c)
    out = torch.empty(r, c, dtype=dtype, device=weight.device)
    for g in range(s.shape[0]):
        lo, hi = max(0, g * bm - orow), min(r, (g + 1) * bm - orow)
        if lo < hi:
            out[lo:hi] = (weight[lo:hi].float() * s_cols[g]).to(dtype)
    return out
