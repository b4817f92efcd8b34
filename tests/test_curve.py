"""bench/curve without training: the token points, the batch plan, the step hook's pruning, the report
(table, fits, plot, JSON) on synthetic points, and the recipe composing for every head."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from bench.common import compose, compose_train
from bench.curve import config as cc
from bench.curve import data as cd
from bench.curve import plan as cp
from bench.curve import record as crec
from bench.curve import report
from bench.curve import run as crun
from bench.curve import seeds as cs
from bench.curve import variants as cv


def test_token_points_double_up_to_the_budget():
    assert cp.log_spaced(16384, 524288) == [16384, 32768, 65536, 131072, 262144, 524288]
    assert cp.log_spaced(1000, 5000) == [1000, 2000, 4000, 5000]  # the budget is always the last point
    assert cp.log_spaced(16384, 8192) == [8192]
    with pytest.raises(ValueError):
        cp.log_spaced(0, 10)


def test_steps_for_tokens_replays_the_batch_plan():
    # 10 samples of 100 tokens, 200-token batches: 5 batches (200 tokens) per epoch, then the next epoch.
    plan = cp.steps_for_tokens([100] * 10, 200, 1, 0, [200, 1000, 1500])
    assert plan == [(1, 200), (5, 1000), (8, 1600)]
    assert cp.steps_for_tokens([100] * 10, 200, 2, 0, [1000]) == [(3, 1200)]  # two micro-batches a step
    # Uneven lengths: the tokens at each step are what the trainer's sampler hands out, in its order.
    from mtp_train.data.sampler import LengthBucketedBatchSampler

    lengths = [37, 250, 90, 410, 12, 180, 333, 64] * 3
    sampler = LengthBucketedBatchSampler(lengths, 512, shuffle=True, seed=3)
    sampler.set_epoch(0)
    cumulative = []
    for batch in sampler:
        cumulative.append((cumulative[-1] if cumulative else 0) + sum(lengths[i] for i in batch))
    step, tokens = cp.steps_for_tokens(lengths, 512, 1, 3, [cumulative[2]])[0]
    assert (step, tokens) == (3, cumulative[2])


def test_point_saver_keeps_the_points_and_the_newest_checkpoint(tmp_path):
    from mtp_train.train.checkpoint import mark_latest, tag_for

    saved = []

    def save():
        step = trainer.step
        (tmp_path / "checkpoints" / tag_for(step)).mkdir(parents=True)
        (tmp_path / "heads" / tag_for(step)).mkdir(parents=True)
        mark_latest(tmp_path, step)
        saved.append(step)

    trainer = SimpleNamespace(out=tmp_path, info=SimpleNamespace(is_main=True, world=1), step=0, save=save)
    hook = cp.PointSaver([3, 7], every=4)
    for step in range(1, 10):
        trainer.step = step
        hook(trainer, step, {})
    assert saved == [3, 4, 7, 8]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-8"]
    assert sorted(p.name for p in (tmp_path / "heads").glob("step-*")) == ["step-3", "step-7", "step-8"]
    trainer.step = 8
    hook(trainer, 8, {})  # already the latest checkpoint: not saved twice
    assert saved == [3, 4, 7, 8]


def _synthetic() -> dict:
    def pts(taus):
        return {str(10 * 2**i): {"step": 10 * 2**i, "tokens": 16384 * 2**i, "tau": t, "acceptance_rate": (t - 1) / 3,
                                 "pos": [t - 1, (t - 1) / 2, (t - 1) / 4], "seconds": 1.0}
                for i, t in enumerate(taus)}

    return {"command": "python -m bench.curve", "data": "synthetic", "data_dir": "/x", "recipe": ["loss.steps=1"],
            "budget_tokens": 131072, "max_steps": 80, "points": [16384, 32768, 65536, 131072],
            "eval": {"prompts": ["demo-heldout"], "limit": 32, "k": 3, "max_new_tokens": 96, "batch_size": 8},
            "skipped": {"eagle3": "head type 'eagle3' has no implementation yet"},
            "head_order": ["mtp", "eagle1", "eagle3"],
            "heads": {"mtp": {"points": pts([1.10, 1.15, 1.25, 1.35])},
                      "eagle1": {"points": pts([1.12, 1.14, 1.20, 1.28])}},
            "ngram": {"n_max": 3, "n_min": 1, "tau": 1.18, "acceptance_rate": 0.06, "pos": [0.1, 0.05, 0.03],
                      "seconds": 1.0}}


def test_fits_and_crossings():
    s = report.summarize(_synthetic())
    assert s["pair"]["heads"] == ["mtp", "eagle1"] and s["pair"]["crossings"] == 1
    assert s["pair"]["last_diff"] == pytest.approx(0.07)
    # upper half (the last two points): +0.10 per doubling from 1.35 at 128k → τ 2.0 after 6.5 more doublings
    assert s["mtp"]["slope_per_doubling_upper"] == pytest.approx(0.10)
    assert s["mtp"]["tokens_for_tau_goal"] == pytest.approx(131072 * 2**6.5)
    assert report.tokens_for_tau((2.0, -0.1)) is None  # a falling curve has no extrapolation
    a, b = report.log_fit([{"tokens": 2**i, "tau": 1 + 0.05 * i} for i in range(4, 9)])
    assert b == pytest.approx(0.05) and a == pytest.approx(1.0)
    assert math.isclose(report.tokens_for_tau((a, b), 1.5), 2**10)


def test_report_table_plot_and_json(tmp_path):
    results = _synthetic()
    out = tmp_path / "run"
    out.mkdir()
    crun.save_results(results, out)
    assert json.loads((out / "curve.json").read_text())["heads"]["mtp"]["points"]["80"]["tau"] == 1.35
    text = report.write_report(results, out, doc=tmp_path / "docs" / "curve.md", png=tmp_path / "docs" / "curve.png")
    assert "| 16k (16384) | 10 | 1.100 | 0.100 / 0.050 / 0.025 | 1.120 |" in text
    assert "| prompt lookup (n = 1..3, no training) | – | 1.180 | 0.100 / 0.050 / 0.030 |  |  |" in text
    assert "`eagle3` skipped" in text and "extrapolated" in text and "cross 1 time(s)" in text
    assert (tmp_path / "docs" / "curve.md").read_text() == text == (out / "curve.md").read_text()
    for png in (out / "curve.png", tmp_path / "docs" / "curve.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # Without prompt lookup (not measured yet) the report still builds.
    results["ngram"] = None
    assert "prompt lookup" not in report.markdown_table(results)


def test_the_recipe_composes_for_every_head_and_unknown_heads_are_skipped(tmp_path):

    cfg = cc.load_config()
    assert cfg.tokens.first < cfg.tokens.last and cfg.eval.k == 3
    heads = [h for h in cfg.heads if cc.head_available(h) is None]
    assert {"mtp", "eagle1"} <= set(heads)
    for head in heads:
        c = compose_train(crun.train_overrides(cfg, head, tmp_path / "pc", "shared-regen", tmp_path,
                                                "models/smollm2-135m-instruct", 123, []))
        assert c.head.type == head and c.head.draft_vocab_size == 8192 and c.train.max_steps == 123
        assert c.resume == "auto" and list(c.spec_eval.prompts) == [] and c.out == str(tmp_path / head)
        assert c.train.save_every == 0 and c.wandb.mode == "disabled"
    pc = compose("precompute", ["data=shared-regen", *cfg.precompute])
    assert pc.max_seq_len == 768 and pc.data.name == "shared-regen"
    assert cc.head_available("mtp_typo") == "no conf/head/mtp_typo.yaml"
    with pytest.raises(Exception, match="hedas"):
        from omegaconf import OmegaConf

        OmegaConf.merge(OmegaConf.structured(cc.CurveConfig), OmegaConf.create({"hedas": []}))


def test_eagle3_trains_on_a_folder_with_its_layers(tmp_path):
    """eagle3 reads three target layers; mtp and eagle1 the final state only; a given folder must hold them."""
    from mtp_train.config.head import default_aux_layers

    assert cc.head_available("eagle3") is None  # `# @package _global_`: its `head:` block is found
    assert cc.head_aux_layers("eagle3", 30) == default_aux_layers(30) == [2, 15, 27]
    assert cc.head_aux_layers("mtp", 30) == [] and cc.head_aux_layers("eagle1", 30) == []
    (tmp_path / "manifest.json").write_text(json.dumps({"hidden": {"kind": "final_norm", "aux_layers": []}}))
    cd.check_folder(tmp_path, [])
    with pytest.raises(SystemExit, match=r"aux_layers \[\].*reads \[2, 15, 27\]"):
        cd.check_folder(tmp_path, [2, 15, 27])
    # A folder with more layers serves every head whose layers it holds (each reads its own columns).
    (tmp_path / "manifest.json").write_text(json.dumps({"hidden": {"kind": "final_norm",
                                                                   "aux_layers": [2, 9, 15, 21, 27, 28]}}))
    cd.check_folder(tmp_path, [2, 15, 27])
    cd.check_folder(tmp_path, [2, 9, 15, 21, 28])
    with pytest.raises(SystemExit, match=r"lacking \[3\]"):
        cd.check_folder(tmp_path, [2, 3, 15])


# --- recipe variants (bench/curve/variants.py)  ----------------------------------------------------------------------


def test_variants_config_parses_in_order_and_composes_after_the_shared_recipe(tmp_path):
    """The issue's list, most informative first; each variant's overrides come after the curve's (so its
    loss.steps wins over the shared loss.steps=1) and the composed config passes the trainer's checks."""

    from mtp_train.config import TrainConfig, typed

    cfg = cc.load_config()
    variants = cc.parse_variants(cfg.variants)
    names = [v.name for v in variants]
    assert names[:6] == ["mtp-soft_ce-s1", "mtp-lk_hybrid-s1", "mtp-tv-s1", "mtp-nla-s1", "mtp-soft_ce-s3",
                         "mtp-lk_hybrid-s3"]
    assert len(names) == len(set(names))
    grid = [v for v in variants if v.head == "mtp" and len(v.overrides) == 2]  # loss.kind × loss.steps alone
    mtp = {(dict(o.split("=") for o in v.overrides)["loss.kind"], dict(o.split("=") for o in v.overrides)
            ["loss.steps"]) for v in grid} - {("argmax_ce", "1")}
    seeds = {v.name: dict(o.split("=") for o in v.overrides).get("train.seed") for v in variants}
    assert sorted(n for n, s in seeds.items() if s) == sorted(f"{n}-seed{s}" for n, s in [
        ("mtp-soft_ce-s1", 1), ("mtp-soft_ce-s1", 2), ("eagle1-soft_ce-s1", 1), ("eagle1-soft_ce-s1", 2),
        ("mtp-lk_hybrid-s1", 1), ("mtp-soft_ce-s3-dpace", 1),
        ("eagle1-soft_ce-s3-dpace", 1), ("eagle3-s3", 1), ("eagle3-s3", 2), ("mtp-aux-s3-dpace", 1)])
    for name, seed in seeds.items():  # a seed variant is its base variant with train.seed added, nothing else
        if seed:
            base = next(v for v in variants if v.name == name.rsplit("-seed", 1)[0])
            assert [o for o in next(v for v in variants if v.name == name).overrides
                    if not o.startswith("train.seed=")] == list(base.overrides)
    assert mtp == {(k, s) for k in ("soft_ce", "tv", "nla", "lk_hybrid") for s in ("1", "3")}
    dpace = [v.name for v in variants if "loss.position_weights=dpace" in v.overrides]
    assert dpace == ["mtp-soft_ce-s3-dpace", "eagle1-soft_ce-s3-dpace", "mtp-soft_ce-s3-dpace-seed1",
                     "eagle1-soft_ce-s3-dpace-seed1", "mtp-aux-s3-dpace", "mtp-aux-s3-dpace-seed1",
                     "dflash-b8-l1", "dflash-b4-l1", "dflash-b16-l1", "dflash-b8-l2", "dflash-b4-l1-all",
                     "dspark-b4-l1"]
    # A block variant restates its head's recipe: one loss step per drafted slot (B - 1; DSpark's every slot: B).
    for v in (v for v in variants if v.head in ("dflash", "dspark")):
        block = int(next(o for o in v.overrides if o.startswith("head.block_size=")).split("=")[1])
        assert f"loss.steps={block - (v.head == 'dflash')}" in v.overrides
    assert "loss.steps=1" in cfg.train
    for v in variants:
        assert cc.head_available(v.head) is None
        run_dir = tmp_path / cc.VARIANTS_DIR / v.name
        shared = crun.train_overrides(cfg, v.head, tmp_path / "pc", "shared-regen", tmp_path,
                                       "models/smollm2-135m-instruct", 299, ["train.log_every=5"])
        ov = cc.variant_overrides(shared, v, run_dir)
        assert ov[:len(shared)] == shared and ov[-1] == f"out={run_dir}"  # the shared recipe first, untouched
        own = dict(o.split("=", 1) for o in v.overrides)
        c = typed(compose_train(ov), TrainConfig)
        assert c.head.type == v.head and c.out == str(run_dir) and c.train.max_steps == 299
        assert c.loss.steps == int(own["loss.steps"]) and c.train.seed == int(own.get("train.seed", 0))
        assert c.optim.lr == float(own.get("optim.lr", 1e-3))
        assert c.train.micro_batch_tokens == int(own.get("train.micro_batch_tokens", 2048))
        assert c.train.log_every == 5
        assert c.loss.kind == own.get("loss.kind", "soft_ce")
        assert c.head.draft_vocab_size == int(own.get("head.draft_vocab_size", 8192))
        eagle31 = v.name.startswith("eagle3.1")  # norm_output is eagle3's own setting
        assert c.head.aux_norm == eagle31 and (v.head != "eagle3" or c.head.settings.norm_output == eagle31)
        assert (c.head.features == "aux") == (v.head in ("eagle3", "dflash", "dspark") or v.name.startswith("mtp-aux"))
        assert c.loss.position_weights == ("dpace" if v.name in dpace else "decay")
    eagle3 = {v.name: int(dict(o.split("=", 1) for o in v.overrides)["loss.steps"]) for v in variants
              if v.head == "eagle3"}
    assert eagle3 == {"eagle3-s3": 3, "eagle3.1-s3": 3, "eagle3-s7": 7, "eagle3.1-s7": 7, "eagle3-s3-seed1": 3,
                      "eagle3-s3-seed2": 3}


