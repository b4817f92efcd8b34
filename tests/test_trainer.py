"""`mtp-train` on a tiny random target (CPU, DeepSpeed ZeRO over gloo): learning, ranks, resume, checkpoints, W&B.

The precompute folder is made once per module from random token sequences over a small part of the vocabulary
(the head has few embeddings to learn, so a few dozen steps show it learning) with random loss masks.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file

from mtp_train.cli.common import CONF_DIR
from mtp_train.cli.train import train_main
from mtp_train.config import HeadConfig, LossConfig, PrecomputeConfig, register_configs
from mtp_train.data.sampler import LengthBucketedBatchSampler
from mtp_train.heads import FrozenTargetParts, build_head, load_head
from mtp_train.models import load_model
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute import (
    ManifestMismatchError,
    PrecomputedDataset,
    Sample,
    precompute,
)
from mtp_train.speculative.chain import inference_chain
from mtp_train.train.checkpoint import latest_tag, resolve_resume
from mtp_train.train.data import MicroBatchStream, eval_batches
from mtp_train.train.evaluation import evaluate
from mtp_train.train.losses import unrolled_loss
from mtp_train.train.trainer import Trainer
from tests.conftest import make_tiny_checkpoint, metrics_by_step

ROOT = Path(__file__).resolve().parents[1]
CONF = Path(CONF_DIR)
VOCAB_USED = 24  # tokens 0..23 of the tiny target's 256


pytestmark = pytest.mark.usefixtures("one_thread")


def make_train_samples(n: int, seed: int) -> list[Sample]:
    """n random sequences of 12..47 tokens from the first VOCAB_USED ids, with ~70% of tokens in the loss."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(12, 48, (1,), generator=g))
        ids = torch.randint(0, VOCAB_USED, (length,), generator=g).tolist()
        mask = (torch.rand(length, generator=g) < 0.7).long().tolist()
        out.append(Sample(id=f"s{seed}-{i:04d}", input_ids=ids, loss_mask=mask))
    return out


@dataclass
class Setup:
    target: Path  # tiny random llama (untied embedding and lm_head)
    other: Path  # another tiny target of the same shape (other weights)
    data: Path  # precompute folder of `target`: ~3.5k tokens, 15% val


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    root = tmp_path_factory.mktemp("train")
    make_tiny_checkpoint("llama", root / "target", seed=0)
    make_tiny_checkpoint("llama", root / "other", seed=1)
    model = load_model(root / "target", dtype="float32", backend="torch")
    cfg = PrecomputeConfig(out=str(root / "pc"), shard_tokens=1500, batch_tokens=2048, val_fraction=0.15, seed=0,
                           progress=False)
    precompute(model, make_train_samples(120, 0), cfg, tokenizer_fingerprint="tok-fp",
               chat_template_fingerprint="tmpl-fp", model_dir=root / "target", data_info={"name": "random"})
    return Setup(root / "target", root / "other", root / "pc")


def _overrides(setup: Setup, out: Path, *extra: str) -> list[str]:
    """A small, fast run; later `key=value` items replace earlier ones."""
    items = [f"model.path={setup.target}", "model.device=cpu", "model.backend=torch", f"data.dir={setup.data}",
             f"out={out}", "wandb.mode=disabled", "train.progress=false", "train.micro_batch_tokens=512",
             "train.log_every=1", "train.eval_every=0", "train.eval_batches=4", "train.save_every=0",
             "optim.lr=1e-2", "optim.warmup_steps=5", "spec_eval.prompts=[]", *extra]
    merged: dict[str, str] = {}
    for item in items:
        key, value = item.split("=", 1)
        merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def _cfg(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=overrides)


_metrics = metrics_by_step


