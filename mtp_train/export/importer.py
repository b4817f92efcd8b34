"""Reading a drafter trained elsewhere (a folder in a layout an engine loads) into one of our heads, so that it can
be evaluated (`mtp-eval`), exported again or fine-tuned (`mtp-train` from the saved head).

`import_drafter(layout, folder, target_dir)` reads any registered layout that has a `Reader` (`Layout.reader`,
built with the layout in its head type's folder: z-lab's and speculators' DFlash layouts, vLLM's DSpark layout,
speculators' P-EAGLE layout, `mtp-export import_from=<layout>`). The folder holds `config.json` and
`model.safetensors` (or shards listed by `model.safetensors.index.json`); an `embed_tokens` or `lm_head` in it is
not read unless the reader keeps it (the head shares the target's, as vLLM does when they are absent). What is
generic is here: the files read and checked by name, the draft layers' fields against the target's shapes (a
draft for another target is refused by name), the tensors against the head the reader's config builds, and a
draft-vocabulary lm_head that must be the target's rows. The reader says how its config.json becomes our
HeadConfig and what its head would silently change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mtp_train.export.layouts import Reader, import_layouts, layout_named
from mtp_train.fileio import file_problem, safetensors_problem
from mtp_train.heads.base import DraftHead
from mtp_train.heads.frozen import FrozenTargetParts
from mtp_train.heads.registry import new_head
from mtp_train.models.config import ModelConfigError
from mtp_train.models.families import args_from_dir

_SHARED = ("embed_tokens.", "lm_head.", "model.embed_tokens.")  # the target's, never the draft's own here


def _read_json(path: Path, what: str, todo: str) -> Any:
    """The JSON in `path`, checked to be a regular file first (a FIFO would block the read); ModelConfigError naming
    the file, what it should be (`what`) and what to do (`todo`) otherwise."""
    problem = file_problem(path)
    if problem:
        raise ModelConfigError(f"{path} {problem}: {what}; {todo}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); {todo}") from None
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}); {todo}") from None


def _tensors(folder: Path, noun: str = "DFlash", keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    todo = "copy the drafter's folder again from where it came from"
    index = folder / "model.safetensors.index.json"
    if file_problem(index) == "does not exist":
        files = ["model.safetensors"]
    else:
        weight_map = _read_json(index, "the shards' index of the drafter's weights", todo)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelConfigError(f"{index}: weight_map is not an object of file names; {todo}")
        files = sorted(set(weight_map.values()))
    out: dict[str, torch.Tensor] = {}
    missing = [name for name in files if file_problem(folder / name) == "does not exist"]
    if missing:
        raise ModelConfigError(f"{folder}: no {', '.join(missing)}: a {noun} drafter's folder holds its weights "
                               "(model.safetensors, or the shards model.safetensors.index.json names)")
    for name in files:
        problem = safetensors_problem(folder / name)  # the library's own errors name no file; a FIFO would block
        if problem:
            raise ModelConfigError(f"{folder / name} {problem}: the {noun} drafter's weights are not readable; "
                                   f"{todo}")
        with safe_open(str(folder / name), framework="pt", device="cpu") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()  # noqa: SIM118
                        if k in keep or not k.startswith(_SHARED)})
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(value: Any, key: str) -> int:
    """`value` of config.json's `key` as an int; ModelConfigError naming the key when JSON holds no integer there
    (`"16"` is text: int() would take it, and `"1,8"` would fail with a message that names nothing)."""
    if not _is_int(value):
        raise ModelConfigError(f"{key} is {json.dumps(value)}, not an integer; write an integer there")
    return value


def integers(value: Any, key: str) -> list[int]:
    """`value` of config.json's `key` as a list of ints; ModelConfigError naming the key otherwise."""
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        shown = f"[{value.replace(',', ', ')}]" if isinstance(value, str) else "[1, 8]"
        raise ModelConfigError(f"{key} is {json.dumps(value)}, not a list of integers; write a JSON list there, "
                               f"e.g. {shown}")
    return list(value)


def reader_of(layout: str) -> Reader:
    """The reader of the registered layout `layout`; a ModelConfigError naming the layouts that have one otherwise."""
    found = layout_named(layout).reader if layout in import_layouts() else None
    if found is None:
        raise ModelConfigError(f"import_from={layout}: no reader for that layout; choose one of "
                               f"{', '.join(import_layouts())}")
    return found


