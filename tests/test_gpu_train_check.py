"""checks/gpu_train_check.py on CPU: the whole recipe (online training of both heads by the clock, mtp-eval at
k = 1..6 against plain decoding, one JSON line per head) on a tiny random chat target, in seconds.

The target is a random 7-layer Llama (room for EAGLE-3's default aux layers [2, 3, 4]) with a small byte-level BPE
tokenizer and a ChatML template; the training conversations and the prompt sets are written here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from checks import gpu_train_check as recipe
from tests.conftest import TOPICS, make_chat_target

WORDS = ["it", "is", "old", "and", "very", "small", "bright", "cold", "round", "near", "far", "often", "seen"]
KEYS = {"head", "device", "dtype", "backend", "budget_s", "tokens_seen", "samples_seen", "steps", "train_seconds",
        "train_wall_s", "stopped_by", "train_loss", "eval_top1", "tau", "speedup", "exact_match",
        "baseline_tokens_per_s", "generated_tokens", "datasets", "head_dir", "wall_s"}
BUDGET_S = 1.0

pytestmark = pytest.mark.usefixtures("one_thread")


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_recipe")
    rng = random.Random(0)
    convs = []
    for i in range(24):
        topic = TOPICS[i % len(TOPICS)]
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
        convs.append({"id": f"c{i:03d}", "messages": [
            {"role": "user", "content": f"Tell me about {topic}."},
            {"role": "assistant", "content": f"Here is a fact about {topic}: {answer}."}]})
    texts = [m["content"] for c in convs for m in c["messages"]]
    # one prompt set of single questions, one of two-turn questions (MT-bench's shape: `turns`)
    single = _write_jsonl(root / "heldout.jsonl", [{"id": "h1", "prompt": "Tell me about owls."},
                                                   {"id": "h2", "prompt": "Tell me about tea."}])
    two = _write_jsonl(root / "two_turns.jsonl", [{"question_id": 1, "turns": ["Tell me about maps.",
                                                                               "Tell me about rivers."]}])
    return {"target": make_chat_target(root / "target", texts=texts, num_layers=7),
            "convs": _write_jsonl(root / "convs.jsonl", convs), "single": single, "two": two, "root": root}


def test_arguments_and_overrides(tmp_path):
    a = recipe.parse_args([])
    assert a.heads == ["eagle3", "mtp"] and a.budget_s == 240 and a.k == [1, 2, 3, 4, 5, 6]
    assert a.device == "auto" and a.backend == "auto" and a.jobs is None
    for bad in (["--budget-s", "0"], ["--k", "0"], ["--jobs", "0"], ["--heads", "eagle1"]):
        with pytest.raises(SystemExit):
            recipe.parse_args(bad)
    a = recipe.parse_args(["--data", "a b.jsonl", "--train-override", "optim.lr=5e-4", "--budget-s", "30"])
    a.model, a.data = Path("/m"), [Path("/d/a b.jsonl")]
    over = recipe.train_overrides(a, "mtp", tmp_path / "run", "cpu", "float32")
    assert "train.max_seconds=30" in over and f"train.max_steps={recipe.MAX_STEPS}" in over
    assert "data.source=online" in over and "data.paths=['/d/a b.jsonl']" in over
    assert "optim.lr=5e-4" in over and "optim.lr=1.0e-3" not in over  # the user's value replaces the recipe's
    assert "head=mtp" in over and "loss.steps=3" in over and "train.micro_batch_tokens=2048" in over
    assert recipe.hydra_value("it's") == "'it\\'s'"


def test_the_recipe_trains_both_heads_by_the_clock_and_evaluates_them(inputs, capsys):
    out, results = inputs["root"] / "out", inputs["root"] / "results"
    rc = recipe.main(["--device", "cpu", "--budget-s", str(BUDGET_S), "--model", str(inputs["target"]),
                      "--data", str(inputs["convs"]), "--prompts", str(inputs["single"]), str(inputs["two"]),
                      "--micro-batch-tokens", "512", "--max-seq-len", "128", "--max-new-tokens", "8",
                      "--out", str(out), "--results", str(results),
                      # the tiny vocabulary (300) is smaller than the recipe's draft vocabulary
                      "--train-override", "head.draft_vocab_size=64",
                      "--train-override", "data.online.val_fraction=0.2",
                      "--eval-override", "model.kv_cache_gb=0.01"])  # 14 engines: no 1 GB page pool each
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]  # stdout holds the JSON lines alone
    assert [x["head"] for x in lines] == ["eagle3", "mtp"]
    for x in lines:
        assert set(x) >= KEYS, KEYS - set(x)
        assert (x["device"], x["dtype"], x["backend"]) == ("cpu", "float32", "torch")
        # the clock ended the run: its loop ran for at least the budget, at least one step
        assert x["stopped_by"] == "max_seconds" and x["train_seconds"] >= BUDGET_S and x["steps"] >= 1
        assert x["tokens_seen"] > 0 and x["samples_seen"] > 0 and x["eval_top1"] is not None
        ks = [str(k) for k in range(1, 7)]
        assert list(x["tau"]) == ks and list(x["speedup"]) == ks
        assert all(1.0 <= t <= int(k) + 1 for k, t in x["tau"].items())
        assert x["exact_match"] == 1.0  # greedy speculative answers equal plain greedy answers (fp32)
        assert set(x["datasets"]) == {"heldout", "two_turns"} and x["datasets"]["two_turns"]["prompts"] == 1
        head_dir = Path(x["head_dir"])
        assert head_dir.parent == out / x["head"] / "train" / "heads" and (head_dir / "model.safetensors").is_file()
        assert json.loads((head_dir / "config.json").read_text())["head"]["type"] == x["head"]
        report = json.loads((out / x["head"] / "eval" / "report.json").read_text())
        assert report["config"]["head_ckpt"] == str(head_dir)
        assert {r["k"] for r in report["rows"] if r["dataset"] == "overall"} == set(range(1, 7))
    assert [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()] == lines
    assert sorted(p.name for p in results.iterdir()) == sorted(
        ["summary.jsonl"] + [f"{h}-{n}" for h in ("eagle3", "mtp") for n in ("report.json", "metrics.jsonl",
                                                                              "train.log")])