def test_variant_selection_and_files(tmp_path):

    variants = cc.parse_variants({"b": {"head": "eagle1", "overrides": ["loss.kind=tv"]}, "a": {"head": "mtp"}})
    assert [(v.name, v.head, v.overrides) for v in variants] == [("b", "eagle1", ("loss.kind=tv",)),
                                                                  ("a", "mtp", ())]
    assert [v.name for v in cc.select(variants, "all")] == ["b", "a"]
    assert [v.name for v in cc.select(variants, "a,b,a")] == ["a", "b"]  # the given order, once each
    with pytest.raises(SystemExit, match="unknown variant.*c.*known: b, a"):
        cc.select(variants, "a,c")
    with pytest.raises(SystemExit, match="key=value"):
        cc.parse_variants({"x": {"head": "mtp", "overrides": ["loss.kind"]}})
    with pytest.raises(SystemExit, match="folder name"):
        cc.parse_variants({"../x": {"head": "mtp"}})
    (tmp_path / "v.yaml").write_text("variants:\n  s3: {head: mtp, overrides: [loss.steps=3]}\n")
    assert cc.load_variants_file(tmp_path / "v.yaml") == [cc.Variant("s3", "mtp", ("loss.steps=3",))]
    (tmp_path / "w.yaml").write_text("s1: {head: eagle1}\n")  # the mapping itself at the top level
    assert cc.load_variants_file(tmp_path / "w.yaml") == [cc.Variant("s1", "eagle1", ())]


