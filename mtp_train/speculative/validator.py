"""The training run's speculative validation: τ of the current head by actually running speculative decoding.

At every evaluation rank 0 decodes the held-out prompts of `spec_eval` greedily with the head as drafter through
`SpecEngine`, and reports spec/tau, spec/acceptance_rate and spec/pos{j} beside the validation loss. The target,
its tokenizer and the prompts are loaded on first use, and kept. The trainer takes it as its injected validator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtp_train.config import ModelConfig, SpecEvalConfig
from mtp_train.heads import DraftHead


class SpeculativeValidator:
    """`validator(head) -> {"spec/tau": ..., ...}`, for the trainer (rank 0).

    spec_eval: the prompts, k, lengths and batch size; model: the target (path, backend, page size); device: where
    the target runs; dtype: the target's compute dtype (the training precision: bfloat16 on CUDA, else float32).
    """

    def __init__(self, spec_eval: SpecEvalConfig, model: ModelConfig, device: torch.device, dtype: str) -> None:
        self.cfg, self.model_cfg, self.device, self.dtype = spec_eval, model, device, dtype
        self._loaded: tuple[Any, Any, list, list[int]] | None = None  # (model, tokenizer, conversations, stops)

    def _load(self) -> tuple[Any, Any, list, list[int]]:
        from mtp_train.data.chat import load_tokenizer
        from mtp_train.engine.turns import stop_token_ids
        from mtp_train.eval.prompts import load_prompt_sets
        from mtp_train.models.loader import load_model

        if self._loaded is None:
            path = Path(self.model_cfg.path)
            model = load_model(path, dtype=self.dtype, device=self.device, backend=self.model_cfg.backend)
            tokenizer = load_tokenizer(path)
            convs = [c for ps in load_prompt_sets(list(self.cfg.prompts), self.cfg.limit) for c in ps.convs]
            self._loaded = (model, tokenizer, convs, stop_token_ids(tokenizer, model.args.eos_token_ids))
        return self._loaded

    def __call__(self, head: DraftHead) -> dict[str, float]:
        from mtp_train.eval.acceptance import head_acceptance
        from mtp_train.speculative.proposers import HeadProposer

        model, tokenizer, convs, stops = self._load()
        was_training = head.training
        try:
            return head_acceptance(model, tokenizer, lambda: HeadProposer(head), convs, self.cfg.k,
                                   self.cfg.max_new_tokens, page_size=self.model_cfg.page_size,
                                   batch_size=self.cfg.batch_size, stop_token_ids=stops)
        finally:
            head.train(was_training)
