"""checks/check_vllm.py and checks/vllm_side.py without vLLM: arguments, the comparison and verdict, the final JSON
line and exit code, vLLM's metric counters, and that the vLLM side imports nothing of the project."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from checks import check_vllm as check
from checks import vllm_side as side

ROOT = Path(__file__).resolve().parents[1]


def test_arguments_default_to_the_check_settings():
    a = check.parse_args([])
    assert a.heads == ["eagle1", "eagle3", "dflash", "dflash-speculators", "dspark", "peagle"]
    assert (a.k, a.max_new_tokens, a.limit, a.prompts, a.tolerance) == (3, 96, 16, "demo-heldout", 0.05)
    assert a.head_eagle1 is None and a.head_eagle3 is None and a.head_dflash is None and a.head_dspark is None
    a = check.parse_args(["--heads", "eagle1", "--head-eagle1", "h/step-9", "--k", "2"])
    assert a.heads == ["eagle1"] and a.head_eagle1 == "h/step-9" and a.k == 2


@pytest.mark.parametrize("argv", [["--heads", "mtp"], ["--heads", ","], ["--k", "0"], ["--tolerance", "-1"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        check.parse_args(argv)


def test_a_final_stop_token_is_not_a_difference():
    assert check.trim_stop([5, 6, 2], [2]) == [5, 6]
    assert check.trim_stop([5, 2, 6], [2]) == [5, 2, 6]
    assert check.count_equal([[1, 2, 7], [1, 3]], [[1, 2], [1, 4]], [7]) == 1
    with pytest.raises(ValueError):
        check.count_equal([[1]], [], [7])


OURS = {"tau": 1.5, "per_position": [0.4, 0.1], "num_drafts": 100, "num_accepted": 50}


def _vllm(tau: float) -> dict:
    return {"tau": tau, "per_position": [0.41, 0.09], "num_drafts": 101, "num_accepted": round((tau - 1) * 101)}


def _ids(spec_last: list[int]) -> dict:
    plain = [[1, 2, 3], [4, 5]]
    return {"ours_plain": plain, "ours_spec": plain, "vllm_plain": plain, "vllm_spec": [plain[0], spec_last]}


def test_verdict_passes_on_equal_ids_and_close_tau():
    r = check.verdict(OURS, _vllm(1.52), _ids([4, 5, 0]), stop_ids=[0], tolerance=0.05)
    assert r["status"] == "pass" and r["texts_equal"] is True and "reason" not in r
    assert (r["tau_ours"], r["tau_vllm"]) == (1.5, 1.52)
    assert r["turns"] == 2 and r["turns_spec_eq_plain_vllm"] == 2 and r["turns_vllm_plain_eq_ours"] == 2
    assert r["per_position_vllm"] == [0.41, 0.09] and r["drafts_vllm"] == 101


def test_verdict_fails_on_different_ids():
    r = check.verdict(OURS, _vllm(1.5), _ids([4, 6]), stop_ids=[0], tolerance=0.05)
    assert r["status"] == "fail" and r["texts_equal"] is False
    assert r["turns_spec_eq_plain_vllm"] == 1 and r["turns_vllm_spec_eq_ours"] == 1
    assert "1 of 2 turns" in r["reason"]


def test_verdict_fails_on_tau_beyond_the_tolerance():
    assert check.verdict(OURS, _vllm(1.574), _ids([4, 5]), [0], 0.05)["status"] == "pass"  # 4.9%
    r = check.verdict(OURS, _vllm(1.6), _ids([4, 5]), [0], 0.05)  # 6.7%
    assert r["status"] == "fail" and r["texts_equal"] is True and "6.7%" in r["reason"]


def test_exit_code_counts_checked_heads_only():
    assert check.exit_code({"eagle1": {"status": "pass"}, "eagle3": {"status": "skipped", "reason": "x"}}) == 0
    assert check.exit_code({"eagle1": {"status": "pass"}, "eagle3": {"status": "fail"}}) == 1
    assert check.exit_code({"eagle1": {"status": "error", "stage": "vllm eagle", "error": "boom"}}) == 1
    assert check.exit_code({"eagle1": {"status": "pass"}, "dspark": {"status": "unsupported", "reason": "x"}}) == 0


def test_a_method_the_vllm_build_refuses_is_reported_unsupported():
    """vLLM 0.32's CPU build refuses method=dspark at configuration (its V1 model runner has no DSpark, its V2 one
    needs Triton): the refusal line is found in vLLM's error, another error is not one."""
    err = ("ValidationError: 1 validation error for VllmConfig\n  Value error, Model Runner V1 does not support: "
           "dspark speculative decoding [type=value_error]\n    For further information visit https://x")
    assert check.refusal(err) == ("Value error, Model Runner V1 does not support: dspark speculative decoding "
                                  "[type=value_error]")
    v2 = "ValueError: Model Runner V2 requires Triton."
    assert check.refusal(v2) == v2
    assert check.refusal("RuntimeError: shape mismatch in fc") is None
    assert check.report_lines("dspark", {"status": "unsupported", "reason": "Model Runner V1 does not support"}) == [
        "dspark: UNSUPPORTED by this vLLM build: Model Runner V1 does not support"]
    assert "dspark" in check.PROBE_FIRST and check.vllm_speculative("dspark")["method"] == "dspark"


