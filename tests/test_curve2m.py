"""The 2M-token curve's configuration (conf/experiment/curve2m.yaml) and the head's own best k (bench/curve/kgrid.py),
without training: each recipe's values survive the curve's composition, the one precompute folder serves every
variant, the k grid's selection, bookkeeping and report on synthetic rows, and old records still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import ROOT, compose, compose_train
from bench.curve import config as cc
from bench.curve import data as cd
from bench.curve import kgrid as ck
from bench.curve import record as crec
from bench.curve import report
from bench.curve import run as crun
from bench.curve import variants as cv

CURVE2M = ROOT / "conf" / "experiment" / "curve2m.yaml"
MODEL = "models/smollm2-135m-instruct"
NUM_LAYERS = 30  # SmolLM2-135M


def _composed(cfg: cc.CurveConfig, tmp_path: Path) -> dict[str, tuple[object, object]]:
    """Per variant: the composed mtp-train config the curve trains it with (as bench.curve.run composes it) and
    its typed form."""
    from mtp_train.config import TrainConfig, typed

    out = {}
    for v in cc.parse_variants(cfg.variants):
        shared = crun.train_overrides(cfg, v.head, tmp_path / "pc", cfg.data.name, tmp_path, MODEL, 1100, [])
        conf = compose_train(cc.variant_overrides(shared, v, tmp_path / cc.VARIANTS_DIR / v.name))
        out[v.name] = (conf, typed(conf, TrainConfig))
    return out


def test_curve2m_config_points_data_and_eval():
    cfg = cc.load_config(CURVE2M)
    from bench.curve.plan import log_spaced

    assert log_spaced(cfg.tokens.first, cfg.tokens.last) == [65536 * 2**i for i in range(6)]  # 64k .. 2M
    assert cfg.heads == [] and cfg.full_curve and cfg.checkpoint_every == 64
    assert [v.name for v in cc.parse_variants(cfg.variants)] == ["chain-best", "eagle3-speculators",
                                                                  "dflash-reference", "peagle"]
    ev = cfg.eval
    assert (ev.prompts, ev.limit, ev.k, ev.max_new_tokens, ev.batch_size) == (["demo-heldout"], 48, 3, 96, 8)
    assert ev.k_grid == [1, 2, 3, 4, 5, 6] and ev.block_k_grid == [1, 2, 3, 4, 6, 8, 11, 15]
    # The shared list pins nothing a recipe sets: a key=value override beats a recipe group whatever the order.
    recipe_keys = ("loss.", "optim.", "head.", "train.optimizer", "deepspeed", "recipe")
    assert not [o for o in cfg.train if o.startswith(recipe_keys)]
    assert {o.split("=", 1)[0] for o in cfg.train} == {
        "train.micro_batch_tokens", "train.grad_accum", "train.eval_every", "train.eval_batches", "train.save_every",
        "train.log_every", "train.seed", "train.progress", "spec_eval.prompts", "resume", "wandb.mode"}
    # Its own conversations, precomputed here: every one of them, 1024-token samples, the union of the layers.
    assert cfg.data.paths == ["runs/curve2m/regenerated.jsonl"]
    pc = compose("precompute", [*cd.data_overrides(cfg, check=False), *cfg.precompute,
                                f"aux_layers=[{','.join(map(str, cfg.aux_layers or []))}]"])
    assert (pc.max_seq_len, pc.val_fraction, pc.limit) == (1024, 0.02, None)
    assert list(pc.data.paths) == cfg.data.paths and pc.data.format == "messages"
    assert list(pc.aux_layers) == [2, 9, 15, 21, 27, 28]


def test_data_paths_must_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = cc.CurveConfig(data=cc.CurveData(name="demo-regen", paths=["convs.jsonl"]))
    with pytest.raises(SystemExit, match=r"data.paths \['convs.jsonl'\] not found"):
        cd.data_overrides(cfg)
    (tmp_path / "convs.jsonl").write_text("")
    assert cd.data_overrides(cfg) == ["data=demo-regen", "data.paths=[convs.jsonl]"]
    assert cd.data_overrides(cc.CurveConfig()) == []  # no paths: the shared set or the demo's, as before


def test_each_recipe_survives_the_curves_composition(tmp_path):
    """The four variants composed as the curve composes them (head=, data, the shared list, then their own):
    each recipe's loss, optimiser, schedule, vocabulary and head settings stand, the shared batching applies."""
    cfg = cc.load_config(CURVE2M)
    composed = _composed(cfg, tmp_path)
    for name, (conf, c) in composed.items():
        assert c.train.micro_batch_tokens == 2048 and c.train.grad_accum == 1 and c.train.seed == 0
        assert c.train.max_steps == 1100 and c.resume == "auto" and c.wandb.mode == "disabled"
        assert list(c.spec_eval.prompts) == [] and c.out == str(tmp_path / cc.VARIANTS_DIR / name)
        assert c.data.name == "demo-regen" and list(c.data.paths) == ["runs/curve2m/regenerated.jsonl"]
        # every variant reads only layers of the curve's one folder
        reads = cc.reads_layers(conf, NUM_LAYERS)
        assert reads and set(reads) <= set(cfg.aux_layers or [])

    _, best = composed["chain-best"]  # mtp-aux-s3-dpace with the 512k curve's recipe restated as its own
    assert best.head.type == "mtp" and best.head.resolved(NUM_LAYERS).aux_layers == [2, 15, 27]
    assert (best.loss.kind, best.loss.steps, best.loss.position_weights, best.loss.w_tok) == ("soft_ce", 3, "dpace",
                                                                                              1.0)
    assert (best.optim.lr, best.optim.warmup_steps, best.optim.min_lr_ratio) == (1e-3, 10, 0.1)
    assert best.head.draft_vocab_size == 8192 and best.train.optimizer == "adamw"

    conf, e3 = composed["eagle3-speculators"]  # conf/recipe/speculators-eagle3.yaml
    assert e3.head.type == "eagle3" and e3.train.optimizer == "muon" and conf.deepspeed.name == "zero0"
    assert (e3.optim.lr, e3.optim.weight_decay, e3.optim.schedule, e3.optim.min_lr_ratio, e3.optim.grad_clip) == (
        1e-4, 0.01, "linear", 0.0, 1.0)
    assert (e3.loss.kind, e3.loss.steps, e3.loss.step_decay, e3.loss.noise_std, e3.loss.w_feat) == (
        "soft_ce", 3, 1.0, 0.05, 0.0)
    s = e3.head.settings
    assert s.norm_output and s.fc_input_norm and s.norm_before_residual and not s.train_lm_head
    assert e3.head.draft_vocab_size == 32000 and e3.optim.warmup_steps == 10  # its 1% warm-up

    conf, df = composed["dflash-reference"]  # conf/recipe/dflash-reference.yaml
    assert df.head.type == "dflash" and df.train.optimizer == "muon" and conf.deepspeed.name == "zero0"
    d = df.head.settings
    assert (d.layers, d.block_size, d.max_anchors, d.mask_token_id) == (5, 16, 512, 16)
    assert (df.loss.kind, df.loss.steps, df.loss.position_weights, df.loss.noise_std) == ("argmax_ce", 15, "dpace",
                                                                                          0.05)
    assert (df.optim.lr, df.optim.min_lr_ratio, df.optim.grad_clip) == (1e-4, 0.0, 1.0)
    assert cc.reads_layers(conf, NUM_LAYERS) == [2, 9, 15, 21, 28]  # z-lab's five: head.layers does not move them

    conf, pe = composed["peagle"]  # conf/head/peagle.yaml's own recipe, mtp-train's optimiser defaults
    assert pe.head.type == "peagle" and pe.loss.steps == 8 and pe.loss.mask_out_of_draft
    assert pe.head.settings.mask_token_id == 16  # the curve sets it: never emitted in chat, unlike 49151
    assert pe.head.draft_vocab_size == 32000 and pe.train.optimizer == "adamw"
    assert cc.reads_layers(conf, NUM_LAYERS) == [2, 15, 27]


