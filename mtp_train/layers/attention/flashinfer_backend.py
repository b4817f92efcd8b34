"""FlashInfer attention backend: planned batch kernels over the shared paged KV cache (CUDA only).

Each step picks one FlashInfer wrapper by mode and plans it once; every layer of the step then runs the
planned kernel:

* prefill (no cached prefix): `BatchPrefillWithRaggedKVCacheWrapper`, causal attention among the new
  tokens, read straight from the packed q/k/v (the pool, if any, is only written);
* decode (one new token per sequence): `BatchDecodeWithPagedKVCacheWrapper` over the pages;
* verify (several new tokens on a cached prefix): `BatchPrefillWithPagedKVCacheWrapper`, causal with
  the queries aligned to the end of each sequence's KV, which is exactly what the metadata means
  (query i of a sequence with Q new and K total tokens sits at position K - Q + i).

The pool layout (num_pages, 2, page_size, Hkv, D) is FlashInfer's NHD layout, so the pool is shared
with the torch backend unchanged. FlashInfer is imported when a backend is created, never when this
module is imported, so the module loads on machines without CUDA or FlashInfer.

Planning needs the query and KV dtypes, which `prepare` does not see: `prepare` builds the host-side
plan inputs, and the first layer's `forward` of the step calls `plan` with its dtypes; the other
layers reuse that plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mtp_train.layers.attention.base import AttentionBackend
from mtp_train.layers.attention.masks import causal_mask, indptr
from mtp_train.layers.attention.metadata import AttentionMetadata, ForwardMode

INSTALL_HINT = ("pip install 'mtp_train[gpu]' (FlashInfer, package flashinfer-python) on a CUDA machine, "
                "or use the torch attention backend")
_STATE_KEY = "flashinfer"
_KV_LAYOUT = "NHD"  # matches the pool's (num_pages, 2, page_size, Hkv, D) layout
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Same rule as vLLM/SGLang: the tensor-core (prefill-kernel) decode path wins once a KV head serves
# enough query heads to fill an MMA tile; for MHA-like ratios the CUDA-core decode kernel is faster.
_TENSOR_CORE_DECODE_MIN_GROUP = 4


def _import_flashinfer() -> Any:
    """Import FlashInfer or fail with the install hint."""
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(f"the flashinfer attention backend needs FlashInfer: {INSTALL_HINT}") from exc
    return flashinfer


def planned_step(meta: AttentionMetadata, key: str, dtype: torch.dtype, supported: tuple[torch.dtype, ...],
                 backend: str, owner: str) -> Any:
    """The step plan `prepare` stored under meta.backend_state[key], after checking that FlashInfer runs `dtype`.

    backend names the backend in the dtype error ("flashinfer attention backend"), owner the class in the
    missing-plan one.
    """
    if dtype not in supported:
        raise TypeError(f"the {backend} runs float16/bfloat16 only, got {dtype}; "
                        "load the model in bf16/fp16 or use the torch backend")
    step = meta.backend_state.get(key)
    if step is None:
        raise RuntimeError(f"{owner}.forward called before prepare(meta) for this step")
    return step


@dataclass
class _StepPlan:
    """One step's plan inputs, and the dtypes it was last planned with (None: not planned yet)."""

    kind: str  # "ragged" | "decode" | "paged"
    args: tuple[Any, ...]  # positional plan arguments (index tensors, head counts, page size)
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword plan arguments (mask, window, scale)
    dtypes: tuple[torch.dtype, torch.dtype] | None = None  # (q dtype, kv dtype) of the current plan
    # A CUDA-graph wrapper this step was planned on by `plan_graph` (None: the backend's own wrappers). Its index
    # buffers have fixed addresses, so a captured step replays with whatever the last plan wrote into them.
    graph_wrapper: Any = None