def test_run_variants_skips_finished_ones_and_resumes_training():
    """The loop's bookkeeping on curve.json's `variants` (training and measuring stand in as recorders)."""

    plan = [(10, 16000), (20, 32000), (40, 64000)]
    calls: list[tuple] = []
    folders: set[tuple[str, int]] = set()

    def train(v, steps):
        calls.append(("train", v.name, tuple(steps)))
        folders.update((v.name, s) for s in steps)
        return {"train/loss": 1.0, "eval/top1": 0.4, "lr": 1e-3}

    def measure(v, step):
        calls.append(("measure", v.name, step))
        return {"step": step, "tokens": dict(plan)[step], "tau": 1.3 + step / 1000, "acceptance_rate": 0.1,
                "pos": [0.3, 0.05, 0.01], "seconds": 2.0}

    def run(results, variants, full_curve=False):
        return cv.run_variants(results, variants, plan, ["loss.steps=1"], full_curve, train, measure,
                               lambda: None, lambda v, step: (v.name, step) in folders)

    a, b = cc.Variant("a", "mtp", ("loss.kind=tv",)), cc.Variant("b", "mtp", ("loss.steps=3",))
    results: dict = {"command": "python -m bench.curve --variants a,b"}
    run(results, [a, b])
    assert calls == [("train", "a", (40,)), ("measure", "a", 40), ("train", "b", (40,)), ("measure", "b", 40)]
    row = results["variants"]["a"]
    assert (row["tau"], row["tokens"], row["step"], row["overrides"], row["head"]) == (1.34, 64000, 40,
                                                                                      ["loss.kind=tv"], "mtp")
    assert row["final"] == {"train/loss": 1.0, "eval/top1": 0.4} and list(row["points"]) == ["40"]
    assert results["variant_order"] == ["a", "b"]
    calls.clear()
    run(results, [b, a])  # both finished: nothing trained or measured again
    assert calls == [] and results["variant_order"] == ["a", "b"]
    # A killed run: the head was exported (the folder is there) but not measured → measured, not retrained.
    del results["variants"]["b"]["points"]["40"]
    run(results, [a, b])
    assert calls == [("measure", "b", 40)]
    calls.clear()
    # A changed definition is refused (its folder holds the old one's heads and checkpoint), by name.
    with pytest.raises(SystemExit, match="variant a is not what curve.json measured"):
        run(results, [cc.Variant("a", "mtp", ("loss.kind=nla",))])
    # --full-curve after a last-point-only run: the earlier exports do not exist, and resuming cannot make them.
    with pytest.raises(SystemExit, match=r"without exports at steps \[10, 20\]"):
        run(results, [a], full_curve=True)
    c = cc.Variant("c", "eagle3", ("loss.steps=7",))
    run(results, [c], full_curve=True)  # every point exported and measured, the last one's fields on the row
    assert calls == [("train", "c", (10, 20, 40)), ("measure", "c", 10), ("measure", "c", 20), ("measure", "c", 40)]
    assert sorted(results["variants"]["c"]["points"], key=int) == ["10", "20", "40"]
    assert results["variants"]["c"]["step"] == 40 and results["variant_order"] == ["a", "b", "c"]
    # A variant that batches otherwise (half the micro-batch tokens) reaches the same budget at its own last step.
    calls.clear()
    halves = [(20, 16000), (40, 32000), (80, 64000)]
    plan.extend(halves[2:])  # measure() looks a step's tokens up in `plan`
    d = cc.Variant("d", "mtp", ("train.micro_batch_tokens=1024",))
    cv.run_variants(results, [a, d], plan[:3], ["loss.steps=1"], False, train, measure, lambda: None,
                    lambda v, step: (v.name, step) in folders, plan_of=lambda v: halves if v is d else plan[:3])
    assert calls == [("train", "d", (80,)), ("measure", "d", 80)]
    assert (results["variants"]["d"]["step"], results["variants"]["d"]["tokens"]) == (80, 64000)


