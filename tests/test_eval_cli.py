"""`mtp-eval` end to end on the real default model, and the training validation that runs speculative decoding:
precompute a few conversations → train a head briefly (spec/tau logged) → evaluate it against plain decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mtp_train.cli.eval import eval_main
from mtp_train.cli.precompute import precompute_main
from mtp_train.cli.train import train_main
from mtp_train.config import HeadConfig
from mtp_train.heads import build_head, save_head
from tests.conftest import compose_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "data" / "demo_heldout.jsonl"


_cfg = compose_config


@pytest.fixture(scope="module")
def trained(default_model_dir, tmp_path_factory):
    """A head trained for 3 steps on 12 demo conversations; returns (run folder, train result)."""
    root = tmp_path_factory.mktemp("spec")
    convs = root / "convs.jsonl"
    rows = [json.loads(line) for line in (ROOT / "data" / "demo_prompts.jsonl").read_text().splitlines()[:12]]
    convs.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": r.get("prompt") or r["turns"][0]},
        {"role": "assistant", "content": "Sure. Here is a short answer, written plainly and without fuss."}]}) + "\n"
        for i, r in enumerate(rows)))
    precompute_main(_cfg("precompute", [f"model.path={default_model_dir}", f"data.paths=[{convs}]",
                                        f"out={root / 'pc'}", "max_seq_len=128", "progress=false",
                                        "val_fraction=0.2"]))
    res = train_main(_cfg("train", [
        f"model.path={default_model_dir}", "model.device=cpu", f"data.dir={root / 'pc'}", f"out={root / 'run'}",
        "wandb.mode=disabled", "train.progress=false", "train.max_steps=3", "train.micro_batch_tokens=512",
        "train.eval_every=0", "train.eval_batches=1", "train.save_every=0", "head.draft_vocab_size=4096",
        f"spec_eval.prompts=[{HELDOUT}]", "spec_eval.limit=2", "spec_eval.max_new_tokens=8", "spec_eval.k=2"]))
    return root, res


def outputs_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]


def test_training_validation_logs_speculative_acceptance(trained):
    root, res = trained
    assert 1.0 <= res["spec/tau"] <= 3.0 and 0.0 <= res["spec/acceptance_rate"] <= 1.0
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("spec/tau" in r for r in rows)


def test_eval_writes_reports_and_greedy_speculation_equals_plain_decoding(trained, default_model_dir):
    root, _ = trained
    head = sorted((root / "run" / "heads").iterdir())[-1]
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "one", "prompt": "Name three colours."}) + "\n" + json.dumps(
        {"id": "two", "turns": ["What is 2 + 2?", "And doubled?"]}) + "\n")
    out = root / "eval"
    report = eval_main(_cfg("eval", [f"model.path={default_model_dir}", "model.device=cpu", f"head_ckpt={head}",
                                     f"prompts=[{prompts}]", "max_new_tokens=10", "k=[1,3]",
                                     "draft_threshold=[0.0,0.5]", "catch_up=[target,own]",
                                     f"out={out}", "progress=false", "warmup=false"]))
    rows = report["rows"]
    heads = [r for r in rows if r["method"] == "head"]
    assert {(r["dataset"], r["k"], r["draft_threshold"], r["catch_up"]) for r in heads} == {
        (d, k, t, c) for d in ("prompts", "overall") for k in (1, 3) for t in (0.0, 0.5) for c in ("target", "own")}
    # prompt lookup ran beside the head at every k, and every head row carries its figures
    assert {(r["dataset"], r["k"]) for r in rows if r["method"] == "ngram"} == {
        (d, k) for d in ("prompts", "overall") for k in (1, 3)}
    floor = {(r["dataset"], r["k"]): r for r in rows if r["method"] == "ngram"}
    for r in rows:
        assert r["exact_match"] == 1.0  # greedy speculation reproduces plain greedy decoding
        assert 1.0 <= r["tau"] <= r["k"] + 1 and len(r["per_position"]) == r["k"]
        assert r["speedup"] > 0 and r["baseline_tokens_per_s"] > 0
        assert r["step_cost"] == pytest.approx(r["tau"] / r["speedup"])  # the break-even τ on this machine
        assert r["speedup_lo"] <= r["speedup"] <= r["speedup_hi"]  # two chunks (batch 1): the interval of their pair
        assert 0 <= r["mean_draft_len"] <= r["k"]
        if r["method"] == "head":
            ng = floor[(r["dataset"], r["k"])]
            assert (r["tau_ngram"], r["speedup_ngram"]) == (ng["tau"], ng["speedup"])
            if r["draft_threshold"] == 0.0:
                assert r["mean_draft_len"] == r["k"]  # a fixed chain always drafts k
    assert report["best"]["k"] in (1, 3) and report["best"]["method"] == "head"
    # every axis that varies is in the labels: 8 head points and 2 lookup points, all named apart
    labels = {r["label"] for r in rows if r["dataset"] == "overall"}
    assert len(labels) == 10 and "head k=3 thr=0.5 catch-up=own" in labels and "prompt lookup k=1" in labels
    assert {o["label"] for o in outputs_of(out)} == labels | {"plain"}
    md = (out / "report.md").read_text()
    assert "step_cost" in md and "tau_ngram" in md and "mean_draft_len" in md
    for name in ("acceptance_per_position.png", "tau_speedup_vs_k.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert OmegaConf.load(out / "config.yaml").out == str(out)
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert {o["method"] for o in outputs} == {"head", "none", "ngram"}
    assert all(o["turns"] and isinstance(o["turns"][0]["text"], str) for o in outputs)
    # The two-turn conversation is answered turn by turn, by every run: 8 head runs, 2 lookup runs, plain once.
    assert [len(o["turns"]) for o in outputs if o["id"] == "two"] == [2] * 11
    assert all(len(o["turns"]) == 1 for o in outputs if o["id"] == "one")


def test_eval_refuses_a_head_of_another_target(tiny_checkpoints, default_model_dir, tmp_path):
    """A head saved for a tiny target cannot draft for SmolLM2: the command exits 2 naming the mismatched dims."""
    head = build_head(HeadConfig(type="mtp"), tiny_checkpoints["llama"][0])
    save_head(head, tmp_path / "head")
    proc = subprocess.run([sys.executable, "-m", "mtp_train.cli.eval", f"model.path={default_model_dir}",
                           f"head_ckpt={tmp_path / 'head'}", "limit=1", f"out={tmp_path / 'eval'}"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mtp-eval: error:" in proc.stderr and "dims.hidden_size" in proc.stderr


def test_eval_names_an_unknown_prompt_set(default_model_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mtp_train.cli.eval", f"model.path={default_model_dir}",
                           "method=none", "prompts=[no-such-set]", f"out={tmp_path / 'eval'}"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "no-such-set" in proc.stderr and "demo-heldout" in proc.stderr


def test_eval_refuses_an_unknown_method_naming_the_registered_ones(default_model_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mtp_train.cli.eval", f"model.path={default_model_dir}",
                           "method=medusa", f"out={tmp_path / 'eval'}"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "unknown eval method 'medusa'; choose one of none, head, draft, ngram" in proc.stderr


def test_eval_prompt_lookup_alone(default_model_dir, tmp_path):
    """method=ngram needs no head: rows for prompt lookup only, identical to plain greedy; bad n refused."""
    report = eval_main(_cfg("eval", [f"model.path={default_model_dir}", "model.device=cpu", "method=ngram",
                                     f"prompts=[{HELDOUT}]", "limit=2", "max_new_tokens=24", "k=3", f"out={tmp_path}",
                                     "progress=false", "warmup=false", "plots=false"]))
    assert {r["method"] for r in report["rows"]} == {"ngram"}
    best = report["best"]
    assert best["method"] == "ngram" and best["exact_match"] == 1.0 and "tau_ngram" not in best
    with pytest.raises(ValueError, match="n_min"):
        eval_main(_cfg("eval", [f"model.path={default_model_dir}", "method=ngram", "ngram.n_min=4",
                                f"out={tmp_path / 'bad'}"]))


def test_eval_draft_method_with_the_target_as_its_own_draft(default_model_dir, tmp_path):
    """method=draft: the target drafting for itself accepts every draft (τ = k + 1) and reproduces plain greedy."""
    report = eval_main(_cfg("eval", [f"model.path={default_model_dir}", "model.device=cpu", "method=draft",
                                     f"draft_model={default_model_dir}", f"prompts=[{HELDOUT}]", "limit=1",
                                     "max_new_tokens=9", "k=2", f"out={tmp_path}", "progress=false",
                                     "warmup=false", "plots=false", "ngram.compare=false"]))
    assert {r["method"] for r in report["rows"]} == {"draft"}
    row = report["best"]
    assert row["method"] == "draft" and row["exact_match"] == 1.0
    assert row["acceptance_rate"] == 1.0 and row["tau"] == 3.0


def test_eval_draft_width_axis_runs_trees_beside_chains(trained, default_model_dir):
    """draft_width=[1,2]: one head row per width; the tree rows verify the runner-up too (two rows at k = 1) and
    still give plain greedy's answers; a width the head cannot have is refused before any run."""
    root, _ = trained
    head = sorted((root / "run" / "heads").iterdir())[-1]
    base = [f"model.path={default_model_dir}", "model.device=cpu", f"head_ckpt={head}", f"prompts=[{HELDOUT}]",
            "limit=2", "max_new_tokens=10", "k=1", "ngram.compare=false", "progress=false", "warmup=false",
            "plots=false"]
    report = eval_main(_cfg("eval", [*base, "draft_width=[1,2]", f"out={root / 'eval-width'}"]))
    rows = {r["draft_width"]: r for r in report["rows"] if r["dataset"] == "overall"}
    assert set(rows) == {1, 2}
    assert rows[1]["mean_draft_len"] == 1.0 and rows[2]["mean_draft_len"] == 2.0
    assert all(r["exact_match"] == 1.0 for r in rows.values())
    assert rows[1]["num_alt_accepted"] == 0 and rows[2]["num_alt_accepted"] >= 0
    assert (rows[1]["label"], rows[2]["label"]) == ("head width=1", "head width=2")  # k=1 only: not named
    assert report["best"]["label"] in ("head width=1", "head width=2")
    with pytest.raises(ValueError, match="draft_width"):
        eval_main(_cfg("eval", [*base, "draft_width=0", f"out={root / 'eval-bad'}"]))