def _baseline_top1(setup: Setup, split: str = "val") -> float:
    """Top-1 of always guessing the most frequent target argmax among the counted positions."""
    frozen = FrozenTargetParts.from_pretrained(setup.target, dtype=torch.float32)
    ds = PrecomputedDataset(setup.data, split=split)
    best = []
    for i in range(len(ds)):
        item = ds[i]
        argmax = frozen.logits(item["hidden"].float()).argmax(-1)  # the target's next token at every row
        mask = item["loss_mask"].bool()
        best.append(argmax[1:][mask[1:]])  # row i of the head predicts row i+1's distribution
    counts = torch.bincount(torch.cat(best))
    return float(counts.max() / counts.sum())


# --- the W&B transaction log --------------------------------------------------------------------------------------


def _wandb_records(path: Path) -> list[bytes]:
    """Records of a `.wandb` file: a 7-byte file header, then a LevelDB-style log of 32 KiB blocks whose chunks
    carry (crc32, length, type) headers; types 1 = full, 2 = first, 3 = middle, 4 = last."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, out, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            out.append(part + chunk)
    return out


def _wandb_history(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(history rows, config) of the one offline run under a W&B dir."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    rows, config = [], {}
    for raw in _wandb_records(files[0]):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows.append({it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item})
        elif kind == "run":  # the run record carries the config passed to wandb.init
            config.update({it.key: json.loads(it.value_json) for it in rec.run.config.update})
    return rows, config


# --- tiny training runs -------------------------------------------------------------------------------------------


class SimulatedCrash(RuntimeError):
    """Raised from the step hook: the run stops as if the job had been killed."""


@dataclass
class Run:
    out: Path
    result: dict[str, Any]
    seen: dict[str, Any]  # what the step hook saw inside the trainer at the last step


def _train(setup: Setup, out: Path, *extra: str, inspect: bool = False, stop_after: int | None = None) -> Run:
    seen: dict[str, Any] = {}

    def hook(trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if inspect:
            frozen = trainer.head.frozen
            seen.update(embed=frozen.embed.clone(), lm_head=frozen.lm_head.clone(),
                        embed_grad=frozen.embed.requires_grad or frozen.lm_head.requires_grad,
                        module_params={n: tuple(p.shape) for n, p in trainer.engine.module.named_parameters()},
                        optimizer_numel=sum(p.numel() for g in trainer.engine.optimizer.optimizer.param_groups
                                            for p in g["params"]),
                        frozen_ptrs={frozen.embed.data_ptr(), frozen.lm_head.data_ptr()},
                        param_ptrs={p.data_ptr() for p in trainer.engine.module.parameters()})
        if stop_after is not None and step == stop_after:
            raise SimulatedCrash(f"simulated kill after step {step}")

    result = train_main(_cfg(_overrides(setup, out, *extra)), on_step=hook)
    return Run(out, result, seen)


STEPS = 50


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory) -> dict[str, Run]:
    """A 50-step run per head type; the mtp one logs to W&B `online` without a key (so: offline)."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        mp.setenv("HOME", str(root))  # no ~/.netrc: no key anywhere
        mp.setenv("WANDB_DIR", str(root / "wandb-env"))
        mp.setenv("WANDB_SILENT", "true")
        runs["mtp"] = _train(setup, root / "mtp", "head=mtp", f"train.max_steps={STEPS}", "train.eval_every=25",
                             "train.save_every=25", "wandb.mode=online", f"wandb.dir={root / 'wandb'}",
                             "wandb.name=tiny-mtp", inspect=True)
    runs["eagle1"] = _train(setup, root / "eagle1", "head=eagle1", f"train.max_steps={STEPS}", inspect=True)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("head", ["mtp", "eagle1"])
