"""Training checkpoints hold no pickle, resume from them is exact, and planted pickles never run.

The engine-level tests run DeepSpeed on a small module (CPU, gloo, a world of one); the run-level ones train a head
on a tiny random target for two steps, then tamper with its checkpoint the way a hostile folder would.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from mtp_train.cli.common import CONF_DIR, run_command
from mtp_train.cli.train import train_main
from mtp_train.config import ConfigError, DeepSpeedConfig, LoopConfig, OptimConfig, PrecomputeConfig, register_configs
from mtp_train.models import load_model
from mtp_train.precompute import Sample, precompute
from mtp_train.train.best import BestTracker, sync_best
from mtp_train.train.checkpoint import (
    CheckpointError,
    check_resume,
    load_engine_state,
    mark_latest,
    publish_best,
    read_best,
    save_engine_state,
    write_checksums,
)
from mtp_train.train.deepspeed_config import build_ds_config, make_lr_scheduler
from mtp_train.train.deepspeed_setup import prepare_deepspeed, release_deepspeed
from mtp_train.train.engine_state import decode, encode
from tests.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


class _Planted:
    """A pickle whose loading creates `marker`: the stand-in for code planted in a checkpoint file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant(path: Path, marker: Path) -> None:
    """Write a live payload to `path` (loading it with torch.load(weights_only=False) creates `marker`)."""
    torch.save(_Planted(marker), path)


def match_checksums(tag: Path) -> None:
    """Rewrite the checkpoint's checksums.json for its files as they are now: what a careful attacker does."""
    write_checksums(tag)


# --- the codec ----------------------------------------------------------------------------------------------------


class Stage(enum.IntEnum):
    two = 2


def test_the_codec_round_trips_an_optimizer_tree_as_json_and_tensors():
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "params": [0]}],
            "zero_stage": Stage.two, "shape": torch.Size([2, 3]), "$odd": "key"}
    tensors: dict[str, torch.Tensor] = {}
    doc = json.loads(json.dumps(encode(tree, tensors)))  # what a file holds is plain JSON
    back = decode(doc, tensors)
    assert back["state"][0]["exp_avg"].tolist() == [0.0, 1.0, 2.0, 3.0] and float(back["state"][0]["step"]) == 3
    assert back["param_groups"][0]["betas"] == (0.9, 0.95) and back["zero_stage"] == 2
    assert back["shape"] == (2, 3) and back["$odd"] == "key" and list(back["state"]) == [0]
    with pytest.raises(TypeError, match="cannot save a _Planted"):
        encode({"x": _Planted(Path("never"))}, {})


def test_decoding_sets_numbers_on_the_live_loss_scaler_and_builds_nothing_else():
    class Scaler:
        cur_scale, dynamic = 1.0, False

    live = Scaler()
    doc = {"loss_scaler": {"$loss_scaler": {"cur_scale": 4.0, "dynamic": True, "__class__": "os.system"}}}
    assert decode(doc, {}, live)["loss_scaler"] is live and live.cur_scale == 4.0 and live.dynamic is True
    assert type(live) is Scaler  # a name in the file is only a key to set, never a class to build


# --- the engine's state: exact, for ZeRO-0/1/2 --------------------------------------------------------------------


def _engine(stage: int, seed: int):
    import deepspeed

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    optim = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.01)
    cfg = build_ds_config(DeepSpeedConfig(zero_optimization={"stage": stage}), optim=optim, grad_accum=1, bf16=False)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg,
                                      lr_scheduler=make_lr_scheduler(optim, 20))
    return engine


