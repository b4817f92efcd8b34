"""`mtp_train.processes`, the one place children start and stop: a child runs in a session of its own, its output
in its log; stopping it ends every process of its group (vLLM's engine processes) with SIGTERM, then SIGKILL after
the grace; a server is awaited on its `/health`."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mtp_train import processes

# A child that starts a grandchild (an engine process) and reports both pids, then sleeps; with IGNORE, both
# ignore SIGTERM.
FAMILY = textwrap.dedent("""
    import signal, subprocess, sys, time
    if sys.argv[1] == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grand = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\\n"
                              "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                              "time.sleep(600)", sys.argv[1]])
    print(grand.pid, flush=True)
    time.sleep(600)
""")
# A server answering 200 on /health (and 404 elsewhere) on the port it is given.
HEALTH = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a):
            pass
    print("listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its state says it has ended
    status = Path(f"/proc/{pid}/stat")
    return not (status.is_file() and status.read_text().split(") ")[-1].startswith("Z"))


def _family(tmp_path: Path, mode: str) -> tuple[object, int]:
    log = tmp_path / "family.log"
    proc = processes.start([sys.executable, "-c", FAMILY, mode], os.environ, log)
    deadline = time.monotonic() + 30
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc, int(log.read_text().split()[0])


@pytest.mark.parametrize("mode", ["term", "ignore"])
def test_stop_ends_the_child_and_what_it_spawned_by_sigterm_or_after_the_grace_by_sigkill(tmp_path, mode):
    proc, grand = _family(tmp_path, mode)
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # a session of its own: our Ctrl-C is not its
    t0 = time.monotonic()
    processes.stop(proc, grace=0.5)
    assert proc.returncode == (-15 if mode == "term" else -9)
    assert time.monotonic() - t0 < 20
    deadline = time.monotonic() + 10
    while _alive(grand) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(grand)
    processes.stop(proc)  # an ended child: nothing to do


def test_kill_ends_the_group_at_once(tmp_path):
    proc, grand = _family(tmp_path, "ignore")
    processes.kill(proc)
    assert proc.returncode == -9
    deadline = time.monotonic() + 10
    while _alive(grand) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(grand)


def test_start_writes_or_appends_the_log_and_gives_a_stdin_pipe_when_asked(tmp_path):
    log = tmp_path / "echo.log"
    code = "import sys; print(sys.stdin.readline().strip().upper(), flush=True)"
    for append in (False, True):
        proc = processes.start([sys.executable, "-c", code], os.environ, log, stdin=True, append=append,
                               cwd=tmp_path)
        proc.stdin.write(b"hello\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    assert log.read_text().split() == ["HELLO", "HELLO"]
    proc = processes.start([sys.executable, "-c", "print('again')"], os.environ, log)
    proc.wait(timeout=60)
    assert log.read_text() == "again\n"  # replaced


def test_serving_yields_a_ready_server_and_stops_it(tmp_path):
    port = processes.free_port()
    url = f"http://127.0.0.1:{port}"
    with processes.serving([sys.executable, "-c", HEALTH, str(port)], os.environ, tmp_path / "s.log", url, 60,
                           name="the test server", every=0.05, grace=5) as proc:
        assert proc.poll() is None
    assert proc.returncode == -15


def test_a_server_that_ends_before_it_is_ready_is_named_with_its_log(tmp_path):
    url = f"http://127.0.0.1:{processes.free_port()}"
    code = "import sys; print('cannot load the model', flush=True); sys.exit(3)"
    said = "(?s)the test server exited with 3 before it was ready.*cannot load"
    with pytest.raises(RuntimeError, match=said), processes.serving(
            [sys.executable, "-c", code], os.environ, tmp_path / "s.log", url, 60, name="the test server", every=0.05):
        pass
    with pytest.raises(TimeoutError, match="not ready after 0 s"):
        processes.wait_ready(url, None, timeout=0.3, every=0.05)
