"""How one request of a regeneration run is decoded: its seed and the engine's SamplingParams."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from mtp_train.config import RegenerateConfig
from mtp_train.engine.sampling import SamplingParams


def request_seed(seed: int, conv_id: str, k: int, turn: int) -> int:
    """A 63-bit seed of one request, a hash of (seed, conversation id, sample index, turn).

    Per request, so that the text does not depend on batching, on the rank split or on what an earlier run did.
    """
    digest = hashlib.sha256(f"{seed}\0{conv_id}\0{k}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def request_params(cfg: RegenerateConfig, seed: int | None, stop_ids: Sequence[int]) -> SamplingParams:
    """The engine's parameters for one request seeded with `seed` (None for greedy); SamplingParams checks the
    values (temperature >= 0, top_p in (0, 1], ...)."""
    return SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                          max_new_tokens=cfg.max_new_tokens, stop_token_ids=list(stop_ids), seed=seed)
