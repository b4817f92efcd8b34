"""The pair head: two draft features from one forward.

    x = fc [E(t_{i+1}) ; h_i];  x = x + MLP(x)      MLP: H → mlp_ratio·H → H
    ĥ_{i+1} = norm(x),  ĥ_{i+2} = norm(W x)         (T, H) each

Its training unroll is that one forward's two outputs as steps 0 and 1 (row i of step j predicts h_{i+j+1}, the
alignment every head type shares).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mtp_train.config.head import HeadConfig
from mtp_train.heads import DraftHead, packed_shift, resolve_seq_lens
from mtp_train.layers.norm import RMSNorm


class PairHead(DraftHead):
    """Two draft features from one forward of an MLP over [E(t_{i+1}) ; h_i]."""

    type_name = "pair"

    def __init__(self, cfg: HeadConfig, target_args: Any, frozen: Any = None, backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        h, ratio = self.args.hidden_size, self.cfg.settings.mlp_ratio
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.mlp = nn.Sequential(nn.Linear(h, ratio * h), nn.SiLU(), nn.Linear(ratio * h, h))
        self.second = nn.Linear(h, h, bias=False)
        self.norm = RMSNorm(h, self.args.rms_norm_eps)

    def pair(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) target hidden h_i, (T,) t_{i+1} → the estimates of h_{i+1} and h_{i+2}, (T, H) each."""
        x = self.fc(torch.cat([self.embed(token_ids), hidden.to(self.dtype)], -1))
        x = x + self.mlp(x)
        return self.norm(x), self.norm(self.second(x))

    def features(self, hidden, token_ids, meta, kv_cache, attn, *, from_target: bool) -> torch.Tensor:
        if not from_target:
            raise ValueError("a pair head reads the target's hidden states only (it never chains)")
        return self.pair(hidden, token_ids)[0]

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens, steps: int, attention: str = "chain",
               chain_mode: str = "diagonal") -> list[torch.Tensor]:
        """(T, H) hidden, (T,) ids of packed sequences → [(T, H)] × steps (at most 2: one forward's two drafts)."""
        if not 1 <= steps <= 2:
            raise ValueError(f"a pair head drafts 2 tokens per forward; loss.steps={steps}")
        self.check_input(hidden, True)
        lens = resolve_seq_lens(hidden.shape[0], seq_lens)
        return list(self.pair(hidden, packed_shift(input_ids, lens, 1)))[:steps]
