"""`mtp-train data.source=offline|online|hybrid` on a tiny random chat target (CPU): the same conversations give
the same training whichever source computes the hidden states, and hybrid's folder is precompute's.

The target is a random 2-layer Llama with a small byte-level BPE tokenizer and a ChatML template, and the data a
few dozen conversations of varied length written here, so conversations → chat template → loss masks → split →
batches runs end to end through both commands.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from mtp_train.cli.common import CONF_DIR
from mtp_train.cli.precompute import precompute_main
from mtp_train.cli.train import train_main
from mtp_train.config import ConfigError, register_configs
from mtp_train.data.chat import load_tokenizer
from mtp_train.data.samples import load_rows
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute import Manifest, PrecomputedDataset
from mtp_train.train.trainer import Trainer
from tests.conftest import TOPICS, make_chat_target, metrics_by_step

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["it", "is", "old", "and", "very", "small", "bright", "cold", "round", "near", "far", "often", "seen"]
AUX = [0, 1, 2]  # hidden_states[j] of the 2-layer target: the embeddings, layer 0's output, the final norm's input
# The samples' settings, given to mtp-precompute and to mtp-train's data.online alike.
SAMPLES = {"max_seq_len": 96, "val_fraction": 0.15, "seed": 3}
STEPS = 8  # 2 micro-batches of 256 tokens a step: epoch 0 (11 batches) ends inside step 6


def _conversations(n: int, seed: int) -> list[dict[str, Any]]:
    """n conversations of 1-2 turns whose answers have 3..30 words, so the samples' lengths vary."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        msgs = []
        for _ in range(rng.choice([1, 1, 2])):
            msgs.append({"role": "user", "content": f"Tell me about {topic}."})
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
            msgs.append({"role": "assistant", "content": f"Here is a fact about {topic}: {answer}."})
        out.append({"id": f"c{i:03d}", "messages": msgs})
    return out


@dataclass
class Chat:
    root: Path
    target: Path  # tiny chat target with its tokenizer
    convs: Path  # messages JSONL


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Chat:
    root = tmp_path_factory.mktemp("sources")
    convs = _conversations(36, seed=0)
    texts = [m["content"] for c in convs for m in c["messages"]]
    target = make_chat_target(root / "target", texts=texts)
    path = root / "convs.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return Chat(root, target, path)


def _compose(name: str, overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(name, overrides=overrides)


def _precompute(chat: Chat, out: Path, *extra: str) -> Path:
    """mtp-precompute of the conversations with the shared sample settings (one rank)."""
    precompute_main(_compose("precompute", [
        f"model.path={chat.target}", "model.device=cpu", "model.backend=torch", f"data.paths=[{chat.convs}]",
        f"out={out}", "progress=false", "shard_tokens=700", *[f"{k}={v}" for k, v in SAMPLES.items()], *extra]))
    return out


def _train_overrides(chat: Chat, out: Path, source: str, *extra: str) -> list[str]:
    items = [f"model.path={chat.target}", "model.device=cpu", "model.backend=torch", f"data.source={source}",
             f"data.paths=[{chat.convs}]", *[f"data.online.{k}={v}" for k, v in SAMPLES.items()], f"out={out}",
             "wandb.mode=disabled", "train.progress=false", "train.micro_batch_tokens=256", "train.grad_accum=2",
             f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=4", "train.eval_batches=2",
             "train.save_every=0", "optim.lr=1e-2", "optim.warmup_steps=2", "loss.steps=2", "spec_eval.prompts=[]",
             *extra]
    merged: dict[str, str] = {}
    for item in items:  # later items replace earlier ones
        key, value = item.split("=", 1)
        merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


class Killed(RuntimeError):
    """Raised from the step hook: the run stops as if the job had been killed."""


def _train(chat: Chat, out: Path, source: str, *extra: str, stop_after: int | None = None,
           seen: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    def hook(trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if seen is not None:
            seen[step] = {"epoch": trainer.stream.epoch, "position": trainer.stream.position}
        if stop_after is not None and step == stop_after:
            raise Killed(f"killed after step {step}")

    return train_main(_compose("train", _train_overrides(chat, out, source, *extra)), on_step=hook)


_metrics = metrics_by_step


# bf16 storage: the hidden states of two runs agree to one bf16 rounding where their packings differ (fp32 sums in
# another order), which moves the losses by far less than this.
CLOSE = dict(rel=2e-3, abs=1e-4)
EXACT_KEYS = ("train/num_tokens", "train/samples_seen", "train/tokens_seen", "train/epoch", "train/lr")
CLOSE_KEYS = ("train/loss", "train/step1/loss", "train/feat_loss", "train/tok_loss", "train/grad_norm")


def _assert_same_training(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], exact: bool) -> None:
    """Step by step: the same batches (counts, epochs, lr exactly) and the same losses (exactly, or within the
    bf16 tolerance), and the same evaluations."""
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    tol = dict(rel=1e-6, abs=1e-9) if exact else CLOSE
    for s in a:
        for key in EXACT_KEYS:
            assert b[s][key] == a[s][key], (s, key)
        for key in CLOSE_KEYS + (("train/top1",) if exact else ()):
            assert b[s][key] == pytest.approx(a[s][key], **tol), (s, key)
        for key in ("eval/loss", "eval/step1/loss"):
            if key in a[s]:
                assert b[s][key] == pytest.approx(a[s][key], **tol), (s, key)
    assert a[STEPS]["train/epoch"] >= 1  # the comparison crossed an epoch boundary


def _head_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "heads" / f"step-{STEPS}" / "model.safetensors"))


