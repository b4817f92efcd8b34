"""Every CLI on a catalogue of bad inputs: exit code 2, one line naming the file, line or key and what to do, and
nothing written (or rewritten) in the output.

The commands run in this process through their console entry points (`main()` with `sys.argv` set, Hydra and
all), on a tiny random Llama with a small byte-level BPE tokenizer and a ChatML template built here, so that no
real model is needed. A finished precompute folder and a saved head of that target serve the later stages.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtp_train.fileio import lock_path, output_lock
from tests.conftest import TOPICS, make_chat_target

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def _chat(i: int, topic: str) -> dict:
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about {topic}."},
                                        {"role": "assistant", "content": f"Here is a fact about {topic}."}]}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_cli(module: str, args: list[str], capsys=None) -> Result:
    """Run `mtp-<module>` in this process as its console script does; (exit code, stdout, stderr), the latter two
    captured with `capsys` when given (else left to pytest and returned empty)."""
    import importlib

    main = importlib.import_module(f"mtp_train.cli.{module}").main
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # Hydra reconfigures logging for the job
    argv = sys.argv
    sys.argv = [f"mtp-{module}", *args]
    if capsys is not None:
        capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
        root.handlers[:] = handlers
        root.setLevel(level)
    if capsys is None:
        return Result(code, "", "")
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def tree(path: Path) -> dict[str, bytes] | None:
    """Every file under `path` with its bytes (None when `path` does not exist)."""
    if not path.exists():
        return None
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------------------- set-up


@dataclass
class World:
    root: Path
    target: Path  # tiny chat target
    data: Path  # good conversations
    pc: Path  # finished precompute folder of `target`, made by mtp-precompute
    head: Path  # a head saved for `target`


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("bad_inputs")
    target = make_chat_target(root / "target")
    data = _jsonl(root / "convs.jsonl", [_chat(i, t) for i, t in enumerate(TOPICS)])
    pc = root / "pc"
    res = run_cli("precompute", [f"model.path={target}", f"data.paths=[{data}]", f"out={pc}", "max_seq_len=64",
                                 "shard_tokens=64", "val_fraction=0", "progress=false", "model.device=cpu"])
    assert res.code == 0, res.err[-3000:]
    assert len(json.loads((pc / "manifest.json").read_text())["shards"]) >= 3

    from mtp_train.config import HeadConfig
    from mtp_train.heads import build_head, save_head
    from mtp_train.models.fingerprint import weights_fingerprint

    head = root / "head"
    save_head(build_head(HeadConfig(type="mtp"), target), head, target_fingerprint=weights_fingerprint(target))
    return World(root, target, data, pc, head)


# ------------------------------------------------------------------------------------------------ the catalogue
#
# Each case: (command, overrides, how to prepare the inputs, fragments the error line must hold). `prepare(w, tmp)`
# returns the output path the command is pointed at (its state is compared before and after) and the overrides
# that depend on the case's files. {tmp}, {target}, {pc}, ... in the fragments are filled in.

Prepare = Callable[[World, Path], tuple[Path, list[str]]]


def _fresh(module: str) -> Prepare:
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        out = tmp / ("out.jsonl" if module == "regenerate" else "out")
        return out, []
    return prepare


def _data(rows: list, name: str = "bad.jsonl", module: str = "precompute", out_from: str | None = None,
          skip: bool = False) -> Prepare:
    """Conversations `rows` as the data; the output is fresh, or a copy of the finished folder (`out_from="pc"`)."""
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        path = _jsonl(tmp / name, rows)
        if out_from == "pc":
            out = tmp / "pc"
            shutil.copytree(w.pc, out)
        else:
            out = tmp / ("out.jsonl" if module == "regenerate" else "out")
        return out, [f"data.paths=[{path}]"] + (["data.on_bad_row=skip"] if skip else [])
    return prepare


def _broken_copy(name: str, key: str, damage: Callable[[Path], None]) -> Prepare:
    """A copy of the world's `name` folder, damaged, passed as `key=<copy>`."""
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        folder = tmp / name
        shutil.copytree(getattr(w, name), folder)
        damage(folder)
        return tmp / "out", [f"{key}={folder}"]
    return prepare


def _broken_target(damage: Callable[[Path], None]) -> Prepare:
    return _broken_copy("target", "model.path", damage)


def _broken_pc(damage: Callable[[Path, dict], None]) -> Prepare:
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        pc = tmp / "pc"
        shutil.copytree(w.pc, pc)
        damage(pc, json.loads((pc / "manifest.json").read_text()))
        return tmp / "out", [f"data.dir={pc}"]
    return prepare


def _broken_head(damage: Callable[[Path], None]) -> Prepare:
    return _broken_copy("head", "head_ckpt", damage)


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip_tail(path: Path, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) - n, len(data)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _shard(pc: Path, manifest: dict, k: int = 1) -> Path:
    return pc / manifest["shards"][k]["file"]


def _foreign_manifest(pc: Path, manifest: dict) -> None:
    """The manifest of another precompute run (other samples, same shard names)."""
    other = json.loads(json.dumps(manifest))
    for s in other["shards"]:
        s["sha256"], s["bytes"] = "0" * 64, s["bytes"] + 8
    (pc / "manifest.json").write_text(json.dumps(other))


def _hybrid_into_pc(w: World, tmp: Path) -> tuple[Path, list[str]]:
    """data.source=hybrid pointed at (a copy of) the finished folder mtp-precompute wrote."""
    pc = tmp / "pc"
    shutil.copytree(w.pc, pc)
    return tmp / "out", [f"data.dir={pc}", f"data.paths=[{w.data}]"]


GOOD = _chat(0, "the moon")
SURROGATE = ('{"id": "s", "messages": [{"role": "user", "content": "x \\ud800 y"}, '
             '{"role": "assistant", "content": "ok"}]}')
CUT = '{"id": "cut", "messages": [{"role": "user", "content": "hello"}'
HOLDS_LOCK = "holds-lock"  # a marker in a case's fragments: the test holds the output's lock while it runs
MISTYPED = "models/smollm2-135m-instrcut"  # a model.path typo next to the default folder, never to be fetched

PRECOMPUTE = ["max_seq_len=64", "shard_tokens=64", "val_fraction=0", "progress=false", "model.device=cpu"]
REGENERATE = ["max_new_tokens=4", "progress=false", "model.device=cpu", "model.kv_cache_gb=0.01"]
TRAIN = ["wandb.mode=disabled", "train.progress=false", "model.device=cpu", "model.backend=torch",
         "spec_eval.prompts=[]", "train.max_steps=2", "train.micro_batch_tokens=256", "train.eval_batches=0",
         "train.save_every=0"]

