"""Stage one: run the frozen target over tokenized samples and write hidden-state shards + the manifest.

Every rank plans its shards from the same samples and settings (`mtp_train.precompute.plan`), skips the ones a
previous run finished and computes the rest, one packed prefill batch at a time; a writer thread writes each
shard and its sidecar atomically while the target computes the next (`mtp_train.precompute.shards`). After a
barrier, rank 0 assembles `manifest.json` from the sidecars, last.

The pieces of a folder (`check_settings`, `folder_spec`, `new_shard_tensors` / `store_rows`, `assemble_manifest`,
`as_stored`) are also what hybrid training writes its epoch-0 folder with (`mtp_train.train.online`), so both
write one format.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

import mtp_train
from mtp_train import dist as mdist
from mtp_train.config import PrecomputeConfig
from mtp_train.engine.runner import prefill_hidden
from mtp_train.fileio import TMP_PREFIX
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    HiddenInfo,
    Manifest,
    SplitInfo,
    TargetInfo,
    TokenizerInfo,
    Totals,
    is_val,
)
from mtp_train.precompute.plan import RANK_ASSIGNMENT, Sample, plan_rank, plan_runs, to_rows
from mtp_train.precompute.quant import FP8, dequantize_fp8, quantize_fp8
from mtp_train.precompute.shards import finished_shard, sidecar_path, write_shard

if TYPE_CHECKING:  # annotations only
    from mtp_train.models.base import CausalLM
    from mtp_train.models.config import ModelArgs
    from mtp_train.precompute.manifest import ShardInfo
    from mtp_train.precompute.plan import Row, ShardPlan

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


def compute_shard(model: CausalLM, plan: ShardPlan, batch_tokens: int, aux_layers: Sequence[int],
                   storage: str, bar: tqdm) -> dict[str, torch.Tensor]:
    """Run the target over one shard's samples in packed batches; returns the shard's CPU tensors.

    storage: a key of `STORAGE_DTYPES`; fp8 stores values and per-token scales (`precompute.quant`).
    """
    k = len(aux_layers)
    tensors = new_shard_tensors(plan, model.args.hidden_size, k, storage)
    offsets = tensors["offsets"]
    with torch.inference_mode():
        for run in plan_runs([r.ids.size for r in plan.rows], batch_tokens):
            out = prefill_hidden(model, [plan.rows[i].ids.tolist() for i in run], hidden_layers=aux_layers)
            a, b = int(offsets[run.start]), int(offsets[run.stop])
            aux = torch.cat([out.layers[j] for j in aux_layers], dim=-1) if k else None  # (n, k*H)
            store_rows(tensors, a, b, out.hidden, aux, storage)
            bar.update(b - a)
    return tensors


def split_counts(rows: Sequence[Row], seed: int, val_fraction: float) -> dict[str, int]:
    """Samples, tokens and loss tokens of each split (the manifest's `split.counts`)."""
    c = {f"{s}_{k}": 0 for s in ("train", "val") for k in ("samples", "tokens", "loss_tokens")}
    for r in rows:
        s = "val" if is_val(r.id, seed, val_fraction) else "train"
        c[f"{s}_samples"] += 1
        c[f"{s}_tokens"] += r.ids.size
        c[f"{s}_loss_tokens"] += int(r.mask.sum())
    return c


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

    @property
    def settings(self) -> dict[str, Any]:
        """Everything that changes a shard's bytes (enters every plan hash): a shard written under other settings
        is redone."""
        return {"format_version": FORMAT_VERSION, "target_fingerprint": self.target.fingerprint,
                "target_dtype": self.target.dtype, "hidden": self.hidden.__dict__}

    @property
    def metadata(self) -> dict[str, str]:
        """The safetensors metadata of every shard (sample_ids are added per shard)."""
        return {"format_version": str(FORMAT_VERSION), "hidden_dtype": self.hidden.dtype,
                "aux_layers": json.dumps(self.hidden.aux_layers)}


def folder_spec(args: ModelArgs, dtype: torch.dtype, model_dir: str | Path, storage: str,
                aux_layers: Sequence[int]) -> FolderSpec:
    """The FolderSpec of a target (config `args`, computing in `dtype`, weights in `model_dir`)."""
    target = TargetInfo(path=str(Path(model_dir).resolve()), fingerprint=weights_fingerprint(model_dir),
                        model_type=args.model_type, hidden_size=args.hidden_size, num_layers=args.num_layers,
                        vocab_size=args.vocab_size, dtype=dtype_name(dtype))
    hidden = HiddenInfo(kind="final_norm", dtype=dtype_name(STORAGE_DTYPES[storage]),
                        aux_layers=[int(j) for j in aux_layers])
    return FolderSpec(target, hidden, storage)


def assemble_manifest(out_dir: Path, plans: Sequence[ShardPlan], rows: Sequence[Row], spec: FolderSpec, *,
                      tokenizer_fingerprint: str, chat_template_fingerprint: str, data_info: dict[str, Any],
                      val_fraction: float, seed: int, provenance: dict[str, Any],
                      redo: str = "re-run precompute to redo it") -> Manifest:
    """The manifest of a folder whose shards `plans` (every rank's, in manifest order) are all finished; raises
    PrecomputeError naming the first one that is not (and `redo`, what to do). `rows`: every sample, for the split
    counts."""
    shards = []
    for p in plans:
        info = finished_shard(out_dir, p, verify=False)  # each rank hashed its own shards
        if info is None:
            raise PrecomputeError(f"rank {p.rank} did not finish {out_dir / p.name}; {redo}")
        shards.append(info)
    totals = Totals(samples=sum(s.samples for s in shards), tokens=sum(s.tokens for s in shards),
                    loss_tokens=sum(s.loss_tokens for s in shards), bytes=sum(s.bytes for s in shards))
    return Manifest(
        target=spec.target,
        tokenizer=TokenizerInfo(fingerprint=tokenizer_fingerprint, chat_template_fingerprint=chat_template_fingerprint),
        hidden=spec.hidden,
        data=dict(data_info),
        split=SplitInfo(val_fraction=val_fraction, seed=seed, counts=split_counts(rows, seed, val_fraction)),
        shards=shards,
        totals=totals,
        provenance=provenance,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def precompute(
    model: CausalLM,
    samples: Sequence[Sample],
    cfg: PrecomputeConfig,
    *,
    tokenizer_fingerprint: str,
    chat_template_fingerprint: str,
    model_dir: str | Path,
    data_info: dict[str, Any],
    rank: int = 0,
    world: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    provenance: dict[str, Any] | None = None,
    on_shard: Callable[[ShardInfo, bool], None] | None = None,
    barrier_timeout: timedelta = timedelta(hours=24),
    on_start: Callable[[], None] | None = None,
) -> Manifest | None:
    """Precompute target hidden states for `samples` into `cfg.out`; returns the manifest on rank 0, else None.

    Every rank passes the same full, ordered `samples` and takes its own slice (`RANK_ASSIGNMENT`). From `cfg`
    (the rest of it, the model and data settings, is not looked at): shard_tokens, most tokens per shard (H=4096
    in bf16: 2**17 tokens ≈ 1 GiB); batch_tokens, most tokens per packed prefill; aux_layers, HF `hidden_states`
    indices stored, concatenated, as `aux_hidden`; val_fraction / seed, the recorded train/val rule
    (`manifest.is_val`); hidden_dtype, the storage (`STORAGE_DTYPES`; fp8 with per-token scales); verify_on_resume,
    re-hash finished shards before skipping them; progress, a bar on rank 0. on_shard(info, skipped): called
    after each shard is written (skipped=False) or found done (skipped=True); an exception from it stops the run,
    which resumes later. barrier_timeout: how long ranks wait for each other
    at the end (a resumed rank may have nothing to do). on_start(): called on rank 0 once the samples and
    settings have been checked, before anything in `cfg.out` changes (the place to save the run's config: a
    refused run leaves the folder as it was). With world > 1, torch.distributed must be initialised
    (`mtp_train.dist`).
    Tensor parallelism: rank / world are the data-parallel rank and world (one per TP group of tp_size
    processes); every member of a group runs the same shards (its forward is collective), and only the group's
    tp_rank 0 writes them. The manifest is written by data-parallel rank 0's tp_rank 0.

    Host memory: up to two shards (the one being written, the one being computed), i.e. about
    2 * shard_tokens * (k+1) * H * 2 bytes in bf16.
    """
    out_dir = Path(cfg.out)
    shard_tokens, batch_tokens, val_fraction, seed = cfg.shard_tokens, cfg.batch_tokens, cfg.val_fraction, cfg.seed
    check_settings(cfg)
    aux_layers = [int(j) for j in cfg.aux_layers]
    storage = cfg.hidden_dtype
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
    rows = to_rows(samples, args.vocab_size)
    if not rows:
        raise ValueError("no samples to precompute")
    out_dir.mkdir(parents=True, exist_ok=True)
    group = mdist.cpu_group(barrier_timeout) if procs > 1 else None

    spec = folder_spec(args, model.dtype, model_dir, storage, aux_layers)
    settings, metadata = spec.settings, spec.metadata

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
        info = finished_shard(out_dir, p, verify=cfg.verify_on_resume)
        if info is not None:
            done[p.index] = info
            if on_shard is not None:
                on_shard(info, True)
    if done and rank == 0:
        log.info("resuming: %d of %d shards of rank 0 are done", len(done), len(plans))

    bar = tqdm(total=sum(p.tokens for p in plans), initial=sum(p.tokens for p in plans if p.index in done),
               unit="tok", unit_scale=True, desc="precompute", disable=not (cfg.progress and rank == 0 and writer),
               dynamic_ncols=True)
    # One writer thread: shard n is serialised, fsynced and hashed while the target computes shard n+1.
    with bar, ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        pending: Future[ShardInfo] | None = None
        for p in plans:
            if p.index in done:
                continue
            if writer:
                sidecar_path(out_dir / p.name).unlink(missing_ok=True)  # it no longer describes what will be there
            tensors = compute_shard(model, p, batch_tokens, aux_layers, storage, bar)
            if not writer:
                continue
            if pending is not None:
                _finish(pending, on_shard)
            pending = pool.submit(write_shard, out_dir, p, tensors, metadata)
        if pending is not None:
            _finish(pending, on_shard)

    mdist.barrier(group)
    manifest = None
    if rank == 0 and writer:
        every = [p for r in range(world)
                 for p in (plans if r == 0 else plan_rank(rows, r, world, shard_tokens, settings))]
        prov = {
            "package_version": mtp_train.__version__,
            "torch_version": torch.__version__,
            "settings": {"world": world, "tp": tp_size, "shard_tokens": shard_tokens,
                         "batch_tokens": batch_tokens, "rank_assignment": RANK_ASSIGNMENT},
            **(provenance or {}),
        }
        manifest = assemble_manifest(out_dir, every, rows, spec, tokenizer_fingerprint=tokenizer_fingerprint,
                                     chat_template_fingerprint=chat_template_fingerprint, data_info=data_info,
                                     val_fraction=val_fraction, seed=seed, provenance=prov)
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