def _assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-2, atol=2e-3, msg=k)


# --- online equals offline ------------------------------------------------------------------------------------


HEAD_ARGS = {  # loss.steps=2 stays the command line's (a head group's recipe comes first)
    "mtp": ["head=mtp"],
    "eagle3": ["head=eagle3", "head.draft_vocab_size=64", f"head.aux_layers=[{','.join(map(str, AUX))}]"],
    "dflash": ["head=dflash", "head.block_size=3", f"head.aux_layers=[{','.join(map(str, AUX))}]"],
}


@pytest.mark.parametrize("head", ["mtp", "eagle3", "dflash"])
def test_online_training_equals_offline_on_the_same_conversations(chat, tmp_path, head):
    head_args = HEAD_ARGS[head]
    pc = _precompute(chat, tmp_path / "pc", *(["aux_layers=[0,1,2]"] if head != "mtp" else []))
    offline = _train(chat, tmp_path / "offline", "offline", f"data.dir={pc}", *head_args)
    online = _train(chat, tmp_path / "online", "online", f"data.dir={tmp_path / 'never'}", *head_args)
    _assert_same_training(_metrics(tmp_path / "offline"), _metrics(tmp_path / "online"), exact=False)
    assert online["eval/top1"] == pytest.approx(offline["eval/top1"], abs=0.02)
    _assert_close_weights(_head_weights(tmp_path / "offline"), _head_weights(tmp_path / "online"))
    assert not (tmp_path / "never").exists()  # online writes nothing but its run folder
    config = json.loads((tmp_path / "online" / "heads" / f"step-{STEPS}" / "config.json").read_text())
    assert config["extra"]["data_source"] == "online" and config["extra"]["data_paths"] == [str(chat.convs)]


def test_online_samples_split_and_order_are_a_one_rank_precomputes(chat, tmp_path):
    """The conversation → sample path is precompute's: same ids, tokens, masks, split and order."""
    pc = _precompute(chat, tmp_path / "pc")
    from mtp_train.config import TrainConfig, typed
    from mtp_train.train.sources.online import split_rows

    tc = typed(_compose("train", _train_overrides(chat, tmp_path / "x", "online")), TrainConfig)
    rows, info = load_rows(load_tokenizer(chat.target), tc.precompute_config(), vocab_size=10**6)
    manifest = Manifest.load(pc)
    assert info == manifest.data
    for split in ("train", "val"):
        folder = PrecomputedDataset(pc, split=split)
        tokens = split_rows(rows, split, tc)
        assert tokens.ids == folder.ids and tokens.lengths == folder.lengths.tolist() and len(tokens) > 0
        for i in range(len(folder)):
            a, b = folder[i], tokens[i]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(folder.token_counts(400), tokens.token_counts(400))


