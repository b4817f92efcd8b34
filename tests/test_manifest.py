"""A precompute folder's manifest checked against the folder on open: shard entries are plain names inside it, each
once; counts, hidden size, dtype and aux layers agree with the shards' own headers and sidecars; totals are the
shards' sums. An edited manifest is named with the field and the shard and never gets a good shard deleted; a
shard that contradicts itself (an fp8 shard without its scales) is named as the one at fault.

The folders are written here with the shard writer (`precompute.shards`) from random rows, without a model.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from mtp_train.precompute import (
    CorruptShardError,
    HiddenInfo,
    Manifest,
    ManifestError,
    PrecomputedDataset,
    SplitInfo,
    TargetInfo,
    TokenizerInfo,
    Totals,
    is_val,
)
from mtp_train.precompute.manifest import MANIFEST_NAME
from mtp_train.precompute.plan import plan_runs, shard_plan
from mtp_train.precompute.quant import FP8_NAME, quantize_fp8
from mtp_train.precompute.safetensors_file import write_safetensors
from mtp_train.precompute.shards import sidecar_path, write_shard

H, LAYERS, VOCAB = 8, 4, 50
ST_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32, FP8_NAME: torch.float8_e4m3fn}


@dataclass
class Row:
    """A sample as the shard planner takes it (`shard_plan` reads these three fields)."""

    id: str
    ids: np.ndarray  # (L,) int32
    mask: np.ndarray  # (L,) uint8


def _rows(n: int, seed: int = 0) -> list[Row]:
    """n random samples of 3..11 tokens, the second half of each in the loss."""
    g = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ids = g.integers(0, VOCAB, size=int(g.integers(3, 12))).astype(np.int32)
        mask = (np.arange(ids.size) >= ids.size // 2).astype(np.uint8)
        rows.append(Row(f"s{i}", ids, mask))
    return rows


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file, and its metadata."""
    with safe_open(str(path), framework="pt") as f:
        names = f.keys()
        return {k: f.get_tensor(k).clone() for k in names}, dict(f.metadata() or {})  # not views of the file


