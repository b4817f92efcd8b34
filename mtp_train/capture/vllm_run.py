"""The vLLM half of `mtp-precompute backend=vllm`: prefill given prompt token ids in vLLM with the capture connector.

Runs in vLLM's own environment, with our checkout on PYTHONPATH so that vLLM can import
`mtp_train.capture.vllm_connector`; it imports only vLLM and the standard library. Request and result are JSON:

    request: {"model": DIR, "dtype": "float32", "max_model_len": 2048, "layer_ids": [2, 15, 30],
              "spool_dir": FOLDER, "tag": TAG, "engine": {vllm.LLM keyword arguments: enforce_eager, max_num_seqs, ...},
              "prompts": PROMPTS_JSONL, "chunk": 4096}
    prompts: one JSON object a line, {"id": SAMPLE_ID, "token_ids": [...]}
    result:  {"vllm_version", "requests"} or {"error": "<exception>", "stage": "import" | "load" | "run"} (exit code 2)

Every prompt is one request of max_tokens=1 (a prefill; the one sampled token is dropped), named by its sample id
in `kv_transfer_params`; the connector writes `spool_dir/req-<hash>.safetensors` for each. Prompts are read and
handed to vLLM `chunk` at a time, in file order, so a million conversations never sit in memory at once.

    python -m mtp_train.capture.vllm_run --request req.json --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Iterator
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


def run(req: dict[str, Any]) -> dict[str, Any]:
    """Load vLLM and prefill every prompt; returns the result (or the error and the stage it happened at)."""
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
        for chunk in chunks(Path(req["prompts"]), int(req.get("chunk", 4096))):
            prompts = [TokensPrompt(prompt_token_ids=list(p["token_ids"])) for p in chunk]
            params = [SamplingParams(max_tokens=1, temperature=0.0,
                                     extra_args={"kv_transfer_params": {"sample_id": p["id"]}}) for p in chunk]
            llm.generate(prompts, params, use_tqdm=False)
            done += len(chunk)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "stage": "run", "traceback": traceback.format_exc()}
    return {"vllm_version": vllm.__version__, "requests": done}


def chunks(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
    """The prompts of a JSONL file, `size` at a time."""
    batch: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                batch.append(json.loads(line))
            if len(batch) == size:
                yield batch
                batch = []
    if batch:
        yield batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--request", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    result = run(json.loads(Path(a.request).read_text()))
    Path(a.out).write_text(json.dumps(result))
    if "error" in result:
        print(result.get("traceback", result["error"]), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