# --- hybrid -----------------------------------------------------------------------------------------------------

HYBRID = ("data.online.shard_tokens=700", "train.save_every=2")


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*"))}


def _manifest_core(folder: Path) -> dict[str, Any]:
    d = Manifest.load(folder).to_dict()
    d.pop("created_at")
    for key in ("run", "config"):  # the paths of the run and of its folder
        d["provenance"].pop(key)
    return d


@pytest.fixture(scope="module")
def hybrid_run(chat, tmp_path_factory) -> tuple[Path, Path, dict[int, dict[str, Any]]]:
    """An uninterrupted hybrid run: (run folder, its data.dir, epoch/position after each step)."""
    root = tmp_path_factory.mktemp("hybrid")
    seen: dict[int, dict[str, Any]] = {}
    _train(chat, root / "run", "hybrid", f"data.dir={root / 'pc'}", *HYBRID, seen=seen)
    return root / "run", root / "pc", seen


def test_hybrid_writes_a_precompute_folder_and_trains_as_online(chat, hybrid_run, tmp_path):
    run, folder, seen = hybrid_run
    online = _train(chat, tmp_path / "online", "online", *HYBRID)
    _assert_same_training(_metrics(tmp_path / "online"), _metrics(run), exact=False)
    _assert_close_weights(_head_weights(tmp_path / "online"), _head_weights(run))
    assert online["step"] == STEPS

    # The folder is precompute's: readable with every check, the same samples and split as mtp-precompute
    # gives, and hidden states equal to its up to one bf16 rounding.
    manifest = Manifest.load(folder)
    assert manifest.provenance["writer"] == "mtp-train data.source=hybrid" and len(manifest.shards) >= 4
    pc = _precompute(chat, tmp_path / "pc")
    ref = Manifest.load(pc)
    assert manifest.split.counts == ref.split.counts
    assert (manifest.totals.samples, manifest.totals.tokens, manifest.totals.loss_tokens) == (
        ref.totals.samples, ref.totals.tokens, ref.totals.loss_tokens)  # (other shards: other header bytes)
    assert manifest.data == ref.data and manifest.target == ref.target and manifest.hidden == ref.hidden
    tok = load_tokenizer(chat.target)
    from mtp_train.data import chat_template_fingerprint, tokenizer_fingerprint

    mine = PrecomputedDataset(folder, expect_target_fingerprint=weights_fingerprint(chat.target),
                              expect_tokenizer_fingerprint=tokenizer_fingerprint(tok),
                              expect_chat_template_fingerprint=chat_template_fingerprint(tok), split="all",
                              verify="always")
    theirs = PrecomputedDataset(pc, split="all")
    assert sorted(mine.ids) == sorted(theirs.ids)
    index = {sid: i for i, sid in enumerate(theirs.ids)}
    for i in range(len(mine)):
        a, b = mine[i], theirs[index[mine.ids[i]]]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["hidden"].float(), b["hidden"].float(), rtol=1e-2, atol=1e-2)
        assert a.keys() == b.keys()
        if "aux_hidden" in a:
            torch.testing.assert_close(a["aux_hidden"].float(), b["aux_hidden"].float(), rtol=1e-2, atol=1e-2)
    for split in ("train", "val"):
        assert sorted(PrecomputedDataset(folder, split=split).ids) == sorted(PrecomputedDataset(pc, split=split).ids)
    # ... and mtp-train data.source=offline trains on it.
    result = _train(chat, tmp_path / "offline", "offline", f"data.dir={folder}", "train.max_steps=2")
    assert result["step"] == 2 and result["eval/num_tokens"] > 0


def test_a_block_drafter_trains_from_hybrid_and_its_folder_holds_its_aux_layers(chat, tmp_path):
    """data.source=hybrid with head=dflash writes the aux layers the head reads (the folder is finished with epoch
    0, inside step 6), and offline training reads them."""
    head = HEAD_ARGS["dflash"]
    result = _train(chat, tmp_path / "run", "hybrid", f"data.dir={tmp_path / 'pc'}", *HYBRID, *head)
    assert result["step"] == STEPS and result["eval/num_tokens"] > 0
    assert Manifest.load(tmp_path / "pc").hidden.aux_layers == AUX
    again = _train(chat, tmp_path / "offline", "offline", f"data.dir={tmp_path / 'pc'}", *head, "train.max_steps=2")
    assert again["step"] == 2 and again["eval/num_tokens"] > 0