def test_tiny_run_learns(setup, trained, head):
    run = trained[head]
    m = _metrics(run.out)
    losses = [m[s]["train/loss"] for s in range(1, STEPS + 1)]
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert last < 0.85 * first, (first, last)
    baseline = _baseline_top1(setup)
    top1 = run.result["eval/top1"]
    assert top1 > 1.5 * baseline, (top1, baseline)
    # the last step runs at schedule step STEPS-1: cosine from lr to 0.1·lr after 5 warmup steps
    progress = (STEPS - 1 - 5) / (STEPS - 5)
    assert m[STEPS]["train/lr"] == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))))
    for key in ("train/feat_loss", "train/tok_loss", "train/step0/top1", "train/step0/top3", "train/grad_norm",
                "train/tokens_per_s", "train/samples_seen", "eval/step0/top3", "eval/loss"):
        assert key in m[STEPS], key
    # the measured peak (this CPU process's resident high-water mark): at least the torch runtime, and it never falls
    peaks = [m[s]["train/peak_memory_gib"] for s in sorted(m) if "train/peak_memory_gib" in m[s]]
    assert peaks and peaks[0] > 0.1 and peaks == sorted(peaks), peaks
    assert run.result["head_dir"] == str(run.out / "heads" / f"step-{STEPS}")