CASES: dict[str, tuple[str, list[str], Prepare, list[str]]] = {
    # --- settings: keys the schema lacks (with or without Hydra's `+`), values out of range, unknown choices
    "precompute-plus-unknown-key": ("precompute", ["+foo=1"], _fresh("precompute"), ["unknown config key `foo`"]),
    "precompute-plus-typo": ("precompute", ["+max_seq_lenn=3"], _fresh("precompute"),
                             ["`max_seq_lenn`", "did you mean `max_seq_len`"]),
    "precompute-typo": ("precompute", ["max_seq_lenn=3"], _fresh("precompute"), ["did you mean `max_seq_len`"]),
    "precompute-negative-limit": ("precompute", ["limit=-1"], _fresh("precompute"), ["limit=-1", "positive"]),
    "precompute-zero-window": ("precompute", ["window=0"], _fresh("precompute"), ["window=0", "positive integer"]),
    "precompute-unknown-model-choice": ("precompute", ["model=smollm3"], _fresh("precompute"),
                                        ["conf/model/smollm3.yaml", "did you mean `model=smollm2-135m`"]),
    "regenerate-plus-typo": ("regenerate", ["+max_new_token=3"], _fresh("regenerate"),
                             ["did you mean `max_new_tokens`"]),
    "regenerate-negative-limit": ("regenerate", ["limit=-3"], _fresh("regenerate"), ["limit=-3"]),
    "train-plus-typo": ("train", ["+train.max_step=3"], _fresh("train"), ["did you mean `train.max_steps`"]),
    "train-typo": ("train", ["train.max_stepz=3"], _fresh("train"), ["did you mean `train.max_steps`"]),
    "train-negative-max-steps": ("train", ["train.max_steps=-1"], _fresh("train"),
                                 ["train.max_steps=-1", "positive integer"]),
    "train-negative-max-seconds": ("train", ["train.max_seconds=-5"], _fresh("train"),
                                   ["train.max_seconds=-5", "0 (no wall-clock limit) or more"]),
    "export-plus-typo": ("export", ["+formatt=native"], _fresh("export"), ["did you mean `format`"]),
    "eval-plus-unknown-key": ("eval", ["+kk=3"], _fresh("eval"), ["unknown config key `kk`"]),
    "eval-negative-limit": ("eval", ["limit=-2"], _fresh("eval"), ["limit=-2"]),
    # --- data rows
    "precompute-lone-surrogate": ("precompute", [], _data([GOOD, SURROGATE]), ["bad.jsonl:2: invalid_text",
                                                                               "lone surrogate"]),
    "precompute-cut-line": ("precompute", [], _data([GOOD, CUT]), ["bad.jsonl:2: invalid_json",
                                                                   f"at column {len(CUT) + 1}"]),
    "precompute-missing-data": ("precompute", ["data.paths=[{tmp}/nope.jsonl]"], _fresh("precompute"),
                                ["nope.jsonl"]),
    "regenerate-lone-surrogate": ("regenerate", [], _data([GOOD, SURROGATE], module="regenerate"),
                                  ["bad.jsonl:2: invalid_text"]),
    # A failed re-run into a finished folder leaves its config.yaml (and everything else) as it was.
    "precompute-rerun-with-a-bad-row": ("precompute", [], _data([GOOD, CUT], out_from="pc"),
                                        ["bad.jsonl:2: invalid_json"]),
    # --- targets
    "precompute-mistyped-model-path": ("precompute", [f"model.path={{tmp}}/{MISTYPED}"], _fresh("precompute"),
                                       [MISTYPED, "does not exist", "mtp-model fetch smollm2-135m --out"]),
    "train-mistyped-model-path": ("train", [f"model.path={{tmp}}/{MISTYPED}"], _fresh("train"),
                                  [MISTYPED, "mtp-model fetch smollm2-135m --out"]),
    "precompute-cut-target-config": ("precompute", [], _broken_target(lambda t: _cut(t / "config.json")),
                                     ["target/config.json: invalid JSON at line", "column"]),
    "precompute-truncated-target-weights": ("precompute", [],
                                            _broken_target(lambda t: _cut(t / "model.safetensors", 0.3)),
                                            ["target/model.safetensors: not a readable safetensors file"]),
    "train-truncated-target-weights": ("train", [], _broken_target(lambda t: _cut(t / "model.safetensors", 0.3)),
                                       ["target/model.safetensors"]),
    # --- precompute folders at mtp-train
    "train-missing-shard": ("train", [], _broken_pc(lambda pc, m: _shard(pc, m).unlink()),
                            ["is listed in", "manifest.json but missing", "re-run precompute"]),
    "train-truncated-shard": ("train", [], _broken_pc(lambda pc, m: _cut(_shard(pc, m), 0.9)),
                              ["bytes, the manifest says", "re-run precompute"]),
    # Checked when the shard is first read (data.verify=first_open), so the run has started: see STARTED.
    "train-corrupt-shard": ("train", ["train.max_steps=50"], _broken_pc(lambda pc, m: _flip_tail(_shard(pc, m), 64)),
                            ["is corrupt: sha256", "re-run precompute"]),
    "train-corrupt-shard-in-a-worker": ("train", ["train.max_steps=50", "data.num_workers=1"],
                                        _broken_pc(lambda pc, m: _flip_tail(_shard(pc, m), 64)),
                                        ["is corrupt: sha256", "re-run precompute"]),
    "train-corrupt-shard-verified-first": ("train", ["data.verify=always"],
                                           _broken_pc(lambda pc, m: _flip_tail(_shard(pc, m), 64)),
                                           ["is corrupt: sha256"]),
    "train-foreign-manifest": ("train", [], _broken_pc(_foreign_manifest),
                               ["manifest.json does not match the shards", "another precompute run"]),
    "train-missing-precompute-folder": ("train", ["data.dir={tmp}/nowhere"], _fresh("train"),
                                        ["nowhere does not exist"]),
    # --- online and hybrid training: the data precompute would refuse, refused by the same key
    "train-online-lone-surrogate": ("train", ["data.source=online"], _data([GOOD, SURROGATE]),
                                    ["bad.jsonl:2: invalid_text"]),
    "train-online-without-conversations": ("train", ["data.source=online", "data.paths=[]"], _fresh("train"),
                                           ["data.source=online reads conversations from data.paths", "data.dir"]),
    "train-online-bad-val-fraction": ("train", ["data.source=online", "data.online.val_fraction=1"], _data([GOOD]),
                                      ["data.online.val_fraction must be in [0, 1)"]),
    "train-online-empty-model-path": ("train", ["data.source=online", "model.path=''"], _data([GOOD]),
                                      ["set model.path"]),
    "train-hybrid-into-a-precompute-folder": ("train", ["data.source=hybrid"], _hybrid_into_pc,
                                              ["pc holds a precompute folder that no hybrid run wrote",
                                               "data.source=offline"]),
    # --- heads at mtp-export
    "export-cut-head-config": ("export", [], _broken_head(lambda h: _cut(h / "config.json")),
                               ["head/config.json: invalid JSON at line", "column"]),
    "export-flipped-head-weights": ("export", [], _broken_head(lambda h: _flip_tail(h / "model.safetensors")),
                                    ["head/model.safetensors does not match the sha256 recorded in"]),
    "export-truncated-head-weights": ("export", [], _broken_head(lambda h: _cut(h / "model.safetensors")),
                                      ["head/model.safetensors has", "bytes"]),
    "export-missing-head": ("export", ["head_ckpt={tmp}/nohead"], _fresh("export"), ["not a head checkpoint"]),
    # --- a second run into an output another live run holds
    "precompute-locked": ("precompute", [], _fresh("precompute"), [HOLDS_LOCK]),
    "regenerate-locked": ("regenerate", [], _fresh("regenerate"), [HOLDS_LOCK]),
    "train-locked": ("train", [], _fresh("train"), [HOLDS_LOCK]),
}



# --- manifests that do not describe their folder (edited, or pointing elsewhere): refused on open, naming the field
# and the shard; an edited manifest is blamed, never the good shard it describes (the message says so).


def _edit_manifest(edit: Callable[[Path, dict], None]) -> Prepare:
    """A copy of the finished folder whose manifest.json `edit(folder, manifest)` has changed."""
    def damage(pc: Path, manifest: dict) -> None:
        edit(pc, manifest)
        (pc / "manifest.json").write_text(json.dumps(manifest))
    return _broken_pc(damage)


def _shard_entry(key: str, change: Callable) -> Callable[[Path, dict], None]:
    """shards[1][key] = change(old value) (and the total with it when it is a count, so only the entry is off)."""
    def edit(pc: Path, m: dict) -> None:
        old = m["shards"][1][key]
        m["shards"][1][key] = change(old)
        if key in m["totals"]:
            m["totals"][key] += m["shards"][1][key] - old
    return edit