def _steps(engine, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = engine(torch.randn(6, 7, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()


@pytest.fixture
def world_of_one():
    os.environ.setdefault("LOCAL_RANK", "0")
    assert prepare_deepspeed(torch.device("cpu"))
    yield
    release_deepspeed()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_resumed_engine_continues_exactly_as_the_uninterrupted_one(world_of_one, tmp_path, stage):
    a = _engine(stage, seed=0)
    _steps(a, 3, seed=1)
    tag = save_engine_state(a, tmp_path, 3, {"step": 3}, 0, 1, {"type": "tiny"})
    write_checksums(tag)
    mark_latest(tmp_path, 3)
    assert not list(tag.glob("*.pt"))
    assert {p.name for p in tag.iterdir()} == {"state.json", "model.safetensors", "optim-rank0.safetensors",
                                               "optim-rank0.json", "rng-rank0.json", "checksums.json"}
    found = check_resume("auto", tmp_path, 1, 0, head_type="tiny")
    b = _engine(stage, seed=5)  # other initial weights: everything must come from the files
    assert load_engine_state(b, *found, 0, 1) == {"step": 3}
    assert (b.global_steps, b.get_lr()) == (a.global_steps, a.get_lr())
    _steps(a, 2, seed=2)
    _steps(b, 2, seed=2)
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    base_a, base_b = (sa, sb) if stage == 0 else (sa["base_optimizer_state"], sb["base_optimizer_state"])
    for ka, kb in zip(base_a["state"].values(), base_b["state"].values(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(ka[key], kb[key], rtol=0, atol=0)
    if stage:  # ZeRO's fp32 master weights came from the file, not rounded from the module's
        for fa, fb in zip(sa["single_partition_of_fp32_groups"], sb["single_partition_of_fp32_groups"], strict=True):
            torch.testing.assert_close(fa, fb, rtol=0, atol=0)
    with pytest.raises(CheckpointError, match=r"state\.json holds the state of a 'tiny' head.*head\.type='mtp'"):
        check_resume("auto", tmp_path, 1, 0, head_type="mtp")


def test_deepspeeds_pickle_format_is_refused_by_name_unless_trusted(world_of_one, tmp_path):
    a = _engine(2, seed=0)
    _steps(a, 2, seed=1)
    ckpt = tmp_path / "checkpoints"
    a.save_checkpoint(str(ckpt), tag="step-2", client_state={"step": 2}, save_latest=False)  # an older version's
    mark_latest(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"step-2/mp_rank_00_model_states\.pt: a checkpoint in DeepSpeed's "
                                              r"pickle format.*resume=none.*resume_trust_pickles=true"):
        check_resume("auto", tmp_path, 1, 0, head_type="tiny")
    b = _engine(2, seed=5)
    with pytest.raises(CheckpointError, match="resume_trust_pickles=true"):  # the loader refuses on its own too
        load_engine_state(b, ckpt, "step-2", 0, 1)
    found = check_resume("auto", tmp_path, 1, 0, head_type="tiny", trust_pickles=True)
    assert load_engine_state(b, *found, 0, 1, trust_pickles=True)["step"] == 2
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


# --- a run's folder, tampered with --------------------------------------------------------------------------------


@dataclass
class Tiny:
    target: Path
    data: Path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint("llama", root / "target", seed=0)
    model = load_model(root / "target", dtype="float32", backend="torch")
    g = torch.Generator().manual_seed(0)
    samples = [Sample(id=f"s{i}", input_ids=torch.randint(0, 24, (int(n),), generator=g).tolist(),
                      loss_mask=[1] * int(n)) for i, n in enumerate(torch.randint(12, 40, (40,), generator=g))]
    cfg = PrecomputeConfig(out=str(root / "pc"), shard_tokens=1500, batch_tokens=2048, val_fraction=0.0,
                           progress=False)
    precompute(model, samples, cfg, tokenizer_fingerprint="tok", chat_template_fingerprint="tmpl",
               model_dir=root / "target", data_info={"name": "random"})
    return Tiny(root / "target", root / "pc")


def _cfg(tiny: Tiny, out: Path, steps: int):
    register_configs()
    overrides = [f"model.path={tiny.target}", "model.device=cpu", "model.backend=torch", f"data.dir={tiny.data}",
                 f"out={out}", "wandb.mode=disabled", "train.progress=false", "train.micro_batch_tokens=256",
                 "train.eval_batches=0", "train.save_every=0", "spec_eval.prompts=[]", f"train.max_steps={steps}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=overrides)


def _refused(cfg, capsys) -> str:
    """The one-line error of `mtp-train` on `cfg` (exit code 2)."""
    with pytest.raises(SystemExit) as e:
        run_command("mtp-train", train_main, cfg)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and err.startswith("mtp-train: error: "), err
    return err


@pytest.fixture(scope="module")
def run_folder(tiny, tmp_path_factory) -> Path:
    """A finished two-step run; tests copy it before tampering."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert train_main(_cfg(tiny, out, 2))["step"] == 2
    return out


def _copy(run_folder: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "run"
    shutil.copytree(run_folder, out)
    return out, out / "checkpoints" / "step-2"


def test_the_checkpoint_holds_only_safetensors_and_json(run_folder):
    tag = run_folder / "checkpoints" / "step-2"
    names = {p.name for p in tag.iterdir()}
    assert names == {"state.json", "model.safetensors", "optim-rank0.safetensors", "optim-rank0.json",
                     "rng-rank0.json", "checksums.json"}
    for name in names:
        head = (tag / name).read_bytes()[:2]
        assert head != b"PK" and head[:1] != b"\x80", name  # neither a torch.save zip nor a bare pickle
    state = json.loads((tag / "state.json").read_text())
    assert state["client"]["step"] == 2 and {"epoch", "position"} <= set(state["client"]["data"])
    assert state["head"]["type"] == "mtp" and state["zero_stage"] == 2 and state["world"] == 1
    assert state["lr_scheduler"]["last_epoch"] == 2


def test_planted_pickles_beside_ours_are_never_opened(tiny, run_folder, tmp_path):
    out, tag = _copy(run_folder, tmp_path)
    marker = tmp_path / "planted-ran"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng-rank0.pt"):
        plant(tag / name, marker)
    match_checksums(tag)
    assert train_main(_cfg(tiny, out, 3))["step"] == 3 and not marker.exists()


@pytest.mark.parametrize("name", ["model.safetensors", "optim-rank0.safetensors", "state.json", "optim-rank0.json"])
def test_a_pickle_in_place_of_our_file_with_matching_checksums_is_refused_unopened(tiny, run_folder, tmp_path,
                                                                                    capsys, name):
    out, tag = _copy(run_folder, tmp_path)
    marker = tmp_path / "planted-ran"
    plant(tag / name, marker)
    match_checksums(tag)
    kept = {n: (out / n).read_bytes() for n in ("config.yaml", "metrics.jsonl")}
    err = _refused(_cfg(tiny, out, 3), capsys)
    assert str(tag / name) in err and "resume=none" in err and not marker.exists()
    assert "safetensors" in err if name.endswith(".safetensors") else "JSON" in err
    assert {n: (out / n).read_bytes() for n in kept} == kept  # nothing of the run was rewritten


@pytest.mark.parametrize("drop_checksums", [False, True])
def test_a_folder_rewritten_in_deepspeeds_pickle_format_is_refused_unopened(tiny, run_folder, tmp_path, capsys,
                                                                            drop_checksums):
    """The old layout, planted: our files gone, DeepSpeed's `.pt` names holding payloads, the checksums matching
    (or removed together with the RNG files, which earlier versions only warned about)."""
    out, tag = _copy(run_folder, tmp_path)
    marker = tmp_path / "planted-ran"
    for p in tag.iterdir():
        p.unlink()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        plant(tag / name, marker)
    if drop_checksums:
        assert not list(tag.glob("rng-rank*")) and not (tag / "checksums.json").exists()
    else:
        match_checksums(tag)
    err = _refused(_cfg(tiny, out, 3), capsys)
    assert str(tag / "mp_rank_00_model_states.pt") in err and "pickle format" in err
    assert "resume_trust_pickles=true" in err and "resume=none" in err and not marker.exists()


def test_a_replaced_file_or_missing_checksums_are_refused_by_name(tiny, run_folder, tmp_path, capsys):
    out, tag = _copy(run_folder, tmp_path)
    good = (tag / "model.safetensors").read_bytes()
    (tag / "model.safetensors").write_bytes(good[:-4] + b"\0\0\0\0")  # not re-checksummed: damage
    err = _refused(_cfg(tiny, out, 3), capsys)
    assert str(tag / "model.safetensors") in err and "checksums.json" in err
    (tag / "model.safetensors").write_bytes(good)
    (tag / "checksums.json").unlink()
    assert "checksums.json is missing" in _refused(_cfg(tiny, out, 3), capsys)


def test_a_diverging_run_stops_with_its_step_and_keeps_the_last_good_checkpoint(tiny, tmp_path, capsys):
    """optim.lr=1e30: step 1's update leaves huge but finite weights (saved, save_every=1); step 2's loss is not
    finite, and the run stops there without writing step-2."""
    out = tmp_path / "run"
    cfg = _cfg(tiny, out, 4)
    cfg.optim.lr, cfg.train.save_every = 1e30, 1
    err = _refused(cfg, capsys)
    assert "step 2: the training loss is" in err and "the last checkpoint, step-1, stays" in err, err
    assert "lower optim.lr (now 1e+30)" in err
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-1"
    assert not (out / "checkpoints" / "step-2").exists() and not (out / "heads" / "step-2").exists()


# --- heads/best -------------------------------------------------------------------------------------------------


def _fake_head(out: Path, step: int) -> Path:
    """heads/step-N with the files an export writes (contents that name the step)."""
    d = out / "heads" / f"step-{step}"
    d.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "train_config.yaml"):
        (d / name).write_text(f"{name} of step {step}\n")
    return d


def test_heads_best_is_a_plain_copy_replaced_whole_and_synced_to_the_tracked_step(tmp_path):
    for step in (2, 4):
        _fake_head(tmp_path, step)
    best = publish_best(tmp_path, 2, {"metric": "eval/loss", "mode": "min", "value": 0.5, "step": 2})
    assert best == tmp_path / "heads" / "best" and not best.is_symlink()
    assert (best / "model.safetensors").read_text() == "model.safetensors of step 2\n"
    publish_best(tmp_path, 4, {"metric": "eval/loss", "mode": "min", "value": 0.4, "step": 4})
    assert read_best(tmp_path) == {"metric": "eval/loss", "mode": "min", "value": 0.4, "step": 4, "head": "step-4"}
    assert sorted(p.name for p in best.iterdir()) == ["best.json", "config.json", "model.safetensors",
                                                      "train_config.yaml"]
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == ["best", "step-2", "step-4"]  # no leftovers
    with pytest.raises(FileNotFoundError, match="step-9"):
        publish_best(tmp_path, 9, {})
    # A resumed state whose best is step 2 (the crash came before step 4's improvement was checkpointed).
    tracker = BestTracker("eval/loss", "min", 0.5, 2)
    sync_best(tmp_path, tracker)
    assert read_best(tmp_path)["step"] == 2
    assert (best / "config.json").read_text() == "config.json of step 2\n"
    sync_best(tmp_path, BestTracker("eval/loss", "min"))  # a state with no best yet shows none
    assert not best.exists()


def test_the_best_tracker_follows_its_direction_and_resumes_only_its_own_metric():
    assert BestTracker.from_config(LoopConfig(keep_best="eval/step1/tok_loss")).mode == "min"  # auto
    assert BestTracker.from_config(LoopConfig(keep_best="eval/alpha")).mode == "max"
    assert BestTracker.from_config(LoopConfig(keep_best="eval/loss", keep_best_mode="max")).mode == "max"
    with pytest.raises(ConfigError, match="keep_best_mode='best'.*auto | max | min"):
        LoopConfig(keep_best="eval/loss", keep_best_mode="best")
    t = BestTracker("spec/tau", "max")
    assert t.update({"eval/loss": 1.0}, 1) == {}  # not this rank's metric (spec/* exist on rank 0 only)
    assert t.update({"spec/tau": 1.2}, 2) == {"best/spec/tau": 1.2, "best/step": 2.0}
    assert t.update({"spec/tau": 1.2}, 3) == {} and t.update({"spec/tau": float("nan")}, 4) == {}  # a tie keeps 2
    assert t.update({"spec/tau": 1.1}, 5) == {} and t.step == 2
    assert t.update({"spec/tau": 1.3}, 6)["best/step"] == 6.0
    again = BestTracker("spec/tau", "max")
    again.load_state_dict(json.loads(json.dumps(t.state_dict())))  # as state.json holds it
    assert (again.value, again.step) == (1.3, 6)
    other = BestTracker("eval/loss", "min")
    other.load_state_dict(t.state_dict())  # kept by another metric: starts afresh
    assert other.value is None and other.update({"eval/loss": 9.0}, 7)
