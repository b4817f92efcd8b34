"""`make check-vllm-fleet`: training straight from a real `vllm serve` (`data.source=fleet`) against the file path.

1. `--conversations` conversations (the demo prompts, each with a fixed answer);
2. a `vllm serve` with our connector (vLLM's CPU build in its own venv, float32), started as `capture.serve`
   starts one;
3. `mtp-train data.source=fleet` over it for one epoch, the spool capped at `--max-spool-bytes` (far below the
   data's captures); once it has taken `--kill-after` steps the server is killed (SIGKILL of its process group)
   and started again on the same port: its requests are retried until it answers (`data.fleet.dead_after` above
   its start-up time);
4. `mtp-precompute backend=vllm` through a fresh server over the same conversations, then `mtp-train
   data.source=offline` on that folder with the same settings;
5. the two heads compared: the largest ‖Δ‖ / ‖W‖ over their tensors within `--train-tolerance` (1e-3, the one
   `check-vllm-capture` uses: both read vLLM's float32 states, which differ between two servers only by the order
   of summation of batched kernels). The spool's peak bytes (the driver's count, logged by the source) are printed.

The last line printed is one JSON object; the exit code is 1 when the heads differ beyond the tolerance or the
peak is above the cap.

    python -m checks.check_vllm_fleet --model models/smollm2-135m-instruct --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from checks.check_vllm_capture import ANSWERS, head_difference
from mtp_train import processes
from mtp_train.capture import launch, serve
from mtp_train.capture.layers import layer_map

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="python of vLLM's venv")
    p.add_argument("--out", default="runs/check_vllm_fleet")
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--max-spool-bytes", type=int, default=20_000_000)
    p.add_argument("--micro-batch-tokens", type=int, default=512)
    p.add_argument("--kill-after", type=int, default=3, help="steps of the fleet run before the server is killed")
    p.add_argument("--train-tolerance", type=float, default=1e-3, help="largest head ‖Δ‖/‖W‖ accepted")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds vllm serve may take to start")
    return p.parse_args(argv)


def write_conversations(path: Path, n: int) -> None:
    """n conversations: the demo prompts in turn, each answered with a fixed text (ids made unique)."""
    prompts = [json.loads(line) for line in (ROOT / "data" / "demo_prompts.jsonl").read_text().splitlines()]
    rows = [{"id": f"fleet-{i:04d}", "messages": [{"role": "user", "content": prompts[i % len(prompts)]["prompt"]},
                                                  {"role": "assistant", "content": ANSWERS[i % 2] * (1 + i % 3)}]}
            for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train_overrides(a: argparse.Namespace, model: str, convs: Path, out: Path, steps: int) -> list[str]:
    return [f"model.path={model}", "model.dtype=float32", "head=mtp", f"data.paths=[{convs}]",
            "data.online.val_fraction=0.0", "data.online.hidden_dtype=float32", "data.online.max_seq_len=512",
            f"train.micro_batch_tokens={a.micro_batch_tokens}", f"train.max_steps={steps}", "train.eval_every=0",
            "train.eval_batches=0", "train.save_every=1", "train.log_every=10", "train.progress=false",
            "train.seed=0", "optim.warmup_steps=5", "spec_eval.prompts=[]", "wandb.mode=disabled", f"out={out}"]


def run(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)


def finished(proc: subprocess.Popen[bytes], name: str, log: Path) -> None:
    if proc.wait() != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
        sys.exit(f"check-vllm-fleet: {name} failed (exit {proc.returncode}):\n{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    vllm_python = Path(a.vllm_python).absolute()
    if not vllm_python.is_file():
        print(f"check-vllm-fleet: {vllm_python} not found: create vLLM's venv first (make check-vllm-fleet does)",
              file=sys.stderr)
        return 2
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    convs = out / "conversations.jsonl"
    write_conversations(convs, a.conversations)
    model = str(Path(a.model).absolute())
    num_layers = json.loads((Path(a.model) / "config.json").read_text())["num_hidden_layers"]
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1"}
    spool = out / "spool"
    # One epoch: the batches of the plan (asked of the trainer itself: a run of 1 step logs nothing of it, so
    # count from the conversations with the sampler the source uses).
    from mtp_train.config import PrecomputeConfig
    from mtp_train.config.data import DataConfig
    from mtp_train.config.model import ModelConfig
    from mtp_train.data.chat import load_tokenizer
    from mtp_train.data.sampler import LengthBucketedBatchSampler
    from mtp_train.data.samples import load_rows

    pc = PrecomputeConfig(model=ModelConfig(path=model, dtype="float32", fetch=None),
                          data=DataConfig(paths=[str(convs)]), max_seq_len=512, val_fraction=0.0,
                          hidden_dtype="float32")
    tok = load_tokenizer(model)
    rows, _ = load_rows(tok, pc, len(tok))
    steps = len(LengthBucketedBatchSampler([int(r.ids.size) for r in rows], a.micro_batch_tokens, seed=0))
    print(f"check-vllm-fleet: {len(rows)} conversations, {sum(int(r.ids.size) for r in rows)} tokens, {steps} steps "
          f"of {a.micro_batch_tokens} tokens; spool cap {a.max_spool_bytes} bytes", flush=True)
    result: dict[str, Any] = {"conversations": len(rows), "steps": steps, "max_spool_bytes": a.max_spool_bytes}
    with tempfile.TemporaryDirectory(prefix="mtp-serve-") as tmp:
        senv = launch.child_env(os.environ, launch.stage_modules(Path(tmp)), 2)
        port = processes.free_port()
        url = f"http://127.0.0.1:{port}"
        argv_ = serve.serve_argv(vllm_python, model, layer_map([], num_layers).vllm_ids, spool, dtype="float32",
                                 max_model_len=1024, port=port, extra=["--max-num-seqs=8"])
        # in its own process group (killed with its engine processes), output appended to one log across restarts
        server = processes.start(argv_, senv, out / "vllm-serve.log", append=True)
        try:
            processes.wait_ready(url, server, a.ready_timeout, every=1.0, name="vllm serve")
            print(f"check-vllm-fleet: fleet: vllm serve with our connector at {url}", flush=True)
            fleet_out = out / "train-fleet"
            cmd = [sys.executable, "-m", "mtp_train.cli.train",
                   *train_overrides(a, model, convs, fleet_out, steps), "data.source=fleet",
                   f"data.fleet.endpoints=[{url}]", f"data.fleet.spool_dir={spool}",
                   f"data.fleet.max_spool_bytes={a.max_spool_bytes}", f"data.fleet.dead_after={a.ready_timeout}",
                   "data.fleet.window=16", "data.fleet.concurrency=4", "data.fleet.backoff=2"]
            trainer = run(cmd, out / "train-fleet.log", env)
            latest = fleet_out / "checkpoints" / "latest"
            deadline = time.monotonic() + a.ready_timeout
            while trainer.poll() is None and time.monotonic() < deadline:
                if latest.is_file() and int(latest.read_text().strip().split("-")[1]) >= a.kill_after:
                    break
                time.sleep(0.5)
            killed_at = latest.read_text().strip() if latest.is_file() else None
            print(f"check-vllm-fleet: fleet: killing the server (SIGKILL) at checkpoint {killed_at}", flush=True)
            processes.kill(server)
            server = processes.start(argv_, senv, out / "vllm-serve.log", append=True)
            processes.wait_ready(url, server, a.ready_timeout, every=1.0, name="vllm serve")
            print("check-vllm-fleet: fleet: the server is back", flush=True)
            finished(trainer, "train-fleet", out / "train-fleet.log")
            result["server_killed_at"] = killed_at
        finally:
            if server.poll() is None:
                processes.kill(server)
        text = (out / "train-fleet.log").read_text(errors="replace")
        peaks = re.findall(r"the spool's peak (\d+) of (\d+) bytes", text)
        peak = int(peaks[-1][0]) if peaks else -1
        retried = "failed" in text or "dead" in text
        print(f"check-vllm-fleet: fleet: spool peak {peak} bytes of cap {a.max_spool_bytes}", flush=True)
        result.update(peak_spool_bytes=peak, retries_seen=retried)

        # The file path: a precompute through a fresh server, then offline training on it.
        port = processes.free_port()
        url = f"http://127.0.0.1:{port}"
        argv_ = serve.serve_argv(vllm_python, model, layer_map([], num_layers).vllm_ids, out / "pc-spool",
                                 dtype="float32", max_model_len=1024, port=port, extra=["--max-num-seqs=8"])
        with processes.serving(argv_, senv, out / "vllm-serve-pc.log", url, a.ready_timeout):
            proc = run([sys.executable, "-m", "mtp_train.cli.precompute", f"model.path={model}", "model.dtype=float32",
                        "hidden_dtype=float32", f"data.paths=[{convs}]", "max_seq_len=512", "val_fraction=0.0",
                        f"out={out / 'precompute'}", "progress=false", "backend=vllm", f"vllm.endpoints=[{url}]",
                        f"vllm.spool_dir={out / 'pc-spool'}", "vllm.concurrency=4"], out / "precompute.log", env)
            finished(proc, "precompute", out / "precompute.log")
    proc = run([sys.executable, "-m", "mtp_train.cli.train",
                *train_overrides(a, model, convs, out / "train-offline", steps), "data.source=offline",
                f"data.dir={out / 'precompute'}"], out / "train-offline.log", env)
    finished(proc, "train-offline", out / "train-offline.log")
    diff = head_difference(out / "train-fleet" / "heads" / f"step-{steps}",
                           out / "train-offline" / "heads" / f"step-{steps}")
    within = diff <= a.train_tolerance
    ok = within and 0 <= peak <= a.max_spool_bytes
    print(f"check-vllm-fleet: heads after {steps} steps, fleet (server killed and restarted) vs offline on a "
          f"backend=vllm precompute: largest ‖Δ‖/‖W‖ {diff:.2e} ({'ok' if within else 'BEYOND'} tolerance "
          f"{a.train_tolerance:g})", flush=True)
    result.update(ok=ok, head_difference=diff, tolerance=a.train_tolerance)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
