"""A vLLM KV connector that saves each finished request's hidden states as a capture file (`spool`).

vLLM's `extract_hidden_states` speculative method writes, at every step, the target's aux hidden states of the
step's tokens into a cache-only layer whose "KV cache" holds [num_blocks, k, block_size, H] (k =
len(eagle_aux_hidden_state_layer_ids)). This connector, loaded by vLLM with

    kv_transfer_config={"kv_connector": "MtpCaptureConnector",
                        "kv_connector_module_path": "mtp_train.capture.vllm_connector",
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"spool_dir": FOLDER, "tag": TAG}}

(the capture modules on PYTHONPATH: `mtp_train.capture.launch` stages a copy of just them), keeps a finished
request's blocks until its states are read out of that cache, then writes `spool.write_capture` files that
`mtp_train.precompute.vllm_backend` turns into shards. A request names its capture by
`kv_transfer_params={"sample_id": ...}` (in SamplingParams.extra_args).

The reading and writing is `saver.CaptureSaver`'s: on the CPU synchronously in `get_finished` (no pinned memory,
no events), the blocks released in the same step; on a GPU without blocking the engine (a side-stream copy into
pinned memory, the blocks released once its event has completed, the file written by a thread). Only
tensor-parallel rank 0 writes.

Imports vLLM, torch and the capture modules only (it runs inside vLLM's processes, where the rest of our package
is not installed).
"""

from __future__ import annotations

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

from mtp_train.capture.book import RequestBook, Save
from mtp_train.capture.saver import CaptureSaver
from mtp_train.capture.spool import file_name

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


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
        self.saver = CaptureSaver(self.folder, self.layer_ids, self.tag, self.block_size)  # worker side
        self.writes = True  # tensor-parallel rank 0 only

    # --- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self.writes = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"expected one cache-only hidden-states layer, found {names}")
        self.saver.bind(kv_caches[names[0]])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # the states are read from the cache when the request ends (get_finished)

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Save the requests this step's metadata names; report those whose blocks may be freed."""
        done: set[str] = set()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        for save in meta.saves if isinstance(meta, CaptureMetadata) else []:
            # Other tensor-parallel ranks report nothing: one report frees the blocks (get_finished_count).
            if self.writes and self.saver.save(save):
                done.add(save.req_id)
        done |= self.saver.poll()
        return done or None, None

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 saves, so its report alone frees a request's blocks

    def shutdown(self) -> None:
        """Finish the writes in flight."""
        self.saver.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # What vLLM's own hidden-states connector asks for; CaptureSaver.bind checks the shape the cache gets.
        return "LBNHC"

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
