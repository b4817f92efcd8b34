"""`mtp-regenerate`: answer the conversations' user turns with the target (self-distillation).

    mtp-regenerate model=smollm2-135m data=demo out=runs/regenerate/demo.jsonl max_new_tokens=512
    mtp-regenerate data.paths=[prompts.jsonl] n=4 temperature=0.8 top_p=0.95 seed=1 out=runs/regenerate/x.jsonl
    torchrun --nproc_per_node 8 -m mtp_train.cli.regenerate model=llama3.1-8b data=shared-mix ...
    mtp-regenerate generator=openai endpoints=[http://gpu1:8000,http://gpu2:8000] concurrency=64 data=shared-mix ...

Writes messages JSONL at `out` (one record per conversation and sample, with provenance), `<out>.config.yaml`
with the resolved config, and prints a summary. The data is read as it is answered: `window` conversations in
flight, each record written as soon as it is complete, memory independent of the data's size. A re-run with the
same settings resumes. Rank 0 holds `<out>.lock` for the whole run: a second run writing the same `out` refuses,
naming the first one's pid and host. See `mtp_train.regenerate` for the record format and how resume and ranks work.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as tdist
from omegaconf import DictConfig

from mtp_train import dist
from mtp_train.cli.common import distributed, ensure_model, hydra_entry, load_target, run_device, save_config
from mtp_train.config import RegenerateConfig, check_config, typed
from mtp_train.data.chat import load_tokenizer
from mtp_train.data.readers import Conversation, ReadStats, iter_conversations
from mtp_train.engine.generator import EngineGenerator, Generator
from mtp_train.engine.llm import LLMEngine
from mtp_train.engine.turns import stop_token_ids
from mtp_train.fileio import output_lock
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.regenerate import (
    RegenerateError,
    RegenerateStats,
    iter_records,
    regenerate,
    request_params,
)

log = logging.getLogger(__name__)
PROG = "mtp-regenerate"
# Ranks finish at very different times (a resumed rank may have nothing left), so the barriers get a long timeout.
BARRIER_TIMEOUT = timedelta(hours=24)


def config_path(out: str | Path) -> Path:
    """Where the resolved config of a run writing `out` is saved."""
    out = Path(out)
    return out.with_name(out.name + ".config.yaml")


def regenerate_main(cfg: DictConfig) -> dict[str, Any]:
    """Run `mtp-regenerate` with a composed config; return the totals over all ranks (see `RegenerateStats`)."""
    # Settings first: a wrong combination fails before anything is loaded.
    rc = typed(check_config(cfg, "regenerate"), RegenerateConfig)
    request_params(rc, None, [])  # the values the engine checks (temperature >= 0, top_p in (0, 1], ...)
    with distributed(rc.model) as (info, stack):
        group = dist.cpu_group(BARRIER_TIMEOUT)
        wait = lambda: dist.barrier(group)
        out = Path(rc.out)
        if info.is_main and (out.exists() or out.is_symlink()):
            for _ in iter_records(out):  # refuses a folder, or a file that is not ours, before anything is written
                pass
        # Every rank reads every conversation, as a stream (rank 0 learns the merge order from it; each rank takes
        # its share). The first ones are read now: no data at all, or a bad first row, fails before the model.
        data = rc.data
        read_stats = ReadStats()
        stream = iter_conversations(data, limit=rc.limit, stats=read_stats)
        head = _head(stream, rc.template_check_rows if rc.generator == "openai" else 0)
        if not head:
            raise RegenerateError(f"no conversations to answer in data.paths={list(data.paths)} "
                                  f"({read_stats.summary()})")
        convs = itertools.chain(head, stream)
        if info.is_main:
            stack.enter_context(output_lock(out, folder=False, command=PROG))  # before `out` is touched
            ensure_model(rc.model)  # one rank converts a missing default model; the others wait
        wait()
        if rc.generator == "openai":
            generator, tokenizer, stop_ids = _remote_generator(rc, head, info.is_main)
        else:
            model, tokenizer, model_path = load_target(rc.model, run_device(rc.model, info))
            engine = LLMEngine(model, page_size=rc.model.page_size, kv_cache_gb=rc.model.kv_cache_gb,
                               max_batch_size=rc.max_batch_size)
            generator = EngineGenerator(engine, name=rc.model.name, path=model_path,
                                        weights_fingerprint=weights_fingerprint(model_path))
            stop_ids = stop_token_ids(tokenizer, model.args.eos_token_ids, rc.chat_template_kwargs)
        at_once = rc.concurrency * len(rc.endpoints) if rc.generator == "openai" else rc.max_batch_size
        if rc.window < at_once and info.is_main:
            log.warning("window=%d holds fewer conversations than the %d requests the generator runs at once: its "
                        "batches will not be full (raise window)", rc.window, at_once)
        stats = regenerate(convs, generator, tokenizer, out, rc, stop_ids=stop_ids,
                           rank=info.rank, world=info.world, barrier=wait, progress=rc.progress and info.is_main,
                           on_start=lambda: save_config(cfg, config_path(out)))
        total = _gather(stats, group)
        result = {**total.as_dict(), "out": str(out), "world": info.world, "rows_read": read_stats.rows,
                  "bad_rows": dict(read_stats.bad)}
        if info.is_main:
            if read_stats.num_bad:
                print(f"{PROG}: data: {read_stats.summary()}", flush=True)
            print(f"{PROG}: {total.summary()}\n{PROG}: wrote {out} (config: {config_path(out)})", flush=True)
        return result


def _head(stream: Iterator[Conversation], rows: int, most: int = 1000) -> list[Conversation]:
    """The first conversations of `stream`, taken out of it: at least one, and enough for `rows` with a user turn
    (the template check's), reading at most `most`."""
    head: list[Conversation] = []
    with_user = 0
    for conv in stream:
        head.append(conv)
        with_user += any(m["role"] == "user" for m in conv.messages)
        if with_user >= rows or len(head) >= most:
            break
    return head


def _remote_generator(rc: RegenerateConfig, convs: list[Any], is_main: bool) -> tuple[Generator, Any, list[int]]:
    """(generator, tokenizer, stop ids) of `generator=openai`: the endpoints asked what they serve, and their chat
    template checked against ours on a few rows, before anything is generated. The tokenizer (and the stop ids)
    come from `model.path`: prompts go to the servers as our own rendering's token ids. Its config.json is read
    as a head reads it (`head_target_args`), so a target our engine does not implement regenerates through the
    servers that run it."""
    from mtp_train.models.foreign import head_target_args
    from mtp_train.remote import OpenAIGenerator

    path = Path(rc.model.path)
    tokenizer = load_tokenizer(path)
    args = head_target_args(path)
    stop_ids = stop_token_ids(tokenizer, args.eos_token_ids, rc.chat_template_kwargs)
    generator = OpenAIGenerator.connect(rc.endpoints, **rc.client_kwargs(), vocab_size=args.vocab_size)
    if rc.template_check_rows and is_main:
        rows = generator.check_template(convs, tokenizer, rc.chat_template_kwargs, rc.template_check_rows)
        log.info("%d rows rendered alike by %s and by us", rows, ", ".join(generator.endpoints))
    return generator, tokenizer, stop_ids


def _gather(stats: RegenerateStats, group: Any) -> RegenerateStats:
    """Every rank's counters summed (the same on every rank)."""
    if not tdist.is_initialized():
        return stats
    everyone: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, stats.as_dict(), group=group)
    total = RegenerateStats()
    for d in everyone:
        total.merge(RegenerateStats.from_dict(d))
    return total


main = hydra_entry(PROG, "regenerate", regenerate_main)


if __name__ == "__main__":
    main()
