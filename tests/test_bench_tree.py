"""bench/tree.py on a tiny chat target and a random head: the grid's shapes, τ per shape beside the plain
chains (a chain-shaped tree has its chain's τ), the headline's best_tree / best_chain, the JSON; and
checks/gpu/tree_cost.py's shapes and table (the GPU check's claim (c) section) on the CPU. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from bench import tree as bench_tree
from checks.gpu import tree_cost
from checks.gpu.common import Checks
from checks.gpu.tree_mask import tree_mask_cost
from mtp_train.data.readers import Conversation
from mtp_train.speculative.tree_draft import TreeSpec
from tests.conftest import TOPICS, predictable_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return predictable_chat_target(tmp_path_factory.mktemp("chat") / "target")


def _convs(n: int) -> list[Conversation]:
    return [Conversation(f"c{i}", [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}],
                         "test", i + 1) for i in range(n)]


def test_the_grid_keeps_shapes_that_exist_and_verify_every_level():
    names = [s.name for s in bench_tree.grid_shapes([1, 2, 3, 4], [1, 2, 4], [2, 4, 8, 16])]
    assert names == ["1x1x2", "1x2x2", "1x4x2", "1x4x4", "2x2x4", "2x4x4", "2x4x8", "2x4x16", "3x1x4", "3x2x4",
                     "3x2x8", "3x4x4", "3x4x8", "3x4x16", "4x2x8", "4x4x8", "4x4x16"]
    # topk 1 leaves the chains only; tokens - 1 < steps (levels never verified) and more nodes than drafted are out
    assert [s.name for s in bench_tree.grid_shapes([2, 3], [1], [3, 4, 8])] == ["2x1x3", "3x1x4"]
    assert bench_tree.grid_shapes([4], [2], [4]) == [] and bench_tree.grid_shapes([1], [2], [4]) == []
    assert all(isinstance(s, TreeSpec) for s in bench_tree.grid_shapes([2], [2], [4]))


def test_best_tree_and_chain_by_tau_at_the_headline_tokens():
    result = {"grid": {"2x2x4": {"steps": 2, "topk": 2, "tokens": 4, "tau": 1.5},
                       "3x2x8": {"steps": 3, "topk": 2, "tokens": 8, "tau": 1.5},  # a tie: fewer rows win
                       "3x4x16": {"steps": 3, "topk": 4, "tokens": 16, "tau": 2.5},  # over the headline's 8 rows
                       "3x1x4": {"steps": 3, "topk": 1, "tokens": 4, "tau": 1.9}},  # a chain, not a tree
              "chains": {1: {"k": 1, "tokens": 2, "tau": 1.2}, 2: {"k": 2, "tokens": 3, "tau": 1.2}}}
    h = bench_tree.headline(result, 8)
    assert h["best_tree"]["shape"] == "2x2x4" and h["best_chain"]["k"] == 1
    assert h["tau_ratio"] == pytest.approx(1.25) and h["goal_met"] is True
    assert bench_tree.headline(result, 16)["best_tree"]["shape"] == "3x4x16"
    assert bench_tree.timed_shapes(result, 2, 8) == ["2x2x4", "3x2x8"]
    none = bench_tree.headline({"grid": {}, "chains": result["chains"]})
    assert none["best_tree"] is None and none["tau_ratio"] is None and none["goal_met"] is None


def test_tree_grid_on_a_tiny_target(target):
    model, tok, head, _ = target
    shapes = [TreeSpec.chain(2), TreeSpec(2, 2, 4)]
    out = bench_tree.tree_grid(model, tok, head, _convs(3), shapes, [2], 12, batch_size=2, verbose=False)
    assert set(out["grid"]) == {"2x1x3", "2x2x4"} and set(out["chains"]) == {2}
    for name, g in out["grid"].items():
        assert (g["steps"], g["topk"], g["tokens"]) == tuple(map(int, name.split("x")))
        assert 1.0 <= g["tau"] <= g["steps"] + 1 and len(g["per_position"]) == g["steps"]
    assert 1.0 < out["chains"][2]["tau"] < 3.0 and 0 < out["chains"][2]["per_position"][1] < 1
    # the chain through the tree code accepts exactly what the plain chain does (greedy, deterministic)
    assert out["grid"]["2x1x3"]["tau"] == out["chains"][2]["tau"] and out["chain_agrees"] is True
    out.update(bench_tree.headline(out, 8))
    assert out["best_tree"]["shape"] == "2x2x4" and out["best_chain"]["k"] == 2
    assert out["tau_ratio"] == pytest.approx(out["best_tree"]["tau"] / out["chains"][2]["tau"], abs=1e-4)
    assert out["tau_ratio_se"] >= 0 and out["chains"][2]["tau_se"] > 0  # over the 3 conversations' requests
    line = json.loads(json.dumps(out, sort_keys=True))  # the report's last line
    assert {"grid", "chains", "chain_agrees", "best_tree", "best_chain", "tau_ratio", "goal_met",
            "headline_tokens"} <= set(line)
    assert line["chains"]["2"]["tau"] == out["chains"][2]["tau"]


def test_tree_cost_shapes():
    assert tree_cost.chain_parents(4) == [-1, 0, 1, 2]
    assert tree_cost.tree_parents(1) == [-1]
    assert tree_cost.tree_parents(7, topk=2) == [-1, 0, 0, 1, 1, 2, 2]
    assert tree_cost.tree_depth(tree_cost.tree_parents(64, topk=4)) == 3
    assert tree_cost.tree_depth(tree_cost.chain_parents(64)) == 63
    with pytest.raises(ValueError, match="rows >= 1"):
        tree_cost.tree_parents(0)


def test_tree_cost_table_on_the_cpu(target):
    model = target[0]
    times = tree_cost.verify_times(model, (1, 4, 9), batch=2, prefix=20, rounds=1, warmup=0)
    assert set(times) == {1, 4, 9} and all(set(t) == set(tree_cost.KINDS) for t in times.values())
    table = tree_cost.cost_table(times)
    assert [r["rows"] for r in table] == [1, 4, 9] and table[0]["chain_vs_decode"] == 1.0
    assert [r["tree_depth"] for r in table] == [0, 1, 2]
    assert all(r[f"{k}_ms"] > 0 for r in table for k in tree_cost.KINDS)
    text = tree_cost.format_table(table).splitlines()
    assert len(text) == 4 and "tree_vs_chain" in text[0]
    with pytest.raises(ValueError, match="at most 64"):
        tree_cost.verify_times(model, (65,))


def test_the_cli_prints_the_grid_and_headline_as_its_last_line(target, tmp_path, capsys):
    """`python -m bench.tree` end to end on the tiny target: a 2-shape grid, one chain, no rows timing, and --timed's
    interleaved speed-up of the best tree and chain (its values are not asserted, only that they are reported)."""
    from mtp_train.heads.checkpoint import save_head

    _, _, head, model_dir = target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]}) + "\n"
                               for t in TOPICS[:2]))
    save_head(head, tmp_path / "head")
    args = ["--model", str(model_dir), "--head", str(tmp_path / "head"), "--prompts", str(prompts), "--limit", "2",
            "--steps", "2", "--topk", "1,2", "--tokens", "3,4", "--chains", "2", "--max-new-tokens", "6",
            "--batch-size", "2", "--no-rows", "--timed", "--timed-top", "1"]
    result = bench_tree.main(args)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(line["grid"]) == {"2x1x3", "2x2x3", "2x2x4"} and set(line["chains"]) == {"2"}
    assert line["best_tree"]["shape"] in ("2x2x3", "2x2x4") and line["best_chain"]["k"] == 2
    assert "rows_cost" not in line and set(line["timed"]) == {line["best_tree"]["shape"], "chain k=2"}
    for best in (line["best_tree"], line["best_chain"]):
        assert {"tau", "speedup", "speedup_lo", "speedup_hi"} <= set(best)
    assert result["best_tree"]["tau"] == line["best_tree"]["tau"]
    assert "requests" not in json.dumps(line)  # the per-request counts pair entries, they are not printed


def test_the_gpu_checks_tree_mask_section_runs_on_the_cpu(target, capsys):
    """checks.gpu's claim (c) group as a dry run on the CPU (torch backend, float32, one round): its check that a
    chain passed as a tree mask gives the causal chain's logits passes, and both tables come out."""
    check = Checks()
    tree_mask_cost(check, "tiny", target[3], device="cpu", backend="torch", rounds=1, dtype=torch.float32)
    assert [(name, ok) for name, ok, _ in check.results] == [
        ("tiny tree mask: a chain as a tree mask = the causal chain (16 and 64 rows)", True)]
    lines = [json.loads(x.split(" ", 1)[1]) for x in capsys.readouterr().out.splitlines()
             if x.startswith("TREE_COST ")]
    assert [t["batch"] for t in lines] == [1, 8]
    assert [r["rows"] for r in lines[0]["table"]] == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