def _outside_shard(pc: Path, m: dict) -> Path:
    """A copy of shard 1 outside the folder (as good as the shard itself)."""
    (pc.parent / "outside").mkdir()
    return Path(shutil.copy(_shard(pc, m), pc.parent / "outside"))


def _up_and_out(pc: Path, m: dict) -> None:
    """shards[1].file pointing at a good copy of the shard outside the folder, through `..`."""
    _outside_shard(pc, m)
    _shard_entry("file", lambda f: f"../outside/{f}")(pc, m)


def _link_out(pc: Path, m: dict) -> None:
    outside = _outside_shard(pc, m)
    _shard(pc, m).unlink()
    _shard(pc, m).symlink_to(outside)


def _listed_twice(pc: Path, m: dict) -> None:
    m["shards"].append(dict(m["shards"][1]))
    for key in ("samples", "tokens", "loss_tokens", "bytes"):
        m["totals"][key] += m["shards"][1][key]


def _set_key(section: str, key: str, value) -> Callable[[Path, dict], None]:
    def edit(pc: Path, m: dict) -> None:
        m[section][key] = value
    return edit


def _fp8_without_scales(w: World, tmp: Path) -> tuple[Path, list[str]]:
    """An fp8 folder made by mtp-precompute, one of whose shards was saved again without `hidden_scale` (its
    manifest entry and sidecar updated to the new file, as a tool that re-saves shards would leave them)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mtp_train.fileio import sha256_file

    pc = tmp / "pc"
    res = run_cli("precompute", [f"model.path={w.target}", f"data.paths=[{w.data}]", f"out={pc}", *PRECOMPUTE,
                                 "hidden_dtype=float8_e4m3"])
    assert res.code == 0
    manifest = json.loads((pc / "manifest.json").read_text())
    path = _shard(pc, manifest)
    with safe_open(str(path), framework="pt") as f:
        names = f.keys()
        tensors = {k: f.get_tensor(k).clone() for k in names if k != "hidden_scale"}
        meta = f.metadata()
    save_file(tensors, str(path), metadata=meta)
    entry = manifest["shards"][1]
    manifest["totals"]["bytes"] += path.stat().st_size - entry["bytes"]
    entry["sha256"], entry["bytes"] = sha256_file(path), path.stat().st_size
    (pc / "manifest.json").write_text(json.dumps(manifest))
    side = path.with_suffix(".json")
    side.write_text(json.dumps({**json.loads(side.read_text()), "sha256": entry["sha256"], "bytes": entry["bytes"]}))
    return tmp / "out", [f"data.dir={pc}"]


RESTORE = "restore this folder's own manifest.json, or re-run mtp-precompute on {tmp}/pc"
CASES.update({
    "train-manifest-shard-up-and-out": (
        "train", [], _edit_manifest(_up_and_out),
        ["{tmp}/pc/manifest.json: shards[1].file '../outside/shard-r0-00001.safetensors' leads out of the folder",
         RESTORE]),
    "train-manifest-absolute-shard": (
        "train", [], _edit_manifest(_shard_entry("file", lambda f: "/etc/hostname")),
        ["{tmp}/pc/manifest.json: shards[1].file '/etc/hostname' is an absolute path", RESTORE]),
    "train-manifest-shard-links-out": (
        "train", [], _broken_pc(_link_out),
        ["{tmp}/pc/shard-r0-00001.safetensors (shards[1] of {tmp}/pc/manifest.json) is a link leading outside",
         "{tmp}/outside/shard-r0-00001.safetensors", "re-run mtp-precompute on {tmp}/pc with overwrite=true"]),
    "train-manifest-shard-listed-twice": (
        "train", [], _edit_manifest(_listed_twice),
        ["'shard-r0-00001.safetensors' is listed twice (shards[1] and shards[", RESTORE]),
    "train-manifest-edited-total-tokens": (
        "train", [], _edit_manifest(lambda pc, m: _set_key("totals", "tokens", m["totals"]["tokens"] + 7)(pc, m)),
        ["{tmp}/pc/manifest.json: totals.tokens is", "the sum of shards[*].tokens", RESTORE]),
    "train-manifest-edited-shard-tokens": (
        "train", [], _edit_manifest(_shard_entry("tokens", lambda n: n + 3)),
        ["{tmp}/pc/manifest.json lists shard-r0-00001.safetensors with tokens=", "header and sidecar say",
         "the shard is not at fault", RESTORE]),
    "train-manifest-edited-hidden-size": (
        "train", [], _edit_manifest(_set_key("target", "hidden_size", 48)),
        ["{tmp}/pc/manifest.json: target.hidden_size is 48, but {tmp}/pc/shard-r0-00000.safetensors holds hidden "
         "states of width 32", "the shard is not at fault", RESTORE]),
    "train-manifest-dtype-the-shards-lack": (
        "train", [], _edit_manifest(_set_key("hidden", "dtype", "float8_e4m3fn")),
        ["{tmp}/pc/manifest.json: hidden.dtype is float8_e4m3fn, but {tmp}/pc/shard-r0-00000.safetensors holds "
         "bfloat16 hidden states", RESTORE]),
    "train-manifest-aux-layers-the-shards-lack": (
        "train", [], _edit_manifest(_set_key("hidden", "aux_layers", [1])),
        ["{tmp}/pc/manifest.json: hidden.aux_layers is [1], but {tmp}/pc/shard-r0-00000.safetensors holds aux "
         "layers []", RESTORE]),
    "train-fp8-shard-without-its-scales": (
        "train", [], _fp8_without_scales,
        ["{tmp}/pc/shard-r0-00001.safetensors is not a shard of the format: it holds no `hidden_scale` tensor "
         "(the per-token scales of its float8_e4m3fn hidden states)", "re-run precompute"]),
})

# --- an `out` holding another tool's output or unrelated files, values of the wrong type, edited heads


def _out_file(name: str = "notes.txt", text: str = "a note without a final newline") -> Prepare:
    """`out` is an existing file of the user's."""
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        out = tmp / name
        out.write_text(text)
        return out, []
    return prepare


def _out_folder(files: dict[str, str]) -> Prepare:
    """`out` is an existing folder holding `files` (name → text); {} for an empty one."""
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        out = tmp / "out"
        out.mkdir()
        for name, text in files.items():
            (out / name).write_text(text)
        return out, []
    return prepare


def _out_data_file(w: World, tmp: Path) -> tuple[Path, list[str]]:
    """mtp-regenerate pointed at (a copy of) its own input conversations."""
    return Path(shutil.copy(w.data, tmp / "convs.jsonl")), []


def _train_into_its_data_dir(w: World, tmp: Path) -> tuple[Path, list[str]]:
    pc = tmp / "pc"
    shutil.copytree(w.pc, pc)
    return pc, [f"data.dir={pc}"]


def _rerun_with_data(name: str, text: str | None) -> Prepare:
    """A re-run into (a copy of) the finished folder with data.paths=[{tmp}/name] (`text` None: no such file)."""
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        out = tmp / "pc"
        shutil.copytree(w.pc, out)
        if text is not None:
            (tmp / name).write_text(text)
        return out, [f"data.paths=[{tmp / name}]"]
    return prepare


def _two_arrays(w: World, tmp: Path, first: list | None = None) -> tuple[Path, list[str]]:
    path = tmp / "two.json"
    path.write_text(json.dumps([GOOD] if first is None else first) + "\n" + json.dumps([_chat(1, "tea")]) + "\n")
    return tmp / "out", [f"data.paths=[{path}]"]


