"""The stage driver: every rank answers its share of the conversations as it reads them, rank 0 merges the records
into `out`.

The conversations are a stream (`data.readers.iter_conversations`): a window of `cfg.window` dialogues is in flight
(`engine.turns.DialogueWindow`), refilled from the stream as dialogues end, and each record is written as soon as its
last turn is answered. What a run holds is the window's dialogues and answers, plus a few numbers per conversation
(`ids`: which records were done before, which ids were seen, the merge order), whatever the number of conversations.

Answers come from a `Generator` (`mtp_train.engine.generator`, through `Generator.stream`): the stage reads its limits
(to skip what it would refuse), its counters and its provenance, and nothing else of whoever generates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtp_train.config import Interrupted, RegenerateConfig
from mtp_train.data.chat import ChatTemplateError, render
from mtp_train.data.ids import IdSet
from mtp_train.data.readers import Conversation
from mtp_train.engine.generator import Generator
from mtp_train.engine.turns import Dialogue, DialogueWindow
from mtp_train.regenerate.ids import RecordOrder, record_id
from mtp_train.regenerate.provenance import make_provenance
from mtp_train.regenerate.records import RecordWriter, consolidate, iter_records, part_path
from mtp_train.regenerate.sampling import request_params, request_seed
from mtp_train.regenerate.stats import (
    DUPLICATE_ID,
    EMPTY_ANSWER,
    EXCEEDS_CONTEXT,
    EXCEEDS_KV_CACHE,
    NO_USER_TURN,
    PROMPT_TOO_LONG,
    TEMPLATE_ERROR,
    RegenerateStats,
)

if TYPE_CHECKING:
    from mtp_train.engine.llm import GenerationOutput
    from mtp_train.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Sample:
    """What one dialogue of the run stands for: sample `k` of a conversation, written as record `rid`."""

    conv: Conversation
    k: int
    rid: str


def regenerate(conversations: Iterable[Conversation], generator: Generator, tokenizer: Any, out: str | Path,
               cfg: RegenerateConfig, *, stop_ids: Sequence[int], rank: int = 0, world: int = 1,
               barrier: Callable[[], None] = lambda: None, progress: bool = False, fsync_every: int = 64,
               on_start: Callable[[], None] | None = None) -> RegenerateStats:
    """Answer the user turns of `conversations` with `generator` and write/merge the records into `out`.

    Args:
        conversations: every conversation, in order, read lazily (each rank passes all of them and takes its share
            r, r + world, ...): at most `cfg.window` of this rank's are held at a time.
        generator: who answers (`EngineGenerator` over our engine); its provenance goes into every record, as
            `provenance.target`.
        tokenizer: the target's tokenizer, whose chat template renders the prompts.
        out: the output file (messages JSONL).
        cfg: the sampling (n, temperature, top_k, top_p, max_new_tokens, seed), max_prompt_tokens, the window and
            the chat template's kwargs; its other fields (model, data, out, ...) are the caller's.
        stop_ids: what ends an answer (`engine.turns.stop_token_ids`: the model's EOS ids, the tokenizer's EOS and
            the template's end-of-turn token).
        rank, world: this rank and the number of ranks; barrier: waits for all ranks (a no-op for one).
        progress: a bar of the records written (rank 0's choice).
        fsync_every: records between fsyncs of the part file.
        on_start: runs on rank 0 once an existing output has been merged and found compatible, before anything is
            generated (the place to save the run's config beside `out`: a refused resume must not overwrite it).

    On return `out` holds every finished record, in conversation order, on every rank. The counters are this
    rank's; `records` (the merged total) is set on rank 0.
    """
    out = Path(out)
    stop = list(stop_ids)
    provenance = make_provenance(target=generator.provenance(), tokenizer=tokenizer, cfg=cfg, stop_ids=stop)
    stats = RegenerateStats()

    # Fold in whatever an earlier run left (parts, a torn line) before anyone reads what is done. The data is not
    # read yet: the records keep the order met, and the merge at the end puts them in conversation order.
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        consolidate(out, None, provenance)
        if on_start is not None:
            on_start()
    barrier()
    done = IdSet()
    if out.exists():
        for line in iter_records(out):
            done.add(line.id)
    order = RecordOrder(cfg.n) if rank == 0 else None  # rank 0 reads every conversation: it merges

    with RecordWriter(part_path(out, rank), fsync_every) as writer:
        try:
            _answer(_dialogues(conversations, cfg.n, rank, world, done, order, stats), generator, tokenizer, cfg,
                    stop, stats, progress, lambda d: writer.write(_record(d, provenance)))
        except KeyboardInterrupt:
            raise Interrupted(f"after {writer.count} records were written to {part_path(out, rank)}; re-run the same "
                              f"command to answer the rest (the records written are kept)") from None
        stats.written = writer.count

    barrier()
    if rank == 0:
        stats.records = consolidate(out, order, provenance)
    barrier()  # nobody returns before the merged file is in place
    return stats


def _dialogues(conversations: Iterable[Conversation], n: int, rank: int, world: int, done: IdSet,
               order: RecordOrder | None, stats: RegenerateStats) -> Iterator[Dialogue]:
    """This rank's dialogues still to answer, one per sample of its conversations, as the stream is read.

    Every conversation is counted for the merge order (`order`, rank 0) and for repeated ids (the first wins, on
    every rank alike); records already done, repeated ids and conversations without a user turn are counted and
    passed by.
    """
    seen = IdSet()
    for i, conv in enumerate(conversations):
        mine = i % world == rank
        stats.conversations += mine
        first = seen.add(conv.id)
        if first and order is not None:
            order.add(conv.id, i)
        if not mine:
            continue
        if not first:
            stats.skipped[DUPLICATE_ID] += n
            continue
        for k in range(n):
            rid = record_id(conv.id, k, n)
            d = Dialogue.of(conv.messages, _Sample(conv, k, rid))
            if rid in done:
                stats.done_before += 1
            elif not d.users:
                stats.skipped[NO_USER_TURN] += 1
            else:
                yield d


def _record(d: Dialogue, provenance: Mapping[str, Any]) -> dict[str, Any]:
    """The output record of a fully answered dialogue."""
    s: _Sample = d.key
    c = s.conv
    return {"id": s.rid, "messages": d.messages(), "source": {"file": c.source, "line": c.line, "id": c.id},
            "finish_reasons": list(d.finish_reasons), "gen_tokens": list(d.gen_tokens), "provenance": dict(provenance)}


def renders_back(tokenizer: Any, prompt: Sequence[Mapping[str, str]], text: str, out: GenerationOutput,
                 template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the conversation `prompt` + the answer `text`, rendered and tokenized as stage one does, starts with
    the tokens the target saw and generated (`out.prompt_ids` + `out.output_ids`, its end token included). An
    answer is stored verbatim (`engine.turns.answer_text`, a thinking block and all), so this holds unless the
    template rewrites it (Qwen3's strips the newlines around a trace)."""
    try:
        whole = render(tokenizer, [*prompt, {"role": "assistant", "content": text}], template_kwargs=template_kwargs)
    except ChatTemplateError:
        return False
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    want = [*out.prompt_ids, *out.output_ids]
    return list(ids[:len(want)]) == want


def _answer(dialogues: Iterator[Dialogue], generator: Generator, tokenizer: Any, cfg: RegenerateConfig,
            stop_ids: list[int], stats: RegenerateStats, progress: bool, write: Callable[[Dialogue], None]) -> None:
    """Turn by turn through a `DialogueWindow` of `cfg.window` dialogues; a record the generator cannot take, or an
    empty answer, is skipped and counted; finished dialogues are written at once."""
    limits = generator.limits
    template_errors = 0

    def admit(d: Dialogue, ids: list[int]) -> bool:
        total = len(ids) + cfg.max_new_tokens
        if len(ids) > cfg.max_prompt_tokens:
            reason = PROMPT_TOO_LONG
        elif limits.max_request_tokens is not None and total > limits.max_request_tokens:
            reason = EXCEEDS_KV_CACHE  # the generator would refuse it mid-batch
        elif total > limits.max_context:
            reason = EXCEEDS_CONTEXT
        else:
            stats.requests += 1
            return True
        stats.skipped[reason] += 1
        return False

    def template_error(d: Dialogue, exc: ChatTemplateError) -> None:
        nonlocal template_errors
        stats.skipped[TEMPLATE_ERROR] += 1
        template_errors += 1
        if template_errors == 1:  # the same template fails the same way on many records
            log.warning("%s:%d: record %s skipped: %s", d.key.conv.source, d.key.conv.line, d.key.rid, exc)

    def keep(d: Dialogue, out: GenerationOutput, text: str) -> bool:
        stats.finish_reasons[out.finish_reason] += 1
        if not text.strip():
            stats.skipped[EMPTY_ANSWER] += 1
            return False
        if not renders_back(tokenizer, d.prompt_messages(), text, out, cfg.chat_template_kwargs):
            stats.not_rendered_back += 1
            if stats.not_rendered_back == 1:  # the same template rewrites the same way on many answers
                log.warning("%s:%d: record %s turn %d does not render back to the tokens the target generated (the "
                            "chat template rewrites the answer, e.g. the whitespace around a reasoning trace); it "
                            "is kept as generated, its samples differ there", d.key.conv.source, d.key.conv.line,
                            d.key.rid, len(d.answers) + 1)
        return True

    def params(d: Dialogue, turn: int) -> SamplingParams:
        # The seed is the request's own (conversation, sample, turn): never the window's or the batch's.
        seed = None if cfg.greedy else request_seed(cfg.seed, d.key.conv.id, d.key.k, turn)
        return request_params(cfg, seed, stop_ids)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="records", unit="rec", dynamic_ncols=True)
    before = generator.stats()
    t0 = time.perf_counter()

    def written(d: Dialogue) -> None:
        write(d)
        if bar is not None:
            bar.update(1)
            rate = (generator.stats().generated_tokens - before.generated_tokens) / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(requests=stats.requests, tok_s=f"{rate:.1f}")

    window = DialogueWindow(dialogues, cfg.window, tokenizer, params, template_kwargs=cfg.chat_template_kwargs,
                            admit=admit, on_template_error=template_error, on_answer=keep, on_done=written,
                            name=lambda d, turn: f"conversation {d.key.rid} turn {turn + 1}")

    try:
        generator.stream(window.feed, window.answered)
    finally:
        if bar is not None:
            bar.close()
        after = generator.stats()
        stats.prompt_tokens += after.prompt_tokens - before.prompt_tokens
        stats.generated_tokens += after.generated_tokens - before.generated_tokens
        stats.seconds += after.seconds - before.seconds