@pytest.mark.parametrize("phase", ["epoch0", "epoch1"])
def test_hybrid_killed_in_either_phase_resumes_to_the_uninterrupted_run(chat, hybrid_run, tmp_path, phase, caplog):
    run, folder, seen = hybrid_run
    first_of_epoch1 = min(s for s, v in seen.items() if v["epoch"] >= 1)
    # epoch0: killed right after the checkpoint of step 2, with the shard of batches 3.. half filled in memory;
    # epoch1: killed after the folder was written, resumed from a checkpoint in epoch 1.
    stop = 2 if phase == "epoch0" else first_of_epoch1 + 1
    assert (seen[stop]["epoch"] == 0) == (phase == "epoch0")
    out, pc = tmp_path / "run", tmp_path / "pc"
    with pytest.raises(Killed):
        _train(chat, out, "hybrid", f"data.dir={pc}", *HYBRID, stop_after=stop)
    assert (pc / "manifest.json").exists() == (phase == "epoch1")
    if phase == "epoch0":
        (pc / ".tmp-shard-r0-00001.safetensors").write_bytes(b"torn")  # a write the kill interrupted
    with caplog.at_level(logging.INFO, logger="mtp_train.train.sources.hybrid"):
        _train(chat, out, "hybrid", f"data.dir={pc}", *HYBRID)  # resume=auto
    # epoch 0: the samples of the open shard computed before the checkpoint were lost with the process: replayed
    assert ("recomputed 1 micro-batch(es)" in caplog.text) == (phase == "epoch0"), caplog.text
    _assert_same_training(_metrics(run), _metrics(out), exact=True)
    assert _folder_files(pc) == _folder_files(folder)
    assert _manifest_core(pc) == _manifest_core(folder)
    assert not list(pc.glob(".tmp-*"))


def test_hybrid_resumed_past_epoch0_redoes_a_lost_shard(chat, hybrid_run, tmp_path):
    run, folder, seen = hybrid_run
    out, pc = tmp_path / "run", tmp_path / "pc"
    stop = min(s for s, v in seen.items() if v["epoch"] >= 1) + 1
    with pytest.raises(Killed):
        _train(chat, out, "hybrid", f"data.dir={pc}", *HYBRID, stop_after=stop)
    (pc / "shard-r0-00001.safetensors").unlink()
    (pc / "manifest.json").unlink()
    _train(chat, out, "hybrid", f"data.dir={pc}", *HYBRID)
    _assert_same_training(_metrics(run), _metrics(out), exact=True)
    assert _folder_files(pc) == _folder_files(folder)