def _edited_head(edit: Callable[[dict, dict], None], *, draft_vocab: int = 0, out_from_head: bool = False,
                 resign: bool = True) -> Prepare:
    """A copy of a saved head (with a draft vocabulary of `draft_vocab` ids) whose config.json and tensors
    `edit(config, tensors)` changed; `resign`: its recorded checksums updated to match, as a hostile edit would.
    `out_from_head`: the edited copy is the `out` of an export of the world's head."""
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        from safetensors.torch import load_file, save_file

        from mtp_train.config import HeadConfig
        from mtp_train.heads import build_head, save_head
        from mtp_train.heads.checkpoint import config_digest, file_checksums

        head = tmp / "head"
        if draft_vocab:
            save_head(build_head(HeadConfig(type="mtp", draft_vocab_size=draft_vocab), w.target), head)
        else:
            shutil.copytree(w.head, head)
        config = json.loads((head / "config.json").read_text())
        tensors = load_file(str(head / "model.safetensors"))
        edit(config, tensors)
        save_file(tensors, str(head / "model.safetensors"), metadata={"format": "pt"})
        if resign:
            config["files"] = file_checksums(head, ["model.safetensors"])
            config["config_sha256"] = config_digest(config)
        (head / "config.json").write_text(json.dumps(config))
        if out_from_head:
            return head, []
        return tmp / "out", [f"head_ckpt={head}"]
    return prepare


def _set_draft_vocab(ids: Callable[[int], list[int]]) -> Callable[[dict, dict], None]:
    def edit(config: dict, tensors: dict) -> None:
        import torch

        tensors["draft_vocab"] = torch.tensor(ids(config["dims"]["vocab_size"]), dtype=torch.long)
    return edit


def _set_head(key: str, value) -> Callable[[dict, dict], None]:
    def edit(config: dict, tensors: dict) -> None:
        config["head"][key] = value
    return edit


NOT_OURS = "writes only into a new or empty folder or into its own earlier output"
CASES.update({
    # Nothing lost: an `out` that holds something else is refused before it is touched.
    "regenerate-out-an-unrelated-line": ("regenerate", [], _out_file(),
                                         ["notes.txt:1 is not a record of mtp-regenerate (line without a newline)",
                                          "choose another `out`"]),
    "regenerate-out-its-own-input": ("regenerate", [], _out_data_file,
                                     ["convs.jsonl:1 is not a record of mtp-regenerate (no provenance)"]),
    "regenerate-out-a-folder": ("regenerate", [], _out_folder({}), ["out={tmp}/out is a folder"]),
    "precompute-out-a-file": ("precompute", [], _out_file("out"), ["out={tmp}/out is a file"]),
    "train-out-a-file": ("train", [], _out_file("out"), ["out={tmp}/out is a file"]),
    "eval-out-a-file": ("eval", [], _out_file("out"), ["out={tmp}/out is a file"]),
    "export-out-a-file": ("export", [], _out_file("out"), ["out={tmp}/out is a file"]),
    "train-out-its-data-dir": ("train", [], _train_into_its_data_dir,
                               ["out={tmp}/pc holds the output of mtp-precompute", NOT_OURS]),
    "eval-out-an-unrelated-folder": ("eval", [], _out_folder({"notes.txt": "mine"}),
                                     ["out={tmp}/out holds files that no mtp command wrote", NOT_OURS]),
    "precompute-out-a-train-run": ("precompute", [], _out_folder({"metrics.jsonl": "{}\n"}),
                                   ["holds the output of mtp-train"]),
    "export-into-another-heads-export": ("export", [], _edited_head(lambda c, t: c.update(num_params=1),
                                                                     out_from_head=True),
                                         ["holds an export of another head than", "choose another `out`"]),
    "precompute-rerun-with-a-missing-file": ("precompute", [], _rerun_with_data("nope.jsonl", None),
                                             ["nope.jsonl"]),
    "precompute-rerun-with-an-unknown-suffix": ("precompute", [], _rerun_with_data("convs.txt", "hello\n"),
                                                ["convs.txt"]),
    "precompute-json-two-arrays": ("precompute", [], _two_arrays,
                                   ["two.json:2: invalid_json: text after the closing ] of the file's array"]),
    "precompute-json-empty-array-then-another": ("precompute", [], lambda w, tmp: _two_arrays(w, tmp, []),
                                                 ["two.json:2: invalid_json: text after the closing ] of the "
                                                  "file's array"]),
    "demo-out-a-precompute-folder": ("demo", [], lambda w, tmp: (_train_into_its_data_dir(w, tmp)[0], []),
                                     ["out={tmp}/pc holds the output of mtp-precompute", NOT_OURS]),
    "demo-out-an-unrelated-folder": ("demo", [], _out_folder({"notes.txt": "mine"}),
                                     ["out={tmp}/out holds files that no mtp command wrote", NOT_OURS]),
    "demo-out-a-file": ("demo", [], _out_file("out"), ["out={tmp}/out is a file, but mtp-demo writes a folder"]),
    "demo-locked": ("demo", [], _fresh("demo"), [HOLDS_LOCK]),
    # Every stage's settings are composed before anything is written: a prompt set that does not exist, or a
    # misspelt key in the last stage's list, is refused before the first stage runs.
    "demo-unknown-prompt-set": ("demo", ["data=demo-6400"], _fresh("demo"),
                                ["the regenerate stage does not compose", "Could not find 'data/demo-6400'",
                                 "demo-640", "data="]),
    "demo-misspelt-key-in-a-later-stage": ("demo", ["export=[formatt=native]"], _fresh("demo"),
                                           ["the export stage does not compose", "Could not override 'formatt'",
                                            "export=[...]"]),
    "eval-locked": ("eval", [], _fresh("eval"), [HOLDS_LOCK]),
    "export-locked": ("export", [], _fresh("export"), [HOLDS_LOCK]),
    # Values of the wrong type, named with the type the key takes.
    "train-max-steps-not-an-integer": ("train", ["train.max_steps=abc"], _fresh("train"),
                                       ["`train.max_steps=abc`", "takes an integer"]),
    "train-data-paths-not-a-list": ("train", ["data.paths=notalist"], _fresh("train"),
                                    ["`data.paths=notalist`", "takes a list"]),
    # Heads: the checksum covers config.json; what it says is checked against the weights.
    "export-head-config-edited": ("export", [], _edited_head(_set_head("init", "zeros"), resign=False),
                                  ["head/config.json does not match the config_sha256 it records"]),
    "export-unknown-head-type": ("export", [], _edited_head(_set_head("type", "medusa")),
                                 ["head/config.json: head", "'medusa'"]),
    "export-draft-vocab-negative": ("export", [], _edited_head(_set_draft_vocab(lambda v: [-1, *range(1, 16)]),
                                                               draft_vocab=16),
                                    ["head/model.safetensors: draft_vocab holds ids outside the target vocabulary"]),
    "export-draft-vocab-past-the-vocabulary": ("export", [],
                                               _edited_head(_set_draft_vocab(lambda v: [*range(15), v + 5]),
                                                            draft_vocab=16),
                                               ["draft_vocab holds ids outside the target vocabulary", "max"]),
    "export-draft-vocab-repeated": ("export", [], _edited_head(_set_draft_vocab(lambda v: [0, 0, *range(2, 16)]),
                                                               draft_vocab=16),
                                    ["head/model.safetensors: draft_vocab repeats token ids"]),
})

# Cases whose error comes once the run has started (its inputs checked, its config saved): only the files of a
# starting run may be there, no checkpoint and no head.
STARTED = {"train-corrupt-shard": {"config.yaml", "metrics.jsonl"},
           "train-corrupt-shard-in-a-worker": {"config.yaml", "metrics.jsonl"}}


