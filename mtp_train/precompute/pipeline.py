"""Stage one end to end: conversations → chat template + loss masks → target prefill → shards + manifest.

`run_precompute` is what `mtp-precompute` calls once the model, tokenizer and distributed setup are
ready, so tests and other tools can call it directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mtp_train
from mtp_train.config import PrecomputeConfig
from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint
from mtp_train.models.base import CausalLM
from mtp_train.precompute.manifest import Manifest
from mtp_train.precompute.samples import build_samples
from mtp_train.precompute.writer import precompute

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