def test_variants_table_and_points_json(tmp_path):

    results = _synthetic()
    pos = [0.4, 0.1, 0.02]
    results["variants"] = {
        name: {"variant": name, "head": "mtp", "overrides": ov, "tokens": 131072, "step": 80, "tau": tau,
               "acceptance_rate": 0.2, "pos": pos, "seconds": 90.0,
               "points": {"80": {"step": 80, "tokens": 131072, "tau": tau, "acceptance_rate": 0.2, "pos": pos,
                                 "seconds": 90.0}}}
        for name, ov, tau in (("mtp-tv-s1", ["loss.kind=tv"], 1.42), ("mtp-nla-s1", ["loss.kind=nla"], 1.30))}
    results["variant_order"] = ["mtp-tv-s1", "mtp-nla-s1"]
    out = tmp_path / "run"
    out.mkdir()
    text = report.write_report(results, out, doc=tmp_path / "docs" / "curve.md")
    assert "| 16k (16384) | 10 | 1.100 | 0.100 / 0.050 / 0.025 | 1.120 |" in text  # the heads' table unchanged
    assert ("| `mtp-tv-s1` | `mtp` | `loss.kind=tv` | 131072 | 80 | 1.420 | – | 0.200 | 0.400 / 0.100 / 0.020 | 90 |"
            in text)
    assert text.index("mtp-tv-s1") < text.index("mtp-nla-s1")
    doc = json.loads((tmp_path / "docs" / "curve.json").read_text())
    assert (doc["best_tau_512k"], doc["best_variant"], doc["best_head"]) == (1.42, "mtp-tv-s1", "mtp")
    last = doc["heads"]["mtp"]["curve"][-1]
    assert (last["tokens"], last["step"], last["tau"]) == (131072, 80, 1.35)
    assert last["pos"] == pytest.approx([0.35, 0.175, 0.0875])
    assert doc["heads"]["mtp"]["mtp-nla-s1"] == [{"tokens": 131072, "step": 80, "tau": 1.30, "pos": pos}]
    assert "eagle1" in doc["heads"] and doc["max_steps"] == 80
    # With per-request counts: τ ± its SE, and each row's paired difference to the best row.
    reqs = {"tv": {"0": [10, 5], "1": [10, 4], "2": [20, 7]}, "nla": {"0": [12, 4], "1": [10, 3], "2": [20, 5]}}
    for name, key in (("mtp-tv-s1", "tv"), ("mtp-nla-s1", "nla")):
        results["variants"][name]["points"]["80"]["requests"] = reqs[key]
        results["variants"][name]["tau_se"] = 0.05
    table = report.variants_markdown(results)
    assert "| 1.420 ± 0.050 | – |" in table  # the best row itself
    from mtp_train.speculative.metrics import paired_tau_difference

    diff, se = paired_tau_difference(reqs["nla"], reqs["tv"])
    assert f"| 1.300 ± 0.050 | {diff:+.3f} ± {se:.3f} |" in table and diff < 0
    # A variant batched otherwise reaches the budget at another step: its last point still counts for the best.
    mb = {"step": 160, "tokens": 131500, "tau": 1.5, "acceptance_rate": 0.2, "pos": pos, "seconds": 90.0}
    results["variants"]["mtp-mb1024"] = {"variant": "mtp-mb1024", "head": "mtp", "overrides": [
        "train.micro_batch_tokens=1024"], "points": {"160": mb}, **mb}
    best = crec.points_json(results)
    assert (best["best_tau_512k"], best["best_variant"]) == (1.5, "mtp-mb1024")
    del results["variants"]
    assert report.variants_markdown(results) == ""  # no variants measured: the report is the heads' alone
    assert crec.points_json(results)["best_variant"] == "curve"  # then the best head of the curve itself