# --- resuming: a run folder of another head, one in DeepSpeed's pickle format; settings that cannot train


def _trained_run(then: Callable[[Path], None] | None = None) -> Prepare:
    """A finished two-step mtp-train run (head=mtp) as the output, then `then(its checkpoint tag folder)`."""
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        out = tmp / "out"
        assert run_cli("train", _base("train", w, out)).code == 0
        if then is not None:
            then(out / "checkpoints" / "step-2")
        return out, []
    return prepare


def _as_pickle_format(tag: Path) -> None:
    """The tag folder rewritten in the layout of earlier versions (DeepSpeed's `.pt` pickles), checksums matching;
    the payload would create `planted-ran` in the run folder (which must stay as it was) if it were unpickled."""
    import torch

    from mtp_train.train.checkpoint import write_checksums

    for f in tag.iterdir():
        f.unlink()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save(_PlantedPickle(tag.parents[1] / "planted-ran"), tag / name)
    write_checksums(tag)


class _PlantedPickle:
    """Unpickling it creates `marker`: the stand-in for code planted in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


CASES.update({
    "train-resume-another-head-type": ("train", ["head=eagle1"], _trained_run(),
                                       ["checkpoints/step-2/state.json holds the state of a 'mtp' head",
                                        "head.type='eagle1'", "resume with head=mtp", "resume=none"]),
    "train-resume-pickle-format": ("train", [], _trained_run(_as_pickle_format),
                                   ["step-2/mp_rank_00_model_states.pt: a checkpoint in DeepSpeed's pickle format",
                                    "resume_trust_pickles=true", "resume=none"]),
    "train-non-finite-loss": ("train", ["optim.lr=1e30", "train.max_steps=4"], _fresh("train"),
                              ["step 2: the training loss is", "stops without saving it",
                               "lower optim.lr (now 1e+30)"]),
    "train-negative-lr": ("train", ["optim.lr=-1"], _fresh("train"), ["optim.lr=-1", "positive finite number"]),
    "train-zero-lr": ("train", ["optim.lr=0"], _fresh("train"),
                      ["optim.lr=0 is refused", "a learning rate of 0 never changes the head"]),
})
STARTED["train-non-finite-loss"] = {"config.yaml", "metrics.jsonl"}  # stopped at step 2: no checkpoint, no head


# --- nothing a user already has is destroyed: an `out` holding the head itself, another head, a finished folder
# of other settings, a run whose checkpoint marker, state or data changed, a finished evaluation


def _trained_heads(w: World, tmp: Path) -> Path:
    """heads/step-1 and heads/step-2 of a run folder as mtp-train saves them (other weights, same settings)."""
    import torch

    from mtp_train.config import HeadConfig
    from mtp_train.heads import build_head, save_head

    heads = tmp / "run" / "heads"
    for step in (1, 2):
        torch.manual_seed(step)
        save_head(build_head(HeadConfig(type="mtp"), w.target), heads / f"step-{step}", {"step": step})
        (heads / f"step-{step}" / "train_config.yaml").write_text(f"step: {step}\n")
    return heads


def _export_into_the_head(w: World, tmp: Path) -> tuple[Path, list[str]]:
    head = Path(shutil.copytree(w.head, tmp / "head"))
    return head, [f"head_ckpt={head}", "format=deepseek-mtp"]


def _export_into_another_trained_head(w: World, tmp: Path) -> tuple[Path, list[str]]:
    heads = _trained_heads(w, tmp)
    return heads / "step-1", [f"head_ckpt={heads / 'step-2'}"]


def _export_into_an_export_of_a_twin(w: World, tmp: Path) -> tuple[Path, list[str]]:
    """`out` is a native export of a head with the same settings and size as the one exported, other weights."""
    heads = _trained_heads(w, tmp)
    out = Path(shutil.copytree(heads / "step-1", tmp / "export"))
    (out / "train_config.yaml").unlink()
    return out, [f"head_ckpt={heads / 'step-2'}"]


def _rerun_pc(w: World, tmp: Path) -> tuple[Path, list[str]]:
    """A re-run of the world's precompute into (a copy of) its finished folder."""
    return Path(shutil.copytree(w.pc, tmp / "pc")), []


def _set_latest(text: str) -> Callable[[Path], None]:
    def edit(tag: Path) -> None:
        (tag.parent / "latest").write_text(text.format(tag=tag) + "\n")
    return edit


