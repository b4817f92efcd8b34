"""Stage one end to end: conversations → chat template + loss masks → target prefill → shards + manifest.

`run_precompute` is what `mtp-precompute` calls once the model, tokenizer and distributed setup are
ready, so tests and other tools can call it directly.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mtp_train
from mtp_train.config import PrecomputeConfig
from mtp_train.data import (
    chat_template_fingerprint,
    read_conversations,
    tokenize_conversations,
    tokenizer_fingerprint,
)
from mtp_train.models.base import CausalLM
from mtp_train.precompute.manifest import Manifest
from mtp_train.precompute.plan import Sample
from mtp_train.precompute.writer import precompute

log = logging.getLogger(__name__)


def _unique_ids(ids: list[str]) -> tuple[list[str], list[str]]:
    """Make conversation ids unique (two sources may both have an id "1"): repeats get "#2", "#3", ...

    Returns the ids and the ones that were repeated (each once, in order of first repeat).
    """
    seen: Counter[str] = Counter()
    out, repeated = [], []
    for i in ids:
        seen[i] += 1
        out.append(i if seen[i] == 1 else f"{i}#{seen[i]}")
        if seen[i] == 2:
            repeated.append(i)
    return out, repeated


def dropped_summary(info: Mapping[str, Any]) -> str:
    """One line on what `build_samples` left out or renamed (its `info`), or "" when nothing was."""
    parts = []
    bad = info.get("bad_rows") or {}
    if bad:
        parts.append(f"{sum(bad.values())} bad row(s) skipped ("
                     + ", ".join(f"{r}={n}" for r, n in sorted(bad.items())) + ")")
    for key, what in (("dropped_no_assistant", "conversation(s) without an assistant turn dropped"),
                      ("dropped_truncated", "conversation(s) dropped: every assistant token was past max_seq_len"),
                      ("dropped_template_error", "conversation(s) the chat template failed on dropped")):
        if info.get(key):
            parts.append(f"{info[key]} {what}")
    dups = int(info.get("duplicate_ids") or 0)
    if dups:
        shown = ", ".join(repr(d) for d in info.get("duplicate_id_examples") or [])
        parts.append(f"{dups} duplicate id(s) kept under new ids id#2, id#3, ... (e.g. {shown})")
    return "; ".join(parts)


def build_samples(tokenizer: Any, cfg: PrecomputeConfig) -> tuple[list[Sample], dict[str, Any]]:
    """Read and tokenize the conversations `cfg.data` names (the first `cfg.limit`, cut to `cfg.max_seq_len`
    tokens, rendered with `cfg.chat_template_kwargs`); returns samples and what happened to the rows."""
    data = cfg.data
    if not data.paths:
        raise ValueError("data.paths is empty: give the conversation files, e.g. data.paths=[convs.jsonl]")
    convs, read_stats = read_conversations(data, limit=cfg.limit)
    tokenized, tok_stats = tokenize_conversations(tokenizer, convs, cfg.max_seq_len,
                                                  template_kwargs=dict(cfg.chat_template_kwargs),
                                                  on_bad_row=data.on_bad_row)
    if tok_stats.dropped_template_error:
        log.warning("skipped %d conversation(s) the chat template failed on: %s", tok_stats.dropped_template_error,
                    "; ".join(tok_stats.template_error_examples))
    ids, repeated = _unique_ids([t.id or f"sample-{i}" for i, t in enumerate(tokenized)])
    samples = [Sample(i, t.input_ids, t.loss_mask) for i, t in zip(ids, tokenized)]
    if not samples:
        raise ValueError(
            f"no usable sample in {list(data.paths)}: {read_stats.summary()}; "
            f"{tok_stats.dropped_no_assistant} conversations had no assistant turn (regenerate prompt-only data "
            f"with mtp-regenerate first), {tok_stats.dropped_truncated} lost every assistant token to max_seq_len, "
            f"{tok_stats.dropped_template_error} failed in the chat template"
        )
    info = {
        "name": data.name,
        "sources": [str(p) for p in data.paths],
        "format": data.format,
        "max_seq_len": cfg.max_seq_len,
        "limit": cfg.limit,
        "rows": read_stats.rows,
        "bad_rows": dict(read_stats.bad),
        "bad_row_examples": {r: list(e) for r, e in read_stats.examples.items()},  # reason → first few file:line
        "conversations": tok_stats.conversations,
        "samples": tok_stats.kept,
        "truncated": tok_stats.truncated,
        "dropped_no_assistant": tok_stats.dropped_no_assistant,
        "dropped_truncated": tok_stats.dropped_truncated,
        "dropped_template_error": tok_stats.dropped_template_error,
        "duplicate_ids": len(repeated),  # ids met more than once (renamed id#2, id#3, ...)
        "duplicate_id_examples": repeated[:5],
    }
    return samples, info


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