def test_a_recipe_group_loses_to_a_value_override_in_any_order():
    """Why the shared list stays off the recipes' keys: Hydra applies key=value overrides after every group."""
    for ov in (["loss.steps=1", "head=eagle3", "recipe=speculators-eagle3"],
               ["head=eagle3", "recipe=speculators-eagle3", "loss.steps=1"]):
        c = compose_train(ov)
        assert c.loss.steps == 1 and c.train.optimizer == "muon"


# --- the head's own best k (bench/curve/kgrid.py) --------------------------------------------------------------------


def test_k_grid_selection_and_best_k():
    assert ck.drafter_bound(lambda k: k) is None  # a chain drafts as deep as asked
    assert ck.drafter_bound(lambda k: min(k, 15)) == 15  # a block of 16: 15 drafts at most
    assert ck.grid_for(None, [6, 1, 2, 3, 3], []) == [1, 2, 3, 6]
    assert ck.grid_for(15, [1, 2, 3, 4, 5, 6], []) == list(range(1, 16))  # every k the block drafts
    assert ck.grid_for(7, [1, 2, 3], [2, 4, 8, 15]) == [2, 4]  # block_k_grid cut at the bound
    with pytest.raises(SystemExit, match="k < 1"):
        ck.grid_for(None, [0, 1], [])
    by_k = {"1": {"tau": 1.3}, "2": {"tau": 1.5}, "3": {"tau": 1.5}, "4": {"tau": 1.45}}
    assert ck.best_k(by_k) == 2  # the smallest of equals
    rec = ck.k_grid_record(1024, 2097152, None, {k: {"tau": 1.0 + k / 10, "tau_se": 0.01 * k} for k in (3, 1, 2)})
    assert (rec["ks"], rec["best_k"], rec["best_tau"], rec["best_tau_se"]) == ([1, 2, 3], 3, 1.3, 0.03)
    assert list(rec["by_k"]) == ["1", "2", "3"]
    assert ck.has_grid({"k_grid": rec}, 1024) and not ck.has_grid({"k_grid": rec}, 512) and not ck.has_grid({}, 1)


