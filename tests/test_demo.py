"""`mtp-demo` end to end at a tiny size on the real default model: every stage runs, the summary is written, and a
re-run skips every finished stage; an `out` that is not the demo's is refused untouched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_train.cli.demo import STAGES, run_demo
from mtp_train.cli.outputs import OutputError
from mtp_train.config import DemoConfig
from tests.conftest import make_chat_target


@pytest.mark.parametrize("files, says", [
    ({"manifest.json": "{}"}, "holds the output of mtp-precompute"),
    ({"notes.txt": "mine"}, "holds files that no mtp command wrote"),
    (None, "is a file, but mtp-demo writes a folder there"),
], ids=["precompute-folder", "unrelated-files", "a-file"])
def test_demo_refuses_an_out_that_is_not_its_own_untouched(tmp_path, files, says):
    out = tmp_path / "out"
    if files is None:
        out.write_text("a note")
    else:
        out.mkdir()
        for name, text in files.items():
            (out / name).write_text(text)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(OutputError, match=says):
        run_demo(DemoConfig(out=str(out), model_path=str(tmp_path / "no-model")))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_demo_runs_every_stage_then_skips_them(default_model_dir, tmp_path, capsys):
    cfg = DemoConfig(
        out=str(tmp_path / "demo"), model_path=str(default_model_dir),
        regenerate=["limit=8", "max_new_tokens=24", "progress=false"],
        precompute=["max_seq_len=192", "val_fraction=0.25", "progress=false"],
        train=["head.draft_vocab_size=1024", "train.max_steps=2", "train.micro_batch_tokens=512",
               "train.eval_every=0", "train.eval_batches=1", "train.save_every=0", "train.progress=false",
               "spec_eval.limit=1", "spec_eval.max_new_tokens=8", "wandb.mode=offline"],
        eval=["prompts=[demo-heldout]", "limit=2", "k=2", "max_new_tokens=12", "progress=false", "warmup=false"],
        export=["format=deepseek-mtp"],
    )
    summary = run_demo(cfg)
    out = tmp_path / "demo"
    saved = json.loads((out / "summary.json").read_text())
    assert saved["tau"] == summary["tau"] and 1.0 <= saved["tau"] <= 3.0
    assert {"tau", "acceptance_rate", "speedup", "minutes"} <= saved.keys()
    # prompt lookup ran on the same held-out prompts in the same eval: the floor the head is compared with
    assert 1.0 <= saved["tau_ngram"] <= 3.0 and saved["speedup_ngram"] > 0
    assert saved["exact_match"] == 1.0
    assert (out / "eval" / "report.json").is_file() and (out / "export" / "model.safetensors").is_file()
    assert list((out / "train" / "wandb").glob("offline-run-*"))  # a real W&B offline run
    first = capsys.readouterr().out
    assert "τ" in first and all(s in first for s in STAGES) and "prompt lookup" in first
    # Every greedy row of the grid, with its step cost and its speed-up's interval, in the summary and its file.
    assert [(r["method"], r["k"]) for r in saved["rows"]] == [("head", 2), ("ngram", 2)]
    assert all(r["step_cost"] > 0 and r["speedup_lo"] <= r["speedup"] <= r["speedup_hi"] for r in saved["rows"])
    assert "step_cost" in first and f"step_cost {saved['step_cost']:.2f}" in first

    again = run_demo(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert sum("skipped" in line for line in lines) == len(STAGES)
    assert again["tau"] == summary["tau"] and again["minutes_this_run"] < summary["minutes"]

    # Another eval setting re-runs the eval alone, over the report the demo made (mtp-eval alone refuses that).
    cfg.eval = [*cfg.eval, "max_new_tokens=10"]
    third = run_demo(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert sum("skipped" in line for line in lines) == len(STAGES) - 1
    assert 1.0 <= third["tau"] <= 3.0
    assert json.loads((out / "stages.json").read_text())["eval"]["overrides"][-1] == "max_new_tokens=10"


def _sigint_default() -> None:
    """In the child before it runs: SIGINT's default disposition, so that Python installs its Ctrl-C handler even
    when the test runner was started with SIGINT ignored (a background job of a non-interactive shell)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_a_stage_is_one_line_naming_the_stage_and_exit_2(tmp_path):
    """SIGINT once the demo has started its first stage (the line it prints for it): one line naming the stage
    and how to go on, exit 2, no traceback, nothing written in the working folder."""
    root = Path(__file__).resolve().parents[1]
    target = make_chat_target(tmp_path / "target")
    work = tmp_path / "work"
    work.mkdir()
    (work / "data").symlink_to(root / "data")  # the demo's prompt sets name files under data/
    before = sorted(p.name for p in work.iterdir())
    env = {**os.environ, "PYTHONPATH": str(root), "MTP_TRAIN_CPU_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.Popen([sys.executable, "-m", "mtp_train.cli.demo", f"model_path={target}",
                             f"out={tmp_path / 'demo'}", "regenerate=[progress=false,model.device=cpu]"],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default)
    try:
        started = next((line for line in proc.stdout if line.startswith("mtp-demo: regenerate")), None)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert started is not None, err[-3000:]
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().count("\n") == 0 and err.startswith("mtp-demo: interrupted in its regenerate stage "), err
    assert "re-run the same command" in err, err
    assert sorted(p.name for p in work.iterdir()) == before