class FlashInferBackend(AttentionBackend):
    """FlashInfer kernels for one model shape; one instance serves all layers of a model.

    The wrappers (and the 128 MiB workspace they share) live as long as the backend; a step only
    re-plans them. A wrapper holds one plan at a time: running a step after another step of the same
    mode has been run re-plans it, so interleaved steps stay correct at the cost of a plan.
    """

    name = "flashinfer"
    workspace_bytes: int = 128 * 1024 * 1024  # FlashInfer's recommended float workspace size

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None, device: torch.device | str = "cuda") -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, sliding_window)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self._fi = _import_flashinfer()
        self.device = torch.device(device)
        # Our window counts the query's own key (p - window < j <= p); FlashInfer's window_left counts
        # the keys strictly left of it (p - window_left <= j <= p), and -1 turns the window off.
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.use_tensor_cores_decode = num_q_heads // num_kv_heads >= _TENSOR_CORE_DECODE_MIN_GROUP
        # Split-KV partial results go here; zeroed because FlashInfer asks for a zeroed first use.
        # All wrappers share it: their kernels run one after another on the same stream.
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[str, Any] = {}
        self._planned: dict[str, _StepPlan] = {}  # wrapper kind → the step plan it currently holds

    # ---------------------------------------------------------------------------------------------
    # planning

    def _wrapper(self, kind: str) -> Any:
        """The cached wrapper of `kind`, created on first use (creation allocates and is slow)."""
        wrapper = self._wrappers.get(kind)
        if wrapper is None:
            fi = self._fi
            if kind == "ragged":
                wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, _KV_LAYOUT)
            elif kind == "paged":
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, _KV_LAYOUT)
            else:
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, _KV_LAYOUT, use_tensor_cores=self.use_tensor_cores_decode)
            self._wrappers[kind] = wrapper
        return wrapper

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build this step's plan inputs in meta.backend_state; the first forward plans the kernel.

        A step pinned to a CUDA-graph wrapper by `plan_graph` is left as it is: it is planned already, and a
        captured forward must not plan (planning is host work and host-to-device copies, outside any graph).
        """
        pinned = meta.backend_state.get(_STATE_KEY)
        if pinned is not None and pinned.graph_wrapper is not None:
            return
        step = self._step_plan(meta)
        self._wrapper(step.kind)
        meta.backend_state[_STATE_KEY] = step

    def _step_plan(self, meta: AttentionMetadata) -> _StepPlan:
        """The wrapper kind and plan arguments of a step.

        Index offsets go to FlashInfer as host tensors built from the host-side lengths: `plan` reads
        them on the host anyway, so passing the device copies would cost a device-to-host sync.
        """
        qo_indptr = indptr(meta.qo_lens)
        common = dict(sm_scale=self.scale, window_left=self.window_left)
        if meta.mode is ForwardMode.PREFILL:
            # The new tokens are the whole sequence: kv offsets are the query offsets.
            args = (qo_indptr, qo_indptr, self.num_q_heads, self.num_kv_heads, self.head_dim)
            return _StepPlan("ragged", args, dict(common, causal=True))
        if not meta.uses_cache or meta.kv_indices is None:
            raise ValueError(f"a {meta.mode.value} step needs the paged KV cache metadata")
        ps = meta.page_size
        kv_indptr = indptr([-(-n // ps) for n in meta.kv_lens])
        last_page_len = torch.tensor([(n - 1) % ps + 1 for n in meta.kv_lens], dtype=torch.int32)
        if int(kv_indptr[-1]) != meta.kv_indices.numel():
            raise ValueError(f"kv_indices holds {meta.kv_indices.numel()} pages but kv_lens "
                             f"{meta.kv_lens} need {int(kv_indptr[-1])} at page_size {ps}")
        paged = (kv_indptr, meta.kv_indices, last_page_len, self.num_q_heads, self.num_kv_heads,
                 self.head_dim, ps)
        if meta.mode is ForwardMode.DECODE:
            return _StepPlan("decode", paged, common)
        if meta.tree_bits is not None:
            # A tree step: each sequence's (Q, kv_len) visibility, flattened in batch order (FlashInfer packs it).
            # One copy of positions and bits to the host (not one sync per sequence); offsets from the host lengths.
            # The window goes into the mask, counted in tree positions; FlashInfer's own window_left would count
            # slots (a query at kv_len - Q + i), so it is off for this plan.
            pos, bits, at = meta.positions.cpu(), meta.tree_bits.cpu(), meta.rotary_positions.cpu()
            starts = qo_indptr.tolist()
            mask = torch.cat([causal_mask(pos[lo:lo + q], kv, self.sliding_window, bits[lo:lo + q],
                                          at[lo:lo + q]).reshape(-1)
                              for lo, q, kv in zip(starts, meta.qo_lens, meta.kv_lens)]).to(self.device)
            return _StepPlan("paged", (qo_indptr, *paged), dict(common, causal=False, custom_mask=mask,
                                                                window_left=-1))
        return _StepPlan("paged", (qo_indptr, *paged), dict(common, causal=True))

    # ---------------------------------------------------------------------------------------------
    # CUDA graphs

    def graph_wrapper(self, mode: ForwardMode, batch_size: int, max_pages: int) -> Any:
        """A CUDA-graph wrapper for steps of `mode` (decode, or verify) over exactly batch_size sequences.

        Its index buffers (kv_indptr (B+1,), kv_indices (max_pages,), last_page_len (B,), and qo_indptr (B+1,)
        for verify) are allocated here once; every `plan_graph` rewrites them in place, so a step captured on
        this wrapper replays over the new pages. All wrappers share the backend's float workspace (their
        kernels run one after another on one stream).
        """
        if mode is ForwardMode.PREFILL:
            raise ValueError("prompt prefills are not captured: their shape changes with every batch")
        fi, dev = self._fi, self.device
        kv_indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        kv_indices = torch.zeros(max_pages, dtype=torch.int32, device=dev)
        last_page_len = torch.zeros(batch_size, dtype=torch.int32, device=dev)
        if mode is ForwardMode.DECODE:
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, _KV_LAYOUT, use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores_decode,
                paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=last_page_len)
        qo_indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        return fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, _KV_LAYOUT, use_cuda_graph=True, qo_indptr_buf=qo_indptr,
            paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices,
            paged_kv_last_page_len_buf=last_page_len)

    def plan_graph(self, wrapper: Any, meta: AttentionMetadata, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> None:
        """Plan `wrapper` (from `graph_wrapper`) for this step and pin it in meta.backend_state.

        Called before a capture and before every replay, outside the graph; `prepare` then keeps the pinned
        step and every layer's `forward` runs the planned wrapper without planning.
        """
        step = self._step_plan(meta)
        if step.kind == "ragged":
            raise ValueError("prompt prefills are not captured: their shape changes with every batch")
        wrapper.plan(*step.args, **step.kwargs, q_data_type=q_dtype, kv_data_type=kv_dtype)
        step.dtypes = (q_dtype, kv_dtype)
        step.graph_wrapper = wrapper
        meta.backend_state[_STATE_KEY] = step

    def _ensure_planned(self, step: _StepPlan, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
        """Plan the step's wrapper unless it already holds this step's plan for these dtypes."""
        if step.graph_wrapper is not None:
            if step.dtypes != (q_dtype, kv_dtype):
                raise TypeError(f"a CUDA-graph step planned for {step.dtypes} ran with {(q_dtype, kv_dtype)}")
            return step.graph_wrapper
        wrapper = self._wrappers[step.kind]
        if self._planned.get(step.kind) is not step or step.dtypes != (q_dtype, kv_dtype):
            wrapper.plan(*step.args, **step.kwargs, q_data_type=q_dtype, kv_data_type=kv_dtype)
            step.dtypes = (q_dtype, kv_dtype)
            self._planned[step.kind] = step
        return wrapper

    # ---------------------------------------------------------------------------------------------
    # per layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of one layer.

        q: (T, Hq, D); k, v: (T, Hkv, D) for the step's new tokens (already rotated), fp16 or bf16.
        kv_cache: this layer's (num_pages, 2, page_size, Hkv, D) pool or None when the step uses no
        cache; when given, the new K/V are written into it at meta.slot_pages/slot_offsets first.
        Returns (T, Hq, D) in q's dtype.
        """
        step = planned_step(meta, _STATE_KEY, q.dtype, _SUPPORTED_DTYPES, "flashinfer attention backend",
                            "FlashInferBackend")
        if kv_cache is not None:
            # Same scatter as the torch backend: one index_put per tensor, no extra index tensors.
            kv_cache[meta.slot_pages, 0, meta.slot_offsets] = k
            kv_cache[meta.slot_pages, 1, meta.slot_offsets] = v
        if step.kind == "ragged":
            # k and v arrive as views into the fused QKV projection; contiguous copies keep the
            # kernel on its plain-stride path on every FlashInfer version (cheap next to attention).
            wrapper = self._ensure_planned(step, q.dtype, k.dtype)
            return wrapper.run(q.contiguous(), k.contiguous(), v.contiguous())
        if kv_cache is None:
            raise ValueError(f"a {meta.mode.value} step needs the KV cache")
        wrapper = self._ensure_planned(step, q.dtype, kv_cache.dtype)
        return wrapper.run(q.contiguous(), kv_cache)
