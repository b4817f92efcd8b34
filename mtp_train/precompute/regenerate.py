"""Self-distillation: answer the user turns of conversations with the target, through the engine's batched generation.

Draft heads learn best from the target's own distribution, so the assistant turns of a data set are replaced by
the target's answers. For each conversation the existing assistant turns are dropped and the user turns answered
one at a time: answer 1 is generated for [system?, user 1], answer 2 for [system?, user 1, answer 1, user 2], and
so on. Turn t of every pending conversation goes through one `LLMEngine.generate` call (continuous batching), then
turn t+1 for those that have one. Prompts are the tokenizer's chat template with the generation prompt, tokenized
without extra special tokens; generation stops on the model's EOS ids and on the template's end-of-turn token,
which is stripped from the stored text.

Output: messages JSONL, one record per (conversation, sample):

    {"id": "<conv id>" (n = 1) or "<conv id>#<k>" (k = 0..n-1), "messages": [...],
     "source": {"file", "line", "id"}, "finish_reasons": ["stop" | "length", ...per turn],
     "gen_tokens": [...per turn, the end-of-turn token included], "provenance": {...}}

Files, resume and ranks: rank r answers conversations r, r + world, ... and appends each record to the part file
`<out>.rank<r>` as soon as all its turns are done (flushed per record, fsynced every few records). After a barrier,
rank 0 merges `<out>` and every part into `<out>` in the original conversation order (temporary file + rename) and
removes the parts. The same merge runs at start-up, before anything is generated, so a killed run (of any world
size) is folded in first; a torn last line is dropped there with a warning. Records already in `<out>` are then
skipped: only conversations whose record is missing, e.g. multi-turn ones cut short, are answered again. A resumed
run must use the same target, tokenizer, chat template and sampling settings (checked per record).

Seeds: every request gets its own seed from (seed, conversation id, sample index, turn), so that the text does not
depend on batching, on the rank split or on what an earlier run already did.

It lives with stage one, on the floor above the engine that it drives; `data/` below supplies the
readers and chat rendering.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtp_train import __version__
from mtp_train.data.chat import ChatTemplateError, chat_template_fingerprint, render, tokenizer_fingerprint
from mtp_train.data.readers import Conversation
from mtp_train.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from mtp_train.engine.llm import GenerationOutput, LLMEngine

log = logging.getLogger(__name__)

# Why a record was not produced; the keys of `RegenerateStats.skipped`.
PROMPT_TOO_LONG = "prompt_too_long"  # a turn's prompt has more than max_prompt_tokens tokens
EXCEEDS_KV_CACHE = "exceeds_kv_cache"  # prompt + max_new_tokens would not fit in the engine's KV pool
EXCEEDS_CONTEXT = "exceeds_context"  # prompt + max_new_tokens is beyond the model's max_position_embeddings
EMPTY_ANSWER = "empty_answer"  # the target answered a turn with nothing but whitespace (readers refuse those)
TEMPLATE_ERROR = "template_error"  # the chat template failed on the conversation
DUPLICATE_ID = "duplicate_id"  # a conversation id seen earlier in the data (records are keyed by id)
NO_USER_TURN = "no_user_turn"

AFTER_ALL = 1 << 62  # sort position of records that are not in the current selection: after every conversation
PROVENANCE_VOLATILE = ("created_at", "package_version", "target.path", "target.name")  # may differ on resume


class RegenerateError(ValueError):
    """Invalid regeneration settings, no data, or an output file that cannot be resumed; the message says why."""


# ------------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class SamplingSettings:
    """How every turn is decoded; recorded in the provenance and checked on resume."""

    n: int = 1  # samples (records) per conversation
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 512  # per assistant turn
    seed: int = 0  # base of the per-request seeds

    def __post_init__(self) -> None:
        if self.n < 1:
            raise RegenerateError(f"n must be >= 1, got {self.n}")
        if self.n > 1 and self.temperature == 0:
            raise RegenerateError(f"n={self.n} samples per prompt need temperature > 0; greedy decoding "
                                  "(temperature=0) gives the same answer every time")
        self.params(None, [])  # SamplingParams checks the rest (temperature >= 0, top_p in (0, 1], ...)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def params(self, seed: int | None, stop_ids: Sequence[int]) -> SamplingParams:
        """The engine's parameters for one request seeded with `seed` (None for greedy)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens, stop_token_ids=list(stop_ids), seed=seed)


