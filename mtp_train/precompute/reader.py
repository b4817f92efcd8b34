"""Reading a precompute folder: a memory-mapped, per-sample dataset (batches: `mtp_train.data.sampler`).

Nothing is loaded whole: building the dataset reads each shard's header and `offsets` (a few KB), and
`ds[i]` reads only sample i's rows through safetensors' memory map. A shard's file is opened the first
time one of its samples is read, then kept open.

Opening checks the manifest against the folder before a sample is read: shard entries are plain file names
inside it, each listed once (`Manifest.check_listing`); each shard's header must hold the format's tensors
(`shards.shard_layout`) and agree with the manifest on its counts, the hidden size, the storage dtype and the aux
layers; totals are the sums over the shards. An error blames the shard only when the shard contradicts itself;
a manifest that disagrees with good shards is the one named, with what to do that keeps the shards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from mtp_train.fileio import sha256_file
from mtp_train.precompute.manifest import (
    SPLITS,
    Manifest,
    ManifestError,
    ShardInfo,
    in_split,
    refuse_outside,
    restore_advice,
)
from mtp_train.precompute.quant import FP8_NAME, dequantize_fp8
from mtp_train.precompute.shards import ShardLayout, ShardLayoutError, shard_layout, sidecar_path

VERIFY_MODES = ("first_open", "never", "always")


class ShardError(RuntimeError):
    """A shard listed in the manifest cannot be used."""


class MissingShardError(ShardError):
    """A shard file listed in the manifest is not in the folder."""


class CorruptShardError(ShardError):
    """A shard whose bytes are not the ones precompute wrote."""


def _advice(path: Path) -> str:
    return f"delete {path} and re-run precompute with the same settings: it redoes that shard"


@dataclass
class _ShardIndex:
    info: ShardInfo
    path: Path
    ids: list[str]  # (S,)
    offsets: np.ndarray  # (S+1,) int64


class PrecomputedDataset(torch.utils.data.Dataset):
    """Random access to the samples of a precompute folder.

    `ds[i]` → {"id": str, "input_ids": LongTensor (L,), "loss_mask": uint8 (L,), "hidden": (L, H) in the
    storage dtype (bf16; an fp8 folder's rows come back dequantised, in bf16), and "aux_hidden": (L, k*H) when
    the folder has aux layers}.

    expect_*_fingerprint: refuse a folder made for another target / tokenizer / chat template (None = do
    not check). split: "train", "val" or "all", by the manifest's recorded rule. verify: "first_open" hashes
    a shard the first time this object opens it, "always" hashes every shard here, before any sample is
    read, "never" only checks sizes. rank / world: this rank keeps every world-th sample of the split,
    starting at rank (disjoint, and the same whatever the shard layout).

    Worker processes get a copy without open files (they reopen lazily) but with the set of shards
    already verified, so verifying before the DataLoader starts avoids hashing again in each worker.
    """

    def __init__(
        self,
        directory: str | Path,
        expect_target_fingerprint: str | None = None,
        expect_tokenizer_fingerprint: str | None = None,
        expect_chat_template_fingerprint: str | None = None,
        split: str = "train",
        verify: str = "first_open",
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be train|val|all, got {split!r}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {'|'.join(VERIFY_MODES)}, got {verify!r}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.directory = Path(directory)
        self.where = str(self.directory)  # named in errors (a TokenDataset names its data.paths)
        self.manifest = Manifest.load(self.directory)
        self.manifest.check(target_fingerprint=expect_target_fingerprint,
                            tokenizer_fingerprint=expect_tokenizer_fingerprint,
                            chat_template_fingerprint=expect_chat_template_fingerprint,
                            where=f"precompute folder {self.directory}")
        self.split, self.verify, self.rank, self.world = split, verify, rank, world
        self._shards = [self._index_shard(s) for s in self.manifest.shards]
        self._check_ids_unique()
        self.manifest.check_totals(self.directory)
        self._handles: dict[int, Any] = {}
        self._verified: set[int] = set()
        if verify == "always":
            for k in range(len(self._shards)):
                self._verify(k)

        # (shard, row) of every selected sample, in manifest order, then this rank's share.
        sel = self.manifest.split
        picked: list[tuple[int, int]] = []
        for k, sh in enumerate(self._shards):
            for j, sid in enumerate(sh.ids):
                if in_split(sid, split, sel.seed, sel.val_fraction):
                    picked.append((k, j))
        picked = picked[rank::world]
        self._shard_of = np.array([k for k, _ in picked], dtype=np.int32)
        self._row_of = np.array([j for _, j in picked], dtype=np.int64)
        self.lengths: list[int] = [int(self._shards[k].offsets[j + 1] - self._shards[k].offsets[j])
                                   for k, j in picked]
        self.ids: list[str] = [self._shards[k].ids[j] for k, j in picked]

    def _check_sidecar(self, info: ShardInfo, path: Path) -> dict[str, Any] | None:
        """Refuse a manifest that describes other shards than the folder's (e.g. one copied from another run);
        returns the shard's sidecar (None when it has no readable one).

        Each shard's sidecar (`<shard>.json`, written with it) records its sha256 and size. When the sidecar agrees
        with the file but not with the manifest, the shard is fine and the manifest is the stranger: blaming the
        shard would have the user delete good data.
        """
        side = sidecar_path(path)
        refuse_outside(self.directory, side, f"the sidecar of {info.file}")
        try:
            d = json.loads(side.read_text())
            own_sha, own_bytes = d["sha256"], int(d["bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no readable sidecar: the shard's own checks below decide
        if (own_sha, own_bytes) != (info.sha256, info.bytes) and own_bytes == path.stat().st_size:
            manifest = self.directory / "manifest.json"
            raise ManifestError(
                f"{manifest} does not match the shards in {self.directory}: it lists {info.file} with sha256 "
                f"{info.sha256[:12]}… ({info.bytes} bytes), the folder's shard and its sidecar are {own_sha[:12]}… "
                f"({own_bytes} bytes). The manifest comes from another precompute run (copied or mixed folders); "
                "restore this folder's own manifest, or re-run precompute with this folder's settings (its "
                "finished shards are kept and the manifest is written anew)"
            )
        return d if isinstance(d, dict) else None

    def _index_shard(self, info: ShardInfo) -> _ShardIndex:
        """Check a shard against its own header, its sidecar and the manifest, and read its ids and offsets
        (header only, no hidden states)."""
        path = self.directory / info.file  # a plain name inside the folder (Manifest.check_listing)
        if not path.is_file():
            raise MissingShardError(
                f"{path} is listed in {self.directory / 'manifest.json'} but missing; restore it, or re-run "
                "precompute with the same settings (it redoes missing shards)"
            )
        side = self._check_sidecar(info, path)
        size = path.stat().st_size
        if size != info.bytes:
            raise CorruptShardError(f"{path} has {size} bytes, the manifest says {info.bytes}: {_advice(path)}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                layout = shard_layout(f)
        except ShardLayoutError as e:
            raise CorruptShardError(f"{path} is not a shard of the format: {e}; {_advice(path)}") from None
        except (SafetensorError, ValueError, OSError) as e:
            raise CorruptShardError(f"{path}: unreadable header ({e}): {_advice(path)}") from None
        self._check_against_manifest(info, path, layout, side, size)
        return _ShardIndex(info=info, path=path, ids=layout.ids, offsets=layout.offsets)

    def _check_against_manifest(self, info: ShardInfo, path: Path, layout: ShardLayout, side: dict[str, Any] | None,
                                size: int) -> None:
        """Refuse a manifest whose counts, hidden size, dtype or aux layers are not what the (self-consistent)
        shard holds: the manifest was edited or belongs elsewhere, and the shard is not to blame."""
        m = self.manifest
        manifest, todo = self.directory / "manifest.json", restore_advice(self.directory)
        # The sidecar vouches for loss_tokens (which only the mask tensor holds) when it describes this very file.
        trusted = side is not None and (side.get("samples"), side.get("tokens"), side.get("bytes")) == (
            len(layout.ids), layout.tokens, size)
        own = {"samples": len(layout.ids), "tokens": layout.tokens}
        if trusted:
            own["loss_tokens"] = side["loss_tokens"]
        for name, have in own.items():
            if getattr(info, name) != have:
                said = "header and sidecar say" if trusted else "header says"
                raise ManifestError(
                    f"{manifest} lists {info.file} with {name}={getattr(info, name)}, but the shard's own {said} "
                    f"{have} ({path}): the manifest was edited, the shard is not at fault; {todo}"
                )
        aux = layout.aux_layers
        stored = [
            ("target.hidden_size", m.target.hidden_size, layout.hidden_size,
             f"hidden states of width {layout.hidden_size}"),
            ("hidden.dtype", m.hidden.dtype, layout.dtype, f"{layout.dtype} hidden states"),
            ("hidden.aux_layers", m.hidden.aux_layers if aux is not None else len(m.hidden.aux_layers),
             aux if aux is not None else layout.aux_count,
             f"aux layers {aux}" if aux is not None else f"{layout.aux_count} aux layer(s)"),
        ]
        for name, want, have, what in stored:
            if want != have:
                raise ManifestError(
                    f"{manifest}: {name} is {want}, but {path} holds {what}: the manifest was edited or belongs to "
                    f"another folder, the shard is not at fault; {todo}"
                )

    def _check_ids_unique(self) -> None:
        """Refuse a folder where a sample appears in two shards (a shard copied under another name, or mixed runs):
        it would be trained on twice."""
        first: dict[str, int] = {}
        for k, sh in enumerate(self._shards):
            for sid in sh.ids:
                j = first.setdefault(sid, k)
                if j != k:
                    raise ManifestError(
                        f"{self.directory / 'manifest.json'} lists sample {sid!r} twice: in "
                        f"{self._shards[j].path.name} and in {sh.path.name} (a shard copied under another name, or "
                        "shards of two runs); "
                        f"{restore_advice(self.directory)}"
                    )

    def _verify(self, k: int) -> None:
        if k in self._verified:
            return
        sh = self._shards[k]
        actual = sha256_file(sh.path)
        if actual != sh.info.sha256:
            raise CorruptShardError(
                f"{sh.path} is corrupt: sha256 {actual}, the manifest expects {sh.info.sha256}; {_advice(sh.path)}"
            )
        self._verified.add(k)

    def _handle(self, k: int) -> Any:
        h = self._handles.get(k)
        if h is None:
            if self.verify == "first_open":
                self._verify(k)
            h = safe_open(str(self._shards[k].path), framework="pt", device="cpu")
            self._handles[k] = h
        return h

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i = i % len(self)
        k, j = int(self._shard_of[i]), int(self._row_of[i])
        sh = self._shards[k]
        a, b = int(sh.offsets[j]), int(sh.offsets[j + 1])
        f = self._handle(k)
        # get_slice reads only rows a:b of each tensor from the memory map.
        item = {
            "id": sh.ids[j],
            "input_ids": f.get_slice("input_ids")[a:b].long(),  # (L,)
            "loss_mask": f.get_slice("loss_mask")[a:b],  # (L,) uint8
            "hidden": self._hidden(f, "hidden", a, b),  # (L, H)
        }
        if self.manifest.hidden.aux_layers:
            item["aux_hidden"] = self._hidden(f, "aux_hidden", a, b)  # (L, k*H)
        return item

    def _hidden(self, f: Any, name: str, a: int, b: int) -> torch.Tensor:
        """Rows a:b of hidden-state tensor `name` in the storage dtype, or dequantised to bf16 from fp8."""
        x = f.get_slice(name)[a:b]
        if self.manifest.hidden.dtype == FP8_NAME:
            return dequantize_fp8(x, f.get_slice(f"{name}_scale")[a:b])
        return x

    def token_counts(self, vocab_size: int, masked_only: bool = True) -> torch.Tensor:
        """(vocab_size,) int64 occurrences of each token id over this dataset's samples (its split and rank share).

        masked_only counts only tokens under the loss mask (the assistant tokens a head learns to draft).
        Reads the token and mask columns shard by shard, never the hidden states.
        """
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for k in np.unique(self._shard_of).tolist():
            sh = self._shards[k]
            f = self._handle(k)
            ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            rows = self._row_of[self._shard_of == k]
            keep = torch.zeros(ids.shape[0], dtype=torch.bool)
            for j in rows.tolist():
                keep[int(sh.offsets[j]):int(sh.offsets[j + 1])] = True
            if masked_only:
                keep &= mask
            sel = ids[keep]
            if sel.numel() and int(sel.max()) >= vocab_size:
                raise ValueError(f"{sh.path}: token id {int(sel.max())} >= vocabulary size {vocab_size}")
            counts += torch.bincount(sel, minlength=vocab_size)
        return counts

    def __getstate__(self) -> dict[str, Any]:
        # Open safetensors handles cannot be pickled (DataLoader workers); they reopen lazily.
        return {**self.__dict__, "_handles": {}}
