"""Our side of the vLLM process: its environment, the capture modules it imports, its request, its prompts, its end
(started and stopped as every child of ours is: `mtp_train.processes`).

vLLM runs in its own environment (`vllm_python`), in a child process, so our package need not be installed there
and its dependencies never meet vLLM's. The child's PYTHONPATH is a temporary folder holding a copy of only the
modules vLLM's side imports (`CHILD_MODULES`), so a `vllm_python` that cannot import the rest of our package still
loads the connector, and nothing of our environment (a site-packages folder) shadows vLLM's torch.

The prompts go to the child's stdin as the driver reads them (`VllmProcess.put`, one line per part, written by a
thread of ours so that a full pipe never blocks the driver), so vLLM starts on the first conversations while the
rest of the data is still being read.
"""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mtp_train
from mtp_train import processes

if TYPE_CHECKING:  # annotations only: vLLM's side imports this module's siblings, never this one
    from mtp_train.data.samples import Row

PACKAGE_DIR = Path(mtp_train.__file__).parent
# What vLLM's processes import of ours: the package's (empty) inits and the capture modules the connector uses.
CHILD_MODULES = ("__init__.py", "capture/__init__.py", "capture/book.py", "capture/saver.py", "capture/spool.py",
                 "capture/vllm_connector.py", "capture/vllm_run.py", "capture/vllm_generate.py")
RUN_MODULE = "mtp_train.capture.vllm_run"


class CaptureError(RuntimeError):
    """vLLM could not capture (not installed, cannot serve the model, failed midway); the message says which."""


def stage_modules(dest: Path) -> Path:
    """Copy `CHILD_MODULES` under dest/mtp_train; returns dest (the child's PYTHONPATH)."""
    for rel in CHILD_MODULES:
        target = dest / "mtp_train" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PACKAGE_DIR / rel, target)
    return dest


def child_env(environ: Mapping[str, str], pythonpath: Path | None, cpu_kvcache_gb: int) -> dict[str, str]:
    """The vLLM process's environment: the caller's, with PYTHONPATH replaced by the staged modules (nothing of
    our environment; None: no PYTHONPATH, a plain `vllm serve`) and VLLM_CPU_KVCACHE_SPACE set unless the caller
    set it (the CPU build's cache size)."""
    env = {k: v for k, v in environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_gb))
    return env


def check_python(python: str | Path) -> Path:
    """vLLM's python as an absolute path (a venv's python is a link: not resolved); CaptureError when missing."""
    path = Path(python).absolute()
    if not path.is_file():
        raise CaptureError(f"vllm_python={python}: no such file; install vLLM in its own environment (`make "
                           "vllm-venv` creates .venv-vllm) or point vllm_python at its python")
    return path


