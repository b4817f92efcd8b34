"""The training run's speculative validation: τ of the current head by actually running speculative decoding.

`head_acceptance` decodes prompts greedily through `SpecEngine` (no baseline, no timing of plain decoding): the
validator below calls it at every evaluation, and the learning curve (bench.curve) at every exported point.

At every evaluation rank 0 decodes the held-out prompts of `spec_eval` greedily with the head as drafter through
`SpecEngine`, and reports spec/tau, spec/acceptance_rate and spec/pos{j} beside the validation loss. The target,
its tokenizer and the prompts are loaded on first use, and kept. The trainer takes it as its injected validator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mtp_train.config import ModelConfig, SpecEvalConfig, head_type
from mtp_train.data.chat import load_tokenizer
from mtp_train.data.prompts import load_prompt_sets
from mtp_train.data.readers import Conversation
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import answer, stop_token_ids
from mtp_train.heads import DraftHead
from mtp_train.models.base import CausalLM
from mtp_train.models.loader import load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.metrics import SpecMetrics, tau_standard_error
from mtp_train.speculative.proposers import Proposer


@torch.inference_mode()
def spec_metrics(target: CausalLM, tokenizer: Any, proposer: Callable[[], Proposer], convs: Sequence[Conversation],
                 k: int, max_new_tokens: int, *, page_size: int = 16, batch_size: int = 8,
                 stop_token_ids: list[int] | None = None) -> tuple[SpecMetrics, float]:
    """The counters (per request too) of greedy speculative decoding of `convs` with `proposer()`, and its seconds."""
    t0 = time.perf_counter()
    engine = SpecEngine(target, proposer(), k, page_size=page_size, max_batch_size=batch_size,
                        kv_cache_gb=0.25)
    answer(engine, tokenizer, convs, SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids))
    return engine.stats.metrics, time.perf_counter() - t0


def head_acceptance(target: CausalLM, tokenizer: Any, proposer: Callable[[], Proposer],
                    convs: Sequence[Conversation], k: int, max_new_tokens: int, *, page_size: int = 16,
                    batch_size: int = 8, stop_token_ids: list[int] | None = None) -> dict[str, float]:
    """τ (and its standard error over requests), acceptance rate and per-position acceptance of a head on held-out
    prompts, greedy (training validation).

    No baseline, no timing: the speculative path only, batched.
    """
    m, seconds = spec_metrics(target, tokenizer, proposer, convs, k, max_new_tokens, page_size=page_size,
                              batch_size=batch_size, stop_token_ids=stop_token_ids)
    out = {"spec/tau": m.mean_acceptance_length, "spec/acceptance_rate": m.acceptance_rate,
           "spec/seconds": seconds}
    se = tau_standard_error(m.by_request)
    if se is not None:
        out["spec/tau_se"] = se
    out.update({f"spec/pos{j}": a for j, a in enumerate(m.per_position)})
    return out


class SpeculativeValidator:
    """`validator(head) -> {"spec/tau": ..., ...}`, for the trainer (rank 0).

    spec_eval: the prompts, k, lengths and batch size; model: the target (path, backend, page size); device: where
    the target runs; dtype: the target's compute dtype (the training precision: bfloat16 on CUDA, else float32).
    """

    def __init__(self, spec_eval: SpecEvalConfig, model: ModelConfig, device: torch.device, dtype: str) -> None:
        self.cfg, self.model_cfg, self.device, self.dtype = spec_eval, model, device, dtype
        self._loaded: tuple[Any, Any, list, list[int]] | None = None  # (model, tokenizer, conversations, stops)

    def _load(self) -> tuple[Any, Any, list, list[int]]:
        if self._loaded is None:
            path = Path(self.model_cfg.path)
            model = load_model(path, dtype=self.dtype, device=self.device, backend=self.model_cfg.backend)
            tokenizer = load_tokenizer(path)
            convs = [c for ps in load_prompt_sets(list(self.cfg.prompts), self.cfg.limit) for c in ps.convs]
            self._loaded = (model, tokenizer, convs, stop_token_ids(tokenizer, model.args.eos_token_ids))
        return self._loaded

    def __call__(self, head: DraftHead) -> dict[str, float]:
        model, tokenizer, convs, stops = self._load()
        was_training = head.training
        try:
            drafter = head_type(head.cfg.type).drafter  # the head type's own proposer, at its default options
            return head_acceptance(model, tokenizer, lambda: drafter(head, {}), convs, self.cfg.k,
                                   self.cfg.max_new_tokens, page_size=self.model_cfg.page_size,
                                   batch_size=self.cfg.batch_size, stop_token_ids=stops)
        finally:
            head.train(was_training)
