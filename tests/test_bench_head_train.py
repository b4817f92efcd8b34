"""The training-step benchmark runs every head type on one shared micro-batch and reports each against eagle3
(tiny: `--quick`; no timing is asserted)."""

from __future__ import annotations

import math

from bench.head_train_step import VARIANTS, curve_overrides, main, micro_batch


def test_the_variants_are_the_curves():
    for name, variant in VARIANTS.items():
        head_type, overrides = curve_overrides(variant)
        assert name.split("-")[0] == head_type and "head.draft_vocab_size=8192" in overrides


def test_the_micro_batch_fills_its_tokens_with_prompts_out_of_the_loss():
    b = micro_batch(300, 40, 128, 1000)
    assert sum(b["seq_lens"]) == b["input_ids"].shape[0] == b["loss_mask"].shape[0] == 300
    assert int(b["loss_mask"][0]) == 0 and 0 < int(b["loss_mask"].sum()) < 300


def test_quick_run_reports_every_head_against_eagle3(default_model_dir):
    res = main(["--model", str(default_model_dir), "--quick", "--heads", "eagle3,dflash-b4,dspark,mtp"])
    assert set(res["heads"]) == {"eagle3", "dflash-b4", "dspark", "mtp"} and res["threads"] == 1
    assert res["heads"]["eagle3"]["ratio_to_eagle3"] == 1.0 and not res["optimizer_step"]
    for row in res["heads"].values():
        assert row["step_s"] > 0 and math.isfinite(row["loss"]) and row["ratio_to_eagle3"] > 0
    assert res["heads"]["dflash-b4"]["loss_steps"] == 3 and res["heads"]["dspark"]["loss_steps"] == 4
