"""`mtp-eval backend=vllm` for the head types vLLM serves: the export format and the engine's keyword arguments the
driver builds (`eval/vllm.py`) for eagle3 and for P-EAGLE (its layout's `parallel_drafting`, all k drafts in one
forward), without vLLM; and an untrained peagle head measured inside a real vLLM (slow; skipped without vLLM's
venv, `make vllm-venv` or VLLM_PYTHON)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mtp_train.config import HEAD_TYPES, EvalConfig, HeadConfig
from mtp_train.config.model import ModelConfig
from mtp_train.eval.vllm import VllmEvalError, check_settings, settings, vllm_serving
from mtp_train.export import export_head
from mtp_train.head_types.peagle import HEAD_TYPE
from mtp_train.heads import build_head, save_head
from tests.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

if "peagle" not in HEAD_TYPES:  # a checkout whose installed entry points predate the type (pip install -e . adds it)
    HEAD_TYPES.add(HEAD_TYPE)

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")).absolute()


def _eval_config(target: Path, head_dir: Path, out: Path, **kw) -> EvalConfig:
    return EvalConfig(model=ModelConfig(path=str(target), dtype="float32", fetch=None), head_ckpt=str(head_dir),
                      backend="vllm", k=3, max_new_tokens=8, out=str(out), **kw)


@pytest.mark.parametrize(("kind", "fmt", "serves"), [
    ("eagle3", "speculators", {"method": "eagle3"}),
    ("peagle", "speculators-peagle", {"method": "eagle3", "parallel_drafting": True}),
])
def test_the_engine_loads_the_heads_export_as_its_layout_says(tmp_path, kind, fmt, serves):
    """The head is exported in its type's layout vLLM serves, and vLLM's engine gets that layout's settings with the
    export and k: for peagle, eagle3 with parallel_drafting (speculators' P-EAGLE config, mask_hidden beside)."""
    target = tmp_path / "target"
    make_tiny_checkpoint("llama", target, num_hidden_layers=5)  # vLLM captures hidden_states[1..L-1]
    head = build_head(HeadConfig.of(type=kind, aux_layers=[1, 2, 4], draft_vocab_size=64), target, dtype="float32")
    head_dir = save_head(head, tmp_path / "head")
    assert vllm_serving(head_dir) == (fmt, serves)
    ec = _eval_config(target, head_dir, tmp_path / "ev")
    point = check_settings(ec)
    assert point.k == 3 and point.method == "head"
    export_dir = tmp_path / "ev" / "export"
    export_head(head_dir, target, fmt, export_dir)
    cfg = settings(ec, point, export_dir, torch.float32, [2], serves)
    engine = cfg["engine"]
    assert engine["speculative_config"] == {**serves, "model": str(export_dir.resolve()), "num_speculative_tokens": 3}
    assert engine["model"] == str(target.resolve()) and engine["dtype"] == "float32"
    assert cfg["stop_token_ids"] == [2] and cfg["max_tokens"] == 8 and cfg["temperature"] == 0.0
    written = json.loads((export_dir / "config.json").read_text())
    assert written["speculators_model_type"] == kind
    if kind == "peagle":  # what vLLM's reader turns into parallel drafting with the slots' placeholder token
        assert written["mask_token_id"] == head.args.vocab_size - 1
        with pytest.raises(VllmEvalError, match=r"draft_threshold=0.5 is an option of our engine's drafter"):
            check_settings(_eval_config(target, head_dir, tmp_path / "ev2", draft_threshold=0.5))


def test_a_head_type_vllm_serves_no_layout_of_is_refused_by_name(tmp_path):
    target = tmp_path / "target"
    make_tiny_checkpoint("llama", target)
    head_dir = save_head(build_head(HeadConfig(type="mtp"), target, dtype="float32"), tmp_path / "head")
    with pytest.raises(VllmEvalError, match=r"vLLM serves no layout of mtp heads .* it serves .*peagle"):
        vllm_serving(head_dir)


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv, or VLLM_PYTHON)")
def test_a_peagle_head_is_measured_inside_vllm(default_model_dir, tmp_path, monkeypatch):
    """`mtp-eval backend=vllm` on an untrained peagle head for SmolLM2: vLLM loads the speculators-peagle export with
    parallel drafting and drafts all k tokens of every step (its counters read back into the report's rows)."""
    from mtp_train.data.prompts import load_prompt_sets
    from mtp_train.eval.vllm import evaluate_vllm

    torch.manual_seed(0)
    head = build_head(HeadConfig.of(type="peagle", draft_vocab_size=1024), default_model_dir, dtype="float32")
    head_dir = save_head(head, tmp_path / "head")
    ec = _eval_config(default_model_dir, head_dir, tmp_path / "ev", vllm_python=str(VLLM_PYTHON))
    monkeypatch.chdir(ROOT)  # prompt-set paths are relative to the checkout
    rows, outputs = evaluate_vllm(ec, load_prompt_sets(["demo-heldout"], 1), environ=dict(os.environ))
    overall = rows[-1]
    assert overall["dataset"] == "overall" and overall["backend"] == "vllm" and overall["num_drafts"] > 0
    assert overall["mean_draft_len"] == 3 and len(overall["per_position"]) == 3 and 1.0 <= overall["tau"] <= 4.0
    assert overall["generated_tokens"] == sum(len(t["output_ids"]) for r in outputs for t in r["turns"])
    assert json.loads((tmp_path / "ev" / "export" / "config.json").read_text())["speculators_model_type"] == "peagle"
