"""`make check-vllm-capture`: stage one captured inside vLLM compared with our own precompute of the same data.

1. a few conversations (the first demo prompts, each with a fixed assistant answer; one of them two turns long);
2. `mtp-precompute` with our engine, and `mtp-precompute backend=vllm` (vLLM's CPU build in its own venv, our
   connector) twice: once launching vLLM itself, once through a running `vllm serve` started with our connector
   (`vllm.endpoints`, the fleet's way), all in float32 (model.dtype and hidden_dtype), over the same conversations
   and `aux_layers`;
3. each vLLM folder compared with ours shard by shard: the same shard files, sample ids, input ids, offsets and
   loss masks (exactly), and for `hidden` and every aux layer the largest relative error of a token's row, max over
   tokens of ‖vllm − ours‖₂ / ‖ours‖₂;
4. `mtp-train head=eagle3` (one thread, the same seed) on our folder and on the served capture's: the same head,
   within `--train-tolerance` (the largest ‖Δ‖ / ‖W‖ over the head's tensors).

The tolerance (1e-3 by default) sits between two scales. Both sides compute in float32, so they differ only by the
order of summation in their kernels (vLLM's CPU GEMMs and attention against torch's): about 1e-7 per operation,
growing through 30 layers to about 1e-5 in relative terms. A wrong layer, a missing final norm or a token shifted by
one gives errors of order 1. And bfloat16, the storage a real run uses, rounds each value by up to 2^-9 ≈ 2e-3: a
disagreement below 1e-3 cannot be seen in a stored shard. The trained heads inherit those 1e-5 differences
through the optimizer's steps (measured: 3.2e-7 after 40 steps), where a head reading one other layer (aux 30 for
27) differs by 8.7e-2 after the same steps: the same 1e-3 separates them. The last line
printed is one JSON object; the exit code is 1 when a layer or the head is beyond its tolerance or anything but
the hidden states differs.

    python -m checks.check_vllm_capture --model models/smollm2-135m-instruct --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mtp_train import processes
from mtp_train.capture import launch, serve
from mtp_train.capture.layers import layer_map

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ["Sure. Here is a short answer, written plainly and without fuss.",
           "Of course: the idea in one sentence, then an example you can try yourself."]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="python of vLLM's venv")
    p.add_argument("--out", default="runs/check_vllm_capture")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--aux-layers", default="0,2,15,27,30", help="HF hidden_states[j] indices to store")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest row relative error accepted")
    p.add_argument("--train-steps", type=int, default=40, help="steps of the training-equivalence run (0: none)")
    p.add_argument("--train-tolerance", type=float, default=1e-3, help="largest head ‖Δ‖/‖W‖ accepted")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds vllm serve may take to start")
    return p.parse_args(argv)


def write_conversations(path: Path, n: int) -> None:
    """n conversations from the demo prompts, each answered with a fixed text; the last one two turns long."""
    prompts = [json.loads(line) for line in (ROOT / "data" / "demo_prompts.jsonl").read_text().splitlines()[:n + 1]]
    rows = []
    for i, p in enumerate(prompts[:n]):
        messages = [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": ANSWERS[i % 2]}]
        if i == n - 1:
            messages += [{"role": "user", "content": prompts[n]["prompt"]},
                         {"role": "assistant", "content": ANSWERS[(i + 1) % 2]}]
        rows.append({"id": p["id"], "messages": messages})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def command(name: str, overrides: list[str], log: Path, module: str = "precompute") -> None:
    """`mtp-<module> overrides...` (one thread), its output in `log`; exits the check on failure with the log's
    tail."""
    print(f"check-vllm-capture: {name}: mtp-{module} {' '.join(overrides)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", f"mtp_train.cli.{module}", *overrides], cwd=ROOT, stdout=f,
                             stderr=subprocess.STDOUT, env=dict(os.environ) | {"OMP_NUM_THREADS": "1"})
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-6:])
        sys.exit(f"check-vllm-capture: {name} failed (exit {rc}):\n{tail}")


def served_capture(a: argparse.Namespace, common: list[str], out: Path, aux: list[int], num_layers: int) -> None:
    """`mtp-precompute backend=vllm vllm.endpoints=[...]` through a `vllm serve` this check starts with our
    connector (`capture.serve.serve_argv`, the command `vllm.serve_command=true` prints) and stops afterwards."""
    spool = out / "served-capture"
    port = processes.free_port()
    with tempfile.TemporaryDirectory(prefix="mtp-serve-") as tmp:
        env = launch.child_env(os.environ, launch.stage_modules(Path(tmp)), 2)
        argv = serve.serve_argv(Path(a.vllm_python).absolute(), Path(a.model).absolute(),
                                layer_map(aux, num_layers).vllm_ids, spool, dtype="float32", max_model_len=2048,
                                port=port, extra=["--max-num-seqs=4"])
        url = f"http://127.0.0.1:{port}"
        print(f"check-vllm-capture: served: starting vllm serve with our connector at {url}", flush=True)
        with processes.serving(argv, env, out / "vllm-serve.log", url, a.ready_timeout):
            command("served", [*common, f"out={out / 'served'}", "backend=vllm", f"vllm.endpoints=[{url}]",
                            f"vllm.spool_dir={spool}", "vllm.concurrency=2"], out / "served.log")


def head_difference(a: Path, b: Path) -> float:
    """The largest ‖a − b‖₂ / ‖b‖₂ over the tensors of two head checkpoints (their model.safetensors)."""
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    if ta.keys() != tb.keys():
        return float("inf")
    return max(float((ta[k].float() - tb[k].float()).norm() / tb[k].float().norm().clamp_min(1e-30)) for k in tb)


def train_on(name: str, folder: Path, out: Path, a: argparse.Namespace, model: str, head_aux: list[int]) -> Path:
    """`mtp-train head=eagle3` for `--train-steps` steps on `folder` (one thread, seed 0); returns the head."""
    command(f"train-{name}", [f"model.path={model}", "model.dtype=float32", "head=eagle3", f"data.dir={folder}",
                              f"head.aux_layers=[{','.join(map(str, head_aux))}]", "head.draft_vocab_size=1024",
                              "loss.steps=2", "optim.warmup_steps=5", "train.micro_batch_tokens=1024",
                              f"train.max_steps={a.train_steps}", "train.eval_every=0", "train.eval_batches=2",
                              f"train.save_every={a.train_steps}", "train.log_every=10", "train.progress=false",
                              "train.seed=0", "spec_eval.prompts=[]", "wandb.mode=disabled",
                              f"out={out / f'train-{name}'}"], out / f"train-{name}.log", module="train")
    return out / f"train-{name}" / "heads" / f"step-{a.train_steps}"


def row_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative error of a row: max over rows of ‖a − ref‖₂ / ‖ref‖₂ (a, ref: (T, H), float32)."""
    return float(((a - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())


def compare(ours: Path, vllm: Path, aux_layers: list[int]) -> dict[str, Any]:
    """Compare two precompute folders of the same plan (module docstring); returns the findings."""
    m_ours, m_vllm = (json.loads((d / "manifest.json").read_text()) for d in (ours, vllm))
    files = [s["file"] for s in m_ours["shards"]]
    same: dict[str, bool] = {"shards": files == [s["file"] for s in m_vllm["shards"]]}
    errors: dict[str, float] = {"hidden": 0.0, **{f"aux {j}": 0.0 for j in aux_layers}}
    same.update(sample_ids=True, input_ids=True, offsets=True, loss_mask=True)
    if not same["shards"]:
        return {"same": same, "errors": errors}
    h = m_ours["target"]["hidden_size"]
    for name in files:
        with safe_open(str(ours / name), "pt") as a, safe_open(str(vllm / name), "pt") as b:
            same["sample_ids"] &= a.metadata()["sample_ids"] == b.metadata()["sample_ids"]
            for key in ("input_ids", "offsets", "loss_mask"):
                same[key] &= torch.equal(a.get_tensor(key), b.get_tensor(key))
            errors["hidden"] = max(errors["hidden"], row_error(b.get_tensor("hidden").float(),
                                                               a.get_tensor("hidden").float()))
            if aux_layers:
                xa, xb = a.get_tensor("aux_hidden").float(), b.get_tensor("aux_hidden").float()  # (T, k*H)
                for i, j in enumerate(aux_layers):
                    cols = slice(i * h, (i + 1) * h)
                    errors[f"aux {j}"] = max(errors[f"aux {j}"], row_error(xb[:, cols], xa[:, cols]))
    same["totals"] = m_ours["totals"]["tokens"] == m_vllm["totals"]["tokens"] and \
        m_ours["totals"]["loss_tokens"] == m_vllm["totals"]["loss_tokens"]
    return {"same": same, "errors": errors, "samples": m_ours["totals"]["samples"],
            "tokens": m_ours["totals"]["tokens"], "loss_tokens": m_ours["totals"]["loss_tokens"]}


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    vllm_python = Path(a.vllm_python).absolute()  # not resolved: a venv's python is a link
    if not vllm_python.is_file():
        print(f"check-vllm-capture: {vllm_python} not found: create vLLM's venv first (make check-vllm-capture "
              "does)", file=sys.stderr)
        return 2
    out = Path(a.out).absolute()
    convs = out / "conversations.jsonl"
    write_conversations(convs, a.conversations)
    aux = [int(j) for j in a.aux_layers.split(",") if j.strip()]
    common = [f"model.path={Path(a.model).absolute()}", "model.dtype=float32", "hidden_dtype=float32",
              f"data.paths=[{convs}]", f"aux_layers=[{','.join(map(str, aux))}]", "progress=false"]
    command("ours", [*common, f"out={out / 'engine'}"], out / "engine.log")
    command("vllm", [*common, f"out={out / 'vllm'}", "backend=vllm", f"vllm_python={vllm_python}"],
            out / "vllm.log")
    num_layers = json.loads((Path(a.model) / "config.json").read_text())["num_hidden_layers"]
    try:
        served_capture(a, common, out, aux, num_layers)
    except (RuntimeError, TimeoutError) as exc:
        print(f"check-vllm-capture: {exc}", file=sys.stderr)
        return 2
    found = {name: compare(out / "engine", out / name, aux) for name in ("vllm", "served")}
    ok = True
    for name, f in found.items():
        print(f"check-vllm-capture: {name}: {f.get('samples')} conversations, {f.get('tokens')} tokens "
              f"({f.get('loss_tokens')} assistant); identical: " +
              ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in f["same"].items()))
        for layer, err in f["errors"].items():
            print(f"check-vllm-capture: {name}: {layer:>8}: max row relative error {err:.2e} "
                  f"({'ok' if err <= a.tolerance else 'BEYOND'} tolerance {a.tolerance:g})")
        ok &= all(f["same"].values()) and all(e <= a.tolerance for e in f["errors"].values())
    result: dict[str, Any] = {"ok": ok, "tolerance": a.tolerance, **found}
    if a.train_steps > 0:
        head_aux = [j for j in aux if 0 < j < num_layers][:3]  # eagle3's three features, among the stored layers
        heads = [train_on(name, out / name, out, a, common[0].split("=", 1)[1], head_aux)
                 for name in ("engine", "served")]
        diff = head_difference(heads[1], heads[0])
        within = diff <= a.train_tolerance
        print(f"check-vllm-capture: train: eagle3 heads after {a.train_steps} steps on our folder and on the served "
              f"capture: largest ‖Δ‖/‖W‖ {diff:.2e} ({'ok' if within else 'BEYOND'} tolerance "
              f"{a.train_tolerance:g})")
        ok &= within
        result.update(ok=ok, train={"steps": a.train_steps, "head_difference": diff,
                                    "tolerance": a.train_tolerance})
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
