"""`make check-vllm-serve`: regeneration through a real `vllm serve` (vLLM's CPU build, its own venv) equals our
engine's greedy answers token for token.

1. `vllm serve` on the model (float32, greedy defaults: `--generation-config vllm`), ready when `/health` answers;
2. `mtp-regenerate generator=openai` through it on a few conversations (the template check on its first rows);
3. `mtp-regenerate` on our engine (float32) on the same conversations;
4. the records compared: answer texts, finish reasons and generated token counts per turn (equal token ids give
   equal texts and counts); vLLM stopped afterwards.

Exit 0 when every record is equal, 1 when some differ (the first differences printed), 2 when a stage failed.

    python -m checks.check_vllm_serve --model models/smollm2-135m-instruct --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtp_train import processes
from mtp_train.capture import launch, serve

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 900.0  # seconds vLLM's CPU build may take to load and warm up


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="check-vllm-serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="python of vLLM's venv")
    p.add_argument("--data", default="demo-heldout", help="conf/data name of the conversations")
    p.add_argument("--limit", type=int, default=8, help="conversations (the 7th of demo-heldout has two turns)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default="runs/check-vllm-serve")
    return p.parse_args(argv)


def regenerate(out: Path, a: argparse.Namespace, *extra: str) -> None:
    cmd = [sys.executable, "-m", "mtp_train.cli.regenerate", f"model.path={a.model}", "model.dtype=float32",
           "model.device=cpu", f"data={a.data}", f"limit={a.limit}", f"max_new_tokens={a.max_new_tokens}",
           f"out={out}", "progress=false", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:4])} {' '.join(extra)} failed ({r.returncode}): {r.stderr[-2000:]}")


def records(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out[r["id"]] = {"messages": r["messages"], "finish_reasons": r["finish_reasons"],
                        "gen_tokens": r["gen_tokens"]}
    return out


def compare(ours: dict[str, dict], theirs: dict[str, dict]) -> list[str]:
    """One line per record that differs (or is missing on one side)."""
    lines = []
    for rid in sorted(set(ours) | set(theirs)):
        a, b = ours.get(rid), theirs.get(rid)
        if a != b:
            lines.append(f"{rid}: ours {json.dumps(a)[:300]} | vLLM {json.dumps(b)[:300]}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    python = Path(a.vllm_python).absolute()  # not resolved: a venv's python is a symlink
    if not python.exists():
        print(f"check-vllm-serve: {python} not found: create vLLM's venv first (make check-vllm-serve does)",
              file=sys.stderr)
        return 2
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.jsonl*"):
        f.unlink()  # a fresh comparison each time
    port = processes.free_port()
    url = f"http://127.0.0.1:{port}"
    env = launch.child_env(os.environ, None, 2)  # nothing of this project in vLLM's venv
    log = out / "vllm-serve.log"
    t0 = time.perf_counter()
    argv = [str(python), "-m", serve.SERVER_MODULE, "--model", str(Path(a.model).absolute()), "--served-model-name",
            "smollm2-135m", "--dtype", "float32", "--max-model-len", "2048", "--port", str(port), "--host",
            "127.0.0.1", "--generation-config", "vllm", "--seed", "0"]
    try:
        with processes.serving(argv, env, log, url, READY_TIMEOUT):  # it loads for minutes
            print(f"check-vllm-serve: vllm serve ready in {time.perf_counter() - t0:.0f} s", flush=True)
            regenerate(out / "vllm.jsonl", a, "generator=openai", f"endpoints=[{url}]", "concurrency=4", "retries=2")
    except RuntimeError as exc:
        print(f"check-vllm-serve: {exc}", file=sys.stderr)
        return 2
    try:
        regenerate(out / "engine.jsonl", a)
    except RuntimeError as exc:
        print(f"check-vllm-serve: {exc}", file=sys.stderr)
        return 2
    ours, theirs = records(out / "engine.jsonl"), records(out / "vllm.jsonl")
    diff = compare(ours, theirs)
    turns = sum(len(r["finish_reasons"]) for r in ours.values())
    tokens = sum(sum(r["gen_tokens"]) for r in ours.values())
    print(f"check-vllm-serve: {len(ours) - len(diff)}/{len(ours)} conversations ({turns} turns, {tokens} tokens) "
          f"equal between vllm serve (generator=openai) and our engine, greedy, float32; records in {out}")
    for line in diff[:5]:
        print(f"  {line}")
    return 0 if not diff and ours else 1


if __name__ == "__main__":
    sys.exit(main())