def _forge_step(tag: Path) -> None:
    """state.json edited to say step 1, its checksum recomputed (as a hostile edit would)."""
    from mtp_train.train.checkpoint import write_checksums

    state = json.loads((tag / "state.json").read_text())
    state["client"]["step"] = 1
    (tag / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    write_checksums(tag)


def _resume_on_other_data(w: World, tmp: Path) -> tuple[Path, list[str]]:
    out, _ = _trained_run()(w, tmp)
    other = shutil.copytree(w.pc, tmp / "other-pc")
    return out, [f"data.dir={other}"]


PROMPTS = ["max_new_tokens=4", "model.kv_cache_gb=0.01", "model.device=cpu"]


def _finished_eval(w: World, tmp: Path) -> tuple[Path, list[str]]:
    """A finished mtp-eval folder (method=none on one prompt); the re-run asks the same of it."""
    prompts = _jsonl(tmp / "prompts.jsonl", [{"id": "p", "prompt": "Tell me about tea."}])
    extra = [f"prompts=[{prompts}]", *PROMPTS]
    out = tmp / "out"
    assert run_cli("eval", _base("eval", w, out) + extra).code == 0
    assert (out / "report.json").is_file() and (out / "config.yaml").is_file()
    return out, extra


CASES.update({
    "export-out-is-the-head": ("export", [], _export_into_the_head,
                               ["out={tmp}/head is the head being exported (head_ckpt={tmp}/head)",
                                "would replace the head's own weights", "choose another `out`"]),
    "export-out-is-another-trained-head": ("export", [], _export_into_another_trained_head,
                                           ["out={tmp}/run/heads/step-1 holds a head saved by mtp-train "
                                            "({tmp}/run/heads/step-1/train_config.yaml beside its weights)",
                                            "choose another `out` or pass overwrite=true"]),
    "export-into-an-export-of-another-head-with-the-same-settings": (
        "export", [], _export_into_an_export_of_a_twin,
        ["out={tmp}/export holds an export of another head than {tmp}/run/heads/step-2",
         "or pass overwrite=true"]),
    "precompute-rerun-with-an-aux-layer-the-target-lacks": (
        "precompute", ["aux_layers=[99]"], _rerun_pc,
        ["aux_layers=[99]: 99 is not a layer of this target (its hidden states are 0..2"]),
    "precompute-rerun-with-other-settings": (
        "precompute", ["hidden_dtype=float16"], _rerun_pc,
        ["{tmp}/pc holds a finished precompute of other settings (hidden_dtype bfloat16, this run float16)",
         "replaces it only with overwrite=true"]),
    "train-latest-names-an-absolute-path": (
        "train", [], _trained_run(_set_latest("/elsewhere/run/checkpoints/step-2")),
        ["checkpoints/latest names '/elsewhere/run/checkpoints/step-2', which is not a checkpoint of this run",
         "the marker was edited"]),
    "train-latest-leads-up-and-out": (
        "train", [], _trained_run(_set_latest("../../other/checkpoints/step-2")),
        ["checkpoints/latest names '../../other/checkpoints/step-2', which is not a checkpoint of this run"]),
    "train-resume-on-other-data": (
        "train", [], _resume_on_other_data,
        ["{tmp}/out/checkpoints/step-2/state.json: the interrupted run read", "this run reads {tmp}/other-pc",
         "resuming would go on training on other data", "resume=none"]),
    "train-state-step-forged": (
        "train", [], _trained_run(_forge_step),
        ["{tmp}/out/checkpoints/step-2/state.json records step 1, but its folder is step-2"]),
    "eval-bad-value-into-a-finished-eval": ("eval", ["top_p=5"], _finished_eval, ["top_p must be in (0, 1]"]),
    "train-missing-spec-eval-prompts": ("train", ["spec_eval.prompts=[{tmp}/nope.jsonl]"], _fresh("train"),
                                        ["spec_eval.prompts: prompts entry '{tmp}/nope.jsonl'",
                                         "neither a file nor a data config"]),
})


# --- data a user has: an eval or a precompute folder is never replaced by a run that measures or captures other
# things, or nothing at all
DEAD = "http://127.0.0.1:9"  # nothing listens there: an endpoint that refuses every connection
CAPTURE = ["backend=vllm", f"vllm.endpoints=[{DEAD}]", "vllm.spool_dir={tmp}/shared/spool"]

CASES.update({
    "eval-no-prompts-into-a-finished-eval": ("eval", ["prompts=[]"], _finished_eval,
                                             ["prompts=[] names no prompt set", "give one or more",
                                              "prompts=[demo-heldout]"]),
    "eval-other-settings-into-a-finished-eval": (
        "eval", ["max_new_tokens=6", "seed=3"], _finished_eval,
        ["out={tmp}/out holds the report of an evaluation of other settings (", "seed 0, this run 3",
         "max_new_tokens 4, this run 6", "replaces only a report of the same settings",
         "choose another `out`, or pass overwrite=true"]),
    "precompute-vllm-into-a-finished-engine-folder": (
        "precompute", CAPTURE, _rerun_pc,
        ["{tmp}/pc holds a finished precompute of other settings (backend engine, this run vllm)",
         "replaces it only with overwrite=true"]),
    "precompute-vllm-endpoint-refused-into-a-new-folder": ("precompute", CAPTURE, _fresh("precompute"),
                                                           [f"endpoint {DEAD}"]),
})


# --- links: nothing written through one, nothing read through one that leads out of the folder


def _move_out_and_link(pc: Path, name: str) -> None:
    """`pc/name` moved outside the folder (as good as it was) and linked back."""
    (pc.parent / "outside").mkdir(exist_ok=True)
    moved = Path(shutil.move(str(pc / name), str(pc.parent / "outside" / name)))
    (pc / name).symlink_to(moved)


CASES.update({
    "train-sidecar-links-out": (
        "train", [], _broken_pc(lambda pc, m: _move_out_and_link(pc, _shard(pc, m).with_suffix(".json").name)),
        ["{tmp}/pc/shard-r0-00001.json (the sidecar of shard-r0-00001.safetensors) is a link leading outside "
         "{tmp}/pc (to {tmp}/outside/shard-r0-00001.json)", "re-run mtp-precompute on {tmp}/pc with overwrite=true"]),
    "train-manifest-links-out": (
        "train", [], _broken_pc(lambda pc, m: _move_out_and_link(pc, "manifest.json")),
        ["{tmp}/pc/manifest.json (the folder's manifest) is a link leading outside {tmp}/pc",
         "with overwrite=true"]),
})


def _base(module: str, w: World, out: Path) -> list[str]:
    if module == "demo":  # the demo's own config: the model's path, stages' overrides as lists
        return [f"model_path={w.target}", f"out={out}"]
    common = [f"model.path={w.target}", f"out={out}"]
    if module == "precompute":
        return [*common, f"data.paths=[{w.data}]", *PRECOMPUTE]
    if module == "regenerate":
        return [*common, f"data.paths=[{w.data}]", *REGENERATE]
    if module == "train":
        return [*common, f"data.dir={w.pc}", *TRAIN]
    if module == "export":
        return [*common, f"head_ckpt={w.head}"]
    return [*common, "method=none", "progress=false"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(world, tmp_path, capsys, case):
    module, overrides, prepare, fragments = CASES[case]
    out, extra = prepare(world, tmp_path)
    args = _base(module, world, out) + extra + [o.format(tmp=tmp_path) for o in overrides]
    if HOLDS_LOCK in fragments:  # the holder (this test) made the folder; the refused run must not touch it
        with output_lock(out, folder=module != "regenerate"):
            before = tree(out)
            res = run_cli(module, args, capsys)
            after = tree(out)
        fragments = [f"pid {os.getpid()} on host {socket.gethostname()}", "in use by another run"]
    else:
        before = tree(out)
        res = run_cli(module, args, capsys)
        after = tree(out)
    prog = f"mtp-{module}"
    errors = [line for line in res.err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert res.code == 2 and len(errors) == 1, (res.code, res.err[-3000:])
    assert "Traceback" not in res.err + res.out and "HYDRA_FULL_ERROR" not in res.err, res.err[-3000:]
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in errors[0], (fragment, errors[0])
    if case in STARTED:
        assert before is None and set(after or {}) <= STARTED[case], sorted(after or {})
    else:
        assert after == before, f"{out} changed"  # nothing written, nothing rewritten
    assert not (tmp_path / MISTYPED).exists() and not Path(MISTYPED).exists()  # and nothing fetched


# ------------------------------------------------------------------------------------ what `skip` skips, and locks


def test_skip_counts_text_rows_and_reports_them_on_the_console(world, tmp_path, capsys):
    """With data.on_bad_row=skip a lone surrogate is skipped and counted, text holding U+E000-U+E002 is
    precomputed, and what was left out or renamed is printed as well as recorded in the manifest."""
    pua = {"id": "pua", "messages": [{"role": "user", "content": "Icons \ue000\ue001\ue002?"},
                                     {"role": "assistant", "content": "Glyphs \ue000\ue001\ue002 here."}]}
    data = _jsonl(tmp_path / "mixed.jsonl", [GOOD, SURROGATE, pua, CUT, {**GOOD, "id": "c0"}])
    out = tmp_path / "pc"
    res = run_cli("precompute", [f"model.path={world.target}", f"data.paths=[{data}]", f"out={out}",
                                 "data.on_bad_row=skip", *PRECOMPUTE], capsys)
    assert res.code == 0, res.err[-3000:]
    recorded = json.loads((out / "manifest.json").read_text())["data"]
    assert recorded["bad_rows"] == {"invalid_text": 1, "invalid_json": 1} and recorded["samples"] == 3
    assert recorded["duplicate_ids"] == 1 and recorded["duplicate_id_examples"] == ["c0"]
    assert "2 bad row(s) skipped (invalid_json=1, invalid_text=1)" in res.out
    assert "1 duplicate id(s)" in res.out and "'c0'" in res.out

    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"id": "p", "prompt": "Tell me about tea."},
                                                  '{"id": "q", "prompt": "bad \\udfff"}'])
    res = run_cli("regenerate", [f"model.path={world.target}", f"data.paths=[{prompts}]",
                                 f"out={tmp_path / 'regen.jsonl'}", "data.on_bad_row=skip", *REGENERATE], capsys)
    assert res.code == 0, res.err[-3000:]
    assert "skipped 1: invalid_text=1" in res.out and "prompts.jsonl:2" in res.out
    assert [json.loads(line)["id"] for line in (tmp_path / "regen.jsonl").read_text().splitlines()] == ["p"]


