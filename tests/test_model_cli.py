"""`mtp-model families`: every registered target family, one line each, with what it supports."""

from __future__ import annotations

from mtp_train.cli.model import main
from mtp_train.models.families import families


def test_families_lists_every_registered_family_with_its_model_types(capsys):
    assert main(["families"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(families())
    by_name = {line.split("\t")[0]: line for line in lines}
    assert {"llama", "deepseek_v2", "deepseek_v3", "qwen3_moe", "gpt_oss"} <= set(by_name)
    oss = by_name["gpt_oss"]
    assert "model_type: gpt_oss" in oss and "eagle3" in oss and "head.moe" in oss and "tp >= 1" in oss
    assert "model_type: qwen3_moe" in by_name["qwen3_moe"] and "head.moe" in by_name["qwen3_moe"]
    assert "tp >= 1" in by_name["qwen3_moe"]
    assert "qwen3" in by_name["llama"] and "tp >= 1" in by_name["llama"]
    assert "heads: mtp" in by_name["deepseek_v2"] and "tp >= 1" in by_name["deepseek_v2"]
    v3 = by_name["deepseek_v3"]
    assert "model_type: deepseek_v3, kimi_k2" in v3 and "heads: mtp; head.moe" in v3 and "tp >= 1" in v3
