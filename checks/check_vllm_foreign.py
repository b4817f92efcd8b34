"""`make check-vllm-foreign`: an EAGLE-3 head for a target family our engine does not implement, end to end.

The family is IBM Granite (`GraniteForCausalLM`, model_type granite): vLLM serves it with EAGLE-3 support
(`SupportsEagle3`, aux hidden states from `GraniteModel`), and no family module here runs it. Granite differs from
a Llama by its multipliers (embedding, residual, attention, logits), so running it as a Llama would be wrong: our
engine refuses it, and the head never needs it.

1. a tiny random Granite built with transformers' random init (8 layers, H = 128, D = 64) and SmolLM2's tokenizer
   and chat template (`--tokenizer`, default models/smollm2-135m-instruct), under `<out>/target`;
2. `--conversations` demo prompts, each with a fixed answer (checks/check_vllm_capture.py's);
3. `mtp-precompute backend=vllm` (vLLM's CPU build, our KV connector) storing aux layers [2, 4, 5];
4. `mtp-train head=eagle3` on that folder for `--steps` steps (only the target's embedding and lm_head are read);
5. `mtp-eval backend=vllm`: the head exported as format=speculators and run by vLLM's eagle3 drafter on the first
   `--limit` held-out demo prompts, greedy, k = 3.

The check passes when every stage ran, the captured `hidden` and aux layers equal transformers' own forward of the
target within a row-relative error of 1e-3 (fp32 both; the family is one our engine cannot run, so transformers is
the reference), and the eval's report has a row with vLLM's drafts counted (τ ≥ 1). The lines printed are each
stage's command, the capture's errors and the report's row; the last line is one JSON object.

The answers are fixed texts, not the target's own: a random target's greedy continuation is unrelated to them
(most of its tokens are outside the head's draft vocabulary), so τ stays near 1 here; the check proves the route,
not a head's quality (a real run regenerates the answers through the target's servers first, serving.md). Stages whose
outputs exist are not redone (the precompute and the training resume; the eval runs again).

    python -m checks.check_vllm_foreign --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FAMILY = "granite"  # the model_type of the target built here (one vLLM serves with EAGLE-3 and we do not)
AUX_LAYERS = (2, 4, 5)  # of 8 layers: EAGLE-3's low / mid / high, each a layer another follows (vLLM reads those)
TOLERANCE = 1e-3  # the capture against transformers, fp32 both (check_vllm_capture.py says why this scale)


def make_foreign_target(out: Path, tokenizer_dir: Path, *, num_layers: int = 8, hidden_size: int = 128,
                        head_dim: int = 64, tie: bool = False, seed: int = 0) -> Path:
    """A random Granite (transformers' random init, float32) with the tokenizer and chat template of
    `tokenizer_dir`, saved with them to `out`; returns `out`.

    Args:
        out: the folder to write.
        tokenizer_dir: a Hugging Face folder whose tokenizer (and template) the target takes.
        num_layers: decoder layers.
        hidden_size: H (H / head_dim query heads, half as many key/value heads, MLP 2H).
        head_dim: D; vLLM's CPU attention takes 32, 64, 80, ... (not 16).
        tie: tie the lm_head to the embedding (checkpoints then hold no lm_head.weight).
        seed: torch's seed for the random weights.
    """
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    cfg = transformers.GraniteConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim, num_key_value_heads=max(1, hidden_size // head_dim // 2),
        head_dim=head_dim, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=None,
        # Granite's own scalings (not a Llama's): the embedding and each residual branch scaled, attention scaled
        # by a constant instead of 1/sqrt(d); the logits left unscaled so that lm_head(h) is the target's.
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=1.0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def capture_errors(target: Path, folder: Path) -> dict[str, float]:
    """The captured folder against transformers' own forward of the target over the same token ids: for `hidden`
    and each aux layer, the largest relative error of a token's row, max over tokens of ‖vllm − hf‖₂ / ‖hf‖₂
    (transformers' `hidden_states[j]`: what the shards' numbering means; its last entry is after the final norm)."""
    import torch
    import transformers
    from safetensors import safe_open

    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    manifest = json.loads((folder / "manifest.json").read_text())
    aux, h = manifest["hidden"]["aux_layers"], manifest["target"]["hidden_size"]
    errors = {"hidden": 0.0, **{f"aux {j}": 0.0 for j in aux}}

    def rel(a: torch.Tensor, ref: torch.Tensor) -> float:  # (T, H) each
        return float(((a - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())

    for shard in manifest["shards"]:
        with safe_open(str(folder / shard["file"]), "pt") as f:
            ids, offsets = f.get_tensor("input_ids"), f.get_tensor("offsets").tolist()
            hidden, stacked = f.get_tensor("hidden").float(), f.get_tensor("aux_hidden").float()  # (T, H), (T, k·H)
        for a, b in zip(offsets[:-1], offsets[1:]):
            with torch.no_grad():
                states = model(ids[a:b][None], output_hidden_states=True).hidden_states  # L + 1 of (1, n, H)
            errors["hidden"] = max(errors["hidden"], rel(hidden[a:b], states[-1][0]))
            for i, j in enumerate(aux):
                errors[f"aux {j}"] = max(errors[f"aux {j}"], rel(stacked[a:b, i * h:(i + 1) * h], states[j][0]))
    return errors


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="models/smollm2-135m-instruct", help="whose tokenizer the target takes")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="python of vLLM's venv")
    p.add_argument("--out", default="runs/check_vllm_foreign")
    p.add_argument("--conversations", type=int, default=24, help="demo prompts captured for training")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--limit", type=int, default=4, help="held-out prompts measured in vLLM")
    p.add_argument("--max-new-tokens", type=int, default=32)
    return p.parse_args(argv)


def command(name: str, module: str, overrides: list[str], log: Path) -> None:
    """`mtp-<module> overrides...`, its output in `log`; exits the check on failure with the log's tail."""
    print(f"check-vllm-foreign: {name}: mtp-{module} {' '.join(overrides)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", f"mtp_train.cli.{module}", *overrides], cwd=ROOT, stdout=f,
                             stderr=subprocess.STDOUT)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-6:])
        sys.exit(f"check-vllm-foreign: {name} failed (exit {rc}):\n{tail}")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The eval's overall row as the check reports it; `ok` when vLLM counted drafts."""
    r = report["rows"][-1]
    keep = ("tau", "acceptance_rate", "per_position", "num_drafts", "num_accepted", "mean_draft_len", "prompts",
            "generated_tokens", "vllm_version")
    found = {k: r.get(k) for k in keep}
    found["ok"] = bool(r.get("num_drafts")) and float(r.get("tau", 0.0)) >= 1.0
    return found