@pytest.mark.slow
def test_two_ranks_with_a_tensor_parallel_target_write_one_folder(chat, hybrid_run, tmp_path):
    """torchrun, 2 processes: the target split over both (model.tp=2), each rank its own batches. Within epoch 0
    the global batches are one rank's with twice the accumulation; epoch 0's 11 batches are evened out to 12 with
    a copy of the first, whose samples the folder still holds once."""
    run, folder, seen = hybrid_run
    out, pc = tmp_path / "run", tmp_path / "pc"
    args = _train_overrides(chat, out, "hybrid", f"data.dir={pc}", *HYBRID, "train.grad_accum=1", "model.tp=2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mtp_train.cli.train", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    a, b = _metrics(run), _metrics(out)
    for s in range(1, 6):  # steps 1-5: batches 0-9 of epoch 0, the same in both
        for key in ("train/num_tokens", "train/samples_seen"):
            assert b[s][key] == a[s][key], (s, key)
        for key in CLOSE_KEYS:
            assert b[s][key] == pytest.approx(a[s][key], **CLOSE), (s, key)
    manifest = Manifest.load(pc)
    assert {s.rank for s in manifest.shards} == {0, 1} and manifest.provenance["settings"]["tp"] == 2
    one = Manifest.load(folder)
    assert manifest.split == one.split and (manifest.totals.samples, manifest.totals.tokens) == (
        one.totals.samples, one.totals.tokens)  # (other shards: other header bytes)
    ours, theirs = PrecomputedDataset(pc, split="all", verify="always"), PrecomputedDataset(folder, split="all")
    assert sorted(ours.ids) == sorted(theirs.ids) and len(set(ours.ids)) == len(ours.ids)
    index = {sid: i for i, sid in enumerate(theirs.ids)}
    for i in range(len(ours)):
        x, y = ours[i], theirs[index[ours.ids[i]]]
        assert torch.equal(x["input_ids"], y["input_ids"])
        torch.testing.assert_close(x["hidden"].float(), y["hidden"].float(), rtol=1e-2, atol=1e-2)


# --- errors -----------------------------------------------------------------------------------------------------


def test_sources_are_registered_by_name_and_an_unknown_one_is_refused():
    """Each source module adds its class where it defines it; the registry, declared on the settings floor, finds
    the modules by scanning the package, and the settings and `source_class` refuse an unknown name naming them."""
    from mtp_train.config import DATA_SOURCES, TrainDataConfig
    from mtp_train.train.sources import source_class
    from mtp_train.train.sources.base import DataSource

    assert sorted(DATA_SOURCES) == ["fleet", "hybrid", "offline", "online"]
    assert all(cls.name == name for name, cls in DATA_SOURCES.items())
    assert [n for n, cls in DATA_SOURCES.items() if cls.writes_folder] == ["hybrid"]
    assert {n for n, cls in DATA_SOURCES.items() if cls.plans_from_conversations} == {"online", "hybrid", "fleet"}
    with pytest.raises(ConfigError) as e:
        source_class("streaming")
    assert "data.source='streaming'" in str(e.value) and "choose one of fleet | hybrid | offline | online" in str(
        e.value)
    with pytest.raises(ConfigError) as e:
        TrainDataConfig(source="streaming")
    assert "data.source='streaming': choose one of fleet | hybrid | offline | online (offline reads" in str(e.value)

    class Again(DataSource):
        name = "online"

    with pytest.raises(ValueError, match="data source 'online' is registered twice"):
        DATA_SOURCES.add(Again)

    class Streaming(DataSource):
        name = "streaming"

    DATA_SOURCES.add(Streaming)  # a source registered at run time (a plug-in of another package) is accepted
    try:
        assert source_class("streaming") is Streaming and TrainDataConfig(source="streaming").source == "streaming"
    finally:
        DATA_SOURCES.unregister("streaming")
    assert source_class("online").__name__ == "OnlineSource" and "streaming" not in DATA_SOURCES


def test_online_and_hybrid_settings_are_refused_by_key(chat, tmp_path):
    def refused(source: str, *extra: str) -> str:
        with pytest.raises((ValueError, ConfigError)) as e:
            _train(chat, tmp_path / "run", source, *extra)
        return str(e.value)

    assert "data.source=online reads conversations from data.paths" in refused("online", "data.paths=[]")
    assert "data.online.val_fraction must be in [0, 1)" in refused("online", "data.online.val_fraction=1.5")
    assert "data.online.hidden_dtype='int4'" in refused("hybrid", "data.online.hidden_dtype=int4")
    assert "set model.path" in refused("online", "model.path=''")
    assert "model.tp=2 must divide the number of processes (1)" in refused("online", "model.tp=2")
    assert "choose one of fleet | hybrid | offline | online" in refused("streaming")
    assert "data.online.max_seq_len" in refused("online", "data.online.max_seq_len=0")
    msg = refused("hybrid", f"data.dir={tmp_path / 'run'}")
    assert "data.dir" in msg and "out=" in msg
    pc = _precompute(chat, tmp_path / "pc")
    before = _folder_files(pc)
    msg = refused("hybrid", f"data.dir={pc}")
    assert "no hybrid run wrote" in msg and "data.source=offline" in msg
    assert _folder_files(pc) == before and not (tmp_path / "run" / "checkpoints").exists()
