"""vLLM's side of `mtp-eval backend=vllm` (and of `make check-vllm`): generation by a vLLM engine over prompt token
ids, plain or speculative, with vLLM's own spec-decode counters.

Runs inside vLLM's environment, started by our driver (`mtp_train.eval.vllm`) with the staged modules on its
PYTHONPATH (`capture.launch`), so it imports only the standard library and vLLM. The driver writes the settings
to a JSON file, then one JSON line per batch (a turn of every conversation still answering) on this process's
stdin; each batch's outputs, with the counters so far, go to `<workdir>/batch-<n>.json` (written whole: renamed
into place), and stdin's end closes the engine. A failure writes `<workdir>/error.json` and exits 2.

    settings: {"engine": {vllm.LLM keyword arguments}, "stop_token_ids": [...], "max_tokens": 96,
               "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    batch:    {"prompts": [[token id, ...], ...], "seeds": [int, ...]}
    result:   {"outputs": [{"token_ids": [...], "finish_reason": "stop" | "length"}, ...],
               "spec": null | {"num_drafts", "num_draft_tokens", "num_accepted", "accepted_per_pos": [...], "tau",
                               "acceptance_rate", "per_position": [...]}, "vllm_version"}

An answer that ended on a stop token has it as its last id (as our engine's `output_ids`), so the text rule of
`engine.turns` applies unchanged.

    <vllm python> -m mtp_train.capture.vllm_generate --settings settings.json --workdir DIR < batches.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
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


def count_delta(after: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """The counters of what ran between two cumulative readings (`spec_counts`; before None: from the start)."""
    if before is None:
        return dict(after)
    per = list(after["accepted_per_pos"])
    for j, v in enumerate(before["accepted_per_pos"]):
        per[j] -= v
    return {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted")} | {
        "accepted_per_pos": per}


def engine_kwargs(req: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for check-vllm's request: float32 eager CPU engine, one sequence at a time, the head
    if given."""
    kwargs: dict[str, Any] = {"model": req["model"], "dtype": req.get("dtype", "float32"), "enforce_eager": True,
                              "max_model_len": int(req.get("max_model_len", 2048)), "max_num_seqs": 1, "seed": 0,
                              "disable_log_stats": False}  # get_metrics() needs the engine's stats
    spec = req.get("speculative")
    if spec:
        kwargs["speculative_config"] = {"method": spec["method"], "model": spec["model"],
                                        "num_speculative_tokens": int(spec["num_speculative_tokens"])}
    return kwargs


def output_ids(token_ids: Sequence[int], finish_reason: str | None, stop_reason: Any) -> list[int]:
    """An answer's ids with the stop token it ended on last (vLLM leaves a stop_token_ids match out of some
    outputs; our engine, and the text rule, keep it)."""
    ids = [int(t) for t in token_ids]
    if finish_reason == "stop" and isinstance(stop_reason, int) and (not ids or ids[-1] != stop_reason):
        ids.append(stop_reason)
    return ids


def write_whole(path: Path, obj: Any) -> None:
    """JSON to `path`, renamed into place (the driver never reads half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def serve(settings: dict[str, Any], batches: Iterable[str], workdir: Path) -> None:
    """Run every batch line of `batches` on one engine (module docstring)."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**settings["engine"])
    for n, line in enumerate(b for b in batches if b.strip()):
        batch = json.loads(line)
        params = [SamplingParams(temperature=float(settings["temperature"]), top_p=float(settings.get("top_p", 1.0)),
                                 top_k=int(settings.get("top_k", 0)), max_tokens=int(settings["max_tokens"]),
                                 stop_token_ids=[int(t) for t in settings["stop_token_ids"]], seed=int(seed),
                                 detokenize=False) for seed in batch["seeds"]]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in batch["prompts"]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        counts = spec_counts(llm.get_metrics())
        write_whole(workdir / f"batch-{n}.json", {
            "outputs": [{"token_ids": output_ids(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                                                 o.outputs[0].stop_reason),
                         "finish_reason": o.outputs[0].finish_reason} for o in outs],
            "spec": spec_summary(counts) if counts is not None else None, "vllm_version": vllm.__version__})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", required=True, type=Path)
    p.add_argument("--workdir", required=True, type=Path)
    a = p.parse_args(argv)
    try:
        serve(json.loads(a.settings.read_text()), sys.stdin, a.workdir)
    except Exception as exc:  # the driver reports it in one line and names the log holding the traceback
        traceback.print_exc()
        write_whole(a.workdir / "error.json", {"error": f"{type(exc).__name__}: {exc}"})
        return 2
    return 0


if __name__ == "__main__":  # the guard vLLM needs: its engine may spawn processes that re-import the main module
    sys.exit(main())
