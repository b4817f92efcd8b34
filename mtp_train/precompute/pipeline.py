"""Stage one end to end: conversations → chat template + loss masks → target prefill → shards + manifest.

`precompute` runs the frozen target over tokenized samples as they stream in: each rank plans its own shards as
its samples arrive (`mtp_train.precompute.plan.plan_stream`, the same shards as a plan of the whole list), its
`FolderWriter` keeps the ones a previous run finished, and the rest are computed one packed prefill batch at a
time and recorded into the writer, whose thread writes each shard (and its counts by split) while the target
computes the next. After a barrier, rank 0 writes `token_counts.safetensors` and then `manifest.json`, last, from
what every rank's shards record (their sidecars and counts files; the ranks send it the list of their shards).

`run_precompute` is what `mtp-precompute` calls once the model, tokenizer and distributed setup are
ready, so tests and other tools can call it directly: it reads and tokenizes `cfg.window` conversations at a time
(`data.samples.SampleStream`), so the target starts on the first shard within seconds of the start and host
memory does not grow with the number of conversations.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import mtp_train
from mtp_train import dist as mdist
from mtp_train.config import Interrupted, PrecomputeConfig
from mtp_train.config.head import check_aux_layers
from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint
from mtp_train.data.samples import Sample, SampleStream, check_context, checked_rows, within_context
from mtp_train.engine.runner import prefill_hidden
from mtp_train.models.base import CausalLM
from mtp_train.precompute.manifest import Manifest, ShardInfo
from mtp_train.precompute.plan import RANK_ASSIGNMENT, plan_runs, plan_stream
from mtp_train.precompute.writer import (
    FolderWriter,
    PrecomputeError,
    ShardEntry,
    check_settings,
    finished_of_same_settings,
    first_difference,
    folder_spec,
    other_samples,
    refuse_other,
)

log = logging.getLogger(__name__)


def run_precompute(model: CausalLM, tokenizer: Any, model_dir: str | Path, cfg: PrecomputeConfig, *,
                   rank: int, world: int, tp_rank: int, tp_size: int, config_dict: dict[str, Any],
                   on_start: Callable[[], None] | None = None) -> Manifest | None:
    """Run stage one as `cfg` says; returns the manifest on rank 0, else None.

    rank / world are data-parallel; with tensor parallelism every TP group (tp_size processes, see
    `mtp_train.models.tensor_parallel`) is one data-parallel rank and only its tp_rank 0 writes. config_dict: the
    command's resolved config, recorded in the manifest's provenance. on_start: see `precompute` (called once the
    first `cfg.window` conversations have been read, tokenized and checked).
    """
    # Positions past the target's context were never trained: such a sample is refused before the target runs,
    # or cut as data.over_context says.
    context = model.args.max_position_embeddings
    check_context(tokenizer, cfg, context)
    stream = SampleStream(tokenizer, cfg, window=cfg.window, context=context)
    if rank == 0 and tp_rank == 0:
        log.info("precompute: %s → %s, %d conversations read and tokenized at a time", list(cfg.data.paths),
                 cfg.out, cfg.window)
    manifest = precompute(
        model, stream, cfg,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        chat_template_fingerprint=chat_template_fingerprint(tokenizer),
        model_dir=model_dir,
        data_info=stream.info,  # complete once the stream has ended, before the manifest is written
        rank=rank,
        world=world,
        tp_rank=tp_rank,
        tp_size=tp_size,
        provenance={"package": "mtp_train", "version": mtp_train.__version__, "config": config_dict},
        on_start=on_start,
    )
    if manifest is not None:
        t = manifest.totals
        log.info("precompute: %d samples, %d tokens (%d assistant) in %d shards → %s", t.samples, t.tokens,
                 t.loss_tokens, len(manifest.shards), cfg.out)
    return manifest


def _gather(group: Any, obj: Any) -> list[Any]:
    """`obj` of every process of `group`, in process order ([obj] without one)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def precompute(
    model: CausalLM,
    samples: Iterable[Sample],
    cfg: PrecomputeConfig,
    *,
    tokenizer_fingerprint: str,
    chat_template_fingerprint: str,
    model_dir: str | Path,
    data_info: Mapping[str, Any],
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

    Every rank passes the same ordered `samples` (a list, or a stream such as `SampleStream`, read once) and takes
    its own (`RANK_ASSIGNMENT`), planning its shards as they come (`plan_stream`): one shard's rows are held at a
    time, never the whole list. From `cfg` (the rest of it, the model and data settings, is not looked at):
    shard_tokens, most tokens per shard (H=4096 in bf16: 2**17 tokens ≈ 1 GiB); batch_tokens, most tokens per
    packed prefill; aux_layers, HF `hidden_states` indices stored, concatenated, as `aux_hidden`; val_fraction /
    seed, the recorded train/val rule (`manifest.is_val`); hidden_dtype, the storage (`writer.STORAGE_DTYPES`; fp8
    with per-token scales); verify_on_resume, re-hash finished shards before skipping them; progress, a bar on
    rank 0. data_info: the manifest's `data`, read when the samples have ended (a stream fills it then).
    on_shard(info, skipped): see `FolderWriter`. barrier_timeout: how long ranks wait for each other at the end (a
    resumed rank may have nothing to do). With world > 1, torch.distributed must be initialised (`mtp_train.dist`).

    What is checked before anything in `cfg.out` changes: the settings, against a finished folder there (one of
    other settings is refused by name), and the first sample (a stream reads and tokenizes its first window for
    it: a bad row there is refused before any write). When `cfg.out` holds a finished folder of these settings,
    every sample is planned and compared with its shards first, writing nothing: the very same folder returns its
    manifest (nothing is written, not even by on_start), another is refused naming the first shard that differs.
    A sample refused later (a bad row with on_bad_row=error, a repeated id) stops the run after the shards before
    it are written: a re-run after the fix keeps them. on_start(): called on rank 0 once those checks pass, before
    anything in `cfg.out` changes (the place to save the run's config).

    Tensor parallelism: rank / world are the data-parallel rank and world (one per TP group of tp_size
    processes); every member of a group runs the same shards (its forward is collective), and only the group's
    tp_rank 0 writes them. The manifest is written by data-parallel rank 0's tp_rank 0.

    Host memory: up to two shards (the one being written, the one being computed), i.e. about
    2 * shard_tokens * (k+1) * H * 2 bytes in bf16, plus what `samples` holds (a `SampleStream`: one window).
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
    spec = folder_spec(model.args, model.dtype, model_dir, cfg.hidden_dtype, aux_layers)
    out = Path(cfg.out)
    rows = within_context(checked_rows(samples, model.args.vocab_size), model.args.max_position_embeddings)
    first = next(rows, None)  # a stream reads its first window here: its bad rows are refused before any write
    if first is None:
        raise ValueError("no samples to precompute")
    plans = plan_stream(itertools.chain([first], rows), rank, world, cfg.shard_tokens, spec.settings)
    owner = rank == 0 and tp_rank == 0
    # Every rank reads the same folder and refuses alike, before anything in it changes.
    finished = finished_of_same_settings(out, spec, world, cfg)
    group = mdist.cpu_group(barrier_timeout) if procs > 1 else None  # every rank gets here or raised above
    try:
        if finished is not None:
            # Ranks read on to the end, so that they all meet a bad row anywhere in the data alike.
            diffs = _gather(group, first_difference(out, finished, plans, rank, world, to_the_end=procs > 1))
            diff = next((d for d in diffs if d is not None), None)
            if diff is not None:
                refuse_other(out, [other_samples(finished, diff)])
            # Already this run's folder: every rank returns, nothing is written (on_start unused).
            if owner:
                log.debug("%s already holds this precompute (finished %s): nothing to do", out, finished.created_at)
            return finished if owner else None
        mine = _compute(model, plans, cfg, spec, aux_layers, rank=rank, world=world, tp_rank=tp_rank,
                        owner=owner, group=group, on_shard=on_shard, on_start=on_start)
        # Rank 0 lists every rank's shards from what they send (a TP group's members send the same list).
        every: list[ShardEntry] = [e for k, part in enumerate(_gather(group, mine)) if k % tp_size == 0
                                   for e in part]
        mdist.barrier(group)
        result = None
        if owner:
            prov = {
                "package_version": mtp_train.__version__,
                "torch_version": torch.__version__,
                "settings": {"world": world, "tp": tp_size, "shard_tokens": cfg.shard_tokens,
                             "batch_tokens": cfg.batch_tokens, "rank_assignment": RANK_ASSIGNMENT},
                **(provenance or {}),
            }
            writer = FolderWriter(out, spec, rank=rank)
            try:
                result = writer.write_streamed_manifest(
                    every, tokenizer_fingerprint=tokenizer_fingerprint,
                    chat_template_fingerprint=chat_template_fingerprint, data_info=dict(data_info),
                    val_fraction=cfg.val_fraction, seed=cfg.seed, provenance=prov)
            finally:
                writer.close()
        # Nobody returns before the manifest exists, so a next stage started on any rank finds it.
        mdist.barrier(group)
        return result
    finally:
        if group is not None:
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group(group)


def _compute(model: CausalLM, plans: Iterable[Any], cfg: PrecomputeConfig, spec: Any, aux_layers: list[int], *,
             rank: int, world: int, tp_rank: int, owner: bool, group: Any,
             on_shard: Callable[[ShardInfo, bool], None] | None,
             on_start: Callable[[], None] | None) -> list[ShardEntry]:
    """This rank's part of `precompute`: open the folder, then each shard as it is planned, kept or computed and
    written; returns the rank's shards (`FolderWriter.entries`) once every one is on disk."""
    # The group's other members compute the same shards and write nothing.
    writer = FolderWriter(cfg.out, spec, rank=rank, writes=tp_rank == 0, verify=cfg.verify_on_resume,
                          on_shard=on_shard, split=(cfg.seed, cfg.val_fraction))
    kept = 0
    try:
        writer.begin(owner=owner, on_start=on_start)
        mdist.barrier(group)  # no rank writes before rank 0 has removed the stale manifest
        bar = tqdm(unit="tok", unit_scale=True, desc="precompute", disable=not (cfg.progress and owner),
                   dynamic_ncols=True)
        with bar:
            for p in plans:
                if not writer.add(p):
                    kept += 1
                    bar.update(p.tokens)
                    continue
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
        raise Interrupted(f"after {len(writer.done)} shards{'' if world == 1 else f' of rank {rank}'} were written "
                          f"to {cfg.out}; re-run the same command to go on from there (finished shards are "
                          "kept)") from None
    finally:
        writer.close()
    if kept and owner:
        log.info("resumed: %d of the %d shards of rank 0 were done", kept, len(writer.entries))
    return writer.entries
