"""Reference attention backend: PyTorch SDPA with explicit masks, on any device.

Prefill runs causal SDPA per sequence over its new tokens only. Decode and verify gather each
sequence's pages into a contiguous (B, S, Hkv, D) view and run one batched SDPA with a mask that
encodes both the sequence lengths and causality among the new tokens.

Attention sinks (GPT-OSS: one learned logit per head that joins the softmax denominator and carries no value) are
a `forward` argument: SDPA has none, so a layer with sinks takes an explicit softmax over [scores ; sink]
(`sink_attention`), and the native CPU decode kernel takes them as an argument; layers without keep SDPA.

Whether a CPU step takes the native kernel or the gather + SDPA path is measured on the machine (`kernel_choice`,
op "attention": one class for decode steps, one query row per sequence, and one for verify steps, several).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mtp_train.config.device import on_cpu
from mtp_train.layers import cpu_kernels, kernel_choice
from mtp_train.layers.attention.base import AttentionBackend
from mtp_train.layers.attention.masks import causal_mask
from mtp_train.layers.attention.metadata import AttentionMetadata, ForwardMode


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                   scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax also runs over one sink logit per head (no value): softmax([q·kᵀ·scale ; s_h]).

    q: (B, Hq, Q, D); k, v: (B, Hkv, S, D); mask: bool broadcastable to (B, Hq, Q, S), True = attend, or None
    (then `causal` among Q = S tokens); sinks: (Hq,). The softmax runs in float32. Returns (B, Hq, Q, D).
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (B, Hq, Q, S)
    if mask is None and causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]  # the sink's share is dropped
    return torch.matmul(probs.to(v.dtype), v)


class TorchBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        st = meta.backend_state
        if meta.mode is ForwardMode.PREFILL:
            # One mask per distinct length, only when a sliding window makes is_causal insufficient.
            if self.sliding_window is not None:
                for n in set(meta.qo_lens):
                    pos = torch.arange(n, device=meta.positions.device)
                    st[("prefill_mask", n)] = causal_mask(pos, n, self.sliding_window)
            return
        if st.get("prepared") == ("torch", self.sliding_window):
            return  # a copy of a state this kind of backend prepared (a head's catch-up over the verify's rows)
        # flat page ids, converted once per step: index_select over dim 0 gathers pages much faster than
        # advanced indexing with the 2-D table
        st["page_ids"] = meta.block_tables.reshape(-1).long()
        # CPU inference: the native kernel reads the pages in place (see forward)
        st["native"] = (on_cpu(meta.positions.device) and cpu_kernels.available()
                        and kernel_choice.prefers_native("attention", "decode" if max(meta.qo_lens) == 1 else "verify"))
        # a tree step's window counts the tokens' tree positions (their depths), not the slots they sit in
        tree_pos = meta.rope_positions if meta.tree_bits is not None else None
        if st["native"]:
            slots = (None if meta.slot_pages is None or meta.slot_offsets is None
                     else meta.slot_pages * meta.page_size + meta.slot_offsets)
            st["native_args"] = cpu_kernels.paged_attention_args(meta.block_tables, meta.qo_indptr, meta.positions,
                                                                 max(meta.kv_lens), meta.tree_bits, tree_pos, slots)
        q = meta.qo_lens[0]
        st["uniform"] = all(n == q for n in meta.qo_lens)
        if st["uniform"] and not st["native"]:
            st["mask"] = self._batched_mask(meta)  # the native kernel needs none (built on demand if it steps aside)
        # Everything above depends on the step's rows and this window alone: another torch backend of the same
        # window (a head's, whatever its heads) may take a copy of the state as it is.
        st["prepared"] = ("torch", self.sliding_window)

    def _batched_mask(self, meta: AttentionMetadata) -> torch.Tensor:
        """(B, 1, Q, S) bool, True = attend: the batched path's mask for B sequences of Q new tokens each, keys
        padded to S = max_pages * page_size."""
        b, q = meta.batch_size, meta.qo_lens[0]
        s = meta.block_tables.shape[1] * meta.page_size
        bits = None if meta.tree_bits is None else meta.tree_bits.view(b, q)
        at = None if meta.tree_bits is None else meta.rope_positions.view(b, q)
        return causal_mask(meta.positions.view(b, q), s, self.sliding_window, bits, at)[:, None]

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: (B, Q, Hq, D); k, v: (B, S, Hkv, D) → (B, Q, Hq, D); sinks: None or (Hq,) sink logits."""
        if sinks is not None:
            out = sink_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal, self.scale,
                                 sinks)
            return out.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            is_causal=causal and mask is None, scale=self.scale,
            enable_gqa=self.num_q_heads != self.num_kv_heads,
        )
        return out.transpose(1, 2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """See `AttentionBackend.forward`; sinks: None, or (Hq,) attention-sink logits of this layer."""
        st = meta.backend_state
        if (st.get("native") and kv_cache is not None and kv_cache.is_contiguous()
                and cpu_kernels.serves(q, kv_cache, k, v) and st["native_args"].slots is not None):
            # decode / verify on CPU: the kernel writes the new K/V into their slots and reads the pages in place
            return cpu_kernels.paged_attention(q, kv_cache, st["native_args"], self.scale, self.sliding_window, sinks,
                                               k=k, v=v)
        if kv_cache is not None:
            kv_cache[meta.slot_pages, 0, meta.slot_offsets] = k
            kv_cache[meta.slot_pages, 1, meta.slot_offsets] = v
        if meta.mode is not ForwardMode.PREFILL and st["uniform"] and "mask" not in st:
            st["mask"] = self._batched_mask(meta)  # prepared for the native kernel, which stepped aside here
        if meta.mode is ForwardMode.PREFILL:
            # The new tokens are the whole sequence: attend among them, never touch the pool.
            if meta.batch_size == 1:
                mask = st.get(("prefill_mask", meta.qo_lens[0]))
                return self._sdpa(q[None], k[None], v[None], mask, causal=True, sinks=sinks)[0]
            outs = []
            for b, n in enumerate(meta.qo_lens):
                lo = int(meta.qo_indptr[b])
                sl = slice(lo, lo + n)
                mask = st.get(("prefill_mask", n))
                outs.append(self._sdpa(q[None, sl], k[None, sl], v[None, sl], mask, causal=True, sinks=sinks)[0])
            return torch.cat(outs, 0)

        assert kv_cache is not None, "decode/verify steps need the KV cache"
        b, p = meta.block_tables.shape
        s = p * meta.page_size
        # Gather K and V separately: index_select over the (strided) K or V half of the pool yields
        # (B*P, page_size, Hkv, D) contiguous pages, so the (B, S, Hkv, D) view costs no second copy.
        keys = kv_cache[:, 0].index_select(0, st["page_ids"]).view(b, s, self.num_kv_heads, self.head_dim)
        values = kv_cache[:, 1].index_select(0, st["page_ids"]).view(b, s, self.num_kv_heads, self.head_dim)
        if b == 1:
            # One sequence: attend over its kv_len tokens only; a single new token needs no mask
            # (unless a sliding window hides the oldest ones).
            n, kv_len = meta.qo_lens[0], meta.kv_lens[0]
            mask = None if n == 1 and self.sliding_window is None else st["mask"][..., :kv_len]
            return self._sdpa(q[None], keys[:, :kv_len], values[:, :kv_len], mask, causal=False, sinks=sinks)[0]
        if st["uniform"]:
            qb = q.view(b, meta.qo_lens[0], self.num_q_heads, self.head_dim)
            return self._sdpa(qb, keys, values, st["mask"], causal=False, sinks=sinks).reshape(q.shape)
        outs = []
        for i, (n, kv_len) in enumerate(zip(meta.qo_lens, meta.kv_lens)):
            lo = int(meta.qo_indptr[i])
            q_pos = meta.positions[lo: lo + n]
            bits = None if meta.tree_bits is None else meta.tree_bits[lo: lo + n]
            at = None if bits is None else meta.rotary_positions[lo: lo + n]
            mask = causal_mask(q_pos, kv_len, self.sliding_window, bits, at)[None]  # (1, Q, S)
            outs.append(self._sdpa(q[None, lo: lo + n], keys[i: i + 1, :kv_len], values[i: i + 1, :kv_len],
                                   mask[:, None], causal=False, sinks=sinks)[0])
        return torch.cat(outs, 0)


# ---- the native-or-torch measurement (kernel_choice) ---------------------------------------------------------------

PROBE_HEADS, PROBE_CONTEXT, PROBE_PAGE = (16, 4, 64), 512, 16  # (Hq, Hkv, D), cached tokens, page size
PROBE_ROWS = {"decode": 1, "verify": 4}  # new tokens of the one sequence per class
# Layers' forwards per step in the probe: a step pays `prepare` once and the kernel once per layer, and the probe
# must time that whole (timing the forward alone once chose the gather path for verify rows, 0.79x on the probe,
# where the engine's step then spent 2.2x the attention time: bench.step, docs/results.md 2026-12-03).
PROBE_LAYERS = 4


def _probe_setup() -> Callable[[str], tuple[Callable[[], object], Callable[[], object]]]:
    """One sequence of PROBE_CONTEXT cached tokens; for a class: (this backend's step on the native kernel, the same
    step gathered through SDPA), each its per-step `prepare` and PROBE_LAYERS layers' forwards. (While measuring,
    `prepare` builds the native kernel's arguments on both paths: the gather path pays those few small tensors.)"""
    hq, hkv, d = PROBE_HEADS
    pages = PROBE_CONTEXT // PROBE_PAGE + 1
    backend = TorchBackend(hq, hkv, d)
    cache = torch.randn(pages, 2, PROBE_PAGE, hkv, d, generator=torch.Generator().manual_seed(0))

    def work(cls: str) -> tuple[Callable[[], object], Callable[[], object]]:
        rows = PROBE_ROWS[cls]
        q, k, v = torch.randn(rows, hq, d), torch.randn(rows, hkv, d), torch.randn(rows, hkv, d)

        def step(native: bool) -> Callable[[], object]:
            def run() -> object:
                meta = AttentionMetadata.build([rows], [PROBE_CONTEXT], [list(range(pages))], PROBE_PAGE)
                backend.prepare(meta)
                meta.backend_state["native"] = native
                return [backend.forward(q, k, v, cache, meta) for _ in range(PROBE_LAYERS)]
            return run

        return step(True), step(False)

    return work


kernel_choice.register(kernel_choice.Probe("attention", tuple(PROBE_ROWS), _probe_setup, budget_s=0.1))
