"""The text of a growing answer, for streaming: the answer-text rule of `mtp_train.engine.turns` (the stop token it
ended on left out, everything else decoded as generated) applied token by token, with OpenAI's stop strings and
partial UTF-8 characters held back until they are whole."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes half a UTF-8 character to


class TextStream:
    """Text deltas of one answer whose token ids arrive a few at a time.

    Args:
        tokenizer: the target's tokenizer.
        stop: stop strings: the answer ends before the first one (not included), as OpenAI's `stop`.
        stop_ids: token ids that end the answer; a final one is not part of the text.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), stop_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.stop_ids = set(stop_ids)
        self.ids: list[int] = []
        self.text = ""  # the text emitted so far
        self.stopped = False  # a stop string appeared: the answer is over

    def _decode(self) -> str:
        ids = self.ids[:-1] if self.ids and self.ids[-1] in self.stop_ids else self.ids
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """Take the next token ids; return the text that is now certain (all of it when `final`). After a stop
        string, `stopped` is set and the text ends before it."""
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in ids)
        full = self._decode()
        if self.stop:
            # A stop string may have begun in text already emitted only if it is longer than one character.
            start = max(0, len(self.text) - max(map(len, self.stop)) + 1)
            hits = [at for at in (full.find(s, start) for s in self.stop) if at >= 0]
            if hits:
                self.stopped = True
                return self._emit(full[: min(hits)])
        if not final:
            keep = len(full)
            if self.stop:  # the tail might be the start of a stop string
                keep -= max(map(len, self.stop)) - 1
            if full.endswith(REPLACEMENT):  # half a character: wait for the rest
                keep = min(keep, len(full) - 1)
            full = full[: max(keep, len(self.text))]
        return self._emit(full)

    def _emit(self, full: str) -> str:
        delta = full[len(self.text):]
        self.text = full if len(full) > len(self.text) else self.text
        return delta
