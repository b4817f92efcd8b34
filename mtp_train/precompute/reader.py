"""Reading a precompute folder: a memory-mapped, per-sample dataset (batches: `mtp_train.data.sampler`).

Nothing is loaded whole. `FolderIndex` reads the manifest and each shard's header and `offsets` (a few KB a
shard) once, closing each file as soon as it is read, and keeps what it needs per sample in numpy arrays and
bytes (about 21 bytes a sample plus its id's length, no Python object per sample); the train and val datasets of
a run share one index. `ds[i]` reads only sample i's rows through safetensors' memory map; a dataset keeps at
most `max_open` shards open (the least recently read is closed), and `verify="first_open"` hashes a shard the
first time its samples are read, not before (`verify_ahead` may start that hashing early, in background threads,
for the shards a first batch will read: a sample is still never returned before its shard's hash is checked).

Opening checks the manifest against the folder before a sample is read: shard entries are plain file names
inside it, each listed once (`Manifest.check_listing`); each shard's header must hold the format's tensors
(`shards.shard_layout`) and agree with the manifest on its counts, the hidden size, the storage dtype and the aux
layers; totals are the sums over the shards. An error blames the shard only when the shard contradicts itself;
a manifest that disagrees with good shards is the one named, with what to do that keeps the shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
    read_token_counts,
    refuse_outside,
    restore_advice,
)
from mtp_train.precompute.quant import FP8_NAME, dequantize_fp8
from mtp_train.precompute.shards import ShardLayout, ShardLayoutError, shard_layout, sidecar_path

log = logging.getLogger(__name__)

VERIFY_MODES = ("first_open", "never", "always")
MAX_OPEN = 32  # shard files a dataset keeps open at once (the least recently read is closed first)
HASH_THREADS = 8  # most shards `FolderIndex.verify_ahead` hashes at once (hashlib and reads release the GIL)


class ShardError(RuntimeError):
    """A shard listed in the manifest cannot be used."""


class MissingShardError(ShardError):
    """A shard file listed in the manifest is not in the folder."""


class CorruptShardError(ShardError):
    """A shard whose bytes are not the ones precompute wrote."""


def _advice(path: Path) -> str:
    return f"delete {path} and re-run precompute with the same settings: it redoes that shard"


@dataclass
class ReadCounts:
    """What the datasets over one `FolderIndex` have read so far (the counters only grow): set-up costs are
    checked against them in tests and benchmarks."""

    headers: int = 0  # shard headers parsed (each shard once, when the index is built)
    opens: int = 0  # shard files opened to read samples (at most `max_open` per dataset at once)
    hashes: int = 0  # shards hashed in full (verify)
    scans: int = 0  # shards whose token columns were read to count tokens (a folder without stored counts)


@dataclass
class _Shard:
    info: ShardInfo
    path: Path
    offsets: np.ndarray  # (S+1,) int64: sample j is rows offsets[j]:offsets[j+1]
    id_bytes: bytes  # the sample ids, UTF-8, one after the other
    id_ends: np.ndarray  # (S,) int64: id j is id_bytes[id_ends[j-1]:id_ends[j]] (from 0 for j = 0)

    @classmethod
    def make(cls, info: ShardInfo, path: Path, offsets: np.ndarray, encoded: list[bytes]) -> _Shard:
        ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
        return cls(info, path, offsets, b"".join(encoded), ends)

    def id(self, j: int) -> str:
        return self.id_bytes[int(self.id_ends[j - 1]) if j else 0:int(self.id_ends[j])].decode()


def _split_keys(encoded: list[bytes], seed: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(S,) bool whether each id (UTF-8) is in the val split, by `is_val`'s rule, and (S,) int64 keys for the
    duplicate check (equal ids, equal keys), hashing each id once.

    `is_val` compares the digest's first 8 bytes, big-endian, over 2^64 with val_fraction; numpy converts them to
    float64 with the same rounding as Python does, so the flags are `is_val`'s exactly.
    """
    if val_fraction <= 0.0:
        # hash() is stable within a process, which is all a duplicate check needs.
        return np.zeros(len(encoded), bool), np.fromiter(map(hash, encoded), dtype=np.int64, count=len(encoded))
    prefix = f"{seed}:".encode()
    heads = np.frombuffer(b"".join([hashlib.sha256(prefix + e).digest()[:8] for e in encoded]), dtype=">u8")  # (S,)
    return heads.astype(np.float64) / 2.0**64 < val_fraction, heads.view(np.int64)


