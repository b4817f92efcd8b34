"""A target family our engine does not implement, through a real vLLM (its CPU build, in its own venv): a random
IBM Granite (`GraniteForCausalLM`; vLLM serves it with EAGLE-3 support, no family here runs it) with SmolLM2's
tokenizer answers the conversations itself (`mtp-regenerate generator=openai` through a `vllm serve` of it), has its
hidden states over those answers captured by `mtp-precompute backend=vllm`, an eagle3 head trains on them reading
only the target's embedding and lm_head, and `mtp-eval backend=vllm` measures it in vLLM. The route only, with few
steps: whether vLLM accepts a trained head's drafts, and not a head reading other layers, is
`make check-vllm-foreign`'s. Skipped when there is no vLLM venv (`make vllm-venv`; or VLLM_PYTHON=<its python>)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from checks.check_vllm_capture import write_conversations
from checks.check_vllm_foreign import AUX_LAYERS, TOLERANCE, capture_errors, make_foreign_target, vllm_server
from mtp_train.cli.precompute import precompute_main
from mtp_train.cli.regenerate import regenerate_main
from mtp_train.cli.train import train_main
from mtp_train.config import EvalConfig
from mtp_train.config.model import ModelConfig
from mtp_train.data.prompts import load_prompt_sets
from mtp_train.eval.vllm import evaluate_vllm
from tests.conftest import compose_config

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")).absolute()
STEPS = 4
NEW_TOKENS = 16


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv, or VLLM_PYTHON)")
def test_an_eagle3_head_for_a_granite_target_trains_on_vllm_states_and_runs_in_vllm(default_model_dir, tmp_path,
                                                                                   monkeypatch):
    target = make_foreign_target(tmp_path / "granite", default_model_dir)
    convs, regen = tmp_path / "convs.jsonl", tmp_path / "regen.jsonl"
    write_conversations(convs, 6)
    aux = f"[{','.join(map(str, AUX_LAYERS))}]"
    model = [f"model.path={target}", "model.fetch=null", "model.dtype=float32"]
    with vllm_server(VLLM_PYTHON, target, tmp_path / "serve.log") as url:
        stats = regenerate_main(compose_config("regenerate", [
            *model, f"data.paths=[{convs}]", "generator=openai", f"endpoints=[{url}]", "concurrency=2", "retries=1",
            "temperature=0.0", f"max_new_tokens={NEW_TOKENS}", f"out={regen}", "progress=false"]))
    records = [json.loads(line) for line in regen.read_text().splitlines()]
    assert len(records) == 6 and stats["out"] == str(regen)
    assert all(n == NEW_TOKENS or r == "stop" for rec in records for n, r in zip(rec["gen_tokens"],
                                                                                rec["finish_reasons"]))
    precompute_main(compose_config("precompute", [
        *model, f"data.paths=[{regen}]", f"aux_layers={aux}", "hidden_dtype=float32", "val_fraction=0.2",
        f"out={tmp_path / 'pc'}", "backend=vllm", f"vllm_python={VLLM_PYTHON}", "progress=false"]))
    manifest = json.loads((tmp_path / "pc" / "manifest.json").read_text())
    assert manifest["target"]["model_type"] == "granite" and manifest["hidden"]["aux_layers"] == list(AUX_LAYERS)
    assert max(capture_errors(target, tmp_path / "pc").values()) <= TOLERANCE  # transformers' forward: the reference
    result = train_main(compose_config("train", [
        *model, "head=eagle3", f"data.dir={tmp_path / 'pc'}", f"head.aux_layers={aux}", "head.draft_vocab_size=1024",
        f"train.max_steps={STEPS}", "train.micro_batch_tokens=1024", "train.eval_every=0", "train.eval_batches=1",
        "train.save_every=0", "train.progress=false", "spec_eval.prompts=[]", "wandb.mode=disabled",
        f"out={tmp_path / 'train'}"]))
    assert result["step"] == STEPS
    ec = EvalConfig(model=ModelConfig(path=str(target), dtype="float32", fetch=None), head_ckpt=result["head_dir"],
                    backend="vllm", vllm_python=str(VLLM_PYTHON), k=3, max_new_tokens=NEW_TOKENS,
                    out=str(tmp_path / "ev"))
    monkeypatch.chdir(ROOT)  # prompt-set paths are relative to the checkout
    rows, outputs = evaluate_vllm(ec, load_prompt_sets(["demo-heldout"], 2), environ=dict(os.environ))
    overall = rows[-1]
    assert overall["dataset"] == "overall" and overall["backend"] == "vllm" and overall["num_drafts"] > 0
    assert 1.0 <= overall["tau"] <= 4.0 and len(overall["per_position"]) == 3
    assert overall["generated_tokens"] == sum(len(t["output_ids"]) for r in outputs for t in r["turns"])
    assert json.loads((tmp_path / "ev" / "export" / "config.json").read_text())["speculators_model_type"] == "eagle3"
