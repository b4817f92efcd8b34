"""Reading big precompute folders: what set-up reads and holds, when shards are hashed, the draft vocabulary with
and without `token_counts.safetensors`, and the batch plan's state at 10^5 samples.

The folders are synthetic (`mtp_train.precompute.synthetic.make_folder`: real shards and manifest, random
contents) with 2-4 tokens a sample, so 10^5 samples are a few tens of MB.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mtp_train.cli.train import train_main
from mtp_train.config import TrainConfig, typed
from mtp_train.data.sampler import LengthBucketedBatchSampler
from mtp_train.dist import DistInfo
from mtp_train.precompute import CorruptShardError, PrecomputedDataset
from mtp_train.precompute.reader import MAX_OPEN
from mtp_train.precompute.synthetic import make_folder
from mtp_train.train.data import MicroBatchStream, draft_vocab_from_data
from mtp_train.train.sources import build_source
from tests.conftest import compose_config, make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = [1, 2, 3]  # the tiny target's layers 1..3: every head type's aux layers
BIG = 100_000


@dataclass
class Folders:
    target: Path  # tiny llama: H 16, 3 layers, vocabulary 256
    big: Path  # BIG samples, token_counts.safetensors
    small: Path  # 10^4 samples, token_counts.safetensors
    small_old: Path  # the same samples without it (as an older precompute wrote them)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Folders:
    root = tmp_path_factory.mktemp("scale")
    target = root / "target"
    make_tiny_checkpoint("llama", target, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1)
    common: dict[str, Any] = dict(target=target, aux_layers=AUX, min_len=2, max_len=4, val_fraction=0.05)
    make_folder(root / "big", BIG, shard_tokens=4096, **common)
    make_folder(root / "small", 10_000, shard_tokens=2048, **common)
    make_folder(root / "small-old", 10_000, shard_tokens=2048, token_counts=False, **common)
    return Folders(target, root / "big", root / "small", root / "small-old")


def mapped_shards(folder: Path) -> int:
    """Shard files of `folder` mapped into this process now (open safetensors handles, or tensors still viewing
    one)."""
    with open("/proc/self/maps") as fh:
        return len({line.split()[-1] for line in fh if str(folder) in line and line.rstrip().endswith(".safetensors")})


def _cfg(folders: Folders, data: Path, out: Path, *extra: str) -> Any:
    return compose_config("train", [
        f"model.path={folders.target}", "model.device=cpu", "model.backend=torch", f"data.dir={data}", f"out={out}",
        "wandb.mode=disabled", "train.progress=false", "train.micro_batch_tokens=64", "train.eval_every=0",
        "train.eval_batches=1", "train.save_every=0", "spec_eval.prompts=[]", "head.draft_vocab_size=64", *extra])


# --- set-up ---------------------------------------------------------------------------------------------------------


def test_data_setup_at_1e5_samples_reads_each_header_once_and_leaves_no_shard_open(folders):
    """The trainer's data set-up (its source, then the draft vocabulary, as `Trainer` does them) reads each shard's
    header once for both splits, hashes nothing, opens no shard for data and counts no token: the counts file
    holds them."""
    tc = typed(_cfg(folders, folders.big, folders.big.parent / "unused", "head=eagle3", f"head.aux_layers={AUX}"),
               TrainConfig)
    source = build_source(tc, DistInfo(0, 1, 0, torch.device("cpu")), torch.device("cpu"))
    vocab = draft_vocab_from_data(source.train_set, 64, 256, [0])
    train, val = source.train_set, source.val_set
    shards = len(train.manifest.shards)
    assert len(train) + len(val) == BIG and shards > 50
    assert val.index is train.index  # one parse of the folder
    assert (train.reads.headers, train.reads.opens, train.reads.hashes, train.reads.scans) == (shards, 0, 0, 0)
    assert mapped_shards(folders.big) == 0
    assert vocab.shape == (64,) and 0 in vocab.tolist()

    # The first batch opens and hashes only the shards its samples are in; the handles stay bounded.
    batch = source.stream.next()
    where = {sid: i for i, sid in enumerate(train.ids)}
    touched = {int(train._shard_of[where[sid]]) for sid in batch.ids}
    assert train.reads.hashes == len(train._verified) and train._verified == touched
    assert len(touched) <= len(batch.ids) < shards
    assert len(train._handles) <= MAX_OPEN and mapped_shards(folders.big) <= MAX_OPEN


@pytest.mark.parametrize("head", ["mtp", "eagle1", "eagle3", "dflash", "dspark"])
def test_every_head_type_trains_reading_only_the_shards_of_its_batches(folders, tmp_path, head):
    """A one-step run per head type (each with a draft vocabulary): every header read once, no token counted from
    the shards, and only the shards of the step's and the evaluation's batches hashed."""
    aux = [] if head in ("mtp", "eagle1") else [f"head.aux_layers={AUX}"]
    block = ["head.block_size=4", "loss.steps=3"] if head == "dflash" else (
        ["head.block_size=4", "loss.steps=4"] if head == "dspark" else [])
    seen: dict[str, Any] = {}

    def on_step(trainer, step, metrics):
        seen["reads"] = trainer.train_set.reads
        seen["shards"] = len(trainer.train_set.manifest.shards)
        seen["vocab"] = trainer.head.draft_vocab.tolist()
        counted = PrecomputedDataset(folders.small_old, split="train")  # no counts file: counted from the shards
        seen["counted"] = draft_vocab_from_data(counted, 64, 256, trainer.head.args.eos_token_ids).tolist()

    train_main(_cfg(folders, folders.small, tmp_path / "run", f"head={head}", "train.max_steps=1", *aux, *block),
               on_step=on_step)
    reads, shards = seen["reads"], seen["shards"]
    assert reads.headers == shards and reads.scans == 0
    assert 0 < reads.hashes < shards and reads.opens >= reads.hashes
    assert seen["vocab"] == seen["counted"]


def test_setup_memory_per_sample_is_small(folders):
    """Building a dataset holds numpy arrays, not Python objects per sample: from 10^4 to 10^5 samples its peak
    traced memory grows by under 80 bytes a sample (a list of ids, lengths and (shard, row) tuples per sample took
    about 190)."""
    peaks = []
    for folder in (folders.small, folders.big):
        tracemalloc.start()
        ds = PrecomputedDataset(folder, split="train")
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        del ds
    per_sample = (peaks[1] - peaks[0]) / (BIG - 10_000)
    assert per_sample < 80, f"{per_sample:.0f} bytes a sample"


# --- verification, handles ------------------------------------------------------------------------------------------


def test_first_open_hashes_a_shard_when_its_samples_are_first_read(folders, tmp_path):
    folder = tmp_path / "pc"
    shutil.copytree(folders.small, folder)
    ds = PrecomputedDataset(folder, split="all")
    ds.token_counts(256)
    assert ds.reads.hashes == 0 and ds._verified == set()
    first = int(np.flatnonzero(ds._shard_of == 0)[0])
    ds[first]
    ds[first + 1]
    assert ds.reads.hashes == 1 and ds._verified == {0}

    # A damaged shard is set up like the others and named when its samples are first read, not before.
    bad = folder / ds.manifest.shards[1].file
    raw = bytearray(bad.read_bytes())
    raw[-3] ^= 0xFF  # inside the tensors: the header, sizes and offsets still agree with the manifest
    bad.write_bytes(bytes(raw))
    again = PrecomputedDataset(folder, split="all")
    again[first]
    with pytest.raises(CorruptShardError, match=ds.manifest.shards[1].file):
        again[int(np.flatnonzero(again._shard_of == 1)[0])]
    assert again._verified == {0}


def test_open_shards_stay_within_max_open_while_every_sample_is_read(folders):
    ds = PrecomputedDataset(folders.small, split="train", verify="never", max_open=2)
    order = np.random.default_rng(0).permutation(len(ds))[:2000]
    for i in order.tolist():
        assert ds[int(i)]["input_ids"].shape[0] == ds.lengths[int(i)]
        assert len(ds._handles) <= 2
    assert mapped_shards(folders.small) <= 2
    ds.close()
    assert mapped_shards(folders.small) == 0
    assert pickle.loads(pickle.dumps(ds))._handles == {}


# --- draft vocabulary -----------------------------------------------------------------------------------------------


def test_token_counts_are_the_same_with_and_without_the_counts_file(folders, caplog):
    """The counts file gives what counting the shards gives (and what counting the samples one by one gives); a
    folder without it is counted shard by shard, each closed after it, and says so once."""
    for split in ("train", "val", "all"):
        new = PrecomputedDataset(folders.small, split=split)
        old = PrecomputedDataset(folders.small_old, split=split)
        with caplog.at_level(logging.WARNING, logger="mtp_train.precompute.reader"):
            caplog.clear()
            counted = old.token_counts(256)
        assert torch.equal(new.token_counts(256), counted)
        assert new.reads.scans == 0 and old.reads.scans == len({int(k) for k in old._shard_of})
        assert [r.message.count("token_counts.safetensors") for r in caplog.records] == [1]
        assert mapped_shards(folders.small_old) == 0
        assert torch.equal(draft_vocab_from_data(new, 64, 256, [0]), draft_vocab_from_data(old, 64, 256, [0]))
    ds = PrecomputedDataset(folders.small, split="val")
    by_sample = torch.zeros(256, dtype=torch.long)
    for i in range(len(ds)):
        item = ds[i]
        by_sample += torch.bincount(item["input_ids"][item["loss_mask"].bool()], minlength=256)
    assert torch.equal(ds.token_counts(256), by_sample)
    # A wider vocabulary than the folder's target: zeros past it, as counting gives.
    assert torch.equal(ds.token_counts(300), torch.nn.functional.pad(by_sample, (0, 44)))


# --- the batch plan -------------------------------------------------------------------------------------------------


def greedy_batches(lengths: list[int], max_tokens: int, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
    """The batch plan's definition, one sample at a time (LengthBucketedBatchSampler's docstring)."""
    rng = np.random.default_rng([seed, epoch])
    tie = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    batches, cur, longest = [], [], 0
    for i in np.lexsort((tie, np.asarray(lengths))).tolist():
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    if cur:
        batches.append(cur)
    return [batches[k] for k in rng.permutation(len(batches))] if shuffle else batches


@pytest.mark.parametrize("shuffle", [True, False])
def test_batch_plan_is_the_greedy_cut(shuffle):
    rng = np.random.default_rng(1)
    for trial in range(40):
        lengths = rng.integers(1, 200, int(rng.integers(1, 400))).tolist()
        max_tokens = int(rng.integers(1, 700))
        s = LengthBucketedBatchSampler(lengths, max_tokens, shuffle=shuffle, seed=trial)
        for epoch in (0, 3):
            s.set_epoch(epoch)
            assert list(s) == greedy_batches(lengths, max_tokens, shuffle, trial, epoch)


def test_batch_plan_resumes_at_1e5_samples_with_the_batches_of_an_uninterrupted_run(folders):
    """The sampler's and the stream's state is two integers whatever the size; restored from it they hand out
    exactly the batches of the uninterrupted run, into the next epoch."""
    ds = PrecomputedDataset(folders.big, split="train", verify="never")

    def sampler() -> LengthBucketedBatchSampler:
        return LengthBucketedBatchSampler(ds.lengths, 256, seed=5, rank=1, world=2)

    whole = sampler()
    want = list(whole)
    whole.set_epoch(1)
    want += list(whole)
    first = sampler()
    it = iter(first)
    got = [next(it) for _ in range(len(first) - 2)]
    state = first.state_dict()
    assert state == {"epoch": 0, "position": len(first) - 2} and len(pickle.dumps(state)) < 100
    resumed = sampler()
    resumed.load_state_dict(state)
    got += list(resumed)
    resumed.set_epoch(1)
    got += list(resumed)
    assert got == want and len(want) > 1000

    def stream() -> MicroBatchStream:
        return MicroBatchStream(ds, sampler())

    uninterrupted = stream()
    ids = [uninterrupted.next().ids for _ in range(5)]
    a = stream()
    got_ids = [a.next().ids for _ in range(3)]
    b = stream()
    b.load_state_dict(a.state_dict())
    assert got_ids + [b.next().ids for _ in range(2)] == ids