def record_id(conv_id: str, k: int, n: int) -> str:
    """`<conv id>` for a single sample, `<conv id>#<k>` (k from 0) for one of n > 1."""
    return conv_id if n == 1 else f"{conv_id}#{k}"


def request_seed(seed: int, conv_id: str, k: int, turn: int) -> int:
    """A 63-bit seed of one request, a hash of (seed, conversation id, sample index, turn)."""
    digest = hashlib.sha256(f"{seed}\0{conv_id}\0{k}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def end_of_turn_token_id(tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> int | None:
    """The special token the chat template writes right after an assistant turn's content, or None.

    Found from a rendering rather than a list of marker names: the text after a probe answer is the turn's
    closing (`<|im_end|>\\n`, `<|eot_id|>`, `<|end|>\\n`, ...), and its first special token ends the turn.
    """
    probe = "\ue000"
    try:
        text = render(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}],
                      template_kwargs=template_kwargs)
    except ChatTemplateError:
        return None
    at = text.rfind(probe)
    if at < 0:
        return None
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for tid in tokenizer(text[at + len(probe):], add_special_tokens=False)["input_ids"]:
        if tid in special:
            return int(tid)
    return None


def stop_token_ids(tokenizer: Any, model_eos_ids: Sequence[int],
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """What ends an answer: the model's EOS ids, the tokenizer's EOS and the template's end-of-turn token."""
    ids = [int(i) for i in model_eos_ids]
    for extra in (getattr(tokenizer, "eos_token_id", None), end_of_turn_token_id(tokenizer, template_kwargs)):
        if extra is not None and int(extra) not in ids:
            ids.append(int(extra))
    if not ids:
        raise RegenerateError("no stop token: the model declares no eos_token_id and the tokenizer and chat "
                              "template name none; answers would always run to max_new_tokens")
    return ids


def make_provenance(*, target_name: str, target_path: str | Path, weights_fingerprint: str, tokenizer: Any,
                    settings: SamplingSettings, stop_ids: Sequence[int],
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What every record carries about how it was made (the weights fingerprint is computed by the caller)."""
    return {
        "target": {"name": target_name, "path": str(target_path), "weights_fingerprint": weights_fingerprint},
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "chat_template_fingerprint": chat_template_fingerprint(tokenizer),
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "sampling": settings.as_dict(),
        "stop_token_ids": [int(i) for i in stop_ids],
        "package_version": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def provenance_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`key: old != new` for every provenance entry that must match on resume (times and paths may differ)."""
    a, b = _flatten(old), _flatten(new)
    keys = sorted((set(a) | set(b)) - set(PROVENANCE_VOLATILE))
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


# -------------------------------------------------------------------------------------------------- stats


@dataclass
class RegenerateStats:
    """Counters of one rank's run (`merge` sums ranks)."""

    conversations: int = 0  # conversations assigned to this rank
    done_before: int = 0  # records already in the output (resume)
    written: int = 0  # records written by this run
    requests: int = 0  # generate requests (one per sample and turn)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0  # time inside generate
    skipped: Counter = field(default_factory=Counter)  # reason → records not produced
    finish_reasons: Counter = field(default_factory=Counter)  # "stop" / "length" → turns
    records: int = 0  # records in the merged output (set on rank 0 after the merge)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def merge(self, other: RegenerateStats) -> None:
        """Add another rank's counters (seconds: the slowest rank, since ranks run side by side)."""
        for name in ("conversations", "done_before", "written", "requests", "prompt_tokens", "generated_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.seconds = max(self.seconds, other.seconds)
        self.skipped.update(other.skipped)
        self.finish_reasons.update(other.finish_reasons)
        self.records = max(self.records, other.records)

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["skipped"], d["finish_reasons"] = dict(self.skipped), dict(self.finish_reasons)
        d["tokens_per_s"] = self.tokens_per_s
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RegenerateStats:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["skipped"], kw["finish_reasons"] = Counter(d.get("skipped", {})), Counter(d.get("finish_reasons", {}))
        return cls(**kw)

    def summary(self) -> str:
        skipped = ", ".join(f"{r}={c}" for r, c in sorted(self.skipped.items())) or "none"
        return (f"{self.conversations} conversations, {self.records} records in the output "
                f"({self.done_before} already there, {self.written} written now); "
                f"{self.generated_tokens} tokens generated in {self.seconds:.1f} s ({self.tokens_per_s:.1f} tokens/s) "
                f"over {self.requests} requests; turns ending on stop/length: {self.finish_reasons.get('stop', 0)}/"
                f"{self.finish_reasons.get('length', 0)}; skipped records: {skipped}")


# -------------------------------------------------------------------------------------------------- files


def part_path(out: str | Path, rank: int) -> Path:
    """The file rank `rank` appends its records to, beside `out`."""
    out = Path(out)
    return out.with_name(f"{out.name}.rank{rank}")


def find_parts(out: str | Path) -> list[Path]:
    """Part files of `out` (`<out>.rank<r>`) left by any rank of any run, by rank."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    prefix = f"{out.name}.rank"
    found = [(int(p.name[len(prefix):]), p) for p in out.parent.iterdir()
             if p.name.startswith(prefix) and p.name[len(prefix):].isdigit() and p.is_file()]
    return [p for _, p in sorted(found)]


@dataclass
class _Line:
    """Where one complete record sits in a file."""

    id: str
    path: Path
    offset: int
    length: int  # bytes, newline included


class RecordWriter:
    """Appends records as JSON lines: each line flushed as written, fsynced every `fsync_every` lines and at close.

    The file is opened on the first record, so a rank with nothing to write leaves no file.
    """

    def __init__(self, path: str | Path, fsync_every: int = 64) -> None:
        self.path = Path(path)
        self.fsync_every = max(1, fsync_every)
        self.count = 0
        self._fh = None

    def write(self, record: Mapping[str, Any]) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("ab")
        # One write call per line: a kill leaves at most the last line torn, never two lines interleaved.
        self._fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._fh.flush()
        self.count += 1
        if self.count % self.fsync_every == 0:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scan_records(path: str | Path, expect: Mapping[str, Any] | None = None) -> list[_Line]:
    """Index the complete records of a JSONL output file.

    A last line without its newline, or a last line that is not a JSON record, is a write cut short by a kill: it
    is left out with a warning. A bad line anywhere else means the file is damaged (RegenerateError, file:line).
    With `expect` (a provenance), every record must have been made with matching settings.
    """
    path = Path(path)
    lines: list[_Line] = []
    bad: tuple[int, str] | None = None  # a bad line is only forgivable if nothing follows it
    offset = 0
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            start, offset = offset, offset + len(raw)
            if bad is not None:
                raise RegenerateError(f"{path}:{bad[0]}: {bad[1]}; the file is damaged (only a torn last line is "
                                      "repaired); remove the line or choose another `out`")
            if not raw.endswith(b"\n"):
                bad = (lineno, "line without a newline")
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                rid = record["id"]
                if not isinstance(rid, str):
                    raise TypeError(f"id is {type(rid).__name__}")
            except (ValueError, KeyError, TypeError) as exc:
                bad = (lineno, f"not a record ({type(exc).__name__}: {exc})")
                continue
            if expect is not None:
                diff = provenance_differences(record.get("provenance") or {}, expect)
                if diff:
                    raise RegenerateError(
                        f"{path}:{lineno} (record {rid!r}) was made with other settings: {'; '.join(diff[:4])}. "
                        "Resuming needs the same target, tokenizer, chat template and sampling; choose another "
                        "`out` or remove the file")
            lines.append(_Line(rid, path, start, len(raw)))
    if bad is not None:
        log.warning("%s:%d: dropping a torn last line (%s), left by an interrupted write; its record is "
                    "generated again", path, bad[0], bad[1])
    return lines


def consolidate(out: str | Path, order: Mapping[str, tuple[int, int]], expect: Mapping[str, Any] | None = None,
                ) -> int:
    """Merge `out` and its part files into `out`, in the order given by `order` (record id → sort key).

    Records whose id is not in `order` (other data, a smaller `limit`) are kept after the others, in their previous
    order; a record present twice is kept once (the copy in `out`). `out` is rewritten through a temporary file
    and a rename, then the parts are removed; when there are no parts and nothing to repair, `out` is left as it
    is. Returns the number of records in `out`.
    """
    out = Path(out)
    parts = find_parts(out)
    size = out.stat().st_size if out.exists() else 0
    existing = scan_records(out, expect) if out.exists() else []
    clean = (existing[-1].offset + existing[-1].length if existing else 0) == size  # nothing cut off at the end
    if not parts and clean:
        return len(existing)
    merged: dict[str, tuple[tuple[int, int], _Line]] = {}
    unknown = 0
    for line in [*existing, *(line for p in parts for line in scan_records(p, expect))]:
        if line.id in merged:
            continue
        key = order.get(line.id)
        if key is None:
            unknown += 1
            key = (AFTER_ALL, unknown)  # after every known record, in the order met
        merged[line.id] = (key, line)
    if unknown:
        log.warning("%d record(s) in %s are not in the current data selection; they are kept at the end", unknown, out)

    # A unique sibling opened normally (mkstemp's 0600 mode would survive the rename); same file system as `out`.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.merge")
    handles: dict[Path, Any] = {}
    try:
        with tmp.open("xb") as dst:
            for _, line in sorted(merged.values(), key=lambda kv: kv[0]):
                src = handles.get(line.path) or handles.setdefault(line.path, line.path.open("rb"))
                src.seek(line.offset)
                dst.write(src.read(line.length))  # byte for byte: a resumed record never changes
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for h in handles.values():
            h.close()
    # Only once the merged file is in place: a kill before this leaves parts that the next merge de-duplicates.
    for p in parts:
        p.unlink(missing_ok=True)
    return len(merged)


# ------------------------------------------------------------------------------------------------ answering


@dataclass
class _Unit:
    """One record in the making: a conversation's user turns, answered one by one."""

    pos: int  # position in the plan (keeps turn batches in a fixed order)
    conv: Conversation
    k: int  # sample index
    rid: str
    system: list[dict[str, str]]
    users: list[str]
    answers: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def prompt_messages(self) -> list[dict[str, str]]:
        """[system?, user 1, answer 1, ..., user t] for the next turn t."""
        return self.messages()[: len(self.system) + 2 * len(self.answers) + 1]

    def messages(self) -> list[dict[str, str]]:
        msgs = list(self.system)
        for t, user in enumerate(self.users):
            msgs.append({"role": "user", "content": user})
            if t < len(self.answers):
                msgs.append({"role": "assistant", "content": self.answers[t]})
        return msgs

    def record(self, provenance: Mapping[str, Any]) -> dict[str, Any]:
        c = self.conv
        return {"id": self.rid, "messages": self.messages(), "source": {"file": c.source, "line": c.line, "id": c.id},
                "finish_reasons": list(self.finish), "gen_tokens": list(self.tokens), "provenance": dict(provenance)}


def split_turns(messages: Sequence[Mapping[str, str]]) -> tuple[list[dict[str, str]], list[str]]:
    """(leading system messages, user contents); assistant turns are dropped."""
    system = [dict(m) for m in messages if m["role"] == "system"]
    return system, [m["content"] for m in messages if m["role"] == "user"]


def plan_order(conversations: Sequence[Conversation], n: int) -> dict[str, tuple[int, int]]:
    """Record id → (conversation position, sample index): the order of the merged output (first id wins)."""
    order: dict[str, tuple[int, int]] = {}
    seen: set[str] = set()
    for i, conv in enumerate(conversations):
        if conv.id in seen:
            continue
        seen.add(conv.id)
        for k in range(n):
            order[record_id(conv.id, k, n)] = (i, k)
    return order


def regenerate(conversations: Sequence[Conversation], engine: LLMEngine, tokenizer: Any, out: str | Path, *,
               settings: SamplingSettings, provenance: Mapping[str, Any], stop_ids: Sequence[int] | None = None,
               max_prompt_tokens: int | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
               rank: int = 0, world: int = 1, barrier: Callable[[], None] = lambda: None, progress: bool = False,
               fsync_every: int = 64, on_start: Callable[[], None] | None = None) -> RegenerateStats:
    """Answer the user turns of `conversations` with `engine` and write/merge the records into `out`.

    Every rank passes the same `conversations` (all of them, in order) and takes its share r, r + world, ...;
    `barrier` waits for all ranks (a no-op for one). `stop_ids` default to `stop_token_ids(tokenizer, model eos)`.
    `on_start` runs on rank 0 once an existing output has been merged and found compatible, before anything is
    generated (the place to save the run's config beside `out`: a refused resume must not overwrite it).
    On return `out` holds every finished record, in conversation order, on every rank. The counters are this
    rank's; `records` (the merged total) is set on rank 0.
    """
    out = Path(out)
    kw = dict(chat_template_kwargs or {})
    stop = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, engine.model.args.eos_token_ids, kw)
    order = plan_order(conversations, settings.n)
    stats = RegenerateStats()

    # Fold in whatever an earlier run left (parts, a torn line) before anyone reads what is done.
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        consolidate(out, order, provenance)
        if on_start is not None:
            on_start()
    barrier()
    done = {line.id for line in scan_records(out)} if out.exists() else set()

    units: list[_Unit] = []
    seen: set[str] = set()
    for i, conv in enumerate(conversations):
        mine = i % world == rank
        stats.conversations += mine
        duplicate = conv.id in seen
        seen.add(conv.id)
        if not mine:
            continue
        if duplicate:
            stats.skipped[DUPLICATE_ID] += settings.n
            continue
        system, users = split_turns(conv.messages)
        for k in range(settings.n):
            rid = record_id(conv.id, k, settings.n)
            if rid in done:
                stats.done_before += 1
            elif not users:
                stats.skipped[NO_USER_TURN] += 1
            else:
                units.append(_Unit(len(units), conv, k, rid, system, users))

    with RecordWriter(part_path(out, rank), fsync_every) as writer:
        _answer(units, _TurnContext(engine, tokenizer, writer, stats, settings, provenance, stop, max_prompt_tokens,
                                    kw, progress))
        stats.written = writer.count

    barrier()
    if rank == 0:
        stats.records = consolidate(out, order, provenance)
    barrier()  # nobody returns before the merged file is in place
    return stats


@dataclass
class _TurnContext:
    """What every turn of one run shares."""

    engine: LLMEngine
    tokenizer: Any
    writer: RecordWriter
    stats: RegenerateStats
    settings: SamplingSettings
    provenance: Mapping[str, Any]
    stop_ids: list[int]
    max_prompt_tokens: int | None
    template_kwargs: Mapping[str, Any]
    progress: bool
    num_turns: int = 0
    template_errors: int = 0


def _answer(units: list[_Unit], ctx: _TurnContext) -> None:
    """Turn by turn: one generate call per turn over every unit still answering; finished units are written."""
    ctx.num_turns = max((len(u.users) for u in units), default=0)
    active, turn = units, 0
    while active:
        requests, prompts = _prepare_turn(active, ctx)
        if not requests:
            break
        active = _generate_turn(requests, prompts, turn, ctx)
        turn += 1


def _prepare_turn(active: list[_Unit], ctx: _TurnContext) -> tuple[list[_Unit], list[list[int]]]:
    """Render and tokenize the next prompt of every active unit; a prompt the engine cannot take skips its record."""
    stats, kv = ctx.stats, ctx.engine.runner.kv
    ready: list[_Unit] = []
    texts: list[str] = []
    for u in active:
        try:
            texts.append(render(ctx.tokenizer, u.prompt_messages(), add_generation_prompt=True,
                                template_kwargs=ctx.template_kwargs))
            ready.append(u)
        except ChatTemplateError as exc:
            stats.skipped[TEMPLATE_ERROR] += 1
            ctx.template_errors += 1
            if ctx.template_errors == 1:  # the same template fails the same way on many records
                log.warning("%s:%d: record %s skipped: %s", u.conv.source, u.conv.line, u.rid, exc)
    # One call for the whole turn: a fast tokenizer encodes the batch on all cores.
    encoded = ctx.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    requests: list[_Unit] = []
    prompts: list[list[int]] = []
    for u, ids in zip(ready, encoded):
        total = len(ids) + ctx.settings.max_new_tokens
        if ctx.max_prompt_tokens is not None and len(ids) > ctx.max_prompt_tokens:
            stats.skipped[PROMPT_TOO_LONG] += 1
        elif kv.pages_for(total) > kv.num_pages:  # the engine would refuse it (OutOfPagesError) mid-batch
            stats.skipped[EXCEEDS_KV_CACHE] += 1
        elif total > ctx.engine.model.args.max_position_embeddings:
            stats.skipped[EXCEEDS_CONTEXT] += 1
        else:
            requests.append(u)
            prompts.append(list(ids))
    return requests, prompts


def _generate_turn(requests: list[_Unit], prompts: list[list[int]], turn: int, ctx: _TurnContext) -> list[_Unit]:
    """Generate turn `turn` for `requests`; write the units this answers completely, return those with more turns."""
    engine, stats, settings = ctx.engine, ctx.stats, ctx.settings
    stop_set = set(ctx.stop_ids)
    params = [settings.params(None if settings.greedy else request_seed(settings.seed, u.conv.id, u.k, turn),
                              ctx.stop_ids) for u in requests]
    bar = None
    if ctx.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=f"turn {turn + 1}/{ctx.num_turns}", unit="req", dynamic_ncols=True)
    before = (engine.stats.prompt_tokens, engine.stats.generated_tokens, engine.stats.seconds)
    t0 = time.perf_counter()
    following: list[_Unit] = []

    def on_finish(i: int, res: GenerationOutput) -> None:
        u = requests[i]
        ids = res.output_ids
        stats.finish_reasons[res.finish_reason] += 1
        if bar is not None:
            bar.update(1)
            rate = (engine.stats.generated_tokens - before[1]) / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{rate:.1f}")
        # The end-of-turn token belongs to the template, not to the answer's text.
        text_ids = ids[:-1] if res.finish_reason == "stop" and ids and ids[-1] in stop_set else ids
        text = ctx.tokenizer.decode(text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not text.strip():
            stats.skipped[EMPTY_ANSWER] += 1
            return
        u.answers.append(text)
        u.finish.append(res.finish_reason)
        u.tokens.append(len(ids))
        if len(u.answers) == len(u.users):
            ctx.writer.write(u.record(ctx.provenance))
        else:
            following.append(u)

    try:
        engine.generate(prompts, params, on_finish=on_finish, progress=False)
    finally:
        if bar is not None:
            bar.close()
    stats.requests += len(requests)
    stats.prompt_tokens += engine.stats.prompt_tokens - before[0]
    stats.generated_tokens += engine.stats.generated_tokens - before[1]
    stats.seconds += engine.stats.seconds - before[2]
    return sorted(following, key=lambda u: u.pos)  # a fixed submission order, whatever the completion order