class FolderIndex:
    """A precompute folder checked against its manifest and indexed once, for any number of datasets over it.

    Reads `manifest.json`, every shard's sidecar and header (`offsets` and the sample ids of its metadata, never a
    hidden state), each file closed as soon as it is read, and keeps per sample, in manifest order, only numpy
    arrays: the sample's length, whether it is in the val split, and its id as UTF-8 bytes. Sample p of the folder
    is row p - starts[k] of shard k, where starts[k] <= p < starts[k+1].

    Args:
        directory: the precompute folder.
        expect_target_fingerprint: refuse a folder made for other target weights (None = do not check).
        expect_tokenizer_fingerprint: the same for the tokenizer.
        expect_chat_template_fingerprint: the same for the chat template.
    """

    def __init__(self, directory: str | Path, expect_target_fingerprint: str | None = None,
                 expect_tokenizer_fingerprint: str | None = None,
                 expect_chat_template_fingerprint: str | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = Manifest.load(self.directory)
        self.check(expect_target_fingerprint, expect_tokenizer_fingerprint, expect_chat_template_fingerprint)
        self.reads = ReadCounts()
        self.verified: set[int] = set()  # shards whose sha256 was checked (shared by every dataset over the index)
        # Shard → its sha256 being computed in the background (`verify_ahead`), by this process's threads.
        self._pending: dict[int, Future[str]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._owner = os.getpid()
        sel = self.manifest.split
        shards: list[_Shard] = []
        lengths, val, keys = [], [], []
        for info in self.manifest.shards:
            shard, encoded = self._index_shard(info)
            shards.append(shard)
            lengths.append(np.diff(shard.offsets).astype(np.int32))
            # Equal keys are compared as strings before anything is refused.
            flags, key = _split_keys(encoded, sel.seed, sel.val_fraction)
            val.append(flags)
            keys.append(key)
        self.shards = shards
        self.starts = np.zeros(len(shards) + 1, dtype=np.int64)  # (K+1,) first sample of each shard
        np.cumsum([s.offsets.size - 1 for s in shards], out=self.starts[1:])
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)  # (N,) int32
        self.val = np.concatenate(val) if val else np.zeros(0, bool)  # (N,) bool
        self._check_ids_unique(np.concatenate(keys) if keys else np.zeros(0, np.int64))
        self.manifest.check_totals(self.directory)

    def check(self, target_fingerprint: str | None, tokenizer_fingerprint: str | None,
              chat_template_fingerprint: str | None) -> None:
        """Refuse the folder when it was made for another target, tokenizer or chat template (None = skip)."""
        self.manifest.check(target_fingerprint=target_fingerprint, tokenizer_fingerprint=tokenizer_fingerprint,
                            chat_template_fingerprint=chat_template_fingerprint,
                            where=f"precompute folder {self.directory}")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def select(self, split: str) -> np.ndarray:
        """(n,) int64 positions of the samples of `split` ("train", "val" or "all"), in manifest order."""
        if split == "all":
            return np.arange(len(self), dtype=np.int64)
        return np.flatnonzero(self.val if split == "val" else ~self.val).astype(np.int64)

    def shard_of(self, positions: np.ndarray) -> np.ndarray:
        """(n,) int32 shard index of each sample position."""
        return (np.searchsorted(self.starts, positions, side="right") - 1).astype(np.int32)


    def verify(self, k: int) -> None:
        """Check shard k's sha256 against the manifest, once (CorruptShardError naming it otherwise)."""
        if k in self.verified:
            return
        sh = self.shards[k]
        ahead = self._pending.pop(k, None)  # hashed or being hashed by `verify_ahead` (counted there)
        if ahead is None or (os.getpid() != self._owner and not ahead.done()):
            # Not started ahead, or a forked copy, where the hashing thread is not: hashed here.
            self.reads.hashes += 1
            ahead = None
        # A future cancelled by close() before it ran has hashed nothing yet.
        actual = sha256_file(sh.path) if ahead is None or ahead.cancelled() else ahead.result()
        if actual != sh.info.sha256:
            raise CorruptShardError(
                f"{sh.path} is corrupt: sha256 {actual}, the manifest expects {sh.info.sha256}; {_advice(sh.path)}"
            )
        self.verified.add(k)

    def verify_ahead(self, shards: Iterable[int]) -> None:
        """Start hashing `shards` (those neither verified nor under way) in background threads, in the order given.

        Nothing is decided here: `verify(k)` waits for shard k's hash and checks it as it would its own, so the
        same shards are refused with the same errors; only the hashing overlaps what the caller does meanwhile
        (and other shards' hashing, on several cores).
        """
        todo = [k for k in dict.fromkeys(int(k) for k in shards) if k not in self.verified and k not in self._pending]
        if not todo or os.getpid() != self._owner:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(min(HASH_THREADS, os.cpu_count() or 1), thread_name_prefix="shard-sha256")
        for k in todo:
            self.reads.hashes += 1
            self._pending[k] = self._pool.submit(sha256_file, self.shards[k].path)

    def close(self) -> None:
        """Stop the background hashing `verify_ahead` started (a shard not hashed yet is hashed when read)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        # Threads and futures stay in this process; a copy hashes what it reads itself.
        return {**self.__dict__, "_pending": {}, "_pool": None}

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

    def _index_shard(self, info: ShardInfo) -> tuple[_Shard, list[bytes]]:
        """Check a shard against its own header, its sidecar and the manifest; returns it with its sample ids in
        UTF-8 (read from the header and `offsets` only, no hidden states)."""
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
            self.reads.headers += 1
            with safe_open(str(path), framework="pt", device="cpu") as f:
                layout = shard_layout(f)
        except ShardLayoutError as e:
            raise CorruptShardError(f"{path} is not a shard of the format: {e}; {_advice(path)}") from None
        except (SafetensorError, ValueError, OSError) as e:
            raise CorruptShardError(f"{path}: unreadable header ({e}): {_advice(path)}") from None
        self._check_against_manifest(info, path, layout, side, size)
        encoded = [sid.encode() for sid in layout.ids]
        return _Shard.make(info, path, layout.offsets, encoded), encoded

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

    def _check_ids_unique(self, keys: np.ndarray) -> None:
        """Refuse a folder where a sample appears in two shards (a shard copied under another name, or mixed runs):
        it would be trained on twice. keys: (N,) a hash of each sample id; only samples whose key is met twice are
        looked at by id."""
        ordered = np.sort(keys)
        twice = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
        if not twice.size:
            return
        first: dict[str, int] = {}
        for p in np.flatnonzero(np.isin(keys, twice)).tolist():  # in manifest order, as a walk over the shards
            k = int(self.shard_of(np.array([p]))[0])
            sid = self.shards[k].id(p - int(self.starts[k]))
            j = first.setdefault(sid, k)
            if j != k:
                raise ManifestError(
                    f"{self.directory / 'manifest.json'} lists sample {sid!r} twice: in "
                    f"{self.shards[j].path.name} and in {self.shards[k].path.name} (a shard copied under another "
                    "name, or shards of two runs); "
                    f"{restore_advice(self.directory)}"
                )


class PrecomputedDataset(torch.utils.data.Dataset):
    """Random access to the samples of a precompute folder.

    `ds[i]` → {"id": str, "input_ids": LongTensor (L,), "loss_mask": uint8 (L,), "hidden": (L, H) in the
    storage dtype (bf16; an fp8 folder's rows come back dequantised, in bf16), and "aux_hidden": (L, k*H) when
    the folder has aux layers}. `lengths`: (n,) int64 numpy array of the samples' lengths.

    Building one costs the folder's `FolderIndex` (pass `index=` another split's `ds.index` to share it) and a few
    numpy arrays (16 bytes a sample); no shard is opened for data until a sample is read.

    Args:
        directory: the precompute folder.
        expect_target_fingerprint: refuse a folder made for another target (None = do not check); likewise
            expect_tokenizer_fingerprint and expect_chat_template_fingerprint.
        split: "train", "val" or "all", by the manifest's recorded rule.
        verify: "first_open" hashes a shard the first time a sample of it is read, "always" hashes every shard
            here, before any sample is read, "never" only checks sizes.
        rank, world: this rank keeps every world-th sample of the split, starting at rank (disjoint, and the same
            whatever the shard layout).
        index: the folder already indexed (by another split's dataset); None = index it here.
        max_open: shard files kept open at once; the least recently read is closed when another opens.

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
        *,
        index: FolderIndex | None = None,
        max_open: int = MAX_OPEN,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be train|val|all, got {split!r}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {'|'.join(VERIFY_MODES)}, got {verify!r}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        expect = (expect_target_fingerprint, expect_tokenizer_fingerprint, expect_chat_template_fingerprint)
        if index is None:
            index = FolderIndex(directory, *expect)
        elif Path(directory).resolve() != index.directory.resolve():
            raise ValueError(f"index= is the index of {index.directory}, not of {directory}")
        else:
            index.check(*expect)
        self.index = index
        self.directory = index.directory
        self.where = str(self.directory)  # named in errors (a TokenDataset names its data.paths)
        self.manifest = index.manifest
        self.split, self.verify, self.rank, self.world, self.max_open = split, verify, rank, world, max_open
        self._handles: OrderedDict[int, Any] = OrderedDict()  # shard → its open file, least recently read first
        if verify == "always":
            for k in range(len(index.shards)):
                index.verify(k)
        pos = index.select(split)[rank::world]  # (n,) folder positions, in manifest order
        self._shard_of = index.shard_of(pos)  # (n,) int32
        self._row_of = (pos - index.starts[self._shard_of]).astype(np.int32)  # (n,) row in its shard
        self.lengths: np.ndarray = index.lengths[pos].astype(np.int64)  # (n,)

    @property
    def reads(self) -> ReadCounts:
        """The index's read counters (shared with the other datasets over it)."""
        return self.index.reads

    @property
    def _verified(self) -> set[int]:
        return self.index.verified

    @property
    def ids(self) -> list[str]:
        """The samples' ids, in order (made at each call: a list of n strings)."""
        shards = self.index.shards
        return [shards[k].id(j) for k, j in zip(self._shard_of.tolist(), self._row_of.tolist())]

    def _runs(self) -> Iterator[tuple[int, int, int]]:
        """(shard, lo, hi): samples lo:hi of this dataset are in shard `shard` (they come in manifest order)."""
        cuts = np.flatnonzero(np.diff(self._shard_of)) + 1
        bounds = [0, *cuts.tolist(), len(self)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                yield int(self._shard_of[lo]), lo, hi

    def _handle(self, k: int) -> Any:
        """Shard k open for reading; opens it (verifying it first under first_open) and closes the least recently
        read shard beyond `max_open`."""
        got = self._handles.get(k)
        if got is not None:
            self._handles.move_to_end(k)
            return got
        if self.verify == "first_open":
            self.index.verify(k)
        self.index.reads.opens += 1
        got = safe_open(str(self.index.shards[k].path), framework="pt", device="cpu")
        self._handles[k] = got
        while len(self._handles) > self.max_open:
            _, old = self._handles.popitem(last=False)
            old.__exit__(None, None, None)  # tensors already read keep their own reference to the mapping
        return got

    def verify_ahead(self, indices: Iterable[int]) -> None:
        """Under verify="first_open", start hashing the shards of samples `indices` (say, the first batch) in the
        background (`FolderIndex.verify_ahead`); reading a sample still waits for its shard's check."""
        if self.verify == "first_open":
            idx = np.asarray(list(indices), dtype=np.int64)  # (b,)
            self.index.verify_ahead(self._shard_of[idx].tolist())

    def close(self) -> None:
        """Close the open shard files (a later read reopens them)."""
        while self._handles:
            _, f = self._handles.popitem()
            f.__exit__(None, None, None)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i = i % len(self)
        k, j = int(self._shard_of[i]), int(self._row_of[i])
        sh = self.index.shards[k]
        a, b = int(sh.offsets[j]), int(sh.offsets[j + 1])
        f = self._handle(k)
        # get_slice reads only rows a:b of each tensor from the memory map.
        item = {
            "id": sh.id(j),
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

        masked_only counts only tokens under the loss mask (the assistant tokens a head learns to draft). A whole
        split's loss-masked counts come from the folder's `token_counts.safetensors` when it has one (no shard is
        read); otherwise the token and mask columns are read shard by shard, each file closed after it, never the
        hidden states and without hashing (a shard is verified when its samples are first read).
        """
        if masked_only and self.world == 1:
            # The file counts the folder's own target vocabulary; a caller may count in a wider one.
            stored = read_token_counts(self.directory, self.split, self.manifest.target.vocab_size)
            if stored is not None:
                return self._resized(stored, vocab_size)
            log.warning("%s has no token_counts.safetensors (made by an older mtp-precompute): counting the "
                        "tokens of its %s split reads input_ids and loss_mask of %d shards (%.1f MB)", self.directory,
                        self.split, len(set(self._shard_of.tolist())),
                        5 * sum(self.index.shards[k].info.tokens for k, _, _ in self._runs()) / 1e6)
        return self._count_tokens(vocab_size, masked_only)

    def _resized(self, counts: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """counts (V,) as (vocab_size,): padded with zeros, or cut where it counts no id (ValueError otherwise)."""
        if vocab_size >= counts.numel():
            return torch.nn.functional.pad(counts, (0, vocab_size - counts.numel()))
        seen = torch.nonzero(counts[vocab_size:]).flatten()
        if seen.numel():
            raise ValueError(f"{self.directory}: token id {vocab_size + int(seen[-1])} >= vocabulary size {vocab_size}")
        return counts[:vocab_size].clone()

    def _count_tokens(self, vocab_size: int, masked_only: bool) -> torch.Tensor:
        """`token_counts` from the shards' own token and mask columns (one shard open at a time)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for k, lo, hi in self._runs():
            sh = self.index.shards[k]
            self.index.reads.scans += 1
            with safe_open(str(sh.path), framework="pt", device="cpu") as f:
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()  # (T,), (T,)
            take = np.zeros(sh.offsets.size - 1, dtype=bool)  # (S,) this dataset's samples of the shard
            take[self._row_of[lo:hi]] = True
            keep = torch.from_numpy(np.repeat(take, np.diff(sh.offsets)))  # (T,)
            if masked_only:
                keep &= mask
            sel = ids[keep]
            if sel.numel() and int(sel.max()) >= vocab_size:
                raise ValueError(f"{sh.path}: token id {int(sel.max())} >= vocabulary size {vocab_size}")
            counts += torch.bincount(sel, minlength=vocab_size)
        return counts

    def __getstate__(self) -> dict[str, Any]:
        # Open safetensors handles cannot be pickled (DataLoader workers); they reopen lazily.
        return {**self.__dict__, "_handles": OrderedDict()}
