"""Writing a precompute folder: `FolderWriter`, the one writer of hidden-state shards and their manifest.

A writer holds one rank's shard plans (`mtp_train.precompute.plan`), given all at once or `add`ed one by one as a
stream plans them. `begin` forgets a stale manifest and torn temporaries and keeps the shards a previous run
finished (their sidecars match the plan); `record` takes the target's rows of any samples, in any grouping, and
stores each in its shard; a shard whose every sample is in goes to a writer thread that writes it and its sidecar
atomically (`mtp_train.precompute.shards`), then its counts by split, while the target computes on; `finish`
waits for the last write, and rank 0 assembles `token_counts.safetensors` and `manifest.json` from the sidecars
and counts files, last (`write_manifest` from every plan and row, `write_streamed_manifest` from every rank's
`ShardEntry` list, holding no row). `mtp-precompute` (`pipeline.precompute`) and hybrid training
(`mtp_train.train.sources.hybrid`) both write their folders with it, so they write one format.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mtp_train.config import PrecomputeConfig
from mtp_train.fileio import TMP_PREFIX
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.models.foreign import target_model_type
from mtp_train.precompute.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    TOKEN_COUNTS_NAME,
    HiddenInfo,
    Manifest,
    ManifestError,
    ShardInfo,
    SplitInfo,
    TargetInfo,
    TokenizerInfo,
    Totals,
    write_token_counts,
)
from mtp_train.precompute.quant import FP8, dequantize_fp8, quantize_fp8
from mtp_train.precompute.shards import (
    SPLIT_NAMES,
    count_samples,
    counts_from_shard,
    finished_shard,
    matching_sidecar,
    read_shard_counts,
    sidecar_path,
    write_shard,
    write_shard_counts,
)

if TYPE_CHECKING:  # annotations only
    from mtp_train.data.samples import Row
    from mtp_train.models.config import ModelArgs
    from mtp_train.precompute.plan import ShardPlan

log = logging.getLogger(__name__)


class PrecomputeError(RuntimeError):
    """A precompute run that cannot go on; the message says what to do."""


FP8_STORAGE = "float8_e4m3"
# `hidden_dtype` setting → the dtype of the stored hidden / aux_hidden tensors (fp8 adds per-token scales).
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, FP8_STORAGE: FP8}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_stored(x: torch.Tensor, storage: str, groups: int = 1) -> torch.Tensor:
    """x: (T, groups·H) as a shard stores it and the reader returns it: cast to the storage dtype, or for fp8
    quantised and dequantised to bf16 (one scale per token and group). Online training feeds the head this, so it
    sees exactly what it would read from a folder written with `storage`."""
    if storage == FP8_STORAGE:
        return dequantize_fp8(*quantize_fp8(x, groups=groups))
    return x.to(STORAGE_DTYPES[storage])


def new_shard_tensors(plan: ShardPlan, hidden_size: int, k: int, storage: str) -> dict[str, torch.Tensor]:
    """The CPU tensors of one shard (the format in `manifest`): ids, mask and offsets filled from the plan,
    hidden (T, H) and aux_hidden (T, k·H) (and fp8 scales) empty, to be filled with `store_rows`."""
    lengths = [r.ids.size for r in plan.rows]
    t = plan.tokens
    dtype = STORAGE_DTYPES[storage]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate([r.ids for r in plan.rows])),  # (T,) int32
        "loss_mask": torch.from_numpy(np.concatenate([r.mask for r in plan.rows])),  # (T,) uint8
        "hidden": torch.empty(t, hidden_size, dtype=dtype),  # (T, H), filled batch by batch
        "offsets": torch.from_numpy(offsets),  # (S+1,)
    }
    if k:
        tensors["aux_hidden"] = torch.empty(t, k * hidden_size, dtype=dtype)  # (T, k*H)
    if storage == FP8_STORAGE:
        tensors["hidden_scale"] = torch.empty(t, 1, dtype=torch.float32)  # (T, 1)
        if k:
            tensors["aux_hidden_scale"] = torch.empty(t, k, dtype=torch.float32)  # (T, k): one per layer
    return tensors


def store_rows(tensors: dict[str, torch.Tensor], a: int, b: int, hidden: torch.Tensor, aux: torch.Tensor | None,
               storage: str) -> None:
    """Put rows a:b of a shard: hidden (b-a, H) and aux (b-a, k·H) (or None), in the forward's own precision, on
    any device."""
    if storage == FP8_STORAGE:  # quantised from the forward's own precision, one scale per token (and layer)
        q, scale = quantize_fp8(hidden)
        tensors["hidden"][a:b], tensors["hidden_scale"][a:b] = q, scale
        if aux is not None:
            q, scale = quantize_fp8(aux, groups=tensors["aux_hidden_scale"].shape[1])
            tensors["aux_hidden"][a:b], tensors["aux_hidden_scale"][a:b] = q, scale
    else:
        # copy_ casts to the storage dtype as it lands in the preallocated CPU buffer.
        tensors["hidden"][a:b].copy_(hidden)
        if aux is not None:
            tensors["aux_hidden"][a:b].copy_(aux)


def check_settings(cfg: PrecomputeConfig, prefix: str = "") -> None:
    """Refuse stage-one settings that cannot be used, naming the key as `prefix` + its name ("" for
    mtp-precompute, "data.online." for mtp-train's online and hybrid sources)."""
    aux_layers = [int(j) for j in cfg.aux_layers]
    if len(set(aux_layers)) != len(aux_layers):
        raise ValueError(f"{prefix}aux_layers {aux_layers} has duplicates")
    if cfg.hidden_dtype not in STORAGE_DTYPES:
        raise ValueError(f"{prefix}hidden_dtype={cfg.hidden_dtype!r}: choose one of {', '.join(STORAGE_DTYPES)}")
    if cfg.shard_tokens < 1 or cfg.batch_tokens < 1:
        raise ValueError(f"{prefix}shard_tokens and {prefix}batch_tokens must be positive")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ValueError(f"{prefix}val_fraction must be in [0, 1), got {cfg.val_fraction}")


@dataclass
class FolderSpec:
    """What the shards of a precompute folder are: the target and its compute dtype, the stored hidden states."""

    target: TargetInfo
    hidden: HiddenInfo
    storage: str  # a key of STORAGE_DTYPES
    backend: str = "engine"  # who computes the hidden states: engine (ours) | vllm (captured inside vLLM)

    @property
    def settings(self) -> dict[str, Any]:
        """Everything that changes a shard's bytes (enters every plan hash): a shard written under other settings
        is redone. vLLM's kernels give other bytes than ours, so a shard one backend wrote is never another's;
        the engine's own entry is left out, so that its folders keep the plan hashes they were written with."""
        backend = {} if self.backend == "engine" else {"backend": self.backend}
        return {"format_version": FORMAT_VERSION, "target_fingerprint": self.target.fingerprint,
                "target_dtype": self.target.dtype, "hidden": self.hidden.__dict__, **backend}

    @property
    def metadata(self) -> dict[str, str]:
        """The safetensors metadata of every shard (sample_ids are added per shard)."""
        return {"format_version": str(FORMAT_VERSION), "hidden_dtype": self.hidden.dtype,
                "aux_layers": json.dumps(self.hidden.aux_layers)}


def folder_spec(args: ModelArgs, dtype: torch.dtype, model_dir: str | Path, storage: str,
                aux_layers: Sequence[int], backend: str = "engine") -> FolderSpec:
    """The FolderSpec of a target (config `args`, computing in `dtype`, weights in `model_dir`) whose hidden states
    `backend` computes."""
    target = TargetInfo(path=str(Path(model_dir).resolve()), fingerprint=weights_fingerprint(model_dir),
                        model_type=target_model_type(args), hidden_size=args.hidden_size, num_layers=args.num_layers,
                        vocab_size=args.vocab_size, dtype=dtype_name(dtype))
    hidden = HiddenInfo(kind="final_norm", dtype=dtype_name(STORAGE_DTYPES[storage]),
                        aux_layers=[int(j) for j in aux_layers])
    return FolderSpec(target, hidden, storage, backend)


@dataclass(frozen=True)
class ShardEntry:
    """What rank 0 needs of another rank's shard to list it: which plan it was written for (its sidecar must
    match) and its counts. A few hundred bytes, where the plan holds every row."""

    name: str
    rank: int
    index: int
    plan_sha256: str
    ids_sha256: str
    samples: int
    tokens: int
    loss_tokens: int

    @classmethod
    def of(cls, plan: ShardPlan) -> ShardEntry:
        return cls(plan.name, plan.rank, plan.index, plan.plan_sha256, plan.ids_sha256, len(plan.rows), plan.tokens,
                   plan.loss_tokens)


def entry_finished(out_dir: Path, e: ShardEntry) -> ShardInfo | None:
    """The shard's info when its file and sidecar are those of entry `e` (`finished_shard` without the rows)."""
    return matching_sidecar(out_dir, e.name, plan_sha256=e.plan_sha256, ids_sha256=e.ids_sha256, samples=e.samples,
                            tokens=e.tokens, loss_tokens=e.loss_tokens)


def folder_manifest(shards: list[ShardInfo], spec: FolderSpec, counts: dict[str, int], token_counts: Any, *,
                    tokenizer_fingerprint: str, chat_template_fingerprint: str, data_info: dict[str, Any],
                    val_fraction: float, seed: int, provenance: dict[str, Any]) -> Manifest:
    """The manifest of a folder holding `shards` (in order), its totals summed from them; `counts` are the split's
    sample counts, `token_counts` the entry of its token_counts.safetensors (None: none written)."""
    totals = Totals(samples=sum(s.samples for s in shards), tokens=sum(s.tokens for s in shards),
                    loss_tokens=sum(s.loss_tokens for s in shards), bytes=sum(s.bytes for s in shards))
    return Manifest(
        target=spec.target,
        tokenizer=TokenizerInfo(fingerprint=tokenizer_fingerprint, chat_template_fingerprint=chat_template_fingerprint),
        hidden=spec.hidden,
        data=dict(data_info),
        split=SplitInfo(val_fraction=val_fraction, seed=seed, counts=counts),
        shards=shards,
        totals=totals,
        provenance=provenance,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        token_counts=token_counts,
    )


def _dense(vocab_size: int) -> dict[str, torch.Tensor]:
    return {s: torch.zeros(vocab_size, dtype=torch.int64) for s in SPLIT_NAMES}  # split → (V,)


def assemble_manifest(out_dir: Path, plans: Sequence[ShardPlan], rows: Sequence[Row], spec: FolderSpec, *,
                      tokenizer_fingerprint: str, chat_template_fingerprint: str, data_info: dict[str, Any],
                      val_fraction: float, seed: int, provenance: dict[str, Any],
                      redo: str = "re-run precompute to redo it") -> Manifest:
    """The manifest of a folder whose shards `plans` (every rank's, in manifest order) are all finished; raises
    PrecomputeError naming the first one that is not (and `redo`, what to do). `rows`: every sample, for the split
    counts and the token counts, whose file (`TOKEN_COUNTS_NAME`) is written here, before the manifest."""
    shards = []
    for p in plans:
        info = finished_shard(out_dir, p, verify=False)  # each rank hashed its own shards
        if info is None:
            raise PrecomputeError(f"rank {p.rank} did not finish {out_dir / p.name}; {redo}")
        shards.append(info)
    dense = _dense(spec.target.vocab_size)
    counts = count_samples(((r.id, r.ids, r.mask) for r in rows), seed, val_fraction)  # one pass: split and tokens
    counts.add_to(dense)
    entry = write_token_counts(out_dir, dense["train"], dense["val"])
    return folder_manifest(shards, spec, counts.split, entry, tokenizer_fingerprint=tokenizer_fingerprint,
                           chat_template_fingerprint=chat_template_fingerprint, data_info=data_info,
                           val_fraction=val_fraction, seed=seed, provenance=provenance)


def assemble_streamed(out_dir: Path, entries: Sequence[ShardEntry], spec: FolderSpec, *,
                      tokenizer_fingerprint: str, chat_template_fingerprint: str, data_info: dict[str, Any],
                      val_fraction: float, seed: int, provenance: dict[str, Any],
                      redo: str = "re-run precompute to redo it") -> Manifest:
    """`assemble_manifest` from what the shards record: `entries` are every rank's shards in manifest order; the
    split counts and `token_counts.safetensors` are the sums of the shards' counts files (a shard whose counts file
    is missing or of another plan or split rule is counted from its own ids and masks). Holds no row."""
    shards = []
    counts = {f"{s}_{k}": 0 for s in SPLIT_NAMES for k in ("samples", "tokens", "loss_tokens")}
    dense = _dense(spec.target.vocab_size)
    for e in entries:
        info = entry_finished(out_dir, e)
        if info is None:
            raise PrecomputeError(f"rank {e.rank} did not finish {out_dir / e.name}; {redo}")
        shards.append(info)
        sc = read_shard_counts(out_dir, e.name, e.plan_sha256, seed, val_fraction)
        if sc is None:
            sc = counts_from_shard(out_dir / e.name, seed, val_fraction)
        for k in counts:
            counts[k] += sc.split[k]
        sc.add_to(dense)
    entry = write_token_counts(out_dir, dense["train"], dense["val"])
    return folder_manifest(shards, spec, counts, entry, tokenizer_fingerprint=tokenizer_fingerprint,
                           chat_template_fingerprint=chat_template_fingerprint, data_info=data_info,
                           val_fraction=val_fraction, seed=seed, provenance=provenance)


def _settings_changed(manifest: Manifest, spec: FolderSpec, world: int, cfg: PrecomputeConfig) -> list[str]:
    """What a finished folder's manifest says that this run would change, in words; [] when the settings agree (the
    samples may still differ)."""
    was = manifest.provenance.get("settings") or {}
    pairs = [("backend", was.get("backend", "engine"), spec.backend),  # a folder that records none is the engine's
             ("target weights", manifest.target.fingerprint, spec.target.fingerprint),
             ("target dtype", manifest.target.dtype, spec.target.dtype),
             ("hidden_dtype", manifest.hidden.dtype, spec.hidden.dtype),
             ("aux_layers", manifest.hidden.aux_layers, spec.hidden.aux_layers),
             ("val_fraction", manifest.split.val_fraction, cfg.val_fraction),
             ("seed", manifest.split.seed, cfg.seed),
             ("shard_tokens", was.get("shard_tokens", cfg.shard_tokens), cfg.shard_tokens),
             ("ranks", was.get("world", world), world)]
    return [f"{key} {old}, this run {new}" for key, old, new in pairs if old != new]


def finished_of_same_settings(out_dir: Path, spec: FolderSpec, world: int, cfg: PrecomputeConfig,
                              ) -> Manifest | None:
    """The first half of `check_replaces`, which needs no sample: refuses (PrecomputeError, naming what differs) a
    finished folder in `out_dir` of other settings, the backend that computed its states included; returns its
    manifest when its settings are this run's (whether its samples are is for `first_difference` to say); None when
    the run goes on whatever its samples: no folder or manifest yet, a damaged manifest a re-run repairs, or
    `overwrite=true` (which redoes any).

    Args:
        out_dir: the run's output folder.
        spec: what this run's shards are (target, stored states, backend).
        world: the run's data-parallel ranks.
        cfg: the run's settings (split, shard size, overwrite).
    """
    if cfg.overwrite or not (out_dir / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = Manifest.load(out_dir)
    except ManifestError:
        return None
    changed = _settings_changed(manifest, spec, world, cfg)
    if changed:
        refuse_other(out_dir, changed)
    return manifest


def refuse_other(out_dir: Path, changed: Sequence[str]) -> None:
    """Raise the PrecomputeError of a finished folder of other settings or samples (`changed`, in words)."""
    raise PrecomputeError(f"{out_dir} holds a finished precompute of other settings ({'; '.join(changed)}): a "
                          "re-run replaces it only with overwrite=true; choose another `out`, or re-run with the "
                          "settings that made it")


def other_samples(manifest: Manifest, where: str) -> str:
    """`refuse_other`'s words for a folder of the same settings and other samples (`where`: the first shard that
    differs, in words)."""
    return (f"other samples ({len(manifest.shards)} shards of {manifest.totals.samples} samples; {where}: data, "
            "limit, max_seq_len or the chat template)")


def first_difference(out_dir: Path, manifest: Manifest, plans: Iterable[ShardPlan], rank: int, world: int, *,
                     to_the_end: bool = False) -> str | None:
    """Compare rank `rank`'s shards, as they stream in, with the finished folder's: None when `manifest` lists
    exactly them (the shards of other ranks and the ranks' order are checked here too, from the manifest alone),
    else the first difference in words. Nothing is written and no row is kept. to_the_end: read every plan even
    after a difference (ranks that read the same data then fail alike on a bad row anywhere in it).
    """
    if any(s.rank not in range(world) for s in manifest.shards) or [s.rank for s in manifest.shards] != sorted(
            s.rank for s in manifest.shards):
        return "its shards are not this run's ranks in order"
    mine = [s for s in manifest.shards if s.rank == rank]
    diff: str | None = None
    k = 0
    for k, plan in enumerate(plans, start=1):
        if diff is None:
            have = mine[k - 1] if k <= len(mine) else None
            if have is None:
                diff = f"this run has more shards than its {len(mine)} of rank {rank}"
            elif have.file != plan.name or finished_shard(out_dir, plan, verify=False) != have:
                diff = f"this run's {plan.name} holds other samples"
        if diff is not None and not to_the_end:
            break
    if diff is None and k < len(mine):
        diff = f"this run has {k} shards of rank {rank}, the folder {len(mine)}"
    return diff


def check_replaces(out_dir: Path, spec: FolderSpec, plans: Sequence[ShardPlan], world: int,
                   cfg: PrecomputeConfig) -> Manifest | None:
    """Judge a finished folder in `out_dir` against what this run writes (`plans`, every rank's in manifest order)
    before anything in it changes. Returns its manifest when it already is exactly that folder: nothing is to be
    done, and the run writes nothing (not even its config or a new manifest: the folder's provenance stays the
    run's that made it). Refuses (PrecomputeError, naming what differs) a finished folder of other settings or
    samples, the backend that computed its states included. Returns None when the run goes on: no folder or
    manifest yet, a damaged manifest a re-run repairs, or `overwrite=true` (which redoes any). A run that plans as
    it streams uses its two halves, `finished_of_same_settings` and `first_difference`.

    Args:
        out_dir: the run's output folder.
        spec: what this run's shards are (target, stored states, backend).
        plans: every rank's shards, in manifest order.
        world: the run's data-parallel ranks.
        cfg: the run's settings (split, shard size, overwrite).
    """
    manifest = finished_of_same_settings(out_dir, spec, world, cfg)
    if manifest is None:
        return None
    if folder_complete(out_dir, plans):
        return manifest
    refuse_other(out_dir, [f"other samples ({len(manifest.shards)} shards of {manifest.totals.samples} samples, this "
                           f"run {len(plans)} of {sum(len(p.rows) for p in plans)}: data, limit, max_seq_len or the "
                           "chat template)"])
    return None  # not reached: refuse_other raises


def folder_complete(out_dir: Path, plans: Sequence[ShardPlan]) -> bool:
    """Whether `out_dir` holds the finished folder of `plans` (every rank's, in manifest order): its manifest lists
    exactly their shards, as their sidecars describe them."""
    try:
        manifest = Manifest.load(out_dir)
    except ManifestError:
        return False
    if [s.file for s in manifest.shards] != [p.name for p in plans]:
        return False
    return all(finished_shard(out_dir, p, verify=False) == s for p, s in zip(plans, manifest.shards))


ShardHook = Callable[["ShardInfo", bool], None]  # (the shard's sidecar info, skipped: found done on disk)


class FolderWriter:
    """One rank's shards of a precompute folder (the module docstring): plan → `begin` → `record` rows →
    `finish` → (rank 0, after every rank finished) `write_manifest`; `close` always. Or, as a stream plans the
    shards: `begin` → for each plan `add` (and, when it returns True, `record` its rows) → `finish` →
    `write_streamed_manifest` from every rank's `entries`.

    plans: this rank's shards, in order, each sample in one of them (none when they are `add`ed). writes=False: a
    tensor-parallel member that computes the same shards as its group's writer and writes nothing (it only learns
    which shards are done). verify: re-hash finished shards before keeping them. on_shard(info, skipped): after
    each shard is written (skipped=False, called in the caller's thread when the write is collected) or found done
    at `begin` / `add` (skipped=True); an exception from it stops the run, which resumes later. split: the split
    rule's (seed, val_fraction): each shard's counts by split are written beside it (`shards.write_shard_counts`),
    for `write_streamed_manifest`; None writes none. Host memory: the shards being filled (one when rows come in
    shard order) and the one being written, about 2 · shard_tokens · (k+1) · H storage bytes; a plan's rows are
    let go once its shard is written.
    """

    def __init__(self, out_dir: str | Path, spec: FolderSpec, plans: Sequence[ShardPlan] = (), *, rank: int,
                 writes: bool = True, verify: bool = False, on_shard: ShardHook | None = None,
                 split: tuple[int, float] | None = None) -> None:
        self.out_dir, self.spec, self.plans = Path(out_dir), spec, list(plans)
        self.rank, self.writes, self.verify, self.on_shard, self.split = rank, writes, verify, on_shard, split
        self.slots: dict[str, tuple[int, int]] = {}  # sample id → (shard index, its first row in the shard)
        self.by_index: dict[int, ShardPlan] = {}  # the plans whose shards are not written yet
        self.entries: list[ShardEntry] = []  # every shard of this rank so far, in order (what rank 0 lists)
        for p in self.plans:
            self._register(p)
        self.done: set[int] = set()  # shard indices finished on disk (or handed to the writer thread)
        self._found: dict[int, ShardInfo] | None = None  # what `scan` found finished on disk
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}  # shard index → its tensors being filled
        self._filled: dict[int, set[str]] = {}  # shard index → ids stored so far
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._pending: Future[ShardInfo] | None = None

    def _register(self, p: ShardPlan) -> None:
        row = 0
        for r in p.rows:
            self.slots[r.id] = (p.index, row)
            row += int(r.ids.size)
        self.by_index[p.index] = p
        self.entries.append(ShardEntry.of(p))

    def _release(self, p: ShardPlan) -> None:
        """Forget a plan whose shard is on disk (or on its way there): its rows are not needed any more."""
        for r in p.rows:
            self.slots.pop(r.id, None)
        self.by_index.pop(p.index, None)

    @property
    def todo(self) -> list[ShardPlan]:
        """This rank's shards not finished yet, in order (of the plans given at construction)."""
        return [p for p in self.plans if p.index not in self.done]

    def needs(self, sample_id: str) -> bool:
        """Whether `sample_id` belongs to one of this rank's unfinished shards."""
        slot = self.slots.get(sample_id)
        return slot is not None and slot[0] not in self.done

    def scan(self) -> None:
        """Find the shards a previous run finished (file and sidecar match the plan), writing nothing: `todo` is
        then what is left to do, known before the run commits to anything. `begin` scans when this was not called."""
        self._found = {}
        for p in self.plans:
            info = finished_shard(self.out_dir, p, verify=self.verify)
            if info is not None:
                self._found[p.index] = info
        self.done = set(self._found)

    def begin(self, *, owner: bool, on_start: Callable[[], None] | None = None) -> None:
        """Open the folder: owner (the one process writing the manifest) calls on_start() and removes a stale
        manifest (it would vouch for shards about to be rewritten) and token counts; a writing rank removes its
        torn temporaries and the sidecars of shards that will be redone. Call a barrier after it, before any rank
        records."""
        if self._found is None:
            self.scan()
        assert self._found is not None
        if self.writes:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        if owner:
            if on_start is not None:
                on_start()
            for name in (MANIFEST_NAME, TOKEN_COUNTS_NAME):
                for stale in (self.out_dir / name, self.out_dir / (TMP_PREFIX + name)):
                    stale.unlink(missing_ok=True)
        if self.writes:
            for tmp in self.out_dir.glob(f"{TMP_PREFIX}shard-r{self.rank}-*"):
                tmp.unlink(missing_ok=True)  # torn temporaries of a killed run
        for p in self.plans:
            info = self._found.get(p.index)
            if info is not None:
                self._kept(p, info)
            elif self.writes:
                sidecar_path(self.out_dir / p.name).unlink(missing_ok=True)  # it no longer describes the file

    def add(self, plan: ShardPlan) -> bool:
        """Take the next shard of a stream of plans (after `begin`); True when it is to be computed (`record` its
        rows), False when a previous run finished it (on_shard(info, True) is called)."""
        self._register(plan)
        info = finished_shard(self.out_dir, plan, verify=self.verify)
        if info is not None:
            self.done.add(plan.index)
            self._kept(plan, info)
            return False
        if self.writes:
            sidecar_path(self.out_dir / plan.name).unlink(missing_ok=True)  # it no longer describes the file
        return True

    def _kept(self, plan: ShardPlan, info: ShardInfo) -> None:
        """A shard a previous run finished: its counts are written again unless they are of this plan and split."""
        if self.writes and self.split is not None:
            seed, val_fraction = self.split
            if read_shard_counts(self.out_dir, plan.name, plan.plan_sha256, seed, val_fraction) is None:
                write_shard_counts(self.out_dir, plan, seed, val_fraction)
        self._release(plan)
        if self.on_shard is not None:
            self.on_shard(info, True)

    def record(self, ids: Sequence[str], seq_lens: Sequence[int], hidden: torch.Tensor,
               aux: torch.Tensor | None) -> None:
        """Store the rows of packed samples `ids` (seq_lens rows each) that belong to this rank's unfinished
        shards; others (another rank's, evaluation's) are ignored. hidden (T, H), aux (T, k·H) or None, in the
        forward's precision, on any device. A shard whose every sample is in goes to the writer thread."""
        if not self.writes:
            return
        a = 0
        for sid, n in zip(ids, seq_lens):
            if self.needs(sid):
                index, row = self.slots[sid]
                plan = self.by_index[index]
                if index not in self._buffers:
                    self._buffers[index] = new_shard_tensors(plan, self.spec.target.hidden_size,
                                                             len(self.spec.hidden.aux_layers), self.spec.storage)
                    self._filled[index] = set()
                store_rows(self._buffers[index], row, row + n, hidden[a:a + n],
                           None if aux is None else aux[a:a + n], self.spec.storage)
                self._filled[index].add(sid)
                if len(self._filled[index]) == len(plan.rows):
                    del self._filled[index]
                    self._write(plan, self._buffers.pop(index))
            a += n

    def _write(self, plan: ShardPlan, tensors: dict[str, torch.Tensor]) -> None:
        # At most one shard waits for the disk: the next one blocks here until it is written.
        self.flush()
        self._pending = self._pool.submit(self._write_files, plan, tensors)
        self.done.add(plan.index)
        self._release(plan)

    def _write_files(self, plan: ShardPlan, tensors: dict[str, torch.Tensor]) -> ShardInfo:
        """The writer thread's work: the shard and its sidecar, then its counts (a shard whose counts a kill lost
        gets them when a re-run finds it done)."""
        info = write_shard(self.out_dir, plan, tensors, self.spec.metadata)
        if self.split is not None:
            write_shard_counts(self.out_dir, plan, *self.split)
        return info

    def flush(self) -> None:
        """Wait for the shard being written (e.g. before a checkpoint: what it counts as done is on disk)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            info = pending.result()  # re-raises a failed write here, in the caller's thread
            if self.on_shard is not None:
                self.on_shard(info, False)

    def finish(self) -> None:
        """Every row is recorded: wait for the last write; a shard still open is a bug of the caller's plan."""
        self.flush()
        if self._buffers:
            raise RuntimeError(f"shards {sorted(self._buffers)} of rank {self.rank} in {self.out_dir} are "
                               "incomplete: some of their samples were never recorded")
        missing = [e.name for e in self.entries if e.index not in self.done]
        if self.writes and missing:
            raise RuntimeError(f"rank {self.rank} never recorded the samples of {missing[:3]} in {self.out_dir}")

    def write_manifest(self, plans: Sequence[ShardPlan], rows: Sequence[Row], **fields: Any) -> Manifest:
        """Rank 0, once every rank has finished: assemble and save `manifest.json` (`assemble_manifest`, with
        `plans` every rank's shards in manifest order and `rows` every sample); returns it."""
        manifest = assemble_manifest(self.out_dir, plans, rows, self.spec, **fields)
        manifest.save(self.out_dir)
        return manifest

    def write_streamed_manifest(self, entries: Sequence[ShardEntry], **fields: Any) -> Manifest:
        """Rank 0, once every rank has finished: `write_manifest` from `entries`, every rank's shards in manifest
        order (each rank's `entries`), with the counts their counts files hold (`assemble_streamed`)."""
        manifest = assemble_streamed(self.out_dir, entries, self.spec, **fields)
        manifest.save(self.out_dir)
        return manifest

    def close(self) -> None:
        """Finish the write in flight and stop the writer thread (whatever happened before)."""
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