def test_a_committed_record_seeds_a_fresh_run(tmp_path):
    """docs/curve.json round-trips: a fresh checkout's curve.json takes its rows, heads and prompt lookup as
    measured (run_variants then skips them), keeps its own rows first, and refuses a seeded row whose definition
    changed."""

    results = _synthetic()
    pos = [0.4, 0.1, 0.02]
    point = {"step": 80, "tokens": 131072, "tau": 1.42, "acceptance_rate": 0.2, "pos": pos, "seconds": 90.0}
    results["recipe"] = ["loss.steps=1"]
    results["ngram"] = {"tau": 1.25, "pos": [0.1, 0.05, 0.02], "n_min": 1, "n_max": 3}
    results["variants"] = {"mtp-tv-s1": {"variant": "mtp-tv-s1", "head": "mtp", "overrides": ["loss.kind=tv"],
                                         "recipe": ["loss.steps=1"], "points": {"80": point}, **point}}
    results["variant_order"] = ["mtp-tv-s1"]
    record = json.loads(json.dumps(crec.points_json(results)))
    fresh: dict = {"variants": {"mtp-nla-s1": {"variant": "mtp-nla-s1", "head": "mtp", "overrides": ["loss.kind=nla"],
                                               "recipe": ["loss.steps=1"], "points": {"80": point}, **point}},
                   "variant_order": ["mtp-nla-s1"]}
    taken = crec.seed(fresh, record)
    assert taken == ["mtp-tv-s1", "mtp (curve)", "eagle1 (curve)", "prompt lookup"]
    assert fresh["variant_order"] == ["mtp-nla-s1", "mtp-tv-s1"] and fresh["max_steps"] == 80
    assert fresh["heads"]["mtp"]["points"]["80"]["tau"] == 1.35
    assert crec.seed(fresh, record) == []  # nothing new the second time
    calls = []
    cv.run_variants(fresh, [cc.Variant("mtp-tv-s1", "mtp", ("loss.kind=tv",))], [(80, 131072)], ["loss.steps=1"],
                    False, lambda v, s: calls.append(v) or {}, lambda v, s: calls.append(v) or {}, lambda: None,
                    lambda v, s: False)
    assert calls == []  # the seeded row counts as measured
    with pytest.raises(SystemExit, match="variant mtp-tv-s1 is not what curve.json measured"):
        cv.run_variants(fresh, [cc.Variant("mtp-tv-s1", "mtp", ("loss.kind=nla",))], [(80, 131072)],
                        ["loss.steps=1"], False, lambda v, s: {}, lambda v, s: {}, lambda: None, lambda v, s: False)
    again = crec.points_json(fresh)
    assert set(again["variants"]) == {"mtp-nla-s1", "mtp-tv-s1"} and again["best_tau_512k"] == 1.42


