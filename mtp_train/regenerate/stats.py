"""The counters of a regeneration run: per rank, summed over ranks, and the one-line summary it prints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# Why a record was not produced; the keys of `RegenerateStats.skipped`.
PROMPT_TOO_LONG = "prompt_too_long"  # a turn's prompt has more than max_prompt_tokens tokens
EXCEEDS_KV_CACHE = "exceeds_kv_cache"  # prompt + max_new_tokens would not fit in the engine's KV pool
EXCEEDS_CONTEXT = "exceeds_context"  # prompt + max_new_tokens is beyond the model's max_position_embeddings
EMPTY_ANSWER = "empty_answer"  # the target answered a turn with nothing but whitespace (readers refuse those)
TEMPLATE_ERROR = "template_error"  # the chat template failed on the conversation
DUPLICATE_ID = "duplicate_id"  # a conversation id seen earlier in the data (records are keyed by id)
NO_USER_TURN = "no_user_turn"


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
    # answers kept whose conversation does not render back to the prompt and the tokens generated (the template
    # rewrites the answer: a reasoning trace it normalises, channels it renders otherwise)
    not_rendered_back: int = 0
    records: int = 0  # records in the merged output (set on rank 0 after the merge)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def merge(self, other: RegenerateStats) -> None:
        """Add another rank's counters (seconds: the slowest rank, since ranks run side by side)."""
        for name in ("conversations", "done_before", "written", "requests", "prompt_tokens", "generated_tokens",
                     "not_rendered_back"):
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
                f"{self.finish_reasons.get('length', 0)}; skipped records: {skipped}"
                + (f"; {self.not_rendered_back} answers render back otherwise than generated"
                   if self.not_rendered_back else ""))
