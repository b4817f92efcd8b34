"""FlashInfer MLA backend: `flashinfer.mla.BatchMLAPagedAttentionWrapper` over the latent-only paged cache (CUDA).

One wrapper serves every mode; each step plans it once (the first layer's forward, when the dtypes are known) and
every layer runs the plan:

* decode and verify: the paged kernel over the step's pages — qo_indptr from qo_lens, kv_indptr / kv_indices (page
  ids) and kv lengths from the metadata, causal. FlashInfer's causal mask is aligned to the end of each sequence's
  KV (query i of Q new tokens over K sits at K - Q + i), which is exactly what the metadata means. The kernel reads
  ckv = latent_cache[..., :C] and kpe = latent_cache[..., C:]: strided views of the one buffer, no copy (the kernel
  takes page and row strides and needs only the last dimension contiguous; with C = 512, R = 64 in 16-bit every
  row start stays 16-byte aligned).
* prefill (no cached prefix, also the cache-free precompute): the same paged kernel with page_size 1 over the new
  rows themselves — ckv = c viewed (T, 1, C), kpe = k_pe viewed (T, 1, R), page j = token j, causal. That is the
  absorbed form over views of tensors the layer already has. FlashInfer's ragged prefill would need either this
  form at head dims 576/512, which it does not instantiate, or the expanded form (192/128), which needs W_UK/W_UV
  inside the backend and returns per-head values instead of the (T, H, C) this interface promises.

Constraints (checked by `mla.flashinfer_mla_problem`, so `auto` picks torch and an explicit request fails by
name): kv_lora_rank 512 with qk_rope_head_dim 64, float16/bfloat16 with the cache in the query's dtype; index
tensors int32 (the metadata's are). FlashInfer is imported when a backend is created, never when this module is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mtp_train.layers.attention.flashinfer_backend import INSTALL_HINT, planned_step
from mtp_train.layers.attention.masks import indptr
from mtp_train.layers.attention.metadata import AttentionMetadata, ForwardMode
from mtp_train.layers.attention.mla import FLASHINFER_MLA_DTYPES, MLABackend, flashinfer_mla_problem

_STATE_KEY = "flashinfer_mla"


def _import_flashinfer_mla() -> Any:
    """Import flashinfer.mla or fail with the install hint."""
    try:
        import flashinfer.mla as fi_mla
    except ImportError as exc:
        raise ImportError(f"the flashinfer MLA backend needs FlashInfer: {INSTALL_HINT}") from exc
    return fi_mla


@dataclass
class _StepPlan:
    """One step's plan inputs, and the dtype it was last planned with (None: not planned yet)."""

    paged: bool  # True: read the pool's pages; False: prefill over the new rows (page_size 1)
    qo_indptr: torch.Tensor  # (B+1,) int32 host
    kv_indptr: torch.Tensor  # (B+1,) int32 host, offsets into kv_indices (pages)
    kv_indices: torch.Tensor  # (Σ pages,) int32 on the device
    kv_lens: torch.Tensor  # (B,) int32 host, tokens per sequence
    page_size: int
    dtype: torch.dtype | None = None


