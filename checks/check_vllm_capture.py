"""`make check-vllm-capture`: stage one captured inside vLLM compared with our own precompute of the same data.

1. a few conversations (the first demo prompts, each with a fixed assistant answer; one of them two turns long);
2. `mtp-precompute` with our engine, and `mtp-precompute backend=vllm` (vLLM's CPU build in its own venv, our
   connector), both in float32 (model.dtype and hidden_dtype), over the same conversations and `aux_layers`;
3. compared shard by shard: the same shard files, sample ids, input ids, offsets and loss masks (exactly), and for
   `hidden` and every aux layer the largest relative error of a token's row, max over tokens of
   ‖vllm − ours‖₂ / ‖ours‖₂.

The tolerance (1e-3 by default) sits between two scales. Both sides compute in float32, so they differ only by the
order of summation in their kernels (vLLM's CPU GEMMs and attention against torch's): about 1e-7 per operation,
growing through 30 layers to about 1e-5 in relative terms. A wrong layer, a missing final norm or a token shifted by
one gives errors of order 1. And bfloat16, the storage a real run uses, rounds each value by up to 2^-9 ≈ 2e-3: a
disagreement below 1e-3 cannot be seen in a stored shard. The last line printed is one JSON object; the exit code
is 1 when a layer is beyond the tolerance or anything but the hidden states differs.

    python -m checks.check_vllm_capture --model models/smollm2-135m-instruct --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

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


def precompute(name: str, overrides: list[str], log: Path) -> None:
    """`mtp-precompute overrides...`, its output in `log`; exits the check on failure with the log's tail."""
    print(f"check-vllm-capture: {name}: mtp-precompute {' '.join(overrides)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "mtp_train.cli.precompute", *overrides], cwd=ROOT, stdout=f,
                             stderr=subprocess.STDOUT)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-6:])
        sys.exit(f"check-vllm-capture: {name} failed (exit {rc}):\n{tail}")


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
    precompute("ours", [*common, f"out={out / 'engine'}"], out / "engine.log")
    precompute("vllm", [*common, f"out={out / 'vllm'}", "backend=vllm", f"vllm_python={vllm_python}"],
               out / "vllm.log")
    found = compare(out / "engine", out / "vllm", aux)
    print(f"check-vllm-capture: {found.get('samples')} conversations, {found.get('tokens')} tokens "
          f"({found.get('loss_tokens')} assistant); identical: " +
          ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in found["same"].items()))
    for layer, err in found["errors"].items():
        print(f"check-vllm-capture: {layer:>8}: max row relative error {err:.2e} "
              f"({'ok' if err <= a.tolerance else 'BEYOND'} tolerance {a.tolerance:g})")
    ok = all(found["same"].values()) and all(e <= a.tolerance for e in found["errors"].values())
    print(json.dumps({"ok": ok, "tolerance": a.tolerance, **found}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
