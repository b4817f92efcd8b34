"""Multi-head latent attention (MLA, DeepSeek-V2) over a latent-only paged cache: the interface, the torch
backend, an adapter for generic backends, and the shapes FlashInfer's MLA kernels run (selection: `selection.py`).

With the key/value up-projection absorbed (see `mtp_train.models.families.deepseek_v2`), every query head attends
to one shared latent head per token: the key is the row [c ; k_pe] (kv_lora_rank C + qk_rope_head_dim R values) and the
value is c. A layer's cache therefore holds that one row per token and nothing else:

    latent_cache: (num_pages, page_size, C + R)      token j of a sequence at page block_tables[b][j // page_size]

which is also FlashInfer MLA's page layout: its ckv and kpe caches are the views latent_cache[..., :C] and
latent_cache[..., C:]. Scores are scaled by the expanded head's softmax scale ((qk_nope + qk_rope)^-0.5, YaRN's
mscale included), not by the latent width's.

Backends: `TorchMLA` (any device, autograd in prefill) and `FlashInferMLA` (CUDA, `flashinfer_mla.py`, which
imports FlashInfer only when created, so that both modules load without CUDA or FlashInfer). `LatentAsOneHead`
runs MLA through a generic `AttentionBackend` without a cache (the heads' chained training attention).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from mtp_train.layers.attention.base import AttentionBackend
from mtp_train.layers.attention.masks import causal_mask
from mtp_train.layers.attention.metadata import AttentionMetadata, ForwardMode

# (kv_lora_rank, qk_rope_head_dim) that FlashInfer's MLA kernels are instantiated and tested for (DeepSeek-V2/V3,
# V2-Lite); its head dims are template parameters, and other widths are neither tested upstream nor guaranteed to
# fit the kernels' tiling and shared-memory plans.
FLASHINFER_MLA_DIMS = (512, 64)
FLASHINFER_MLA_DTYPES = (torch.float16, torch.bfloat16)
_TORCH_STATE_KEY = "torch_mla"


class MLABackend(ABC):
    """MLA for one model shape; one instance serves all layers of a model."""

    name: str = "base"
    tree_steps: bool = True  # verifies a tree of new tokens per sequence (`AttentionMetadata.set_tree`)

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"MLA needs the expanded head's softmax scale (> 0), got {scale}")
        self.num_heads = num_heads  # H query heads
        self.kv_lora_rank = kv_lora_rank  # C
        self.rope_dim = rope_dim  # R
        self.scale = scale

    @property
    def latent_dim(self) -> int:
        """C + R: the width of one cached row."""
        return self.kv_lora_rank + self.rope_dim

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Do the per-step work shared by all layers (masks, kernel plans); writes meta.backend_state."""

    @abstractmethod
    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                latent_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of one layer over the latent.

        q_nope: (T, H, C) the no-RoPE query with W_UK absorbed; q_pe: (T, H, R) the rotated RoPE query;
        c: (T, C) the normed compressed KV of the new tokens; k_pe: (T, R) their rotated shared RoPE key.
        latent_cache: this layer's (num_pages, page_size, C + R) pool, or None when the step uses no cache; when
        given, the rows [c ; k_pe] are written at meta.slot_pages/slot_offsets first. A prefill attends among the
        new tokens; decode and verify attend over the pages. Returns (T, H, C): softmax-weighted sums of c.
        """

    def write(self, c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the new tokens' rows [c ; k_pe] (T, C + R) at their slots: one index_put."""
        latent_cache[meta.slot_pages, meta.slot_offsets] = torch.cat([c, k_pe], dim=-1).to(latent_cache.dtype)


