"""Layers with different attention windows in one model (Qwen2/Qwen3 from `max_window_layers` on, GPT-OSS's
`layer_types`): one inner backend per distinct window, each with its own step state.

A layer calls `attend` with its window (and, on the torch backend, its attention sinks); `forward` is full
attention without sinks, what a draft head's block calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mtp_train.layers.attention.base import AttentionBackend
from mtp_train.layers.attention.metadata import AttentionMetadata

_STATE_KEY = "layer_windows"


class LayerWindowAttention(AttentionBackend):
    """One inner backend per distinct window (None = full attention), each preparing its own copy of the metadata.

    The inner backends build their step state (masks, kernel plans, native-kernel arguments) from their own window,
    so each gets a copy of the step's metadata with a private `backend_state`, prepared on the window's first layer
    of the step.
    """

    def __init__(self, make: Callable[[int | None], AttentionBackend], windows: set[int | None]) -> None:
        self.inner = {w: make(w) for w in sorted(windows | {None}, key=lambda w: -1 if w is None else w)}
        full = self.inner[None]
        super().__init__(full.num_q_heads, full.num_kv_heads, full.head_dim, None)
        self.name = full.name

    @property
    def tree_steps(self) -> bool:
        return all(b.tree_steps for b in self.inner.values())

    def prepare(self, meta: AttentionMetadata) -> None:
        """Start the step: each window's metadata copy is made and prepared on its first layer."""
        meta.backend_state[_STATE_KEY] = {}

    def _meta(self, meta: AttentionMetadata, window: int | None) -> AttentionMetadata:
        subs = meta.backend_state.get(_STATE_KEY)
        if subs is None:
            raise RuntimeError("LayerWindowAttention.forward called before prepare(meta) for this step")
        sub = subs.get(window)
        if sub is None:
            sub = subs[window] = dataclasses.replace(meta, backend_state={})
            self.inner[window].prepare(sub)
        return sub

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
               meta: AttentionMetadata, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer with its own window.

        Args:
            q: (T, Hq, D); k, v: (T, Hkv, D) of the step's new tokens, already rotated.
            kv_cache: this layer's pool, or None (see `AttentionBackend.forward`).
            meta: the step's metadata (prepared by `prepare`).
            window: the layer's window, one of those the backend was made for (None: full attention).
            sinks: None, or (Hq,) attention-sink logits (GPT-OSS; the torch backend takes them).

        Returns (T, Hq, D).
        """
        inner = self.inner.get(window)
        if inner is None:
            raise ValueError(f"no attention backend for a window of {window}; made for {sorted(self.inner, key=str)}")
        sub = self._meta(meta, window)
        if sinks is None:
            return inner.forward(q, k, v, kv_cache, sub)
        return inner.forward(q, k, v, kv_cache, sub, sinks=sinks)  # type: ignore[call-arg]  # torch backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(q, k, v, kv_cache, meta, None, None)
