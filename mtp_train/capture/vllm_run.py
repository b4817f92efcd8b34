"""The vLLM half of `mtp-precompute backend=vllm`: prefill given prompt token ids in vLLM with the capture connector.

Runs in vLLM's own environment, with our checkout on PYTHONPATH so that vLLM can import
`mtp_train.capture.vllm_connector`; it imports only vLLM and the standard library. Request and result are JSON:

    request: {"model": DIR, "dtype": "float32", "max_model_len": 2049, "layer_ids": [2, 15, 30],
              "spool_dir": FOLDER, "tag": TAG, "engine": {vllm.LLM keyword arguments: enforce_eager, max_num_seqs, ...}}
    stdin:   one part a line, a JSON list of prompts [{"id": SAMPLE_ID, "token_ids": [...]}, ...]; its end ends the run
    result:  {"vllm_version", "requests"} or {"error": "<exception>", "stage": "import" | "load" | "run"} (exit code 2)

Every prompt is one request of max_tokens=1 (a prefill; the one sampled token is dropped), named by its sample id
in `kv_transfer_params`; the connector writes `spool_dir/req-<hash>.safetensors` for each. Each part is one
`generate` call, run as soon as its line arrives: the driver sends the conversations a window at a time as it reads
them (`launch.VllmProcess.put`), so vLLM starts before the data has been read to its end and a million
conversations never sit in memory at once. `max_model_len` is the run's (max_seq_len + 1, at most the target's
positions), not the longest conversation's: it is known before any is read.

    python -m mtp_train.capture.vllm_run --request req.json --out result.json < parts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

CONNECTOR = "MtpCaptureConnector"
CONNECTOR_MODULE = "mtp_train.capture.vllm_connector"


def capture_configs(layer_ids: list[int], spool_dir: str, tag: str = "") -> dict[str, Any]:
    """vLLM's `speculative_config` and `kv_transfer_config` that capture `layer_ids` with our connector into
    `spool_dir` (the same for `vllm.LLM` and for `vllm serve`'s flags of those names)."""
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in layer_ids]}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"spool_dir": str(spool_dir), "tag": tag},
        },
    }


def engine_args(req: dict[str, Any]) -> dict[str, Any]:
    """vllm.LLM's keyword arguments for a capture request: extract_hidden_states with our connector; prefix
    caching off (a shared prefix would not be recomputed, so its states would never reach the capture cache)."""
    return {
        "model": req["model"],
        "dtype": req.get("dtype", "auto"),
        "max_model_len": req["max_model_len"],
        "enable_prefix_caching": False,
        **capture_configs(req["layer_ids"], req["spool_dir"], req.get("tag", "")),
        **req.get("engine", {}),
    }


def run(req: dict[str, Any], lines: Iterable[str]) -> dict[str, Any]:
    """Load vLLM and prefill every prompt of every part in `lines` (stdin); returns the result (or the error and the
    stage it happened at)."""
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 - not vLLM's environment
        return {"error": f"{type(e).__name__}: {e}", "stage": "import", "traceback": traceback.format_exc()}
    try:
        llm = LLM(**engine_args(req))
    except Exception as e:  # noqa: BLE001 - any failure to load is reported as such
        return {"error": f"{type(e).__name__}: {e}", "stage": "load", "traceback": traceback.format_exc()}
    done = 0
    try:
        for chunk in parts(lines):
            prompts = [TokensPrompt(prompt_token_ids=list(p["token_ids"])) for p in chunk]
            params = [SamplingParams(max_tokens=1, temperature=0.0,
                                     extra_args={"kv_transfer_params": {"sample_id": p["id"]}}) for p in chunk]
            llm.generate(prompts, params, use_tqdm=False)
            done += len(chunk)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "stage": "run", "traceback": traceback.format_exc()}
    return {"vllm_version": vllm.__version__, "requests": done}


def parts(lines: Iterable[str]) -> Iterator[list[dict[str, Any]]]:
    """The parts of the driver's input, one JSON list of prompts a line (blank lines and empty parts skipped), each
    as soon as its line is read."""
    for line in lines:
        if line.strip():
            part = json.loads(line)
            if part:
                yield part


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--request", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    result = run(json.loads(Path(a.request).read_text()), sys.stdin)
    Path(a.out).write_text(json.dumps(result))
    if "error" in result:
        print(result.get("traceback", result["error"]), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
