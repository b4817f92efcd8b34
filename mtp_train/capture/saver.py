"""Reading a finished request's hidden states out of vLLM's capture cache and writing its capture file.

The cache is the cache-only layer's tensor, (num_blocks, k, block_size, H): token t of a request lies in its block
block_ids[t // block_size] at offset t % block_size (`book.slots`). On the CPU a save gathers the rows and writes
the file at once, so the request's blocks can be freed when `save` returns True. On a GPU the engine must not
wait: the rows are gathered on a side stream (after an event marks the forward that filled them) into pinned host
memory with a non-blocking copy whose completion is another event; `poll` reports a request done once that event
has completed (queried, never waited on), which is when its blocks may be reused, and a writer thread waits for the
event and writes the file. Imports torch and the capture modules only (it runs inside vLLM's processes).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mtp_train.capture.book import Save, slots
from mtp_train.capture.spool import write_capture

log = logging.getLogger(__name__)


class CaptureSaver:
    """Saves requests from one capture cache into capture files (`spool`).

    Args:
        folder: the capture folder.
        layer_ids: vLLM's aux ids of the cache's k states (stored in each file).
        tag: the driver's tag of the run (stored in each file whose request named none).
        block_size: tokens per cache block.
    """

    def __init__(self, folder: str | Path, layer_ids: list[int], tag: str, block_size: int) -> None:
        self.folder, self.layer_ids, self.tag, self.block_size = Path(folder), list(layer_ids), tag, block_size
        self.cache: torch.Tensor | None = None  # (num_blocks, k, block_size, H)
        self._stream: Any = None  # GPU: the side stream of the device-to-host copies
        self._copies: dict[str, Any] = {}  # GPU: req id → the event of its copy
        self._files: dict[str, Future[Path]] = {}  # GPU: req id → its file write
        self._pool: ThreadPoolExecutor | None = None

    def bind(self, cache: torch.Tensor) -> None:
        """Use `cache`, checking its shape: (num_blocks, len(layer_ids), block_size, H)."""
        if cache.dim() != 4 or cache.shape[1] != len(self.layer_ids) or cache.shape[2] != self.block_size:
            raise ValueError(f"hidden-states cache of shape {tuple(cache.shape)}: expected "
                             f"(blocks, {len(self.layer_ids)}, {self.block_size}, hidden)")
        self.cache = cache
        if cache.is_cuda:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mtp-capture")

    def rows(self, save: Save) -> torch.Tensor:
        """The request's (n, k, H) states, gathered from the cache on its device (a new tensor)."""
        assert self.cache is not None, "bind a cache first"
        s = torch.tensor(slots(save.block_ids, self.block_size, len(save.token_ids)), dtype=torch.long)
        if self.cache.is_cuda:
            s = s.pin_memory().to(self.cache.device, non_blocking=True)
        return self.cache[s // self.block_size, :, s % self.block_size]  # (n, k, H)

    def save(self, save: Save) -> bool:
        """Save one request; True when done (CPU: its file is written and its blocks may be freed now), False when
        its copy is in flight (GPU: `poll` reports it)."""
        assert self.cache is not None, "bind a cache first"
        tag = self.tag if save.tag is None else save.tag  # the request's own, else the connector's
        if not self.cache.is_cuda:
            write_capture(self.folder, save.sample_id, torch.tensor(save.token_ids), self.rows(save), self.layer_ids,
                          tag)
            return True
        assert self._pool is not None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.cache.device)
        ready = torch.cuda.Event()
        ready.record()  # after the forward that filled the cache, on the engine's stream
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            states = self.rows(save)
            host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
            host.copy_(states, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._copies[save.req_id] = copied

        def write() -> Path:
            copied.synchronize()  # in the writer thread: the engine never waits for the copy
            return write_capture(self.folder, save.sample_id, torch.tensor(save.token_ids), host, self.layer_ids, tag)

        self._files[save.req_id] = self._pool.submit(write)
        return False

    def poll(self) -> set[str]:
        """The requests whose copies have left the cache since the last call (their blocks may be reused); logs
        the writes that failed (the driver then finds their captures missing and names vLLM's log)."""
        done = set()
        for req_id, event in list(self._copies.items()):
            if event.query():
                del self._copies[req_id]
                done.add(req_id)
        for req_id, fut in list(self._files.items()):
            if fut.done():
                del self._files[req_id]
                if fut.exception() is not None:
                    log.error("the capture of request %s was not written: %r", req_id, fut.exception())
        return done

    def close(self) -> None:
        """Finish the writes in flight."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
