"""Capture through running vLLM servers: `mtp-precompute backend=vllm vllm.endpoints=[...]`.

The servers were started with our connector (`capture.serve`: `mtp-precompute ... vllm.serve_command=true` prints
the command) and write their capture files into a folder this machine reads too (`vllm.spool_dir`). The driver
sends every conversation's prompt token ids to `/v1/completions` (a prefill: max_tokens=1, greedy) with
`kv_transfer_params = {"sample_id", "tag"}`, through `OpenAIGenerator`: `vllm.concurrency` requests in flight per
endpoint, a failed try (a dropped connection, a timeout, 429 / 5xx: a server killed or restarting) put back for any
endpoint, an endpoint failing for `vllm.dead_after` seconds dropped (its requests go to the others) and, with none
left, the run stopped in one line (`remote.generator`). The requests go from a thread, a chunk at a time in plan
order, while the driver turns the files into shards as they appear: `mtp-precompute` hands them over a window at
a time as it reads the data (`open`, `put`, `close`), so the servers start on the first conversations before the
rest is read.

Before the first request of a run, `probe` asks every endpoint to capture one conversation and refuses, naming the
endpoint and the fix, a server that does not run our connector, writes elsewhere than `vllm.spool_dir`, captures
other layers, runs another dtype or other token ids.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mtp_train.capture.launch import CaptureError
from mtp_train.capture.spool import file_name, read_capture
from mtp_train.config.precompute import VllmCaptureConfig
from mtp_train.data.samples import Row
from mtp_train.engine.sampling import SamplingParams
from mtp_train.remote.generator import OpenAIGenerator
from mtp_train.remote.http import RemoteError

PROBE = "mtp-probe-"  # the sample ids of the probes (one per endpoint)
# A prefill: one token sampled and dropped; ignore_eos, so that a first token that happens to be EOS (the server's
# stop, not ours) still ends the request as "length".
PREFILL = SamplingParams(max_new_tokens=1, ignore_eos=True)
SERVE_HINT = "`mtp-precompute ... vllm.serve_command=true` prints the command to start it with"


class EndpointCapture:
    """Captures conversations through running servers (module docstring).

    Args:
        gen: the client of the endpoints (`OpenAIGenerator.connect`).
        spool: the servers' capture folder as this machine sees it.
        tag: the run's tag (`vllm_backend.capture_tag`), sent with every request.
        layer_ids: vLLM's aux ids the run needs.
        dtype: the dtype the servers must run (the run's model.dtype).
        capture_timeout: seconds a capture file may take to appear after its request was answered.
        chunk: requests handed to the client at once (the stop flag is checked between chunks).
    """

    def __init__(self, gen: OpenAIGenerator, spool: Path, tag: str, layer_ids: Sequence[int], dtype: torch.dtype,
                 capture_timeout: float = 120.0, chunk: int = 256) -> None:
        self.gen, self.spool, self.tag, self.layer_ids = gen, spool, tag, [int(i) for i in layer_ids]
        self.dtype, self.capture_timeout, self.chunk = dtype, capture_timeout, chunk
        self.answered: dict[str, float] = {}  # sample id → when its request was answered (monotonic)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # What `put` hands the sending thread (see `open`), in chunks; None: no more.
        self._parts: queue.Queue[list[tuple[str, Row]] | None] = queue.Queue()

    @classmethod
    def connect(cls, v: VllmCaptureConfig, spool: Path, tag: str, layer_ids: Sequence[int],
                dtype: torch.dtype) -> EndpointCapture:
        """Ask every endpoint what it serves (`OpenAIGenerator.connect`: one line each for one that does not
        answer or serves another model)."""
        gen = OpenAIGenerator.connect(v.endpoints, **v.client_kwargs())
        return cls(gen, spool, tag, layer_ids, dtype, v.capture_timeout)

    def provenance(self) -> dict[str, Any]:
        """What the manifest records of the servers."""
        return {"endpoints": list(self.gen.endpoints), **self.gen.provenance()}

    def check_lengths(self, rows: Sequence[Row]) -> None:
        """Refuse a conversation longer than the servers' context (they would refuse its request)."""
        longest = max(rows, key=lambda r: r.ids.size)
        if longest.ids.size + 1 > self.gen.max_context:
            raise RemoteError(f"sample {longest.id!r} has {longest.ids.size} tokens; the endpoints serve "
                              f"max_model_len={self.gen.max_context}: start them with --max-model-len "
                              f"{longest.ids.size + 1} or more, or lower max_seq_len")

    def _body(self, sample_id: str) -> dict[str, Any]:
        return {"kv_transfer_params": {"sample_id": sample_id, "tag": self.tag}}

    def probe(self, row: Row) -> None:
        """Capture `row` once through every endpoint and check each capture (module docstring); RemoteError naming
        the endpoint and what to change."""
        body = self.gen.completion_body(row.ids.tolist(), PREFILL)
        for url in self.gen.endpoints:
            sample_id = f"{PROBE}{url}"
            path = self.spool / file_name(sample_id)
            path.unlink(missing_ok=True)
            answer = self.gen.post(url, "/v1/completions", body | self._body(sample_id))
            written = (answer.get("kv_transfer_params") or {}).get("capture_file")
            if not written:
                raise RemoteError(f"{url} does not capture hidden states (its answer names no capture_file): start "
                                  f"it with our connector; {SERVE_HINT}")
            deadline = time.monotonic() + self.capture_timeout
            while not path.is_file():
                if time.monotonic() > deadline:
                    raise RemoteError(f"{url} wrote its capture to {written}, which did not appear in "
                                      f"vllm.spool_dir={self.spool} within {self.capture_timeout:.0f} s: point "
                                      "spool_dir at the folder the servers write to, as this machine sees it")
                time.sleep(0.05)
            cap = read_capture(path)
            path.unlink(missing_ok=True)
            if cap.layer_ids != self.layer_ids:
                raise RemoteError(f"{url} captures vLLM layers {cap.layer_ids}; this run needs {self.layer_ids} "
                                  f"(aux_layers): restart it with those; {SERVE_HINT}")
            if cap.hidden_states.dtype != self.dtype:
                name = str(cap.hidden_states.dtype).removeprefix("torch.")
                raise RemoteError(f"{url} runs the model in {name}; this run reads {self.dtype} states: set "
                                  f"model.dtype={name} or serve with --dtype {str(self.dtype).removeprefix('torch.')}")
            if cap.token_ids.tolist() != row.ids.tolist():
                raise RemoteError(f"{url} ran other token ids than the ones sent (sample {row.id!r})")

    def send(self, part: Sequence[tuple[str, Row]]) -> None:
        """Capture `part` now, blocking until every request is answered: (name, row) pairs, each request naming
        its capture `name` (a row's id, or another name for a row captured more than once, as `sources.fleet`
        does per epoch)."""
        names = [n for n, _ in part]
        self.gen.generate([r.ids.tolist() for _, r in part], [PREFILL] * len(part),
                          on_finish=lambda j, _out: self.answered.__setitem__(names[j], time.monotonic()),
                          extra=[self._body(n) for n in names], names=[f"sample {n!r}" for n in names])

    def serve(self, feed: Callable[[], Sequence[tuple[str, Row]] | None]) -> None:
        """Send, from a thread, what `feed` hands over a part at a time (`send`) until it returns None or `stop`
        is called; `feed` runs in that thread and may block until it has something to send."""
        def loop() -> None:
            try:
                while not self._stop.is_set():
                    part = feed()
                    if part is None:
                        return
                    if part:
                        self.send(part)
            except BaseException as exc:  # noqa: BLE001 - reported by `check` in the driver's thread
                self.error = exc
            finally:
                self._done.set()

        self._thread = threading.Thread(target=loop, name="mtp-capture-requests", daemon=True)
        self._thread.start()

    def open(self) -> None:
        """Start the sending thread on what `put` hands over, until `close` (module docstring)."""
        self.serve(self._parts.get)

    def put(self, rows: Sequence[Row]) -> None:
        """Send `rows` (after `open`), `chunk` at a time in order, without blocking the caller."""
        for i in range(0, len(rows), self.chunk):
            self._parts.put([(r.id, r) for r in rows[i:i + self.chunk]])

    def close(self) -> None:
        """No more rows: the thread ends once the ones handed over are answered."""
        self._parts.put(None)

    def taken(self, sample_id: str) -> None:
        """The driver has read `sample_id`'s capture: forget when it was answered (the bookkeeping stays as large
        as the requests in flight, not the conversations of the run)."""
        self.answered.pop(sample_id, None)

    def finish(self) -> None:
        """After `close`, once every capture was read: CaptureError when the sending thread failed."""
        if self.error is not None:
            raise CaptureError(f"capturing through {', '.join(self.gen.endpoints)} failed: {self.error}")

    @property
    def stopped(self) -> bool:
        """Whether `stop` was called."""
        return self._stop.is_set()

    def join(self, seconds: float) -> bool:
        """Wait at most `seconds` for the sending thread to end (the part in flight answered); True when it has."""
        return self._done.wait(seconds) if self._thread is not None else True

    # --- the driver's wait for a capture file (`vllm_backend.wait_for`) --------------------------------------

    def wait(self, seconds: float) -> None:
        """Pause the driver's wait for a file (shorter when the requests end meanwhile)."""
        if self._done.is_set():
            time.sleep(seconds)
        else:
            self._done.wait(seconds)

    def check(self, sample_id: str, path: Path) -> None:
        """Raise CaptureError when the file of `sample_id` cannot come any more."""
        if self.error is not None:
            raise CaptureError(f"capturing through {', '.join(self.gen.endpoints)} failed: {self.error}")
        at = self.answered.get(sample_id)
        if at is not None and time.monotonic() - at > self.capture_timeout:
            raise CaptureError(f"sample {sample_id!r} was answered {time.monotonic() - at:.0f} s ago but its capture "
                               f"{path.name} is not in {path.parent} (vllm.capture_timeout={self.capture_timeout:g}); "
                               "the server's log says why")
        if at is None and self._done.is_set():
            raise CaptureError(f"sample {sample_id!r} was never sent to the endpoints")

    def stop(self) -> None:
        """Send no further chunk (the one in flight ends on its own: the thread is a daemon)."""
        self._stop.set()
        self._parts.put(None)  # a thread waiting for the next part (`open`) ends too
