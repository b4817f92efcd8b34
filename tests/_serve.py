"""Running `mtp-serve` for tests: the app on uvicorn in a thread of the test's process, or the command as a process
of its own (to be killed); both on a free localhost port, ready when `/health` answers (polled, with a bound)."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from mtp_train.processes import free_port
from mtp_train.processes import wait_ready as _wait_ready

READY_TIMEOUT = 120.0  # seconds a server may take to load its model and listen


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = READY_TIMEOUT) -> None:
    """`mtp_train.processes.wait_ready` with the tests' bound."""
    _wait_ready(url, proc, timeout)


@contextlib.contextmanager
def _in_thread(config) -> Iterator[str]:
    """Run a `uvicorn.Config` on a thread of the test's process until the block ends; yield its base URL."""
    import uvicorn

    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://{config.host}:{config.port}"
    try:
        wait_ready(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def app_server(app) -> Iterator[str]:
    """Serve a FastAPI app from `build_app` on uvicorn in a thread, with mtp-serve's connection settings (its limits:
    request timeout, header bound); yield its base URL."""
    from mtp_train.serve.http import uvicorn_config

    with _in_thread(uvicorn_config(app, "127.0.0.1", free_port())) as url:
        yield url


@contextlib.contextmanager
def plain_server(app) -> Iterator[str]:
    """A FastAPI app written for a test on uvicorn in a thread (its default settings); yields its base URL."""
    import uvicorn

    # a request the app still holds at the end is cancelled after 1 s (a server written to hang, say)
    with _in_thread(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                   timeout_graceful_shutdown=1)) as url:
        yield url


def exchange(sock: socket.socket, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One request on an open connection, left open for the next: (status, headers, body) of its response."""
    head = (f"{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    data = resp.read()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the socket's own timeout)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def metric_samples(text: str, name: str) -> dict[str, float]:
    """The samples of one metric of a `/metrics` text: labels (as written) → value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(f"mtp_serve_{name}{{") or line.startswith(f"mtp_serve_{name} "):
            key, value = line.rsplit(" ", 1)
            out[key[len(f"mtp_serve_{name}"):]] = float(value)
    return out


def served_app(model, tokenizer, path, engine=None, start: bool = True, chat_template: str | None = None,
               limits=None):
    """(app, worker) serving `model` as "tiny" (plain decoding unless `engine` is given; the worker started unless
    `start` is False). chat_template: serve with another template than the tokenizer's (a server that disagrees);
    limits: a `ServeLimits` (default: mtp-serve's)."""
    import copy

    from mtp_train.engine import LLMEngine
    from mtp_train.engine.turns import stop_token_ids
    from mtp_train.serve import EngineWorker, ServedModel, ServeLimits, build_app

    engine = engine or LLMEngine(model, kv_cache_gb=0.01)
    worker = EngineWorker(engine, vocab_size=model.args.vocab_size)
    if chat_template is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = chat_template
    served = ServedModel(model_id="tiny", root=str(path), tokenizer=tokenizer,
                         max_context=model.args.max_position_embeddings,
                         max_request_tokens=engine.scheduler.max_request_tokens,
                         stop_ids=stop_token_ids(tokenizer, model.args.eos_token_ids), limits=limits or ServeLimits())
    if start:
        worker.start()
    return build_app(worker, served), worker


def start_serve(model_dir: Path, port: int, *extra: str, log: Path | None = None) -> subprocess.Popen:
    """`mtp-serve` on `model_dir` (fp32, CPU) as a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                          os.environ.get("PYTHONPATH", "")])}
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (the process owns it)
    return subprocess.Popen(
        [sys.executable, "-m", "mtp_train.cli.serve", f"model.path={model_dir}", "model.name=tiny",
         "model.fetch=null", "model.dtype=float32", "model.device=cpu", "model.kv_cache_gb=0.01",
         f"port={port}", *extra], stdout=out, stderr=out, env=env)