def _data_range(path: Path, name: str) -> range:
    """The bytes of tensor `name` in the safetensors file at `path` (from its header)."""
    with path.open("rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    a, b = header[name]["data_offsets"]
    return range(8 + n + a, 8 + n + b)


def _shard_tensors(rows: list[Row], aux: int, dtype: str, seed: int) -> dict[str, torch.Tensor]:
    """The tensors of a shard holding `rows`: ids, mask, offsets, and random hidden (T, H) / aux (T, aux*H)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [r.ids.size for r in rows]
    t = sum(lengths)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = {"input_ids": torch.from_numpy(np.concatenate([r.ids for r in rows])),  # (T,) int32
           "loss_mask": torch.from_numpy(np.concatenate([r.mask for r in rows])),  # (T,) uint8
           "offsets": torch.from_numpy(offsets)}  # (S+1,)
    hidden = {"hidden": torch.randn(t, H, generator=g)}  # (T, H)
    if aux:
        hidden["aux_hidden"] = torch.randn(t, aux * H, generator=g)  # (T, aux*H)
    for name, x in hidden.items():
        if dtype == FP8_NAME:
            out[name], out[f"{name}_scale"] = quantize_fp8(x, groups=x.shape[1] // H)
        else:
            out[name] = x.to(ST_NAMES[dtype])
    return out


def make_folder(out: Path, n: int = 12, aux_layers: tuple[int, ...] = (), dtype: str = "bfloat16") -> Manifest:
    """A finished precompute folder of `n` random samples in shards of at most 24 tokens, as the writer lays it out."""
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows(n)
    settings = {"dtype": dtype, "aux_layers": list(aux_layers)}
    meta = {"format_version": "1", "hidden_dtype": dtype, "aux_layers": json.dumps(list(aux_layers))}
    shards = []
    for index, run in enumerate(plan_runs([r.ids.size for r in rows], 24)):
        plan = shard_plan(0, index, [rows[i] for i in run], settings)
        shards.append(write_shard(out, plan, _shard_tensors(plan.rows, len(aux_layers), dtype, index), meta))
    counts = {f"{s}_{k}": 0 for s in ("train", "val") for k in ("samples", "tokens", "loss_tokens")}
    for r in rows:
        s = "val" if is_val(r.id, 3, 0.25) else "train"
        counts[f"{s}_samples"] += 1
        counts[f"{s}_tokens"] += r.ids.size
        counts[f"{s}_loss_tokens"] += int(r.mask.sum())
    manifest = Manifest(
        target=TargetInfo(path="target", fingerprint="fp", model_type="llama", hidden_size=H, num_layers=LAYERS,
                          vocab_size=VOCAB, dtype="float32"),
        tokenizer=TokenizerInfo(fingerprint="tok", chat_template_fingerprint="tmpl"),
        hidden=HiddenInfo(dtype=dtype, aux_layers=list(aux_layers)), data={}, split=SplitInfo(0.25, 3, counts=counts),
        shards=shards, totals=Totals(samples=n, tokens=sum(s.tokens for s in shards),
                                     loss_tokens=sum(s.loss_tokens for s in shards),
                                     bytes=sum(s.bytes for s in shards)),
        provenance={})
    manifest.save(out)
    return manifest


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good") / "pc"
    assert len(make_folder(folder).shards) >= 3
    return folder


def _copy(src: Path, tmp: Path) -> tuple[Path, dict]:
    dst = tmp / "pc"
    shutil.copytree(src, dst, symlinks=True)
    return dst, json.loads((dst / MANIFEST_NAME).read_text())


def _save(pc: Path, m: dict) -> None:
    (pc / MANIFEST_NAME).write_text(json.dumps(m))


def _refused(pc: Path, error: type[Exception] = ManifestError) -> str:
    """The message opening `pc` fails with (every verify mode fails the same way, before reading a sample)."""
    messages = set()
    for verify in ("never", "first_open"):
        with pytest.raises(error) as e:
            PrecomputedDataset(pc, split="all", verify=verify)
        messages.add(str(e.value))
    assert len(messages) == 1
    return messages.pop()


# --------------------------------------------------------------------------------------------- good folders


@pytest.mark.parametrize("aux_layers,dtype", [((), "bfloat16"), ((1, 3), "float32"), ((0, 2), FP8_NAME)])
def test_good_folders_open_and_read(tmp_path, aux_layers, dtype):
    m = make_folder(tmp_path / "pc", aux_layers=aux_layers, dtype=dtype)
    ds = PrecomputedDataset(tmp_path / "pc", split="all", verify="always")
    assert len(ds) == m.totals.samples and Manifest.load(tmp_path / "pc").to_dict() == m.to_dict()
    item = ds[len(ds) - 1]
    assert item["hidden"].shape == (item["input_ids"].shape[0], H)
    if aux_layers:
        assert item["aux_hidden"].shape == (item["input_ids"].shape[0], len(aux_layers) * H)


def test_a_link_that_stays_inside_the_folder_is_read(good, tmp_path):
    """Containment is what is checked, not links as such: a shard kept in a subfolder and linked is fine."""
    pc, m = _copy(good, tmp_path)
    name = m["shards"][1]["file"]
    (pc / "store").mkdir()
    (pc / name).rename(pc / "store" / name)
    (pc / name).symlink_to(Path("store") / name)
    assert len(PrecomputedDataset(pc, split="all", verify="always")) == m["totals"]["samples"]


# ---------------------------------------------------------------------- edited manifests: the manifest is named


def _outside_copy(pc: Path, m: dict) -> str:
    """A copy of shard 1 outside the folder, at ../outside/<name>; returns the relative path."""
    name = m["shards"][1]["file"]
    (pc.parent / "outside").mkdir()
    shutil.copy(pc / name, pc.parent / "outside" / name)
    return f"../outside/{name}"


def _set(key: str, value) -> Callable[[Path, dict], None]:
    def edit(pc: Path, m: dict) -> None:
        *path, last = key.split(".")
        d = m
        for k in path:
            d = d[int(k)] if isinstance(d, list) else d[k]
        d[last] = value
    return edit


def _add(key: str, n: int, also_total: bool = True) -> Callable[[Path, dict], None]:
    """shards[1].<key> += n (and the totals with it, so that only the shard's entry disagrees with the shard)."""
    def edit(pc: Path, m: dict) -> None:
        m["shards"][1][key] += n
        if also_total:
            m["totals"][key] += n
    return edit


def _listed_twice(pc: Path, m: dict) -> None:
    m["shards"].append(dict(m["shards"][1]))
    for k in ("samples", "tokens", "loss_tokens", "bytes"):
        m["totals"][k] += m["shards"][1][k]


def _copied_under_another_name(pc: Path, m: dict) -> None:
    """shard 1 (and its sidecar) copied as shard-r0-00099 and listed again under that name."""
    one = pc / m["shards"][1]["file"]
    shutil.copy(one, pc / "shard-r0-00099.safetensors")
    shutil.copy(sidecar_path(one), pc / "shard-r0-00099.json")
    m["shards"].append({**m["shards"][1], "file": "shard-r0-00099.safetensors", "index": 99})
    for k in ("samples", "tokens", "loss_tokens", "bytes"):
        m["totals"][k] += m["shards"][1][k]


def _two_names_one_file(pc: Path, m: dict) -> None:
    """shard 2's file replaced by a link to shard 1 (the manifest's entry for it copied from shard 1's)."""
    one, two = m["shards"][1]["file"], m["shards"][2]["file"]
    (pc / two).unlink()
    (pc / two).symlink_to(one)


# case → (edit, fragments the message holds)
EDITS: dict[str, tuple[Callable[[Path, dict], None], list[str]]] = {
    "dotdot": (lambda pc, m: _set("shards.1.file", _outside_copy(pc, m))(pc, m),
               ["shards[1].file '../outside/shard-r0-00001.safetensors' leads out of the folder (..)"]),
    "absolute": (_set("shards.1.file", "/etc/hostname"), ["shards[1].file '/etc/hostname' is an absolute path"]),
    "subfolder": (_set("shards.1.file", "sub/shard-r0-00001.safetensors"), ["is a path, not a file name"]),
    "not-a-shard-name": (_set("shards.1.file", MANIFEST_NAME), ["shards[1].file 'manifest.json' is not a shard file"]),
    "not-a-string": (_set("shards.1.file", 7), ["shards[1].file 7 is not a file name"]),
    "listed-twice": (_listed_twice, ["shard-r0-00001.safetensors' is listed twice (shards[1] and shards["]),
    "copied-under-another-name": (_copied_under_another_name, ["lists sample 's", "twice: in shard-r0-00001."
                                                               "safetensors and in shard-r0-00099.safetensors"]),
    "total-tokens": (_set("totals.tokens", 12345), ["totals.tokens is 12345, but its", "the manifest was edited"]),
    "total-samples-a-string": (_set("totals.samples", "12"), ["totals.samples is '12', expected an integer"]),
    "shard-tokens": (_add("tokens", 3), ["lists shard-r0-00001.safetensors with tokens=", "header and sidecar say",
                                         "the shard is not at fault"]),
    "shard-samples": (_add("samples", 1), ["lists shard-r0-00001.safetensors with samples="]),
    "shard-loss-tokens": (_add("loss_tokens", 2), ["lists shard-r0-00001.safetensors with loss_tokens=",
                                                   "header and sidecar say"]),
    "shard-tokens-no-total": (_add("tokens", 3, also_total=False), ["with tokens="]),
    "hidden-size": (_set("target.hidden_size", 999), ["target.hidden_size is 999, but",
                                                      "shard-r0-00000.safetensors holds hidden states of width 8"]),
    "dtype-fp8": (_set("hidden.dtype", FP8_NAME), ["hidden.dtype is float8_e4m3fn, but",
                                                   "shard-r0-00000.safetensors holds bfloat16 hidden states"]),
    "dtype-float16": (_set("hidden.dtype", "float16"), ["hidden.dtype is float16, but"]),
    "dtype-unknown": (_set("hidden.dtype", "int4"), ["hidden.dtype is 'int4', expected one of bfloat16"]),
    "aux-layers": (_set("hidden.aux_layers", [1]), ["hidden.aux_layers is [1], but",
                                                    "shard-r0-00000.safetensors holds aux layers []"]),
    "aux-layers-out-of-range": (_set("hidden.aux_layers", [9]), ["hidden.aux_layers=[9]: 9 is not a layer of this "
                                                                 "target (its hidden states are 0..4"]),
    "split-counts": (lambda pc, m: _set("split.counts.train_samples", m["split"]["counts"]["train_samples"] + 1)(
        pc, m), ["split.counts train_samples + val_samples is"]),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_an_edited_manifest_is_named_and_no_shard_is_blamed(good, tmp_path, case):
    edit, fragments = EDITS[case]
    pc, m = _copy(good, tmp_path)
    edit(pc, m)
    _save(pc, m)
    msg = _refused(pc)
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    assert str(pc / MANIFEST_NAME) in msg
    assert "delete" not in msg and "re-run mtp-precompute on" in msg
    assert "\n" not in msg


def test_a_bad_shard_entry_is_refused_before_any_file_is_looked_at(good, tmp_path):
    """Manifest.load alone refuses the entry (the reader never gets to stat or open it)."""
    pc, m = _copy(good, tmp_path)
    _set("shards.0.file", "/etc/hostname")(pc, m)
    _save(pc, m)
    with pytest.raises(ManifestError, match="'/etc/hostname' is an absolute path"):
        Manifest.load(pc)


def test_a_link_out_of_the_folder_is_refused(good, tmp_path):
    pc, m = _copy(good, tmp_path)
    name = m["shards"][1]["file"]
    _outside_copy(pc, m)
    (pc / name).unlink()
    (pc / name).symlink_to(pc.parent / "outside" / name)
    msg = _refused(pc)
    assert f"{pc / name} (shards[1] of {pc / MANIFEST_NAME}) is a link leading outside {pc}" in msg
    assert "delete" not in msg
    # A dangling link out of the folder is refused the same way (and not reported as a missing shard).
    (pc.parent / "outside" / name).unlink()
    assert "is a link leading outside" in _refused(pc)


def test_two_entries_for_one_file_are_refused(good, tmp_path):
    pc, m = _copy(good, tmp_path)
    _two_names_one_file(pc, m)
    assert "shards[2].file 'shard-r0-00002.safetensors' is the same file as shards[1]" in _refused(pc)


def test_a_sample_in_two_shards_is_refused(good, tmp_path):
    """A shard's samples written again under another name (other bytes, same ids): trained twice, so refused."""
    pc, m = _copy(good, tmp_path)
    sh = m["shards"][1]
    tensors, meta = _read(pc / sh["file"])
    tensors["hidden"] = tensors["hidden"] + 1
    name = "shard-r0-00099.safetensors"
    with (pc / name).open("wb") as fh:
        sha = write_safetensors(fh, tensors, meta)
    m["shards"].append({**sh, "file": name, "index": 99, "sha256": sha, "bytes": (pc / name).stat().st_size})
    for k in ("samples", "tokens", "loss_tokens", "bytes"):
        m["totals"][k] += m["shards"][-1][k]
    _save(pc, m)
    msg = _refused(pc)
    assert "lists sample 's" in msg and f"twice: in {sh['file']} and in {name}" in msg


# --------------------------------------------------------------------- shards that contradict themselves


def _rewrite(pc: Path, m: dict, k: int, change: Callable[[dict, dict], None]) -> Path:
    """Rewrite shard k with `change(tensors, metadata)` applied, its sidecar and manifest entry updated to match
    (as a tool that re-saves shards would leave them)."""
    sh = m["shards"][k]
    path = pc / sh["file"]
    tensors, meta = _read(path)
    change(tensors, meta)
    with path.open("wb") as fh:
        sha = write_safetensors(fh, tensors, meta)
    size = path.stat().st_size
    m["totals"]["bytes"] += size - sh["bytes"]
    sh["sha256"], sh["bytes"] = sha, size
    side = json.loads(sidecar_path(path).read_text())
    sidecar_path(path).write_text(json.dumps({**side, "sha256": sha, "bytes": size}))
    _save(pc, m)
    return path


@pytest.mark.parametrize("drop,aux", [("hidden_scale", ()), ("aux_hidden_scale", (1, 2))])
def test_an_fp8_shard_without_its_scales_is_named(tmp_path, drop, aux):
    make_folder(tmp_path / "src", aux_layers=aux, dtype=FP8_NAME)
    pc, m = _copy(tmp_path / "src", tmp_path)
    path = _rewrite(pc, m, 1, lambda t, meta: t.pop(drop))
    msg = _refused(pc, CorruptShardError)
    assert f"{path} is not a shard of the format: it holds no `{drop}` tensor (the per-token scales" in msg
    assert "re-run precompute" in msg


@pytest.mark.parametrize("change,fragment", [
    (lambda t, meta: meta.update(hidden_dtype="float32"), "its metadata says hidden_dtype float32"),
    (lambda t, meta: meta.pop("sample_ids"), "its metadata has no readable sample_ids"),
    (lambda t, meta: t.update(offsets=t["offsets"].flip(0).contiguous()), "its offsets do not cut its"),
    (lambda t, meta: t.update(loss_mask=t["loss_mask"][:-1].contiguous()), "its `loss_mask` tensor is U8"),
    (lambda t, meta: t.update(aux_hidden=t["hidden"].clone()), "it holds an `aux_hidden` tensor, but"),
])
def test_a_shard_that_contradicts_itself_is_the_one_named(good, tmp_path, change, fragment):
    pc, m = _copy(good, tmp_path)
    path = _rewrite(pc, m, 2, change)
    msg = _refused(pc, CorruptShardError)
    assert msg.startswith(f"{path} is not a shard of the format: ") and fragment in msg, msg


def test_opening_reads_headers_not_hidden_states(good, tmp_path):
    """Every hidden-state byte of every shard garbled: the folder still opens (and reads with verify=never), since
    the checks read headers, offsets and sidecars only; the sha256 check on first read then names the shard."""
    pc, m = _copy(good, tmp_path)
    for sh in m["shards"]:
        path = pc / sh["file"]
        data = bytearray(path.read_bytes())
        for i in _data_range(path, "hidden"):
            data[i] ^= 0x40
        path.write_bytes(bytes(data))
    ds = PrecomputedDataset(pc, split="all", verify="never")
    assert len(ds) == m["totals"]["samples"] and ds[0]["hidden"].shape[1] == H
    with pytest.raises(CorruptShardError, match="is corrupt: sha256"):
        PrecomputedDataset(pc, split="all", verify="first_open")[0]


def test_a_folder_reached_through_a_link_opens(good, tmp_path):
    """The folder itself may be a link (data.dir on another disk): containment is checked on resolved paths."""
    os.symlink(good, tmp_path / "linked")
    assert len(PrecomputedDataset(tmp_path / "linked", split="all")) > 0


# --------------------------------------------------------------------------------------------- token counts


def _direct_counts(rows: list[Row], split: str) -> torch.Tensor:
    """(VOCAB,) occurrences of each token id under the loss mask over `split`'s rows (seed 3, val_fraction 0.25)."""
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for r in rows:
        if split == "all" or (split == "val") == is_val(r.id, 3, 0.25):
            counts += torch.bincount(torch.from_numpy(r.ids[r.mask.astype(bool)]).long(), minlength=VOCAB)
    return counts


def test_token_counts_are_read_and_damage_is_named(good, tmp_path):
    from mtp_train.precompute.manifest import TOKEN_COUNTS_NAME, read_token_counts, write_token_counts

    assert read_token_counts(good, "train", VOCAB) is None  # a folder written before the file existed
    pc, m = _copy(good, tmp_path)
    rows = _rows(12)
    m["token_counts"] = write_token_counts(pc, _direct_counts(rows, "train"), _direct_counts(rows, "val"))
    _save(pc, m)
    assert Manifest.load(pc).token_counts == m["token_counts"]
    for split in ("train", "val", "all"):
        got = read_token_counts(pc, split, VOCAB)
        assert got is not None and got.dtype == torch.int64 and torch.equal(got, _direct_counts(rows, split))
    assert int(read_token_counts(pc, "all", VOCAB).sum()) == m["totals"]["loss_tokens"]

    with pytest.raises(ManifestError, match=rf"{TOKEN_COUNTS_NAME} counts a vocabulary of {VOCAB} token ids, this "
                                            "target has 51"):
        read_token_counts(pc, "train", VOCAB + 1)
    _flip = bytearray((pc / TOKEN_COUNTS_NAME).read_bytes())
    _flip[-3] ^= 0x01
    (pc / TOKEN_COUNTS_NAME).write_bytes(bytes(_flip))
    with pytest.raises(ManifestError, match=rf"{TOKEN_COUNTS_NAME} is damaged: sha256 .* re-run mtp-precompute"):
        read_token_counts(pc, "val", VOCAB)
    (pc / TOKEN_COUNTS_NAME).write_bytes(b"not safetensors")
    del m["token_counts"]["sha256"]  # without a recorded hash the file's own shape is what is checked
    _save(pc, m)
    with pytest.raises(ManifestError, match=rf"{TOKEN_COUNTS_NAME} is damaged: not a readable safetensors file"):
        read_token_counts(pc, "val", VOCAB)
    (pc / TOKEN_COUNTS_NAME).unlink()
    with pytest.raises(ManifestError, match=rf"{TOKEN_COUNTS_NAME} is missing, though .*manifest.json names it"):
        read_token_counts(pc, "train", VOCAB)
