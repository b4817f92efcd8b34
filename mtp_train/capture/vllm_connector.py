"""A vLLM KV connector that saves each finished request's hidden states as a capture file (`spool`).

vLLM's `extract_hidden_states` speculative method writes, at every step, the target's aux hidden states of the
step's tokens into a cache-only layer whose "KV cache" holds [num_blocks, k, block_size, H] (k =
len(eagle_aux_hidden_state_layer_ids)). This connector, loaded by vLLM with

    kv_transfer_config={"kv_connector": "MtpCaptureConnector",
                        "kv_connector_module_path": "mtp_train.capture.vllm_connector",
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"spool_dir": FOLDER, "tag": TAG}}

(our checkout on PYTHONPATH), keeps a finished request's blocks until its states are read out of that cache,
then writes `spool.write_capture` files that `mtp_train.precompute.vllm_backend` turns into shards. A request
names its capture by `kv_transfer_params={"sample_id": ...}` (in SamplingParams.extra_args).

On the CPU the read and the write happen in `get_finished`, synchronously (no pinned memory, no events), and the
blocks are released in the same step. On a GPU the engine is not blocked: the rows are gathered on a side stream
into pinned host memory, the blocks are released once that copy's event has completed (polled, never waited on),
and a writer thread waits for the event and writes the file. Only tensor-parallel rank 0 writes.

Imports vLLM, torch and the capture modules only (it runs inside vLLM's processes, where the rest of our package
is not installed).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from mtp_train.capture.book import RequestBook, Save, slots
from mtp_train.capture.spool import file_name, write_capture

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class CaptureMetadata(KVConnectorMetadata):
    """What the scheduler sends the worker with a step: the requests to save."""

    saves: list[Save] = field(default_factory=list)


def hidden_group(kv_cache_config: KVCacheConfig | None) -> int:
    """The KV cache group of the cache-only hidden-states layer (0 when there is a single group)."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ValueError(f"cannot tell the hidden-states cache group among {len(groups)} KV cache groups")


class MtpCaptureConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: each finished request's hidden states → one capture file in `spool_dir`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("MtpCaptureConnector needs speculative_config method 'extract_hidden_states'")
        self.layer_ids = [int(i) for i in spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids]
        folder = self._kv_transfer_config.get_from_extra_config("spool_dir", None)
        if not folder:
            raise ValueError("MtpCaptureConnector needs kv_connector_extra_config.spool_dir")
        self.folder = Path(folder)
        self.tag = str(self._kv_transfer_config.get_from_extra_config("tag", ""))
        self.group = hidden_group(kv_cache_config)
        self.block_size = (vllm_config.cache_config.block_size if kv_cache_config is None
                           else kv_cache_config.kv_cache_groups[self.group].kv_cache_spec.block_size)
        self.book = RequestBook()  # scheduler side
        # Worker side (register_kv_caches):
        self.cache: torch.Tensor | None = None  # (num_blocks, k, block_size, H)
        self.writes = True  # tensor-parallel rank 0 only
        self._stream: Any = None  # GPU: the side stream of the device-to-host copies
        self._copies: dict[str, Any] = {}  # GPU: req id → the event of its copy
        self._files: dict[str, Future[Path]] = {}  # GPU: req id → its file write
        self._pool: ThreadPoolExecutor | None = None

    # --- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self.writes = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"expected one cache-only hidden-states layer, found {names}")
        self.cache = kv_caches[names[0]]
        if self.cache.dim() != 4 or self.cache.shape[2] != self.block_size:
            raise ValueError(f"hidden-states cache of shape {tuple(self.cache.shape)}: expected "
                             f"(blocks, {len(self.layer_ids)}, {self.block_size}, hidden)")
        if self.cache.is_cuda:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mtp-capture")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # the states are read from the cache when the request ends (get_finished)

    def wait_for_save(self) -> None:
        pass

    def rows(self, save: Save) -> torch.Tensor:
        """The request's (n, k, H) states, gathered from the cache on its device."""
        assert self.cache is not None
        s = torch.tensor(slots(save.block_ids, self.block_size, len(save.token_ids)), dtype=torch.long)
        if self.cache.is_cuda:
            s = s.pin_memory().to(self.cache.device, non_blocking=True)
        return self.cache[s // self.block_size, :, s % self.block_size]  # (n, k, H)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Save the requests this step's metadata names; report those whose blocks may be freed."""
        done: set[str] = set()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        for save in meta.saves if isinstance(meta, CaptureMetadata) else []:
            if not self.writes:
                done.add(save.req_id)
            elif self.cache is not None and self.cache.is_cuda:
                self._copy_async(save)
            else:
                write_capture(self.folder, save.sample_id, torch.tensor(save.token_ids), self.rows(save).clone(),
                              self.layer_ids, self.tag)
                done.add(save.req_id)
        for req_id, event in list(self._copies.items()):
            if event.query():  # the copy left the cache: its blocks may be reused
                del self._copies[req_id]
                done.add(req_id)
        for req_id, fut in list(self._files.items()):
            if fut.done():
                del self._files[req_id]
                if fut.exception() is not None:
                    log.error("capture of request %s was not written: %r", req_id, fut.exception())
        return done or None, None

    def _copy_async(self, save: Save) -> None:
        """GPU: gather on a side stream into pinned memory; a writer thread waits for the copy, then writes."""
        assert self.cache is not None and self._pool is not None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.cache.device)
        ready = torch.cuda.Event()
        ready.record()  # the forward that filled the cache, on the current stream
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            states = self.rows(save)
            host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
            host.copy_(states, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._copies[save.req_id] = copied

        def write() -> Path:
            copied.synchronize()
            return write_capture(self.folder, save.sample_id, torch.tensor(save.token_ids), host, self.layer_ids,
                                 self.tag)

        self._files[save.req_id] = self._pool.submit(write)

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0's report counts (the others report at once)

    def shutdown(self) -> None:
        """Finish the writes in flight."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # (blocks, heads = layers, block positions, hidden): a token's states side by side

    # --- scheduler side ------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # nothing is ever loaded

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            extra = new.sampling_params.extra_args if new.sampling_params is not None else None
            self.book.admit(new.req_id, (extra or {}).get("kv_transfer_params"))
        return CaptureMetadata(saves=self.book.take())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a finished request until its states are saved (True: freed on done_sending)."""
        save = self.book.finish(request.request_id, list(request.prompt_token_ids or []), block_ids)
        if save is None:
            return False, None
        return True, {"capture_file": str(self.folder / file_name(save.sample_id))}

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self.group < len(block_ids):
            return False, None  # never scheduled
        return self.request_finished(request, block_ids[self.group])
