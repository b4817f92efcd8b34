"""The vLLM half of `make check-vllm`: greedy decoding of given prompt token ids by vLLM, plain or speculative.

Runs inside vLLM's own virtual environment (`.venv-vllm`, vLLM's CPU build), so it imports only vLLM,
transformers and the standard library, never mtp_train. `checks/check_vllm.py` writes the request and reads the
result; both are JSON files:

    request: {"model": DIR, "prompts": [[token id, ...], ...], "max_tokens": 96, "stop_token_ids": [...],
              "max_model_len": 2048, "dtype": "float32",
              "speculative": null | {"method": "eagle" | "eagle3", "model": HEAD_DIR, "num_speculative_tokens": 3}}
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# vLLM's spec-decode counters (v1 engine), by metric name.
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counts(metrics: Iterable[Any]) -> dict[str, Any] | None:
    """vLLM's spec-decode counters from `llm.get_metrics()` (objects with .name and .value, or .values for the
    per-position vector), summed over label sets; None when the engine reported none (no speculative decoding)."""
    counts: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted": 0, "accepted_per_pos": []}
    seen = False
    keys = {DRAFTS: "num_drafts", DRAFT_TOKENS: "num_draft_tokens", ACCEPTED: "num_accepted"}
    for m in metrics:
        name = getattr(m, "name", "")
        if name in keys:
            counts[keys[name]] += int(m.value)
            seen = True
        elif name == ACCEPTED_PER_POS:
            values = [int(v) for v in m.values]
            per = counts["accepted_per_pos"]
            per.extend([0] * (len(values) - len(per)))
            for j, v in enumerate(values):
                per[j] += v
            seen = True
    return counts if seen else None


def spec_summary(counts: dict[str, Any]) -> dict[str, Any]:
    """τ = 1 + accepted / drafts (vLLM's mean acceptance length), acceptance rate = accepted / drafted tokens,
    per position j = share of drafts whose token j was accepted (≥ j+1 accepted): the definitions mtp-eval uses."""
    drafts = counts["num_drafts"]
    return {**counts,
            "tau": 1.0 + counts["num_accepted"] / drafts if drafts else 1.0,
            "acceptance_rate": counts["num_accepted"] / counts["num_draft_tokens"] if counts["num_draft_tokens"]
            else 0.0,
            "per_position": [a / drafts if drafts else 0.0 for a in counts["accepted_per_pos"]]}


def engine_kwargs(req: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for a request: float32 eager CPU engine, one sequence at a time, the head if given."""
    kwargs: dict[str, Any] = {"model": req["model"], "dtype": req.get("dtype", "float32"), "enforce_eager": True,
                              "max_model_len": int(req.get("max_model_len", 2048)), "max_num_seqs": 1, "seed": 0,
                              "disable_log_stats": False}  # get_metrics() needs the engine's stats
    spec = req.get("speculative")
    if spec:
        kwargs["speculative_config"] = {"method": spec["method"], "model": spec["model"],
                                        "num_speculative_tokens": int(spec["num_speculative_tokens"])}
    return kwargs


def run(req: dict[str, Any]) -> dict[str, Any]:
    """Generate every prompt of `req` with vLLM (module docstring); the result object."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(req))
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