def _seed_row(head: str, overrides: list[str], requests: dict[str, list[int]]) -> dict:
    steps, accepted = sum(s for s, _ in requests.values()), sum(a for _, a in requests.values())
    tau = 1 + accepted / steps
    return {"variant": f"{head}-{'-'.join(overrides)}", "head": head, "overrides": overrides, "tokens": 131072,
            "step": 80, "tau": tau, "acceptance_rate": 0.2, "pos": [0.3], "seconds": 1.0,
            "points": {"80": {"step": 80, "tokens": 131072, "tau": tau, "pos": [0.3], "requests": requests}}}


def test_seeds_group_by_recipe_and_two_heads_compare_with_an_interval():

    assert cs.recipe_and_seed(["loss.steps=1", "train.seed=2", "loss.kind=tv"]) == (
        ("loss.kind=tv", "loss.steps=1"), 2)
    assert cs.recipe_and_seed(["loss.kind=tv"]) == (("loss.kind=tv",), 0)
    recipe = ["loss.kind=soft_ce", "loss.steps=1"]
    # mtp accepts 5 of 10 steps per request, eagle1 4 of 10 (seeds 0..2 shift both by one accepted token)
    rows = [_seed_row(head, recipe + ([f"train.seed={s}"] if s else []),
                      {str(i): [10, base + s - 1 + (i % 2)] for i in range(6)})
            for head, base in (("mtp", 5), ("eagle1", 4)) for s in range(3)]
    rows.append(_seed_row("mtp", ["loss.kind=tv"], {"0": [10, 3], "1": [10, 2]}))  # one seed: no comparison
    groups = cs.seed_groups(rows)
    assert sorted(groups[("mtp", tuple(recipe))]) == [0, 1, 2] and len(groups[("mtp", ("loss.kind=tv",))]) == 1
    (c,) = cs.comparisons(rows)
    assert (c["head_a"], c["head_b"], c["recipe"]) == ("mtp", "eagle1", recipe)
    assert c["diff"] == pytest.approx(0.1) and c["per_seed_diff"] == pytest.approx([0.1, 0.1, 0.1])
    assert c["seed_sd"] == pytest.approx(0.0, abs=1e-12) and c["se"] == pytest.approx(c["se_prompts"])
    assert c["ci95"][0] < 0.1 < c["ci95"][1]
    # a noisier eagle1 seed widens the interval through the seeds' spread, the pooled difference moves with it
    rows[4]["points"]["80"]["requests"] = {str(i): [10, 1 + (i % 2)] for i in range(6)}
    rows[4]["tau"] = 1 + sum(a for _, a in rows[4]["points"]["80"]["requests"].values()) / 60
    (wide,) = cs.comparisons(rows)
    assert wide["seed_sd"] > 0.1 and wide["se"] > c["se"] and wide["diff"] > c["diff"]
    assert wide["ci95"][1] - wide["ci95"][0] > 2 * 4.303 * wide["seed_sd"] / math.sqrt(3) * 0.99
    text = cs.seeds_markdown(rows)
    assert "| `mtp` − `eagle1` | `loss.kind=soft_ce loss.steps=1` |" in text and "| 0, 1, 2 |" in text
    assert cs.seeds_markdown(rows[:1]) == ""
    # per-seed differences pair seed numbers (the same batch order): heads without two seeds in common are not compared
    apart = [_seed_row(head, ["loss.kind=nla", f"train.seed={s}"], {"0": [10, 3], "1": [10, 2]})
             for head, seeds in (("mtp", (1, 2)), ("eagle1", (3, 4))) for s in seeds]
    assert len(cs.multi_seed_groups(apart)) == 2 and cs.comparisons(apart) == []
    results = {"eval": {"k": 3}, "max_steps": 80, "variants": {r["variant"]: r for r in rows}}
    assert crec.points_json(results)["seed_comparisons"][0]["head_b"] == "eagle1"
    assert "## Seeds" in report.variants_markdown(results)