def _point(step: int, tokens: int, tau: float) -> dict:
    return {"step": step, "tokens": tokens, "tau": tau, "tau_se": 0.02, "acceptance_rate": 0.2,
            "pos": [0.3, 0.1, 0.05], "seconds": 1.0, "requests": {"0": [10, 3], "1": [10, 4]}}


def test_run_variants_measures_the_grid_once_at_the_last_point():
    plan = [(10, 16000), (20, 32000)]
    calls: list[tuple] = []
    folders: set[tuple[str, int]] = set()

    def train(v, steps):
        calls.append(("train", v.name))
        folders.update((v.name, s) for s in steps)
        return {}

    def measure(v, step):
        calls.append(("measure", v.name, step))
        return _point(step, dict(plan)[step], 1.2)

    def grid(v, step, last):
        calls.append(("grid", v.name, step, last["tau"]))
        return ck.k_grid_record(step, dict(plan)[step], None, {3: last, 4: {"tau": 1.3}})

    def run(results, full_curve=True):
        cv.run_variants(results, [a], plan, ["train.seed=0"], full_curve, train, measure, lambda: None,
                        lambda v, s: (v.name, s) in folders, measure_grid=grid)

    a = cc.Variant("a", "mtp", ("loss.steps=3",))
    results: dict = {}
    run(results)
    assert calls == [("train", "a"), ("measure", "a", 10), ("measure", "a", 20), ("grid", "a", 20, 1.2)]
    assert results["variants"]["a"]["k_grid"]["best_k"] == 4
    calls.clear()
    run(results)  # done, grid included
    assert calls == []
    del results["variants"]["a"]["k_grid"]  # a row measured before grids: only the grid is measured
    run(results)
    assert calls == [("grid", "a", 20, 1.2)]
    calls.clear()
    del results["variants"]["a"]["k_grid"]
    folders.clear()  # a row taken from a record, its heads elsewhere: neither retrained nor measured
    run(results)
    assert calls == [] and "k_grid" not in results["variants"]["a"]