def main(argv: Sequence[str] | None = None) -> int:
    from checks.check_vllm_capture import write_conversations

    a = parse_args(argv)
    vllm_python = Path(a.vllm_python).absolute()  # not resolved: a venv's python is a link
    if not vllm_python.is_file():
        print(f"check-vllm-foreign: {vllm_python} not found: create vLLM's venv first (make check-vllm-foreign "
              "does)", file=sys.stderr)
        return 2
    out = Path(a.out).absolute()
    target = out / "target"
    if not (target / "model.safetensors").is_file():
        make_foreign_target(target, ROOT / a.tokenizer)
    print(f"check-vllm-foreign: target {target}: a random {FAMILY} (no family here runs it)", flush=True)
    convs = out / "conversations.jsonl"
    write_conversations(convs, a.conversations)
    aux = f"[{','.join(map(str, AUX_LAYERS))}]"
    model = [f"model.path={target}", "model.fetch=null", "model.dtype=float32"]
    command("capture", "precompute", [*model, f"data.paths=[{convs}]", f"aux_layers={aux}", "hidden_dtype=float32",
                                      "val_fraction=0.1", f"out={out / 'precompute'}", "backend=vllm",
                                      f"vllm_python={vllm_python}", "progress=false"], out / "precompute.log")
    errors = capture_errors(target, out / "precompute")
    print("check-vllm-foreign: capture against transformers' forward: " +
          ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f" (max row relative error; tolerance {TOLERANCE:g})",
          flush=True)
    command("train", "train", [*model, "head=eagle3", f"data.dir={out / 'precompute'}", f"head.aux_layers={aux}",
                               "head.draft_vocab_size=4096", "loss.steps=3", "optim.lr=1.0e-3", "optim.warmup_steps=3",
                               "train.micro_batch_tokens=2048", f"train.max_steps={a.steps}", "train.eval_every=0",
                               "train.eval_batches=2", f"train.save_every={a.steps}", "train.log_every=10",
                               "train.progress=false", "spec_eval.prompts=[]", "wandb.mode=disabled",
                               f"out={out / 'train'}"], out / "train.log")
    command("eval", "eval", [*model, "backend=vllm", f"vllm_python={vllm_python}",
                             f"head_ckpt={out / 'train' / 'heads' / f'step-{a.steps}'}", "prompts=[demo-heldout]",
                             f"limit={a.limit}", "k=3", "temperature=0.0", f"max_new_tokens={a.max_new_tokens}",
                             f"out={out / 'eval'}", "progress=false"], out / "eval.log")
    found = summary(json.loads((out / "eval" / "report.json").read_text()))
    per = " / ".join(f"{x:.3f}" for x in found["per_position"] or [])
    print(f"check-vllm-foreign: vLLM {found['vllm_version']} ran the {FAMILY} target's eagle3 head on "
          f"{found['prompts']} prompts ({found['generated_tokens']} tokens): τ {found['tau']:.3f}, acceptance "
          f"{found['acceptance_rate']:.3f}, per position {per}, {found['num_accepted']} tokens accepted over "
          f"{found['num_drafts']} drafts → {'ok' if found['ok'] else 'FAILED'}", flush=True)
    found["ok"] = found["ok"] and max(errors.values()) <= TOLERANCE
    print(json.dumps({"family": FAMILY, **found, "capture_errors": errors}))
    return 0 if found["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