class TorchMLA(MLABackend):
    """Reference MLA with PyTorch SDPA: multi-query attention over the latent (one key head, values c).

    Prefill runs causal SDPA per sequence over its new tokens (differentiable, no cache read). Decode and verify
    gather each sequence's pages into (B, S, C + R) and run one batched SDPA with a mask that encodes the sequence
    lengths and causality among the new tokens.
    """

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.mode is ForwardMode.PREFILL:
            return  # is_causal per sequence: nothing to build
        if meta.block_tables is None:
            raise ValueError(f"a {meta.mode.value} step needs the paged KV cache metadata")
        # Flat page ids, converted once per step (index_select over dim 0 gathers pages fast).
        state = {"page_ids": meta.block_tables.reshape(-1).long()}
        q = meta.qo_lens[0]
        if all(n == q for n in meta.qo_lens):
            # Batched path: queries (B, Q), keys padded to S = max_pages * page_size.
            s = meta.block_tables.shape[1] * meta.page_size
            bits = None if meta.tree_bits is None else meta.tree_bits.view(meta.batch_size, q)
            state["mask"] = causal_mask(meta.positions.view(meta.batch_size, q), s, None, bits)[:, None]  # (B,1,Q,S)
        meta.backend_state[_TORCH_STATE_KEY] = state

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q: (B, Q, H, C+R); k: (B, S, 1, C+R); v: (B, S, 1, C) → (B, Q, H, C); causal when mask is None."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            scale=self.scale, enable_gqa=self.num_heads != 1,
        )
        return out.transpose(1, 2)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                latent_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        if latent_cache is not None:
            self.write(c, k_pe, latent_cache, meta)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (T, H, C+R)
        if meta.mode is ForwardMode.PREFILL:
            # The new tokens are the whole sequence: attend among them, never read the pool.
            k = torch.cat([c, k_pe], dim=-1)[:, None]  # (T, 1, C+R)
            v = c[:, None]  # (T, 1, C)
            if meta.batch_size == 1:
                return self._sdpa(q[None], k[None], v[None], None)[0]
            outs = []
            for b, n in enumerate(meta.qo_lens):
                lo = int(meta.qo_indptr[b])
                sl = slice(lo, lo + n)
                outs.append(self._sdpa(q[None, sl], k[None, sl], v[None, sl], None)[0])
            return torch.cat(outs, 0)

        if latent_cache is None:
            raise ValueError(f"a {meta.mode.value} step needs the latent cache")
        state = meta.backend_state.get(_TORCH_STATE_KEY)
        if state is None:
            raise RuntimeError("TorchMLA.forward called before prepare(meta) for this step")
        b, p = meta.block_tables.shape
        keys = latent_cache.index_select(0, state["page_ids"]).view(b, p * meta.page_size, 1, self.latent_dim)
        values = keys[..., :self.kv_lora_rank]  # (B, S, 1, C): the values are c
        mask = state.get("mask")
        if mask is not None:
            qb = q.view(b, meta.qo_lens[0], self.num_heads, self.latent_dim)
            return self._sdpa(qb, keys, values, mask).reshape(q.shape[0], self.num_heads, self.kv_lora_rank)
        outs = []
        for i, (n, kv_len) in enumerate(zip(meta.qo_lens, meta.kv_lens)):
            lo = int(meta.qo_indptr[i])
            bits = None if meta.tree_bits is None else meta.tree_bits[lo: lo + n]
            m = causal_mask(meta.positions[lo: lo + n], kv_len, None, bits)[None, None]  # (1, 1, Q, S)
            outs.append(self._sdpa(q[None, lo: lo + n], keys[i: i + 1, :kv_len], values[i: i + 1, :kv_len], m)[0])
        return torch.cat(outs, 0)


class LatentAsOneHead(MLABackend):
    """MLA through a generic backend built for (H query heads, 1 KV head, C + R): the latent row is that KV head and c
    its value. Cache-free only — for training attention with its own masks (e.g. the heads' chained unroll).

    The generic backend's scale is the one applied; set it to the expanded head's before wrapping.
    """

    name = "latent-as-one-head"

    def __init__(self, inner: AttentionBackend, kv_lora_rank: int) -> None:
        if inner.num_kv_heads != 1 or inner.head_dim <= kv_lora_rank:
            raise ValueError(f"a latent backend needs one KV head wider than kv_lora_rank {kv_lora_rank}, got "
                             f"{inner.num_kv_heads} heads of {inner.head_dim}")
        super().__init__(inner.num_q_heads, kv_lora_rank, inner.head_dim - kv_lora_rank, inner.scale)
        self.inner = inner

    def prepare(self, meta: AttentionMetadata) -> None:
        self.inner.prepare(meta)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                latent_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        if latent_cache is not None:
            raise ValueError(f"{self.name} runs without a cache")
        q = torch.cat([q_nope, q_pe], dim=-1)  # (T, H, C+R)
        k = torch.cat([c, k_pe], dim=-1)[:, None]  # (T, 1, C+R)
        return self.inner.forward(q, k, c[:, None], None, meta)  # SDPA takes values narrower than keys


def flashinfer_mla_problem(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype | None = None) -> str | None:
    """Why FlashInfer's MLA kernels cannot run this shape / dtype (None: they can)."""
    if (kv_lora_rank, rope_dim) != FLASHINFER_MLA_DIMS:
        c, r = FLASHINFER_MLA_DIMS
        return (f"FlashInfer's MLA kernels run kv_lora_rank={c} with qk_rope_head_dim={r} (DeepSeek-V2/V3, V2-Lite) "
                f"only; this model has kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={rope_dim}")
    if dtype is not None and dtype not in FLASHINFER_MLA_DTYPES:
        return f"FlashInfer's MLA kernels run float16/bfloat16 only, got {dtype} (load the model in bf16 or fp16)"
    return None
