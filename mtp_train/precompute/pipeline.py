"""Stage one end to end: conversations → chat template + loss masks → target prefill → shards + manifest.

`precompute` runs the frozen target over tokenized samples: every rank plans its shards from the same samples and
settings (`mtp_train.precompute.plan`), and its `FolderWriter` keeps the ones a previous run finished; the rest
are computed one packed prefill batch at a time and recorded into the writer, whose thread writes each shard
while the target computes the next. After a barrier, rank 0 writes `manifest.json`, last.

`run_precompute` is what `mtp-precompute` calls once the model, tokenizer and distributed setup are
ready, so tests and other tools can call it directly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import mtp_train
from mtp_train import dist as mdist
from mtp_train.config import Interrupted, PrecomputeConfig
from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint
from mtp_train.data.samples import Sample, build_samples, to_rows
from mtp_train.engine.runner import prefill_hidden
from mtp_train.models.base import CausalLM
from mtp_train.precompute.manifest import Manifest, ShardInfo
from mtp_train.precompute.plan import RANK_ASSIGNMENT, plan_rank, plan_runs
from mtp_train.precompute.writer import (
    FolderWriter,
    PrecomputeError,
    check_aux_layers,
    check_replaces,
    check_settings,
    folder_spec,
)

log = logging.getLogger(__name__)


def run_precompute(model: CausalLM, tokenizer: Any, model_dir: str | Path, cfg: PrecomputeConfig, *,
                   rank: int, world: int, tp_rank: int, tp_size: int, config_dict: dict[str, Any],
                   on_start: Callable[[], None] | None = None) -> Manifest | None:
    """Run stage one as `cfg` says; returns the manifest on rank 0, else None.

    rank / world are data-parallel; with tensor parallelism every TP group (tp_size processes, see
    `mtp_train.models.tensor_parallel`) is one data-parallel rank and only its tp_rank 0 writes. config_dict: the
    command's resolved config, recorded in the manifest's provenance. on_start: see `precompute` (called once the
    data has been read, tokenized and checked).
    """
    samples, info = build_samples(tokenizer, cfg)
    if rank == 0 and tp_rank == 0:
        log.info("precompute: %d samples, %d tokens (%d assistant) → %s", len(samples),
                 sum(len(s.input_ids) for s in samples), sum(sum(s.loss_mask) for s in samples), cfg.out)
    return precompute(
        model, samples, cfg,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        chat_template_fingerprint=chat_template_fingerprint(tokenizer),
        model_dir=model_dir,
        data_info=info,
        rank=rank,
        world=world,
        tp_rank=tp_rank,
        tp_size=tp_size,
        provenance={"package": "mtp_train", "version": mtp_train.__version__, "config": config_dict},
        on_start=on_start,
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
    (`manifest.is_val`); hidden_dtype, the storage (`writer.STORAGE_DTYPES`; fp8 with per-token scales);
    verify_on_resume, re-hash finished shards before skipping them; progress, a bar on rank 0. on_shard(info,
    skipped): see `FolderWriter`. barrier_timeout: how long ranks wait for each other at the end (a resumed rank
    may have nothing to do). on_start(): called on rank 0 once the samples and settings have been checked, before
    anything in `cfg.out` changes (the place to save the run's config: a refused run leaves the folder as it
    was); never when `cfg.out` already holds this very folder, finished (the run returns its manifest and writes
    nothing). With world > 1, torch.distributed must be initialised (`mtp_train.dist`).
    Tensor parallelism: rank / world are the data-parallel rank and world (one per TP group of tp_size
    processes); every member of a group runs the same shards (its forward is collective), and only the group's
    tp_rank 0 writes them. The manifest is written by data-parallel rank 0's tp_rank 0.

    Host memory: up to two shards (the one being written, the one being computed), i.e. about
    2 * shard_tokens * (k+1) * H * 2 bytes in bf16.
    """
    check_settings(cfg)
    aux_layers = [int(j) for j in cfg.aux_layers]
    check_aux_layers(aux_layers, model.args.num_layers)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    procs = world * tp_size
    if procs > 1 and (mdist.get_world_size() != procs or mdist.get_rank() != rank * tp_size + tp_rank):
        raise PrecomputeError(
            f"data-parallel rank {rank} of {world} (tp rank {tp_rank} of {tp_size}) needs torch.distributed "
            f"initialised with {procs} processes, this one rank {rank * tp_size + tp_rank} "
            "(launch with torchrun and call mtp_train.dist.init_distributed() first)"
        )
    rows = to_rows(samples, model.args.vocab_size)
    if not rows:
        raise ValueError("no samples to precompute")
    spec = folder_spec(model.args, model.dtype, model_dir, cfg.hidden_dtype, aux_layers)
    plans = plan_rank(rows, rank, world, cfg.shard_tokens, spec.settings)
    every = [p for r in range(world) for p in (plans if r == rank else plan_rank(rows, r, world, cfg.shard_tokens,
                                                                               spec.settings))]
    # Every rank reads the same folder and refuses alike, before anything in it changes.
    finished = check_replaces(Path(cfg.out), spec, every, world, cfg)
    owner = rank == 0 and tp_rank == 0
    if finished is not None:  # already this run's folder: every rank returns, nothing is written (on_start unused)
        if owner:
            log.debug("%s already holds this precompute (finished %s): nothing to do", cfg.out, finished.created_at)
        return finished if owner else None
    group = mdist.cpu_group(barrier_timeout) if procs > 1 else None  # every rank gets here or returned above
    # The group's other members compute the same shards and write nothing.
    writer = FolderWriter(cfg.out, spec, plans, rank=rank, writes=tp_rank == 0, verify=cfg.verify_on_resume,
                          on_shard=on_shard)
    try:
        writer.begin(owner=owner, on_start=on_start)
        mdist.barrier(group)  # no rank writes before rank 0 has removed the stale manifest
        if writer.done and rank == 0:
            log.info("resuming: %d of %d shards of rank 0 are done", len(writer.done), len(plans))
        bar = tqdm(total=sum(p.tokens for p in plans), initial=sum(p.tokens for p in plans if p.index in writer.done),
                   unit="tok", unit_scale=True, desc="precompute", disable=not (cfg.progress and owner),
                   dynamic_ncols=True)
        with bar:
            for p in writer.todo:
                for run in plan_runs([r.ids.size for r in p.rows], cfg.batch_tokens):
                    batch = [p.rows[i] for i in run]
                    with torch.inference_mode():
                        out = prefill_hidden(model, [r.ids.tolist() for r in batch], hidden_layers=aux_layers)
                    aux = torch.cat([out.layers[j] for j in aux_layers], dim=-1) if aux_layers else None  # (n, k*H)
                    writer.record([r.id for r in batch], [int(r.ids.size) for r in batch], out.hidden, aux)
                    bar.update(sum(int(r.ids.size) for r in batch))
            writer.finish()
    except KeyboardInterrupt:
        writer.close()  # the shard in flight is finished: the re-run keeps it
        raise Interrupted(f"after {len(writer.done)} of {len(plans)} shards{'' if world == 1 else f' of rank {rank}'} "
                          f"were written to {cfg.out}; re-run the same command to go on from there (finished shards "
                          f"are kept)") from None
    finally:
        writer.close()

    mdist.barrier(group)
    manifest = None
    if owner:
        prov = {
            "package_version": mtp_train.__version__,
            "torch_version": torch.__version__,
            "settings": {"world": world, "tp": tp_size, "shard_tokens": cfg.shard_tokens,
                         "batch_tokens": cfg.batch_tokens, "rank_assignment": RANK_ASSIGNMENT},
            **(provenance or {}),
        }
        manifest = writer.write_manifest(every, rows, tokenizer_fingerprint=tokenizer_fingerprint,
                                         chat_template_fingerprint=chat_template_fingerprint, data_info=data_info,
                                         val_fraction=cfg.val_fraction, seed=cfg.seed, provenance=prov)
    # Nobody returns before the manifest exists, so a next stage started on any rank finds it.
    mdist.barrier(group)
    if group is not None:
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group(group)
    return manifest