@pytest.mark.slow
def test_frozen_target_tensors_stay_out_of_engine_optimizer_and_checkpoints(setup, trained):
    target = FrozenTargetParts.from_pretrained(setup.target, dtype=torch.float32)
    for head, run in trained.items():
        seen = run.seen
        torch.testing.assert_close(seen["embed"], target.embed, rtol=0, atol=0)
        torch.testing.assert_close(seen["lm_head"], target.lm_head, rtol=0, atol=0)
        assert not seen["embed_grad"] and not (seen["frozen_ptrs"] & seen["param_ptrs"])
        assert all(n.startswith("head.") and "embed" not in n and "lm_head" not in n for n in seen["module_params"])
        trainable = sum(torch.Size(s).numel() for s in seen["module_params"].values())
        assert seen["optimizer_numel"] == trainable  # ZeRO's flat partition holds the head's weights only

        ckpt = run.out / "checkpoints"
        assert latest_tag(ckpt) == f"step-{STEPS}"
        tag = ckpt / f"step-{STEPS}"
        states = load_file(str(tag / "model.safetensors"))  # the engine module's weights (safetensors, no pickle)
        assert set(states) == set(seen["module_params"])
        assert not any("embed" in k or "lm_head" in k for k in states)
        client = json.loads((tag / "state.json").read_text())["client"]
        assert client["step"] == STEPS and {"epoch", "position"} <= set(client["data"])
        assert {"python", "numpy", "torch"} <= set(json.loads((tag / "rng-rank0.json").read_text()))
        optim = load_file(str(tag / "optim-rank0.safetensors"))
        flat = [t for k, t in optim.items() if k.startswith("single_partition_of_fp32_groups.")]
        assert sum(t.numel() for t in flat) == trainable

        export = run.out / "heads" / f"step-{STEPS}"
        with safe_open(str(export / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())  # noqa: SIM118 (safe_open is not a dict)
        assert names == {n.removeprefix("head.") for n in seen["module_params"]}
        config = json.loads((export / "config.json").read_text())
        assert config["target_fingerprint"] == weights_fingerprint(setup.target)
        assert config["head"]["type"] == head and config["extra"]["step"] == STEPS
        assert OmegaConf.load(export / "train_config.yaml").head.type == head
        loaded = load_head(export, setup.target)  # refuses other target weights; fits this one
        for k, v in loaded.state_dict().items():
            torch.testing.assert_close(v, states[f"head.{k}"], rtol=0, atol=0)
    # save_every=25 kept the intermediate export too: a loadable head of step 25 with the final one's tensors
    mid = trained["mtp"].out / "heads" / "step-25"
    assert json.loads((mid / "config.json").read_text())["extra"]["step"] == 25
    final = load_head(trained["mtp"].out / "heads" / f"step-{STEPS}", setup.target).state_dict()
    assert load_head(mid, setup.target).state_dict().keys() == final.keys()


@pytest.mark.slow
def test_wandb_offline_run_holds_the_logged_keys(setup, trained):
    run = trained["mtp"]
    rows, config = _wandb_history(run.out.parent / "wandb")  # wandb.dir, not $WANDB_DIR
    keys = set().union(*rows)
    for key in ("train/loss", "train/feat_loss", "train/tok_loss", "train/step0/top1", "train/step0/top3",
                "train/lr", "train/grad_norm", "train/tokens_per_s", "train/samples_seen", "eval/loss",
                "eval/step0/top1", "eval/step0/top3"):
        assert key in keys, key
    steps = [r["_step"] for r in rows if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1))
    m = _metrics(run.out)
    last = next(r for r in rows if r.get("_step") == STEPS and "train/loss" in r)
    assert last["train/loss"] == pytest.approx(m[STEPS]["train/loss"])
    assert config["head"]["type"] == "mtp" and config["train"]["max_steps"] == STEPS
    run_id = (run.out / "wandb-run-id").read_text().strip()  # the id a resumed online run continues
    assert run_id and list((run.out.parent / "wandb").glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


# --- ranks and resume ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_zero2_match_one_rank_with_the_same_global_batch(setup, tmp_path):
    steps = 5
    # 256-token micro-batches: the 10 of the 5 steps stay inside the first epoch (13 batches), where the split
    # over ranks cannot change which samples a global step holds.
    common = [f"train.max_steps={steps}", "train.eval_batches=0", "deepspeed=zero2", "loss.steps=2",
              "train.micro_batch_tokens=256"]
    one = _train(setup, tmp_path / "one", *common, "train.grad_accum=2")
    args = _overrides(setup, tmp_path / "two", *common, "train.grad_accum=1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mtp_train.cli.train", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    a, b = _metrics(one.out), _metrics(tmp_path / "two")
    for s in range(1, steps + 1):
        assert b[s]["train/num_tokens"] == a[s]["train/num_tokens"]  # the same tokens in each global batch
        assert b[s]["train/samples_seen"] == a[s]["train/samples_seen"]
        for key in ("train/loss", "train/step1/loss", "train/grad_norm", "train/top1"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-5, abs=1e-7), (s, key)
    # both ranks wrote their part of the checkpoint; rank 0 alone exported the head
    tag = tmp_path / "two" / "checkpoints" / f"step-{steps}"
    assert {p.name for p in tag.glob("rng-rank*.json")} == {"rng-rank0.json", "rng-rank1.json"}
    assert {"rng-rank0.json", "rng-rank1.json", "model.safetensors", "state.json", "optim-rank0.safetensors",
            "optim-rank1.safetensors", "optim-rank0.json", "optim-rank1.json"} == set(
        json.loads((tag / "checksums.json").read_text())["files"])  # every rank's files, checksummed by rank 0
    assert not list(tag.glob("*.pt"))  # no pickle (tests/test_checkpoint.py: what resuming trusts)
    # Two ranks resume it: rank 0 checks every file, rank 1 its own RNG file, then both load.
    more = [a if not a.startswith("train.max_steps=") else f"train.max_steps={steps + 1}" for a in cmd]
    res = subprocess.run(more, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(_metrics(tmp_path / "two")) == list(range(1, steps + 2))


@pytest.mark.slow
def test_kill_and_resume_reproduces_the_uninterrupted_run(setup, tmp_path):
    steps = 8
    # Feature noise and two unrolled steps: what must be restored is more than weights and the data position.
    common = [f"train.max_steps={steps}", "train.save_every=3", "train.grad_accum=2", "loss.steps=2",
              "loss.noise_std=0.05", "train.eval_every=3", "train.eval_batches=2"]
    full = _train(setup, tmp_path / "full", *common)
    with pytest.raises(SimulatedCrash, match="simulated kill"):
        _train(setup, tmp_path / "killed", *common, stop_after=5)
    assert latest_tag(tmp_path / "killed" / "checkpoints") == "step-3"
    resumed = _train(setup, tmp_path / "killed", *common)  # resume=auto
    a, b = _metrics(full.out), _metrics(resumed.out)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        for key in ("train/loss", "train/step1/loss", "train/lr", "train/grad_norm", "train/samples_seen"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-6, abs=1e-9), (s, key)
    assert b[6]["eval/loss"] == pytest.approx(a[6]["eval/loss"], rel=1e-6)
    assert resumed.result["eval/top1"] == pytest.approx(full.result["eval/top1"], rel=1e-6)
    # a finished run resumed again has nothing left to do
    again = _train(setup, tmp_path / "killed", *common)
    assert again.result["step"] == steps and again.result["head_dir"].endswith(f"step-{steps}")


def test_a_wall_clock_budget_ends_the_run_as_max_steps_would_and_a_rerun_resumes(setup, tmp_path):
    out = tmp_path / "timed"
    # A budget no optimizer step fits in: the clock ends the run after its first step on any machine (the check
    # comes after each step), so the test needs no sleeps and no timing assumptions.
    common = ["train.max_steps=5", "train.log_every=4", "train.eval_batches=2"]
    first = _train(setup, out, *common, "train.max_seconds=1e-9")
    assert first.result["step"] == 1 and first.result["stopped_by"] == "max_seconds"
    assert first.result["train_seconds"] > 0
    # what max_steps would have done at the end: the last step logged, an evaluation, a checkpoint, a head export
    m = _metrics(out)
    assert sorted(m) == [1] and "train/elapsed_s" in m[1] and "eval/loss" in m[1]
    assert latest_tag(out / "checkpoints") == "step-1" and first.result["head_dir"].endswith("step-1")
    assert (Path(first.result["head_dir"]) / "model.safetensors").is_file()
    again = _train(setup, out, *common, "train.max_seconds=1e-9")  # resumes, then spends another budget
    assert again.result["step"] == 2 and again.result["stopped_by"] == "max_seconds"
    rest = _train(setup, out, *common)  # max_seconds=0: no wall-clock limit, on to max_steps
    assert rest.result["step"] == 5 and rest.result["stopped_by"] == "max_steps"
    assert sorted(_metrics(out)) == [1, 2, 4, 5] and latest_tag(out / "checkpoints") == "step-5"


def test_resume_option_resolution(tmp_path):
    assert resolve_resume("auto", tmp_path) is None and resolve_resume("none", tmp_path) is None
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step-4").mkdir(parents=True)
    (ckpt / "latest").write_text("step-4\n")
    assert resolve_resume("auto", tmp_path) == (ckpt, "step-4")
    assert resolve_resume(str(ckpt / "step-4"), tmp_path / "elsewhere") == (ckpt, "step-4")
    assert resolve_resume(str(ckpt), tmp_path / "elsewhere") == (ckpt, "step-4")
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    (ckpt / "latest").write_text("step-9\n")
    with pytest.raises(FileNotFoundError, match="step-9"):
        resolve_resume("auto", tmp_path)


# --- data, evaluation -----------------------------------------------------------------------------------------


def test_rank_shares_are_disjoint_and_together_equal_one_rank_with_accumulation(setup):
    ds = PrecomputedDataset(setup.data, split="train")

    def stream(rank: int, world: int) -> MicroBatchStream:
        return MicroBatchStream(ds, LengthBucketedBatchSampler(ds.lengths, 300, seed=3, rank=rank, world=world))

    one, r0, r1 = stream(0, 1), stream(0, 2), stream(1, 2)
    # Within an epoch (11 batches here; at its end world=2 repeats a batch to even the ranks out), a global step
    # of 2 micro-batches of one rank is exactly 1 of each of two ranks.
    for _ in range(5):
        a, b = one.next().ids + one.next().ids, r0.next().ids + r1.next().ids
        assert sorted(a) == sorted(b)
    r0, r1 = stream(0, 2), stream(1, 2)
    ids0 = [i for _ in range(5) for i in r0.next().ids]
    ids1 = [i for _ in range(5) for i in r1.next().ids]
    assert not set(ids0) & set(ids1) and len(set(ids0 + ids1)) == len(ids0 + ids1)
    # resuming a stream at its saved position continues with the same batches
    state = r0.state_dict()
    expected = [r0.next().ids for _ in range(30)]  # crosses into the next epoch
    again = stream(0, 2)
    again.load_state_dict(state)
    assert [again.next().ids for _ in range(30)] == expected and again.epoch >= 1


def _assert_evaluation_is_the_training_path(head, batches, cfg: LossConfig, metrics: tuple[str, ...]) -> None:
    """Chains of `inference_chain` equal the training unroll row by row, and `evaluate`'s per-step `metrics` are
    the token-weighted means of `unrolled_loss`'s over `batches` (for aux heads, both read `aux_hidden`)."""
    head.eval()
    for b in batches:
        inputs = b.hidden if b.aux_hidden is None else b.aux_hidden
        with torch.no_grad():
            train_path = head.unroll(inputs, b.input_ids, b.seq_lens, 3, attention="chain")
        infer_path = inference_chain(head, inputs, b.input_ids, b.seq_lens, 3, kv_slots=64)  # several chunks
        for j, (x, y) in enumerate(zip(train_path, infer_path)):
            valid = torch.cat([torch.arange(n) < n - j - 1 for n in b.seq_lens])  # rows with a real chain
            torch.testing.assert_close(y[valid], x[valid], rtol=1e-4, atol=1e-5, msg=f"step {j}")
    ev = evaluate(head, batches, cfg, torch.device("cpu"))
    totals: dict[str, float] = {}
    counts = [0.0] * 3
    for b in batches:
        with torch.no_grad():
            _, m = unrolled_loss(head, b.hidden, b.input_ids, b.loss_mask, b.seq_lens, cfg, aux_hidden=b.aux_hidden)
        for j in range(3):
            n = float(m[f"step{j}/num_tokens"])
            counts[j] += n
            for k in metrics:
                totals[f"{j}/{k}"] = totals.get(f"{j}/{k}", 0.0) + float(m[f"step{j}/{k}"]) * n
    for j in range(3):
        assert ev[f"eval/step{j}/num_tokens"] == counts[j]
        for k in metrics:
            assert ev[f"eval/step{j}/{k}"] == pytest.approx(totals[f"{j}/{k}"] / counts[j], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("type_", ["mtp", "eagle1"])
def test_evaluation_through_the_inference_path_matches_the_training_path(setup, type_):
    torch.manual_seed(0)
    head = build_head(HeadConfig(type=type_, init="last_layer"), setup.target, dtype=torch.float32)
    batches = list(eval_batches(PrecomputedDataset(setup.data, split="val"), 400, 2))
    assert all(b.aux_hidden is None for b in batches)
    _assert_evaluation_is_the_training_path(head, batches, LossConfig(steps=3), ("loss", "top1", "top3"))
    assert head.training is False  # evaluate restores the mode it found


# --- eagle3 and aux features ------------------------------------------------------------------------------------

AUX = [2, 1, 0]  # EAGLE-3's default [2, L//2, L-3] for the tiny target's 3 layers


@pytest.fixture(scope="module")
def aux_data(setup, tmp_path_factory) -> Path:
    """The same samples as `setup.data`, precomputed with the aux layers EAGLE-3 reads."""
    out = tmp_path_factory.mktemp("pc-aux") / "pc"
    model = load_model(setup.target, dtype="float32", backend="torch")
    cfg = PrecomputeConfig(out=str(out), shard_tokens=1500, batch_tokens=2048, val_fraction=0.15, seed=0,
                           progress=False, aux_layers=AUX)
    precompute(model, make_train_samples(120, 0), cfg, tokenizer_fingerprint="tok-fp",
               chat_template_fingerprint="tmpl-fp", model_dir=setup.target, data_info={"name": "random"})
    return out


@pytest.mark.parametrize("kw", [dict(type="eagle3", draft_vocab_size=32), dict(type="mtp", features="aux")],
                         ids=["eagle3", "mtp-aux"])
def test_aux_heads_evaluate_through_the_inference_path_as_they_train(setup, aux_data, kw):
    torch.manual_seed(0)
    head = build_head(HeadConfig.of(**kw), setup.target, dtype=torch.float32)
    assert head.aux_layers == AUX
    batches = list(eval_batches(PrecomputedDataset(aux_data, split="val"), 400, 2))
    for b in batches:
        assert b.aux_hidden is not None and b.aux_hidden.shape == (b.num_rows, 3 * 64)
    cfg = LossConfig(steps=3, mask_out_of_draft=head.draft_vocab is not None)
    _assert_evaluation_is_the_training_path(head, batches, cfg, ("loss", "top1", "tok_loss"))


def test_a_folder_without_the_heads_aux_layers_is_refused_by_key(setup, aux_data, tmp_path):
    with pytest.raises(ValueError, match=r"holds aux layers \[\] .* aux_layers=\[2,1,0\]"):
        train_main(_cfg(_overrides(setup, tmp_path / "a", "head=eagle3", "head.draft_vocab_size=32")))
    with pytest.raises(ValueError, match=r"lacking \[3\].*head.aux_layers"):
        train_main(_cfg(_overrides(setup, tmp_path / "b", f"data.dir={aux_data}", "head=mtp", "head.features=aux",
                                   "head.aux_layers=[3]")))
    assert not (tmp_path / "a" / "checkpoints").exists()


@pytest.mark.slow
def test_tiny_eagle3_run_trains_its_own_lm_head_and_exports(setup, aux_data, tmp_path):
    out = tmp_path / "e3"
    run = _train(setup, out, f"data.dir={aux_data}", "head=eagle3", "head.draft_vocab_size=128", "loss.steps=3",
                 "loss.w_feat=0", "loss.w_tok=1", "loss.mask_out_of_draft=true", "train.max_steps=30",
                 "train.eval_batches=2")
    m = _metrics(out)
    top1 = [m[s]["train/top1"] for s in range(1, 31)]
    assert sum(top1[-5:]) / 5 > 1.5 * sum(top1[:3]) / 3, top1  # (the soft CE's floor is the target's entropy)
    for key in ("train/step2/top1", "train/step2/tok_loss", "eval/step2/top1"):
        assert key in m[30], key
    assert run.result["eval/top1"] > 1.2 * _baseline_top1(setup)
    head = load_head(run.result["head_dir"], setup.target, dtype="float32")
    assert head.type_name == "eagle3" and head.aux_layers == AUX and head.vocab_size == 128
    target_rows = head.frozen.lm_head[head.draft_vocab]
    assert not torch.allclose(head.lm_head.weight, target_rows)  # its own rows trained


# --- configuration ------------------------------------------------------------------------------------------------


def test_a_wrong_config_key_is_refused_by_name(setup, tmp_path):
    for key in ("train.max_stepz=3", "optim.learning_rate=1", "deepspeed.zero_optimisation.stage=1", "outt=x"):
        with pytest.raises(ConfigCompositionException, match=key.split("=")[0].split(".")[-1]):
            _cfg([key])
    r = subprocess.run([sys.executable, "-m", "mtp_train.cli.train", f"out={tmp_path / 'x'}", "train.max_stepz=3"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "max_stepz" in r.stderr


def test_a_precompute_folder_of_another_target_is_refused(setup, tmp_path):
    cfg = _cfg(_overrides(setup, tmp_path / "run", f"model.path={setup.other}"))
    with pytest.raises(ManifestMismatchError, match="target weights fingerprint"):
        train_main(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()
