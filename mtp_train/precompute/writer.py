"""Stage one: run the frozen target over tokenized samples and write hidden-state shards + the manifest.

Planning is a pure function of the sample list and the settings, so a re-run finds the same shards
under the same names and skips those already written (resume):

* ranks: rank r takes samples r, r+world, r+2*world, ... of the given order (strided, so every rank
  gets a similar mix of lengths whatever order the caller uses);
* shards: a rank's samples, in order, are cut into consecutive runs of at most `shard_tokens` tokens
  (a longer sample gets a shard of its own);
* batches: a shard's samples, in order, are cut the same way by `batch_tokens` into packed prefills.

Each shard is written to `.tmp-<name>`, fsynced and renamed; then its sidecar `<name>.json` (sha256,
counts, ids hash, plan hash) is written the same way. A shard counts as done only when its sidecar
matches the plan. After a barrier, rank 0 assembles `manifest.json` from the sidecars, last.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

import mtp_train
from mtp_train import dist as mdist
from mtp_train.engine.runner import prefill_hidden
from mtp_train.fileio import TMP_PREFIX, atomic_write, sha256_file
from mtp_train.models.base import CausalLM
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    HiddenInfo,
    Manifest,
    ShardInfo,
    SplitInfo,
    TargetInfo,
    TokenizerInfo,
    Totals,
    is_val,
    read_json,
    write_json,
)

log = logging.getLogger(__name__)

RANK_ASSIGNMENT = "strided: rank r takes samples r, r+world, r+2*world, ... of the given order"


class PrecomputeError(RuntimeError):
    """A precompute run that cannot go on; the message says what to do."""


@dataclass(frozen=True)
class Sample:
    """One tokenized conversation: loss_mask is 1 on the tokens the head learns (assistant tokens)."""

    id: str  # unique across the whole data set; decides the train/val split
    input_ids: list[int]  # (L,)
    loss_mask: list[int]  # (L,) 0/1


@dataclass
class _Row:
    """A validated sample as compact arrays."""

    id: str
    ids: np.ndarray  # (L,) int32
    mask: np.ndarray  # (L,) uint8


@dataclass
class ShardPlan:
    """What one shard will hold; two runs with equal plans write byte-identical shards."""

    rank: int
    index: int
    rows: list[_Row]
    tokens: int
    loss_tokens: int
    ids_sha256: str  # sha256 over the sample ids
    plan_sha256: str  # sha256 over the settings and every sample's id, tokens and mask

    @property
    def name(self) -> str:
        return shard_name(self.rank, self.index)


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank}-{index:05d}.safetensors"


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_runs(lengths: Sequence[int], budget: int) -> list[range]:
    """Cut consecutive items into runs of at most `budget` total length (an item over budget runs alone)."""
    runs: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > budget:
            runs.append(range(start, i))
            start, total = i, 0
        total += n
    if len(lengths) > start:
        runs.append(range(start, len(lengths)))
    return runs


def rank_slice(n: int, rank: int, world: int) -> range:
    """Indices of the samples rank `rank` precomputes (`RANK_ASSIGNMENT`)."""
    return range(rank, n, world)


def _rows(samples: Sequence[Sample], vocab_size: int) -> list[_Row]:
    """Validate samples (unique ids, equal lengths, ids in vocab, 0/1 mask) and convert them to arrays."""
    rows, seen = [], set()
    for s in samples:
        if s.id in seen:
            raise ValueError(f"duplicate sample id {s.id!r}: ids must be unique (they decide resume and the split)")
        seen.add(s.id)
        ids = np.asarray(s.input_ids, dtype=np.int64)
        mask = np.asarray(s.loss_mask, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"sample {s.id!r}: input_ids must be a non-empty list of ints")
        if mask.shape != ids.shape:
            raise ValueError(f"sample {s.id!r}: {ids.size} input_ids but {mask.size} loss_mask entries")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"sample {s.id!r}: token ids must be in 0..{vocab_size - 1}")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(f"sample {s.id!r}: loss_mask must hold only 0 and 1")
        rows.append(_Row(s.id, ids.astype(np.int32), mask.astype(np.uint8)))
    return rows


def plan_rank(rows: Sequence[_Row], rank: int, world: int, shard_tokens: int, settings: dict[str, Any]) -> list[
        ShardPlan]:
    """The shards rank `rank` writes, in order; `settings` (anything that changes shard bytes) enters the hash."""
    mine = [rows[i] for i in rank_slice(len(rows), rank, world)]
    settings_bytes = json.dumps(settings, sort_keys=True).encode()
    plans = []
    for index, run in enumerate(plan_runs([r.ids.size for r in mine], shard_tokens)):
        part = [mine[i] for i in run]
        ids_h, plan_h = hashlib.sha256(), hashlib.sha256(settings_bytes)
        for r in part:
            key = r.id.encode() + b"\0"
            ids_h.update(key)
            plan_h.update(key + r.ids.size.to_bytes(8, "little") + r.ids.tobytes() + r.mask.tobytes())
        plans.append(ShardPlan(rank, index, part, sum(r.ids.size for r in part), sum(int(r.mask.sum()) for r in part),
                               ids_h.hexdigest(), plan_h.hexdigest()))
    return plans


def _sidecar(plan: ShardPlan, sha256: str, size: int) -> dict[str, Any]:
    info = ShardInfo(file=plan.name, rank=plan.rank, index=plan.index, samples=len(plan.rows), tokens=plan.tokens,
                     loss_tokens=plan.loss_tokens, sha256=sha256, bytes=size)
    return {**info.__dict__, "format_version": FORMAT_VERSION, "first_id": plan.rows[0].id,
            "last_id": plan.rows[-1].id, "ids_sha256": plan.ids_sha256, "plan_sha256": plan.plan_sha256}


def finished_shard(out_dir: Path, plan: ShardPlan, verify: bool) -> ShardInfo | None:
    """The shard's info if file + sidecar exist and match the plan (and the file's sha256 when verify)."""
    path = out_dir / plan.name
    side = sidecar_path(path)
    if not (path.is_file() and side.is_file()):
        return None
    try:
        d = read_json(side)
        info = ShardInfo.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # torn or foreign sidecar: redo the shard
    same = (d.get("format_version") == FORMAT_VERSION and d.get("plan_sha256") == plan.plan_sha256
            and d.get("ids_sha256") == plan.ids_sha256 and info.samples == len(plan.rows)
            and info.tokens == plan.tokens and info.loss_tokens == plan.loss_tokens
            and info.bytes == path.stat().st_size)
    if not same or (verify and sha256_file(path) != info.sha256):
        return None
    return info


def _compute_shard(model: CausalLM, plan: ShardPlan, batch_tokens: int, aux_layers: Sequence[int],
                   hidden_dtype: torch.dtype, bar: tqdm) -> dict[str, torch.Tensor]:
    """Run the target over one shard's samples in packed batches; returns the shard's CPU tensors."""
    lengths = [r.ids.size for r in plan.rows]
    h = model.args.hidden_size
    t = plan.tokens
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate([r.ids for r in plan.rows])),  # (T,) int32
        "loss_mask": torch.from_numpy(np.concatenate([r.mask for r in plan.rows])),  # (T,) uint8
        "hidden": torch.empty(t, h, dtype=hidden_dtype),  # (T, H), filled batch by batch
        "offsets": torch.from_numpy(offsets),  # (S+1,)
    }
    if aux_layers:
        tensors["aux_hidden"] = torch.empty(t, len(aux_layers) * h, dtype=hidden_dtype)  # (T, k*H)
    with torch.inference_mode():
        for run in plan_runs(lengths, batch_tokens):
            out = prefill_hidden(model, [plan.rows[i].ids.tolist() for i in run], hidden_layers=aux_layers)
            a, b = int(offsets[run.start]), int(offsets[run.stop])
            # copy_ casts to the storage dtype as it lands in the preallocated CPU buffer: no extra copy.
            tensors["hidden"][a:b].copy_(out.hidden)
            for k, j in enumerate(aux_layers):
                tensors["aux_hidden"][a:b, k * h:(k + 1) * h].copy_(out.layers[j])
            bar.update(b - a)
    return tensors


# safetensors dtype names of the tensors a shard can hold
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8"}


def write_safetensors(fh: Any, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write `tensors` to the open binary file `fh` in the safetensors format; returns the bytes' sha256.

    Written here rather than with `safetensors.torch.save_file` because the library orders the metadata
    map arbitrarily (so two runs would not give byte-identical shards) and first copies every tensor to
    a bytes object. Tensors go in order of decreasing element size, then name (as the library does), so
    each is naturally aligned after the 8-byte aligned header.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    start = 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [start, start + n]}
        start += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # spaces pad the header so the data starts 8-byte aligned
    h = hashlib.sha256()
    for block in (struct.pack("<Q", len(raw)), raw):
        fh.write(block)
        h.update(block)
    for k in order:
        buf = tensors[k].contiguous().view(-1).view(torch.uint8).numpy()  # the tensor's own memory, no copy
        fh.write(memoryview(buf))
        h.update(buf)
    return h.hexdigest()


def _write_shard(out_dir: Path, plan: ShardPlan, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str]) -> ShardInfo:
    """Atomically write one shard, then its sidecar (which is what marks the shard as done)."""
    path = out_dir / plan.name
    meta = {**metadata, "sample_ids": json.dumps([r.id for r in plan.rows])}
    digest: list[str] = []

    def write(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            digest.append(write_safetensors(fh, tensors, meta))

    atomic_write(path, write)
    side = _sidecar(plan, digest[0], path.stat().st_size)
    write_json(sidecar_path(path), side)
    return ShardInfo.from_dict(side)


def _split_counts(rows: Sequence[_Row], seed: int, val_fraction: float) -> dict[str, int]:
    c = {f"{s}_{k}": 0 for s in ("train", "val") for k in ("samples", "tokens", "loss_tokens")}
    for r in rows:
        s = "val" if is_val(r.id, seed, val_fraction) else "train"
        c[f"{s}_samples"] += 1
        c[f"{s}_tokens"] += r.ids.size
        c[f"{s}_loss_tokens"] += int(r.mask.sum())
    return c


def precompute(
    model: CausalLM,
    samples: Sequence[Sample],
    out_dir: str | Path,
    *,
    tokenizer_fingerprint: str,
    chat_template_fingerprint: str,
    model_dir: str | Path,
    data_info: dict[str, Any],
    shard_tokens: int = 1 << 17,
    batch_tokens: int = 8192,
    aux_layers: Sequence[int] = (),
    val_fraction: float = 0.0,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    hidden_dtype: torch.dtype = torch.bfloat16,
    provenance: dict[str, Any] | None = None,
    progress: bool = True,
    verify_on_resume: bool = True,
    on_shard: Callable[[ShardInfo, bool], None] | None = None,
    barrier_timeout: timedelta = timedelta(hours=24),
    on_start: Callable[[], None] | None = None,
) -> Manifest | None:
    """Precompute target hidden states for `samples` into `out_dir`; returns the manifest on rank 0, else None.

    Every rank passes the same full, ordered `samples` and takes its own slice (`RANK_ASSIGNMENT`).
    shard_tokens: most tokens per shard (H=4096 in bf16: 2**17 tokens ≈ 1 GiB). batch_tokens: most tokens
    per packed prefill. aux_layers: HF `hidden_states` indices stored, concatenated, as `aux_hidden`.
    val_fraction / seed: the recorded train/val rule (`manifest.is_val`). verify_on_resume: re-hash
    finished shards before skipping them. on_shard(info, skipped): called after each shard is written
    (skipped=False) or found done (skipped=True); an exception from it stops the run, which resumes
    later. barrier_timeout: how long ranks wait for each other at the end (a resumed rank may have
    nothing to do). on_start(): called on rank 0 once the samples and settings have been checked, before
    anything in `out_dir` changes (the place to save the run's config: a refused run leaves the folder as it
    was). With world > 1, torch.distributed must be initialised (`mtp_train.dist`).
    Tensor parallelism: rank / world are the data-parallel rank and world (one per TP group of tp_size
    processes); every member of a group runs the same shards (its forward is collective), and only the group's
    tp_rank 0 writes them. The manifest is written by data-parallel rank 0's tp_rank 0.

    Host memory: up to two shards (the one being written, the one being computed), i.e. about
    2 * shard_tokens * (k+1) * H * 2 bytes in bf16.
    """
    out_dir = Path(out_dir)
    aux_layers = [int(j) for j in aux_layers]
    if len(set(aux_layers)) != len(aux_layers):
        raise ValueError(f"aux_layers {aux_layers} has duplicates")
    if hidden_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden_dtype must be bfloat16, float16 or float32, got {hidden_dtype}")
    if shard_tokens < 1 or batch_tokens < 1:
        raise ValueError("shard_tokens and batch_tokens must be positive")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    procs = world * tp_size
    if procs > 1 and (mdist.get_world_size() != procs or mdist.get_rank() != rank * tp_size + tp_rank):
        raise PrecomputeError(
            f"data-parallel rank {rank} of {world} (tp rank {tp_rank} of {tp_size}) needs torch.distributed "
            f"initialised with {procs} processes, this one rank {rank * tp_size + tp_rank} "
            "(launch with torchrun and call mtp_train.dist.init_distributed() first)"
        )
    writer = tp_rank == 0  # the group's other members compute the same shards and write nothing
    args = model.args
    rows = _rows(samples, args.vocab_size)
    if not rows:
        raise ValueError("no samples to precompute")
    out_dir.mkdir(parents=True, exist_ok=True)
    group = mdist.cpu_group(barrier_timeout) if procs > 1 else None

    target = TargetInfo(path=str(Path(model_dir).resolve()), fingerprint=weights_fingerprint(model_dir),
                        model_type=args.model_type, hidden_size=args.hidden_size, num_layers=args.num_layers,
                        vocab_size=args.vocab_size, dtype=dtype_name(model.dtype))
    hidden = HiddenInfo(kind="final_norm", dtype=dtype_name(hidden_dtype), aux_layers=aux_layers)
    # Everything that changes a shard's bytes; a shard written under other settings is redone.
    settings = {"format_version": FORMAT_VERSION, "target_fingerprint": target.fingerprint,
                "target_dtype": target.dtype, "hidden": hidden.__dict__}
    metadata = {"format_version": str(FORMAT_VERSION), "hidden_dtype": hidden.dtype,
                "aux_layers": json.dumps(aux_layers)}

    # A stale manifest would vouch for shards this run is about to rewrite; the barrier keeps other
    # ranks from writing before it is gone. Leftover temporaries of this rank are from a crash.
    if rank == 0 and writer:
        if on_start is not None:
            on_start()
        for stale in (out_dir / MANIFEST_NAME, out_dir / (TMP_PREFIX + MANIFEST_NAME)):
            stale.unlink(missing_ok=True)
    if writer:
        for tmp in out_dir.glob(f"{TMP_PREFIX}shard-r{rank}-*"):
            tmp.unlink(missing_ok=True)
    mdist.barrier(group)

    plans = plan_rank(rows, rank, world, shard_tokens, settings)
    done: dict[int, ShardInfo] = {}
    for p in plans:
        info = finished_shard(out_dir, p, verify=verify_on_resume)
        if info is not None:
            done[p.index] = info
            if on_shard is not None:
                on_shard(info, True)
    if done and rank == 0:
        log.info("resuming: %d of %d shards of rank 0 are done", len(done), len(plans))

    bar = tqdm(total=sum(p.tokens for p in plans), initial=sum(p.tokens for p in plans if p.index in done),
               unit="tok", unit_scale=True, desc="precompute", disable=not (progress and rank == 0 and writer),
               dynamic_ncols=True)
    # One writer thread: shard n is serialised, fsynced and hashed while the target computes shard n+1.
    with bar, ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        pending: Future[ShardInfo] | None = None
        for p in plans:
            if p.index in done:
                continue
            if writer:
                sidecar_path(out_dir / p.name).unlink(missing_ok=True)  # it no longer describes what will be there
            tensors = _compute_shard(model, p, batch_tokens, aux_layers, hidden_dtype, bar)
            if not writer:
                continue
            if pending is not None:
                _finish(pending, on_shard)
            pending = pool.submit(_write_shard, out_dir, p, tensors, metadata)
        if pending is not None:
            _finish(pending, on_shard)

    mdist.barrier(group)
    manifest = None
    if rank == 0 and writer:
        shards = []
        for r in range(world):
            for p in (plans if r == 0 else plan_rank(rows, r, world, shard_tokens, settings)):
                info = finished_shard(out_dir, p, verify=False)  # each rank hashed its own shards
                if info is None:
                    raise PrecomputeError(f"rank {r} did not finish {out_dir / p.name}; re-run precompute to redo it")
                shards.append(info)
        totals = Totals(samples=sum(s.samples for s in shards), tokens=sum(s.tokens for s in shards),
                        loss_tokens=sum(s.loss_tokens for s in shards), bytes=sum(s.bytes for s in shards))
        prov = {
            "package_version": mtp_train.__version__,
            "torch_version": torch.__version__,
            "settings": {"world": world, "tp": tp_size, "shard_tokens": shard_tokens,
                         "batch_tokens": batch_tokens, "rank_assignment": RANK_ASSIGNMENT},
            **(provenance or {}),
        }
        manifest = Manifest(
            target=target,
            tokenizer=TokenizerInfo(fingerprint=tokenizer_fingerprint,
                                    chat_template_fingerprint=chat_template_fingerprint),
            hidden=hidden,
            data=dict(data_info),
            split=SplitInfo(val_fraction=val_fraction, seed=seed, counts=_split_counts(rows, seed, val_fraction)),
            shards=shards,
            totals=totals,
            provenance=prov,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        manifest.save(out_dir)
    # Nobody returns before the manifest exists, so a next stage started on any rank finds it.
    mdist.barrier(group)
    if group is not None:
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group(group)
    return manifest


def _finish(pending: Future[ShardInfo], on_shard: Callable[[ShardInfo, bool], None] | None) -> None:
    info = pending.result()  # re-raises a failed write here, in the caller's thread
    if on_shard is not None:
        on_shard(info, False)
