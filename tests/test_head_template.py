"""A head type is one folder: the template `tests/head_template/pair/` (two drafts from one forward, one setting of
its own, its drafter, an export layout with a reader, its `head=pair` conf file), copied into a temporary folder on
the head-type package's path with no other file of the package edited, is found by the registry's scan and runs
through every stage: `mtp-precompute` → `mtp-train head=pair head.mlp_ratio=3` → `mtp-eval method=head` (drafts
exactly: every greedy answer equals plain decoding) → `mtp-export format=pair-flat` and back (`import_from`)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import mtp_train.head_types
from mtp_train.cli.eval import eval_main
from mtp_train.cli.export import export_main
from mtp_train.cli.precompute import precompute_main
from mtp_train.cli.train import train_main
from mtp_train.config import HEAD_TYPES, HeadConfig
from mtp_train.config.checks import ConfigError
from mtp_train.config.store import head_type_confs
from mtp_train.export.layouts import LAYOUTS, export_formats, import_layouts
from mtp_train.heads import load_head
from tests.conftest import compose_config, make_chat_target, metrics_by_step, topic_conversations

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = Path(__file__).parent / "head_template" / "pair"


@pytest.fixture(scope="module")
def pair_folder(tmp_path_factory) -> Iterator[Path]:
    """The template copied into a fresh folder that joins `mtp_train.head_types`' search path, found by a rescan;
    everything it registered is removed afterwards."""
    root = tmp_path_factory.mktemp("head_types")
    shutil.copytree(TEMPLATE, root / "pair", ignore=shutil.ignore_patterns("__pycache__"))
    mtp_train.head_types.__path__.append(str(root))
    HEAD_TYPES.rescan()
    try:
        yield root / "pair"
    finally:
        from hydra.core.config_store import ConfigStore

        HEAD_TYPES.unregister("pair")
        if LAYOUTS.registered("pair-flat") is not None:
            LAYOUTS.unregister("pair-flat")
        mtp_train.head_types.__path__.remove(str(root))
        ConfigStore.instance().repo.get("head", {}).pop("pair.yaml", None)
        for name in [m for m in sys.modules if m.startswith("mtp_train.head_types.pair")]:
            del sys.modules[name]


def test_the_copied_folder_is_a_head_type_with_its_own_setting_layout_and_conf(pair_folder):
    t = HEAD_TYPES["pair"]
    assert t.module.__module__ == "mtp_train.head_types.pair.head"
    assert head_type_confs()["pair"] == pair_folder / "conf.yaml"
    assert "pair-flat" in export_formats() and "pair-flat" in import_layouts()
    cfg = HeadConfig.of(type="pair", mlp_ratio=3)
    assert cfg.settings.mlp_ratio == 3 and cfg.to_dict()["mlp_ratio"] == 3
    with pytest.raises(ValueError, match="head.mlp_ratio must be >= 1"):
        HeadConfig.of(type="pair", mlp_ratio=0)
    # its setting is its own: another type refuses it, and it refuses another type's
    with pytest.raises(ValueError, match="mlp_ratio"):
        HeadConfig.of(type="mtp", mlp_ratio=3)
    with pytest.raises(ValueError, match="block_size"):
        HeadConfig.of(type="pair", block_size=4)


def test_the_template_trains_drafts_exactly_in_eval_and_exports(pair_folder, tmp_path):
    target = make_chat_target(tmp_path / "target")
    convs, prompts = topic_conversations(tmp_path)
    precompute_main(compose_config("precompute", [
        f"model.path={target}", "model.device=cpu", f"data.paths=[{convs}]", f"out={tmp_path / 'pc'}",
        "max_seq_len=64", "progress=false", "val_fraction=0.25"]))
    train = [f"model.path={target}", "model.device=cpu", "model.backend=torch", f"data.dir={tmp_path / 'pc'}",
             "wandb.mode=disabled", "train.progress=false", "train.max_steps=6", "train.micro_batch_tokens=256",
             "train.eval_every=3", "train.eval_batches=2", "train.save_every=0", "optim.lr=1e-2",
             "optim.warmup_steps=1", "head=pair", f"spec_eval.prompts=[{prompts}]", "spec_eval.k=2",
             "spec_eval.max_new_tokens=8"]
    # the type derives loss.steps (two drafts per forward): a contradicting value is refused before any work
    with pytest.raises((ConfigError, ValueError), match="loss.steps"):
        train_main(compose_config("train", [*train, "loss.steps=3", f"out={tmp_path / 'bad'}"]))
    train_main(compose_config("train", [*train, "head.mlp_ratio=3", f"out={tmp_path / 'run'}"]))
    history = metrics_by_step(tmp_path / "run")
    evals = [m for m in history.values() if "eval/step1/top1" in m]  # both steps trained and validated
    assert evals and all(1.0 <= m["spec/tau"] <= 3.0 for m in evals), history
    head_dir = tmp_path / "run" / "heads" / "step-6"
    saved = json.loads((head_dir / "config.json").read_text())["head"]
    assert saved["type"] == "pair" and saved["mlp_ratio"] == 3

    base = [f"model.path={target}", "model.device=cpu", f"prompts=[{prompts}]", "max_new_tokens=16",
            "progress=false", "warmup=false", "plots=false", "ngram.compare=false", "k=2"]
    report = eval_main(compose_config("eval", [*base, "method=head", f"head_ckpt={head_dir}",
                                               f"out={tmp_path / 'eval'}"]))
    rows = [r for r in report["rows"] if r["method"] == "head"]
    assert rows and all(r["exact_match"] == 1.0 and 1.0 <= r["tau"] <= 3.0 for r in rows)
    assert all(r["mean_draft_len"] == 2 for r in rows)  # both drafts of every step come from its one forward

    exp = [f"model.path={target}", "model.device=cpu", f"head_ckpt={head_dir}"]
    export_main(compose_config("export", [*exp, "format=pair-flat", f"out={tmp_path / 'flat'}"]))
    cfg = json.loads((tmp_path / "flat" / "config.json").read_text())
    assert cfg["architectures"] == ["PairDraftModel"] and cfg["pair_config"] == {"mlp_ratio": 3}
    export_main(compose_config("export", [f"model.path={target}", "model.device=cpu",
                                          f"head_ckpt={tmp_path / 'flat'}", "import_from=pair-flat",
                                          f"out={tmp_path / 'back'}"]))
    trained, back = load_head(head_dir, target), load_head(tmp_path / "back", target)
    assert back.cfg.settings.mlp_ratio == 3
    own, again = trained.state_dict(), back.state_dict()
    assert own.keys() == again.keys() and all(torch.equal(own[k], again[k].to(own[k].dtype)) for k in own)
