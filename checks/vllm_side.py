"""The vLLM half of `make check-vllm`: greedy decoding of given prompt token ids by vLLM, plain or speculative.

Runs inside vLLM's own virtual environment (`.venv-vllm`, vLLM's CPU build), so it imports only vLLM, the standard
library and the package's staged vLLM-side module `mtp_train.capture.vllm_generate` (the counters and engine
settings `mtp-eval backend=vllm` uses too), never the rest of mtp_train. `checks/check_vllm.py` writes the
request and reads the result; both are JSON files:

    request: {"model": DIR, "prompts": [[token id, ...], ...], "max_tokens": 96, "stop_token_ids": [...],
              "max_model_len": 2048, "dtype": "float32",
              "speculative": null | {"method": "eagle" | "eagle3" | ..., "model": HEAD_DIR, "num_speculative_tokens": 3,
                                     "parallel_drafting": true (optional: P-EAGLE, all k drafts in one forward)}}
    result:  {"vllm_version", "outputs": [{"token_ids": [...], "finish_reason": "stop" | "length"}, ...],
              "spec": null | {"num_drafts", "num_draft_tokens", "num_accepted", "accepted_per_pos": [...],
                              "tau", "acceptance_rate", "per_position": [...]}}
          or {"error": "<exception and traceback>"} (exit code 2) when vLLM fails.

Batch 1: every prompt is its own `generate` call on an engine with max_num_seqs=1, so no request shares a step
with another (our mtp-eval's batch_size=1). Greedy (temperature 0), the prompt's ids as given (no template, no
special tokens added), stop on the given ids. Spec counters are vLLM's own (`llm.get_metrics()`), cumulative over
the process, so plain and speculative runs are separate processes.

    .venv-vllm/bin/python checks/vllm_side.py --request req.json --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# vLLM's counters and engine settings are the package's (`mtp-eval backend=vllm` reads them the same way); this
# file runs with the staged capture modules on its PYTHONPATH (`mtp_train.capture.launch.stage_modules`).
from mtp_train.capture.vllm_generate import (
    ACCEPTED,
    ACCEPTED_PER_POS,
    DRAFT_TOKENS,
    DRAFTS,
    engine_kwargs,
    spec_counts,
    spec_summary,
)

__all__ = ["ACCEPTED", "ACCEPTED_PER_POS", "DRAFTS", "DRAFT_TOKENS", "engine_kwargs", "main", "run", "spec_counts",
           "spec_summary"]


def run(req: dict[str, Any]) -> dict[str, Any]:
    """Generate every prompt of `req` with vLLM (module docstring); the result object."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = engine_kwargs(req)
    if (req.get("speculative") or {}).get("parallel_drafting"):  # vLLM's eagle3 drafting all k in one forward
        kwargs["speculative_config"]["parallel_drafting"] = True
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]),
                            stop_token_ids=[int(t) for t in req["stop_token_ids"]], detokenize=False)
    outputs = []
    for ids in req["prompts"]:
        out = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in ids])], params, use_tqdm=False)[0]
        comp = out.outputs[0]
        outputs.append({"token_ids": [int(t) for t in comp.token_ids], "finish_reason": comp.finish_reason})
    counts = spec_counts(llm.get_metrics())
    return {"vllm_version": vllm.__version__, "outputs": outputs,
            "spec": spec_summary(counts) if counts is not None else None}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--request", required=True, type=Path, help="the request JSON (module docstring)")
    p.add_argument("--out", required=True, type=Path, help="where the result JSON goes")
    a = p.parse_args(argv)
    req = json.loads(a.request.read_text())
    try:
        result, rc = run(req), 0
    except Exception as exc:  # vLLM's failure is the finding: record it whole for the driver's report
        result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        rc = 2
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result) + "\n")
    return rc


if __name__ == "__main__":  # the guard vLLM needs: its engine spawns processes that re-import this file
    sys.exit(main())