class FlashInferMLA(MLABackend):
    """FlashInfer's MLA kernel for one model shape; one instance serves all layers of a model.

    The wrapper and its 128 MiB workspace live as long as the backend; a step only re-plans it. Running a step
    after another step has been planned re-plans, so interleaved steps stay correct at the cost of a plan.
    """

    tree_steps = False  # the MLA kernels take no custom mask

    name = "flashinfer"
    workspace_bytes: int = 128 * 1024 * 1024  # FlashInfer's recommended float workspace size

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 device: torch.device | str = "cuda") -> None:
        super().__init__(num_heads, kv_lora_rank, rope_dim, scale)
        problem = flashinfer_mla_problem(kv_lora_rank, rope_dim)
        if problem:
            raise ValueError(problem)
        fi_mla = _import_flashinfer_mla()
        self.device = torch.device(device)
        # Split-KV partial results go here; zeroed because FlashInfer asks for a zeroed first use.
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        # backend="auto": FlashInfer picks its FA3 kernel on Hopper, FA2 elsewhere.
        self._wrapper = fi_mla.BatchMLAPagedAttentionWrapper(self._workspace, backend="auto")
        self._planned: _StepPlan | None = None  # the step plan the wrapper currently holds

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build this step's plan inputs in meta.backend_state; the first forward plans the kernel.

        Offsets and lengths go to FlashInfer as host tensors built from the host-side lengths (`plan` reads them on
        the host anyway); the page ids stay on the device, where the kernel reads them.
        """
        if meta.tree_bits is not None:
            raise ValueError("FlashInfer's MLA kernels take no custom mask: tree steps need the torch MLA backend")
        qo_indptr = indptr(meta.qo_lens)
        if meta.mode is ForwardMode.PREFILL:
            # Every new token is its own page of one row: kv offsets are the query offsets.
            step = _StepPlan(False, qo_indptr, qo_indptr,
                             torch.arange(meta.num_tokens, dtype=torch.int32, device=self.device),
                             torch.tensor(meta.qo_lens, dtype=torch.int32), page_size=1)
        else:
            if not meta.uses_cache or meta.kv_indices is None:
                raise ValueError(f"a {meta.mode.value} step needs the paged KV cache metadata")
            ps = meta.page_size
            kv_indptr = indptr([-(-n // ps) for n in meta.kv_lens])
            if int(kv_indptr[-1]) != meta.kv_indices.numel():
                raise ValueError(f"kv_indices holds {meta.kv_indices.numel()} pages but kv_lens "
                                 f"{meta.kv_lens} need {int(kv_indptr[-1])} at page_size {ps}")
            step = _StepPlan(True, qo_indptr, kv_indptr, meta.kv_indices.to(self.device, torch.int32),
                             torch.tensor(meta.kv_lens, dtype=torch.int32), page_size=ps)
        meta.backend_state[_STATE_KEY] = step

    def _ensure_planned(self, step: _StepPlan, dtype: torch.dtype) -> Any:
        """Plan the wrapper unless it already holds this step's plan for this dtype."""
        if self._planned is not step or step.dtype != dtype:
            self._wrapper.plan(step.qo_indptr, step.kv_indptr, step.kv_indices, step.kv_lens, self.num_heads,
                               self.kv_lora_rank, self.rope_dim, step.page_size, True, self.scale, dtype, dtype)
            step.dtype = dtype
            self._planned = step
        return self._wrapper

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                latent_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """See `MLABackend.forward`; inputs and cache in float16/bfloat16, one dtype. Returns (T, H, C)."""
        dtype = q_nope.dtype
        step = planned_step(meta, _STATE_KEY, dtype, FLASHINFER_MLA_DTYPES, "flashinfer MLA backend", "FlashInferMLA")
        if latent_cache is not None:
            if latent_cache.dtype != dtype:
                raise TypeError(f"the latent cache is {latent_cache.dtype} but the queries are {dtype}")
            self.write(c, k_pe, latent_cache, meta)
        t, cr = c.shape[0], self.kv_lora_rank
        if step.paged:
            if latent_cache is None:
                raise ValueError(f"a {meta.mode.value} step needs the latent cache")
            ckv, kpe = latent_cache[..., :cr], latent_cache[..., cr:]  # (P, ps, C), (P, ps, R) views
        else:
            ckv = c.to(dtype).contiguous().view(t, 1, cr)  # (T, 1, C): token j is page j
            kpe = k_pe.to(dtype).contiguous().view(t, 1, self.rope_dim)
        wrapper = self._ensure_planned(step, dtype)
        # q_nope arrives from an einsum whose output may be head-major; the kernel wants unit-stride rows.
        return wrapper.run(q_nope.contiguous(), q_pe.to(dtype).contiguous(), ckv, kpe)