def error_line(text: str, most: int = 240) -> str:
    """The informative line of an exception's text: for pydantic's "N validation error(s) for X" the error under it
    (vLLM validates its settings with pydantic), without the long lists and type details it appends; at most
    `most` characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[1] if "validation error" in lines[0] and len(lines) > 1 else lines[0]
    line = line.removeprefix("Value error, ")
    for tail in (" Supported architectures:", " [type="):
        line = line.split(tail)[0]
    return line if len(line) <= most else line[:most - 1] + "…"


@dataclass
class VllmProcess:
    """The running vLLM side: its process, result file and log, and the thread writing its prompts to its stdin.

    Args:
        proc: the child (`processes.start`, its stdin a pipe).
        python: vLLM's python.
        result_path: where the child writes its result.
        log_path: the child's stdout and stderr.
        model: the model it serves (named in errors).
        max_model_len: the longest prompt plus its one sampled token the child's engine takes.
    """

    proc: subprocess.Popen[bytes]
    python: Path
    result_path: Path
    log_path: Path
    model: str
    max_model_len: int
    # The parts `put` hands over, written by the feeding thread; None ends the child's input. Unbounded: the
    # driver sends about a window of conversations ahead of the shard it converts.
    _parts: queue.Queue[str | None] = field(default_factory=queue.Queue)
    _feeder: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._feeder = threading.Thread(target=self._feed, name="mtp-vllm-prompts", daemon=True)
        self._feeder.start()

    def _feed(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            while (line := self._parts.get()) is not None:
                stdin.write(line.encode())
                stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            return  # the child has ended (or was stopped): `check` reports why
        finally:
            with contextlib.suppress(OSError, ValueError):
                stdin.close()

    def check_lengths(self, rows: Sequence[Row]) -> None:
        """Refuse a conversation the engine cannot take (longer than max_model_len - 1: one token is sampled)."""
        longest = max(rows, key=lambda r: r.ids.size)
        if longest.ids.size + 1 > self.max_model_len:
            raise CaptureError(f"sample {longest.id!r} has {longest.ids.size} tokens; vLLM was started with "
                               f"max_model_len={self.max_model_len} (the target's positions or max_seq_len + 1): "
                               "lower max_seq_len")

    def put(self, rows: Sequence[Row]) -> None:
        """Send `rows` as one part (one `generate` call of the child: `vllm_run`), in order, without blocking."""
        self._parts.put(json.dumps([{"id": r.id, "token_ids": r.ids.tolist()} for r in rows]) + "\n")

    def close(self) -> None:
        """No more prompts: the child ends once it has run the ones sent."""
        self._parts.put(None)

    def taken(self, sample_id: str) -> None:
        """The driver has read `sample_id`'s capture (nothing is kept of it here)."""

    def finish(self) -> None:
        """After `close`, once every capture was read: wait for the child's end; CaptureError when it failed."""
        if self.proc.wait() != 0:
            raise self.error()

    def result(self) -> dict[str, Any]:
        """The child's result once it has exited (an error dict when it wrote none)."""
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            return {"error": f"vLLM exited with code {self.proc.returncode} and no result", "stage": "run"}

    def error(self) -> CaptureError:
        """The one-line error of a child that failed, naming its log."""
        r = self.result()
        first = error_line(str(r.get("error", ""))) or "no error reported"
        if r.get("stage") == "import":
            return CaptureError(f"{self.python} cannot import vLLM: {first}; vllm_python must be the python of "
                                "vLLM's environment")
        if r.get("stage") == "load":
            return CaptureError(f"vLLM cannot serve {self.model}: {first} (its log: {self.log_path})")
        return CaptureError(f"vLLM failed while capturing: {first} (its log: {self.log_path})")

    def wait(self, seconds: float) -> None:
        """Pause a wait for a capture file (shorter when the child exits meanwhile)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=seconds)

    def check(self, sample_id: str, path: Path) -> None:
        """Raise CaptureError when the child has ended without writing `path`."""
        if self.proc.poll() is None:
            return
        if self.proc.returncode != 0:
            raise self.error()
        raise CaptureError(f"vLLM finished without capturing sample {sample_id!r} (its log: {self.log_path})")

    def stop(self) -> None:
        """End the child and the engine processes it spawned (its own process group) if it still runs (a refused
        or interrupted run): `processes.stop`, SIGKILL after 30 s."""
        self._parts.put(None)  # the feeding thread ends (a write blocked on a full pipe ends with the child)
        processes.stop(self.proc, grace=30.0)


def start(python: Path, request: dict[str, Any], workdir: Path, env: Mapping[str, str],
          log_path: Path) -> VllmProcess:
    """Write `request` (the `vllm_run` format) to workdir and start vLLM's side on it, its output to log_path; the
    prompts follow through `VllmProcess.put` and `close`.

    Args:
        python: vLLM's python.
        request: the settings (`vllm_run`'s request).
        workdir: a private folder for the request and result files (the child's working directory).
        env: the child's environment (`child_env`).
        log_path: the child's stdout and stderr.
    """
    req_path, result_path = workdir / "request.json", workdir / "result.json"
    req_path.write_text(json.dumps(request))
    result_path.unlink(missing_ok=True)
    proc = processes.start([python, "-m", RUN_MODULE, "--request", req_path, "--out", result_path], env, log_path,
                           cwd=workdir, stdin=True)
    return VllmProcess(proc, python, result_path, log_path, str(request["model"]), int(request["max_model_len"]))