def test_a_lock_is_released_on_exit_and_taken_over_after_its_holder_died(tmp_path, capsys):
    out = tmp_path / "run"
    with output_lock(out) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists() and out.is_dir()  # released, and removed with it
    # A holder killed with SIGKILL leaves its lock file; the kernel has dropped its flock, so the next run takes it.
    code = ("import os; from mtp_train.fileio import output_lock; "
            f"held = output_lock({str(out)!r}); held.__enter__(); os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -9 and lock_path(out).is_file()
    dead = json.loads(lock_path(out).read_text())["pid"]
    assert dead != os.getpid()
    with output_lock(out):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    # A refused run leaves no folder behind that it made for its lock.
    fresh = tmp_path / "fresh" / "run"
    with output_lock(out), pytest.raises(RuntimeError, match="boom"), output_lock(fresh):
        raise RuntimeError("boom")
    assert not (tmp_path / "fresh").exists()


@dataclass
class Planted:
    module: str
    out: Callable[[World, Path], Path]  # makes the output folder
    link: str  # the name planted in it as a link to a file of the user's outside
    extra: list[str]


def _empty(w: World, tmp: Path) -> Path:
    (tmp / "out").mkdir()
    return tmp / "out"


PLANTED = {
    "precompute-lock": Planted("precompute", lambda w, tmp: _rerun_pc(w, tmp)[0], ".lock", []),
    "precompute-tmp-config": Planted("precompute", lambda w, tmp: _rerun_pc(w, tmp)[0], ".tmp-config.yaml", []),
    "train-tmp-config": Planted("train", _empty, ".tmp-config.yaml", []),
    "train-lock": Planted("train", _empty, ".lock", []),
    "eval-tmp-config": Planted("eval", _empty, ".tmp-config.yaml", []),
    "export-tmp-model": Planted("export", _empty, ".tmp-model.safetensors", []),
    "precompute-shard": Planted("precompute", lambda w, tmp: _rerun_pc(w, tmp)[0], "shard-r0-00001.safetensors", []),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_link_is_refused_by_name_and_nothing_is_written_through_it(world, tmp_path, capsys, case):
    p = PLANTED[case]
    out = p.out(world, tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes((out / p.link).read_bytes() if (out / p.link).is_file() else b"the user's own file\n")
    (out / p.link).unlink(missing_ok=True)
    (out / p.link).symlink_to(victim)
    before, kept = tree(out), victim.read_bytes()
    res = run_cli(p.module, _base(p.module, world, out) + p.extra, capsys)
    errors = [line for line in res.err.splitlines() if line.startswith(f"mtp-{p.module}: error: ")]
    assert res.code == 2 and len(errors) == 1, (res.code, res.err[-3000:])
    assert f"holds a link leading outside it, {out / p.link} → {victim}" in errors[0], errors[0]
    assert "overwrite=true" in errors[0], errors[0]
    assert tree(out) == before and (out / p.link).is_symlink() and victim.read_bytes() == kept


def test_overwrite_replaces_a_linked_out_shard_and_leaves_its_target_alone(world, tmp_path, capsys):
    """The shard a training run refused as linked out of its folder is not done for a re-run with overwrite=true:
    it is computed anew into the folder, and the file the link pointed at stays as it was."""
    from mtp_train.precompute import PrecomputedDataset

    pc = _rerun_pc(world, tmp_path)[0]
    manifest = json.loads((pc / "manifest.json").read_text())
    _link_out(pc, manifest)
    shard, outside = _shard(pc, manifest), tmp_path / "outside" / _shard(pc, manifest).name
    outside.write_bytes(b"not a shard: a re-run must neither read nor write it\n")
    res = run_cli("precompute", _base("precompute", world, pc) + ["overwrite=true"], capsys)
    assert res.code == 0, res.err[-3000:]
    assert not shard.is_symlink() and shard.read_bytes() == (world.pc / shard.name).read_bytes()
    assert outside.read_bytes() == b"not a shard: a re-run must neither read nor write it\n"
    assert len(PrecomputedDataset(pc, verify="always")) > 0


def test_overwrite_replaces_another_trained_head_as_a_whole(world, tmp_path, capsys):
    """mtp-export overwrite=true into heads/step-1: the folder becomes step-2's export, nothing of step-1 left."""
    heads = _trained_heads(world, tmp_path)
    res = run_cli("export", _base("export", world, heads / "step-1")
                  + [f"head_ckpt={heads / 'step-2'}", "overwrite=true"], capsys)
    assert res.code == 0, res.err[-3000:]
    assert sorted(p.name for p in (heads / "step-1").iterdir()) == ["config.json", "model.safetensors"]
    assert ((heads / "step-1" / "model.safetensors").read_bytes()
            == (heads / "step-2" / "model.safetensors").read_bytes())
    assert sorted(p.name for p in heads.iterdir()) == ["step-1", "step-2"]  # no staging folder left


def test_outputs_follow_the_umask(world, tmp_path):
    """Heads, exports, shards and configs get the mode a plain open gives (0666 less the umask), not 0600."""
    old = os.umask(0o027)
    try:
        res = run_cli("export", _base("export", world, tmp_path / "export") + ["format=deepseek-mtp"])
        assert res.code == 0
        from mtp_train.config import HeadConfig
        from mtp_train.heads import build_head, save_head

        save_head(build_head(HeadConfig(type="mtp"), world.target), tmp_path / "head")
    finally:
        os.umask(old)
    files = [*(tmp_path / "export").iterdir(), *(tmp_path / "head").iterdir()]
    assert {p.name for p in files} == {"config.json", "model.safetensors"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o640) for p in files}


def test_atomic_writes_and_locks_never_write_through_a_link(tmp_path):
    from mtp_train.fileio import LinkError, atomic_write_text

    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".tmp-config.yaml").symlink_to(victim)
    atomic_write_text(out / "config.yaml", "a: 1\n")
    assert not (out / "config.yaml").is_symlink() and (out / "config.yaml").read_text() == "a: 1\n"
    assert victim.read_text() == "mine\n" and not (out / ".tmp-config.yaml").exists()
    (out / ".lock").symlink_to(victim)
    with pytest.raises(LinkError, match=r"\.lock is a link"), output_lock(out):
        pass
    assert victim.read_text() == "mine\n"


# --- a run that has nothing to do, or is refused by the servers it captures through, leaves every byte as it was


def test_a_capture_refused_by_its_endpoint_leaves_nothing_behind(world, tmp_path, capsys):
    """backend=vllm through an endpoint that refuses the connection: neither `out` nor the capture folder the run
    would have made is left; into a finished folder with overwrite=true the folder stays byte for byte (nothing
    was captured, so neither its manifest nor its config.yaml claims a capture)."""
    spool = tmp_path / "shared" / "spool"
    capture = [o.format(tmp=tmp_path) for o in CAPTURE]
    res = run_cli("precompute", _base("precompute", world, tmp_path / "out") + capture, capsys)
    errors = [line for line in res.err.splitlines() if line.startswith("mtp-precompute: error: ")]
    assert res.code == 2 and len(errors) == 1 and DEAD in errors[0], res.err[-3000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "shared").exists()

    pc = _rerun_pc(world, tmp_path)[0]
    before = tree(pc)
    res = run_cli("precompute", _base("precompute", world, pc) + capture + ["overwrite=true"], capsys)
    errors = [line for line in res.err.splitlines() if line.startswith("mtp-precompute: error: ")]
    assert res.code == 2 and len(errors) == 1 and DEAD in errors[0], res.err[-3000:]
    assert tree(pc) == before and not spool.exists()


def test_a_precompute_rerun_into_its_finished_folder_says_so_and_changes_nothing(world, tmp_path, capsys):
    pc = _rerun_pc(world, tmp_path)[0]
    before = tree(pc)
    res = run_cli("precompute", _base("precompute", world, pc), capsys)
    assert res.code == 0, res.err[-3000:]
    said = [line for line in res.out.splitlines() if line.startswith("mtp-precompute: ")]
    assert len(said) == 1 and f"{pc} already holds this precompute (" in said[0], res.out
    assert "backend=engine" in said[0] and "nothing to do, nothing changed" in said[0]
    assert tree(pc) == before


def test_eval_replaces_a_report_of_its_own_settings_and_another_only_with_overwrite(world, tmp_path, capsys):
    """A re-run of the same settings measures again (how it shows itself, progress or plots, aside); a report of
    other settings is replaced with overwrite=true, and then describes this run."""
    out, extra = _finished_eval(world, tmp_path)
    res = run_cli("eval", _base("eval", world, out) + extra + ["progress=true", "plots=false"], capsys)
    assert res.code == 0, res.err[-3000:]
    res = run_cli("eval", _base("eval", world, out) + extra + ["seed=3", "overwrite=true"], capsys)
    assert res.code == 0, res.err[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["seed"] == 3 and report["config"]["overwrite"] is True


# --- what a target, a drafter folder or a head's settings bring that only looks like the real thing: exports of the
# head's own target, config.json keys of another JSON type, drafter files that are not files or are cut short, and
# block settings past what the target and the memory hold. One line, exit 2, nothing written.


def _zlab(w: World, tmp: Path) -> Path:
    """A DFlash drafter of the world's target in z-lab's layout, as a folder written elsewhere (no block of ours)."""
    from mtp_train.config import HeadConfig
    from mtp_train.export import export_head
    from mtp_train.heads import build_head, save_head

    head = build_head(HeadConfig.of(type="dflash", block_size=4, mask_token_id=1, aux_layers=[1]), w.target,
                      dtype="float32")
    folder = export_head(save_head(head, tmp / "dflash-head"), w.target, "dflash", tmp / "zlab")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["mtp_train"]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _drafter(damage: Callable[[Path], None]) -> Prepare:
    """`mtp-export import_from=dflash` of a z-lab folder that `damage` has changed."""
    def prepare(w: World, tmp: Path) -> tuple[Path, list[str]]:
        folder = _zlab(w, tmp)
        damage(folder)
        return tmp / "out", [f"head_ckpt={folder}", "import_from=dflash", "model.device=cpu"]
    return prepare


def _replace_with(make: Callable[[Path], None]) -> Callable[[Path], None]:
    """Damage: the folder's config.json replaced by what `make(path)` puts there."""
    def damage(folder: Path) -> None:
        (folder / "config.json").unlink()
        make(folder / "config.json")
    return damage


def _edit_json(name: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        cfg = json.loads((folder / name).read_text())
        edit(cfg)
        (folder / name).write_text(json.dumps(cfg))
    return damage


def _text_hidden_size(cfg: dict) -> None:
    cfg["hidden_size"] = str(cfg["hidden_size"])


def _max_positions(n: int) -> Callable[[dict], None]:
    return lambda cfg: cfg.update(max_position_embeddings=n)


WEIGHTS = "model.safetensors"
LOOKS_LIKE = {
    # mtp-export import_from=dflash
    "import-truncated-weights": ("export", [], _drafter(lambda f: _cut(f / WEIGHTS)),
                                 ["{tmp}/zlab/model.safetensors is truncated", "copy the drafter's folder again"]),
    "import-empty-weights": ("export", [], _drafter(lambda f: (f / WEIGHTS).write_bytes(b"")),
                             ["{tmp}/zlab/model.safetensors is empty (0 bytes)", "copy the drafter's folder again"]),
    "import-text-weights": ("export", [], _drafter(lambda f: (f / WEIGHTS).write_text("not tensors at all\n")),
                            ["{tmp}/zlab/model.safetensors is truncated or not a safetensors file",
                             "copy the drafter's folder again"]),
    "import-fifo-config": ("export", [], _drafter(_replace_with(os.mkfifo)),
                           ["{tmp}/zlab/config.json is not a regular file: it is a FIFO (named pipe)",
                            "restore it from where the drafter came from"]),
    "import-config-link-loop": ("export", [], _drafter(_replace_with(lambda p: p.symlink_to(p.name))),
                                ["{tmp}/zlab/config.json is a link loop", "restore it from where the drafter came"]),
    "import-layer-ids-as-text": ("export", [], _drafter(_edit_json(
        "config.json", lambda c: c["dflash_config"].update(target_layer_ids="1,8"))),
        ["{tmp}/zlab/config.json: dflash_config.target_layer_ids is \"1,8\", not a list of integers",
         "write a JSON list there, e.g. [1, 8]"]),
    # a target config.json whose number is text: transformers' strict config classes would raise a traceback
    "precompute-text-hidden-size": ("precompute", [], _broken_target(_edit_json("config.json", _text_hidden_size)),
                                    ['{tmp}/target/config.json: hidden_size is "32" (a string), not an integer',
                                     'write it without quotes ("hidden_size": 32)']),
    "eval-text-hidden-size": ("eval", [], _broken_target(_edit_json("config.json", _text_hidden_size)),
                              ['{tmp}/target/config.json: hidden_size is "32" (a string), not an integer']),
    "export-text-hidden-size": ("export", [], _broken_target(_edit_json("config.json", _text_hidden_size)),
                                ['{tmp}/target/config.json: hidden_size is "32" (a string), not an integer']),
    "export-fifo-target-config": ("export", [], _broken_target(_replace_with(os.mkfifo)),
                                  ["{tmp}/target/config.json is not a regular file: it is a FIFO"]),
    "precompute-fifo-target-config": ("precompute", [], _broken_target(_replace_with(os.mkfifo)),
                                      ["{tmp}/target has a config.json that is not a regular file: it is a FIFO"]),
    "precompute-fifo-target-weights": ("precompute", [], _broken_target(
        lambda f: (f / WEIGHTS).unlink() or os.mkfifo(f / WEIGHTS)),
        ["{tmp}/target/model.safetensors is not a regular file: it is a FIFO", "copy, fetch or save them again"]),
    # mtp-export of a head that records no target, without model.path
    "export-head-without-a-recorded-target": ("export", ["model.path=''"], _fresh("export"),
                                              ["records no target", "pass model.path="]),
    # block settings past the target's positions, past a sane maximum, past the memory
    "train-block-past-the-maximum": ("train", ["head=dflash", "head.block_size=1000000"], _fresh("train"),
                                     ["head.block_size=1000000 is over 256", "choose at most 256"]),
    "train-block-past-the-targets-positions": (
        "train", ["head=dflash", "head.block_size=100"], _broken_target(_edit_json("config.json", _max_positions(64))),
        ["head.block_size=100 is over the target's max_position_embeddings (64, {tmp}/target/config.json)",
         "choose at most 64"]),
    "train-blocks-past-the-memory": ("train", ["head=dflash", f"head.max_anchors={10 ** 13}"], _fresh("train"),
                                     [f"head.max_anchors={10 ** 13}: the blocks of one micro-batch alone take at "
                                      "least", "free on cpu; lower head.block_size or head.max_anchors"]),
}


@pytest.mark.parametrize("case", sorted(LOOKS_LIKE))
def test_what_only_looks_like_the_real_thing_is_one_line_exit_2_and_writes_nothing(world, tmp_path, capsys, case):
    module, overrides, prepare, fragments = LOOKS_LIKE[case]
    out, extra = prepare(world, tmp_path)
    args = _base(module, world, out) + extra + [o.format(tmp=tmp_path) for o in overrides]
    before = tree(out)
    res = run_cli(module, args, capsys)
    errors = [line for line in res.err.splitlines() if line.startswith(f"mtp-{module}: error: ")]
    assert res.code == 2 and len(errors) == 1, (res.code, res.err[-3000:])
    assert "Traceback" not in res.err + res.out, res.err[-3000:]
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in errors[0], (fragment, errors[0])
    assert tree(out) == before, f"{out} changed"
