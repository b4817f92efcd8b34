"""Sampling: greedy, temperature, top-k, top-p; seeded per sequence.

`filtered_probs` is the one place where logits become a distribution, so that speculative
acceptance applies temperature/top-k/top-p to draft and target in exactly the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request is decoded."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p; 1 = off
    max_new_tokens: int = 128  # stop after this many generated tokens
    stop_token_ids: list[int] | None = None  # None = the model's EOS ids
    ignore_eos: bool = False  # generate exactly max_new_tokens
    seed: int | None = None  # seeds this request's own generator exactly; None = torch's global RNG

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # a NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with `seed`, or None when unseeded."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


class SamplingError(RuntimeError):
    """Rows of a batch whose logits give no distribution to sample from (non-finite or all zero after temperature,
    top-k and top-p); raised before any row is drawn, so that no generator has moved and the step can be run again
    without them.

    Args:
        message: what failed, for the log and the clients.
        params: the failing rows' own `SamplingParams` objects (a sequence's `params`, by identity).
    """

    def __init__(self, message: str, params: list[SamplingParams]) -> None:
        super().__init__(message)
        self.params = params


@dataclass
class SamplingBatch:
    """Per-row parameters of a batch of logits."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None] = field(default_factory=list)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits: (..., V) → (...) int64, the first maximal index of each row: `argmax`'s answer, through `max`'s
    kernel, which torch runs ~3× faster on CPU (65 against 23 µs a 49k-token row, measured), on every greedy step."""
    return logits.max(-1).indices


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits: (..., V) → probabilities (..., V) in float32 after temperature, top-k and top-p.

    temperature 0 gives the one-hot distribution of the argmax (what greedy decoding samples from).
    """
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p; the first token always stays, even where
        # top_p rounds to 0 in float32
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: (B, V) → next tokens (B,) int64, row b decoded with batch.params[b]."""
    params = batch.params
    if all(p.greedy for p in params):
        return greedy_ids(logits)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    probs: dict[int, torch.Tensor] = {}
    for b, p in enumerate(params):
        if p.greedy:
            out[b] = greedy_ids(logits[b])
        else:
            probs[b] = filtered_probs(logits[b], p.temperature, p.top_k, p.top_p)
    # Every row is checked before any is drawn: a row that cannot be sampled fails alone, the others' generators
    # untouched (a rerun of the step without it draws what it would have drawn). One check for all rows.
    if probs:
        rows = torch.stack(list(probs.values()))  # (S, V)
        ok = (torch.isfinite(rows).all(-1) & (rows.sum(-1) > 0)).tolist()
        bad = [b for b, good in zip(probs, ok) if not good]
        if bad:
            raise SamplingError(
                "no distribution to sample from (non-finite or zero probabilities) in rows "
                + ", ".join(f"{b} (temperature={params[b].temperature}, top_p={params[b].top_p})" for b in bad),
                [params[b] for b in bad])
    for b, row in probs.items():
        gen = batch.generators[b] if batch.generators else None
        out[b] = torch.multinomial(row, 1, generator=gen)[0]
    return out