def import_drafter(layout: str, folder: str | Path, target_dir: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> DraftHead:
    """The drafter in `folder` in `layout` (a layout with a reader, `import_layouts()`; module docstring) as our head
    for the target in `target_dir`."""
    reader = reader_of(layout)
    noun = reader.noun
    folder = Path(folder)
    cfg_file = folder / "config.json"
    cfg = _read_json(cfg_file, f"head_ckpt is a {noun} drafter's folder here ({reader.origin}'s layout: "
                     "config.json and model.safetensors as plain files)",
                     "restore it from where the drafter came from")
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{cfg_file}: a JSON {type(cfg).__name__}, not an object; restore it from where the "
                               "drafter came from")
    if not reader.recognises(cfg):
        other = [name for name in import_layouts() if name != layout and reader_of(name).recognises(cfg)]
        raise ModelConfigError(f"{cfg_file}: no {reader.expected} ({reader.origin}'s {noun} layout)"
                               + (f"; this folder is read with import_from={other[0]}" if other else ""))
    layer = (cfg.get(reader.layer_key) or {}) if reader.layer_key else cfg
    sliding = [t for t in layer.get("layer_types") or [] if t != "full_attention"]
    if sliding or (cfg.get("dflash_config") or {}).get("use_swa") or layer.get("attention_bias"):
        raise ModelConfigError(f"{folder}: draft layers with sliding windows or attention bias; ours are full "
                               "attention without bias")
    args = args_from_dir(target_dir)
    theirs = {k: layer.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "intermediate_size")}
    ours = {"hidden_size": args.hidden_size, "num_attention_heads": args.num_heads,
            "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim,
            "intermediate_size": args.intermediate_size}
    off = {k: (theirs[k], v) for k, v in ours.items() if theirs[k] is not None and theirs[k] != v}
    if off:
        raise ModelConfigError(f"{folder}: a {noun} drafter of other shapes than the target {target_dir} "
                               f"(draft, target): {off}")
    tensors = _tensors(folder, noun, reader.keep)
    try:
        head_cfg = reader.head_config(cfg, tensors)
    except ValueError as e:  # ModelConfigError naming the key, or a value HeadConfig refuses (its bounds)
        raise ModelConfigError(f"{cfg_file}: {e}") from None
    frozen = FrozenTargetParts.from_pretrained(target_dir, device=device)
    head = new_head(head_cfg, args, frozen)
    unfit = [] if reader.fit is None else reader.fit(cfg, tensors, head)
    if unfit:
        raise ModelConfigError(f"{folder}: a {noun} drafter this head would change:\n  " + "\n  ".join(unfit))
    tensors.pop("embed_tokens.weight", None)  # checked to be the target's (above): the head reads that one
    try:
        state = layout_named(layout).from_layout(tensors, head)
    except ValueError as e:  # e.g. d2t / t2d that do not describe one draft vocabulary
        raise ModelConfigError(f"{folder}: {e}") from None
    own = head.state_dict()
    problems = [f"{k}: missing" for k in sorted(own.keys() - state.keys())]
    problems += [f"{k}: not a tensor of the layout" for k in sorted(state.keys() - own.keys())]
    problems += [f"{k}: shape {tuple(state[k].shape)}, expected {tuple(own[k].shape)}"
                 for k in sorted(own.keys() & state.keys()) if state[k].shape != own[k].shape]
    if problems:
        raise ModelConfigError(f"{folder} is not a {noun} drafter for this target:\n  " + "\n  ".join(problems))
    dt = dtype or next(v for v in state.values() if v.is_floating_point()).dtype
    head.load_state_dict({k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()})
    head.attach(frozen.to(device=device, dtype=dt))
    if "lm_head.weight" in reader.keep and "lm_head.weight" in tensors and not reader.trained_lm_head:
        _check_lm_head_rows(folder, tensors["lm_head.weight"], head)
    return head.to(device=device, dtype=dt).eval()


def _check_lm_head_rows(folder: Path, lm_head: torch.Tensor, head: DraftHead) -> None:
    """Refuse a draft-vocabulary lm_head that is not the target's rows of those tokens: our head drafts through the
    target's frozen lm_head, so a trained one would silently be replaced."""
    rows = head.lm_head_weight().detach().to("cpu", torch.float32)
    theirs = lm_head.to(torch.float32)
    tol = 1e-2 if lm_head.dtype in (torch.bfloat16, torch.float16) else 1e-5  # the target's rows rounded to 16 bits
    if theirs.shape != rows.shape or not torch.allclose(theirs, rows, rtol=tol, atol=tol):
        raise ModelConfigError(f"{folder}: lm_head.weight is not the target's rows of the draft vocabulary (a "
                               "trained lm_head); our head drafts through the target's frozen lm_head and cannot "
                               "hold it")