def test_the_last_line_is_one_json_object_of_every_head(monkeypatch, capsys):
    entries = {"eagle1": check.verdict(OURS, _vllm(1.5), _ids([4, 5]), [0], 0.05),
               "eagle3": {"status": "skipped", "reason": "no conf/head/eagle3.yaml in this checkout"},
               "dflash": {"status": "skipped", "reason": "no conf/head/dflash.yaml in this checkout"},
               "dflash-speculators": {"status": "skipped", "reason": "no conf/head/dflash.yaml in this checkout"},
               "dspark": {"status": "unsupported", "reason": "Model Runner V1 does not support: dspark"},
               "peagle": {"status": "skipped", "reason": "no conf/head/peagle.yaml in this checkout"}}
    monkeypatch.setattr(check, "check_head", lambda side, head: entries[head])
    assert check.main(["--vllm-python", sys.executable]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == entries
    assert "eagle3: skipped (no conf/head/eagle3.yaml in this checkout)" in lines
    assert any("PASS" in line for line in lines)
    entries["eagle1"] = {"status": "error", "stage": "vllm eagle", "error": "vLLM spec-eagle1: ValueError: x"}
    assert check.main(["--vllm-python", sys.executable]) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eagle1"]["status"] == "error"


def test_a_missing_vllm_venv_is_reported(tmp_path, capsys):
    assert check.main(["--vllm-python", str(tmp_path / "none" / "python")]) == 2
    assert "not found" in capsys.readouterr().err


def test_head_types_this_checkout_lacks_are_skipped_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(check, "ROOT", tmp_path)
    assert check.unavailable("eagle3") == "no conf/head/eagle3.yaml in this checkout"
    assert check.check_head(SimpleNamespace(a=None), "eagle3") == {
        "status": "skipped", "reason": "no conf/head/eagle3.yaml in this checkout"}


def test_aux_layers_and_manifests(monkeypatch, tmp_path):
    monkeypatch.setattr(check, "ROOT", tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    assert check.aux_layers(Path("m")) == [2, 15, 27]
    assert check.manifest_aux(Path("pc")) is None
    (tmp_path / "pc").mkdir()
    (tmp_path / "pc" / "manifest.json").write_text(json.dumps({"hidden": {"kind": "final_norm", "aux_layers": []}}))
    assert check.manifest_aux(Path("pc")) == []


def test_vllm_error_lines_keep_the_cause():
    log = "INFO starting\nERROR ... EngineCore failed\nValueError: eagle3 is not supported on CPU\nINFO x\n" \
          "RuntimeError: Engine core initialization failed\nValueError: eagle3 is not supported on CPU\n"
    assert check.vllm_error_lines(log) == ["ERROR ... EngineCore failed", "ValueError: eagle3 is not supported on CPU",
                                           "RuntimeError: Engine core initialization failed"]


def test_spec_counters_from_vllm_metrics():
    metrics = [SimpleNamespace(name="vllm:num_requests_running", value=0),
               SimpleNamespace(name=side.DRAFTS, value=10), SimpleNamespace(name=side.DRAFT_TOKENS, value=30),
               SimpleNamespace(name=side.ACCEPTED, value=9), SimpleNamespace(name=side.ACCEPTED, value=3),
               SimpleNamespace(name=side.ACCEPTED_PER_POS, values=[6, 4, 2])]
    counts = side.spec_counts(metrics)
    assert counts == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted": 12, "accepted_per_pos": [6, 4, 2]}
    s = side.spec_summary(counts)
    assert s["tau"] == pytest.approx(2.2) and s["acceptance_rate"] == pytest.approx(0.4)
    assert s["per_position"] == pytest.approx([0.6, 0.4, 0.2])
    assert side.spec_counts([SimpleNamespace(name="vllm:num_requests_running", value=0)]) is None


def test_engine_arguments():
    req = {"model": "m", "prompts": [[1]], "max_tokens": 4, "stop_token_ids": [2], "speculative": None}
    kw = side.engine_kwargs(req)
    assert kw["max_num_seqs"] == 1 and kw["dtype"] == "float32" and kw["enforce_eager"] is True
    assert kw["disable_log_stats"] is False  # llm.get_metrics() refuses to run without the stats
    assert "speculative_config" not in kw
    req["speculative"] = {"method": "eagle", "model": "h", "num_speculative_tokens": 3}
    assert side.engine_kwargs(req)["speculative_config"] == {"method": "eagle", "model": "h",
                                                             "num_speculative_tokens": 3}


def test_the_vllm_side_imports_only_vllm_the_standard_library_and_the_staged_module():
    from mtp_train.capture import launch

    for path in (ROOT / "checks" / "vllm_side.py", ROOT / "mtp_train" / "capture" / "vllm_generate.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        ours = {n for n in names if n.split(".")[0] == "mtp_train"}
        assert ours <= {"mtp_train.capture.vllm_generate"}, path  # staged for vLLM's process
        assert "capture/vllm_generate.py" in launch.CHILD_MODULES
        roots = {n.split(".")[0] for n in names - ours}
        assert roots - {"vllm", "transformers", "__future__"} <= set(sys.stdlib_module_names), path
    assert "vllm" in {n.split(".")[0] for n in names}


def test_a_dflash_head_is_trained_with_the_block_vllm_drafts():
    """vLLM's method=dflash queries the bonus token and k masks: the head's block is k + 1, over the folder's aux
    layers."""
    assert check.block_recipe(3, [2, 15, 27]) == ("head.block_size=4", "loss.steps=3", "head.aux_layers=[2,15,27]")
    assert check.export_format("dflash") == "dflash" and check.vllm_speculative("dflash")["method"] == "dflash"
    # method=dspark queries the last token and k - 1 masks, every slot a draft (sample_from_anchor): a block of k
    assert check.block_recipe(3, [2, 15, 27], "dspark") == ("head.block_size=3", "loss.steps=3",
                                                             "head.aux_layers=[2,15,27]")


def test_the_speculators_dflash_row_trains_a_dflash_head_with_a_draft_vocabulary():
    """A row that checks another layout of a head type: dflash trained, exported in speculators' layout with d2t."""
    assert check.head_type("dflash-speculators") == "dflash" and check.head_type("eagle3") == "eagle3"
    assert check.export_format("dflash-speculators") == "speculators-dflash"
    assert check.vllm_speculative("dflash-speculators")["method"] == "dflash"
    assert check.DRAFT_VOCAB["dflash-speculators"] > 0
    assert check.speculative("peagle", Path("x"), 3)["parallel_drafting"] is True  # the layout's own vLLM settings
    assert check.unavailable("dflash-speculators") is None
    a = check.parse_args(["--heads", "dflash-speculators", "--head-dflash-speculators", "runs/x"])
    assert a.heads == ["dflash-speculators"] and a.head_dflash_speculators == "runs/x"
