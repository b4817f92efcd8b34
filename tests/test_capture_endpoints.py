"""The capture through running servers (`vllm.endpoints`) when one dies, against `tests.test_capture`'s stand-in
for a `vllm serve` with our connector: the other endpoints finish the run with every conversation captured once,
and with none left the run stops in one line within a bounded time."""

from __future__ import annotations

import threading

import pytest

from mtp_train.capture.layers import layer_map
from mtp_train.precompute import PrecomputeError
from mtp_train.precompute.vllm_backend import precompute_vllm
from tests.test_capture import (  # noqa: F401 (convs, engine_folder, target: the fixtures, shared)
    AUX,
    LAYERS,
    _CapturingServer,
    _endpoint_cfg,
    _same_shards,
    convs,
    engine_folder,
    target,
)

pytestmark = pytest.mark.usefixtures("one_thread")


class _DyingServer(_CapturingServer):
    """`_CapturingServer` that dies at its POST number `answers` + 1: it stops listening (later connections are
    refused) and drops that request and any later one unanswered, capturing nothing for them."""

    def __init__(self, *args, answers: int, **kw) -> None:
        super().__init__(*args, **kw)
        owner, lock, self.posts = self, threading.Lock(), 0

        class Dying(self.httpd.RequestHandlerClass):
            def do_POST(self) -> None:
                with lock:
                    owner.posts += 1
                    n = owner.posts
                if n <= answers:
                    super().do_POST()
                    return
                if n == answers + 1:  # shutdown waits for the serving loop: from a thread of its own
                    threading.Thread(target=owner.kill, daemon=True).start()
                self.close_connection = True  # no answer: the client sees the connection dropped

        self.httpd.RequestHandlerClass = Dying

    def kill(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _run_bounded(fn, timeout: float = 120.0):
    """fn() in a thread: (its result, its exception); fails the test when it has not returned after `timeout`
    seconds (generous: the runs here end within seconds)."""
    done: dict[str, object] = {}

    def run() -> None:
        try:
            done["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the run did not stop within {timeout:.0f} s"
    return done.get("result"), done.get("error")


def test_a_capture_whose_server_dies_finishes_on_the_other_endpoint(
        target, convs, engine_folder, tmp_path):  # noqa: F811 (tests.test_capture's fixtures)
    spool, ids = tmp_path / "shared", layer_map(AUX, LAYERS).vllm_ids
    with _CapturingServer(target, spool, ids) as live, _DyingServer(target, spool, ids, answers=2) as dying:
        cfg = _endpoint_cfg(target, convs, tmp_path / "out", spool, dying.url)
        cfg.vllm.endpoints = [dying.url, live.url]
        # retries=1: the dead endpoint's probes are its own failures, not the requests'
        cfg.vllm.retries, cfg.vllm.backoff, cfg.vllm.dead_after = 1, 0.05, 1.0
        _, error = _run_bounded(lambda: precompute_vllm(cfg, environ={}, config_dict={}))
        assert error is None, error
        assert dying.posts > 2 and dying.requests == 2  # the probe and one capture, then it died
        assert dying.requests + live.requests == 6 + 2  # every conversation captured once, and the two probes
    _same_shards(engine_folder, tmp_path / "out")


def test_a_capture_whose_only_server_dies_stops_in_one_line(
        target, convs, tmp_path):  # noqa: F811 (tests.test_capture's fixtures)
    spool = tmp_path / "shared"
    with _DyingServer(target, spool, layer_map(AUX, LAYERS).vllm_ids, answers=2) as dying:
        cfg = _endpoint_cfg(target, convs, tmp_path / "out", spool, dying.url)
        # retries far beyond what the bound needs: the endpoint's death, not the requests' tries, ends the run
        cfg.vllm.retries, cfg.vllm.backoff, cfg.vllm.dead_after = 1000, 0.05, 1.0
        _, error = _run_bounded(lambda: precompute_vllm(cfg, environ={}, config_dict={}))
    assert isinstance(error, PrecomputeError), error
    msg = str(error)
    assert "no endpoint left" in msg and f"{dying.url} (failing for " in msg and "dead_after=1 s" in msg
    assert "\n" not in msg