def _results_with_grids() -> dict:
    rows = {}
    for name, head, taus, bound in (("chain-best", "mtp", [1.30, 1.36, 1.40], None),
                                    ("dflash-reference", "dflash", [1.10, 1.20, 1.25], 15)):
        points = {str(s): _point(s, t, tau) for s, t, tau in zip((256, 512, 1024), (524288, 1048576, 2097152), taus)}
        last = points["1024"]
        by_k = {k: {"tau": 1.0 + 0.1 * k - (0.02 * k * k if bound is None else 0.001 * k), "tau_se": 0.01}
                for k in (range(1, 7) if bound is None else range(1, 16))}
        by_k[3] = {"tau": last["tau"], "tau_se": last["tau_se"]}
        rows[name] = {"variant": name, "head": head, "overrides": [], "recipe": ["train.seed=0"], "points": points,
                      **{k: last[k] for k in cv.LAST_FIELDS}, "k_grid": ck.k_grid_record(1024, 2097152, bound, by_k)}
    return {"command": "python -m bench.curve", "data": "synthetic", "data_dir": "/x", "recipe": ["train.seed=0"],
            "budget_tokens": 2097152, "max_steps": 1024, "points": [524288, 1048576, 2097152],
            "eval": {"prompts": ["demo-heldout"], "limit": 48, "k": 3, "max_new_tokens": 96, "batch_size": 8,
                     "k_grid": [1, 2, 3, 4, 5, 6], "block_k_grid": []},
            "heads": {}, "variants": rows, "variant_order": ["chain-best", "dflash-reference"]}


def test_report_best_k_columns_and_the_k_table(tmp_path):
    results = _results_with_grids()
    text = report.markdown(results) + report.variants_markdown(results)
    assert "| best k | τ at best k ± SE |" in text
    assert "No head trained on the shared recipe alone" in text and "## Fits" not in text  # variants only
    best = results["variants"]["chain-best"]["k_grid"]
    assert best["best_k"] == 3 and best["ks"] == [1, 2, 3, 4, 5, 6]  # 1.0 + 0.1k - 0.02k²: 1.12, 1.12, 1.40 (k=3)
    assert "| 1024 | 1.400 ± 0.020 | – | 0.200 | 0.300 / 0.100 / 0.050 | 1 | 3 | 1.400 ± 0.020 |" in text
    df = results["variants"]["dflash-reference"]["k_grid"]
    assert df["ks"] == list(range(1, 16)) and df["best_k"] == 15 and df["bound"] == 15
    assert "| k = 1 |" in text and "| k = 15 |" in text and "**1.400 ± 0.020**" in text
    assert "| `chain-best` | `mtp` | 2M | 1.080 ± 0.010 |" in text
    assert " – |" * 9 + " 3 | 1.400 ± 0.020 |" in text  # k = 7..15 not measured on a chain head
    # every point of the full-curve variants, token point by token point
    assert "| 512k | 1.300 ± 0.020 | 1.100 ± 0.020 |" in text and "| 2M | 1.400 ± 0.020 | 1.250 ± 0.020 |" in text
    out = tmp_path / "run"
    out.mkdir()
    report.write_report(results, out, doc=tmp_path / "docs" / "curve2m.md")
    doc = json.loads((tmp_path / "docs" / "curve2m.json").read_text())
    assert doc["best_k"]["chain-best"] == {"k": 3, "tau": 1.4, "tau_se": 0.02, "tokens": 2097152,
                                           "ks": [1, 2, 3, 4, 5, 6]}
    assert doc["variants"]["dflash-reference"]["k_grid"]["best_k"] == 15  # the rows in full: a fresh run resumes


def test_old_records_without_grids_still_load_and_report(tmp_path):
    results = _results_with_grids()
    for row in results["variants"].values():
        del row["k_grid"]
    results["eval"] = {k: v for k, v in results["eval"].items() if not k.startswith(("k_grid", "block_k_grid"))}
    assert cc.CurveEval(**results["eval"]).k_grid == []  # an old curve.json's settings
    text = report.variants_markdown(results)
    assert "best k" not in text and "τ at each k" not in text
    doc = crec.points_json(results)
    assert doc["best_k"] == {} and doc["heads_k_grid"] == {}
    # a head of the curve with a grid round-trips through the record
    results["heads"] = {"mtp": {"points": {"1024": _point(1024, 2097152, 1.3)},
                                "k_grid": ck.k_grid_record(1024, 2097152, None, {1: {"tau": 1.2}, 2: {"tau": 1.3}})}}
    results["head_order"] = ["mtp"]
    record = json.loads(json.dumps(crec.points_json(results)))
    assert record["best_k"]["mtp (curve)"]["k"] == 2
    fresh: dict = {}
    assert "mtp (curve)" in crec.seed(fresh, record)
    assert fresh["heads"]["mtp"]["k_grid"]["best_k"] == 2
    assert "`mtp (curve)`" in report.k_grid_markdown(results)
