"""The child processes we start and stop: vLLM engines and `vllm serve` (run by vLLM's own python), and the servers
the checks and benchmarks start. The one place that says how a child starts (its command, environment, working
directory and log file, in a session of its own), how a server is awaited (a free port, `/health`), and how a child
ends (its whole process group: SIGTERM, a grace, SIGKILL).

A child runs in a session of its own: stopping it reaches the processes it spawned (vLLM's engine processes), and a
Ctrl-C meant for us reaches only us, which then stops it. What the child runs and its environment are the caller's
(`capture.launch.child_env`: vLLM's side sees only the staged capture modules).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx


def start(argv: Sequence[str | Path], env: Mapping[str, str], log: str | Path, *, cwd: str | Path | None = None,
          stdin: bool = False, append: bool = False) -> subprocess.Popen[bytes]:
    """Start `argv` in a session of its own, its stdout and stderr to `log`; `stop` ends it.

    Args:
        argv: the command (vLLM's python and its module, a server, ...).
        env: its whole environment.
        log: the file its output goes to (os.devnull: dropped).
        cwd: its working directory (None: ours).
        stdin: a pipe we write to (the child's `stdin`); False: it inherits ours.
        append: add to `log` (a server started again on the same log) instead of replacing it.
    """
    with open(log, "ab" if append else "wb") as f:  # the child holds its own copy of the file
        return subprocess.Popen([str(a) for a in argv], env=dict(env), cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if stdin else None, start_new_session=True)


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End a child `start` started, with every process of its group (vLLM's engine processes), if it still runs:
    SIGTERM to the group, SIGKILL after `grace` seconds, then reap it. Whatever is left of its group after the
    child itself ended (processes it spawned that outlived it) is killed too: the group holds nothing else."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL a child `start` started and its group at once (a crash, as the checks of recovery make one), and
    reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def free_port() -> int:
    """A TCP port free on localhost now (for a server this process starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0, every: float = 0.05,
               name: str = "the server") -> None:
    """Poll `url`/health until it answers 200; RuntimeError when `proc` (the server's process) exits first,
    TimeoutError after `timeout` seconds. `every`: the poll interval (readiness, not the interval, ends the wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=max(1.0, every)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(every)
    raise TimeoutError(f"{name} at {url} not ready after {timeout:.0f} s")


@contextlib.contextmanager
def serving(argv: Sequence[str | Path], env: Mapping[str, str], log: str | Path, url: str, timeout: float, *,
            name: str = "vllm serve", every: float = 1.0, grace: float = 60.0,
            cwd: str | Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run a server (`argv`, output to `log`) until the block ends; yields its process once `url`/health answers,
    and stops it (`stop`, SIGKILL after `grace` seconds) on the way out. RuntimeError / TimeoutError, with the log's
    last lines, when it ends or stalls before it is ready.

    Args:
        argv, env, log, cwd: as `start` takes them.
        url: where it answers (http://host:port).
        timeout: seconds it may take to be ready (vLLM loads for minutes).
        name: what errors call it.
        every: seconds between two looks at `/health`.
        grace: seconds it may take to end after SIGTERM.
    """
    proc = start(argv, env, log, cwd=cwd)
    try:
        try:
            wait_ready(url, proc, timeout, every=every, name=name)
        except (RuntimeError, TimeoutError) as exc:
            tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-10:]) if Path(log).is_file() else ""
            raise RuntimeError(f"{exc}\n--- {log} (last lines)\n{tail}") from None
        yield proc
    finally:
        stop(proc, grace)
