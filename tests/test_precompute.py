"""Stage-one precompute: shards hold exactly the target's hidden states, resume is exact, ranks agree,
damaged or foreign folders are refused by name, and the bucketed sampler keeps its promises."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_train.config import PrecomputeConfig
from mtp_train.data.sampler import LengthBucketedBatchSampler
from mtp_train.data.samples import to_rows
from mtp_train.engine import prefill_hidden
from mtp_train.models import load_model
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.precompute import (
    CorruptShardError,
    FolderWriter,
    Manifest,
    ManifestError,
    ManifestMismatchError,
    MissingShardError,
    PrecomputedDataset,
    PrecomputeError,
    Sample,
    folder_spec,
    is_val,
    plan_runs,
    plan_shards,
    precompute,
)
from mtp_train.precompute import pipeline as pipeline_mod
from tests._precompute_worker import make_samples

ROOT = Path(__file__).resolve().parents[1]
AUX = (1, 3)  # HF hidden_states indices: the output of layer 0, and 3 = after the final norm (equals hidden)
KW = dict(tokenizer_fingerprint="tok-fp", chat_template_fingerprint="tmpl-fp", data_info={"source": "random"})


def _cfg(out: Path, **settings) -> PrecomputeConfig:
    """Writer settings into `out`: no progress bar and, unless `val_fraction` is given, no validation split."""
    return PrecomputeConfig(out=str(out), progress=False, **{"val_fraction": 0.0, **settings})


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints) -> Path:
    return tiny_checkpoints["llama"][0]


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype="float32", backend="torch")


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    return make_samples(48, seed=1)


@pytest.fixture(scope="module")
def ref(model, model_dir, samples, tmp_path_factory) -> tuple[Path, Manifest]:
    """One finished run with aux layers and a val split, shared by the read-only tests."""
    out = tmp_path_factory.mktemp("ref")
    m = precompute(model, samples, _cfg(out, shard_tokens=256, batch_tokens=100, aux_layers=list(AUX),
                                        val_fraction=0.25, seed=7), model_dir=model_dir, **KW)
    return out, m


def _copy(ref, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(ref[0], dst)
    return dst


# ----------------------------------------------------------------------------------------------------------------
# contents


def test_readback_equals_target_forward(ref, model, samples):
    out, manifest = ref
    ds = PrecomputedDataset(out, split="all")
    by_id = {s.id: s for s in samples}
    assert sorted(ds.ids) == sorted(by_id) and len(ds) == manifest.totals.samples
    h = model.args.hidden_size

    # Bitwise: replay the writer's batching (consecutive samples of a shard, ≤ batch_tokens) and cast.
    pos = 0
    for shard in manifest.shards:
        ids = ds.ids[pos:pos + shard.samples]
        for run in plan_runs([len(by_id[i].input_ids) for i in ids], 100):
            batch = [by_id[ids[k]] for k in run]
            fwd = prefill_hidden(model, [s.input_ids for s in batch], hidden_layers=AUX)
            a = 0
            for k, s in zip(run, batch):
                item = ds[pos + k]
                b = a + len(s.input_ids)
                assert item["id"] == s.id
                assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == s.input_ids
                assert item["loss_mask"].tolist() == s.loss_mask
                assert item["hidden"].dtype == torch.bfloat16 and item["hidden"].shape == (b - a, h)
                assert torch.equal(item["hidden"], fwd.hidden[a:b].to(torch.bfloat16))
                aux = torch.cat([fwd.layers[j][a:b] for j in AUX], dim=-1).to(torch.bfloat16)
                assert item["aux_hidden"].shape == (b - a, len(AUX) * h)
                assert torch.equal(item["aux_hidden"], aux)
                a = b
        pos += shard.samples

    # One sample at a time: packing only changes fp32 rounding, far below one bf16 step.
    for i in range(0, len(ds), 5):
        item = ds[i]
        fwd = prefill_hidden(model, [item["input_ids"].tolist()], hidden_layers=AUX)
        torch.testing.assert_close(item["hidden"], fwd.hidden.to(torch.bfloat16), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(item["aux_hidden"][:, h:], fwd.layers[3].to(torch.bfloat16), rtol=1e-2, atol=1e-2)


def test_manifest_records_target_split_and_totals(ref, model, model_dir, samples):
    out, manifest = ref
    assert Manifest.load(out).to_dict() == manifest.to_dict()
    t = manifest.target
    assert (t.fingerprint, t.model_type, t.hidden_size, t.num_layers, t.vocab_size, t.dtype) == (
        weights_fingerprint(model_dir), "llama", 64, 3, 256, "float32")
    assert manifest.hidden.kind == "final_norm" and manifest.hidden.dtype == "bfloat16"
    assert manifest.hidden.aux_layers == list(AUX)
    assert manifest.tokenizer.fingerprint == "tok-fp" and manifest.tokenizer.chat_template_fingerprint == "tmpl-fp"
    assert manifest.data == {"source": "random"}
    assert manifest.totals.samples == len(samples) == sum(s.samples for s in manifest.shards)
    assert manifest.totals.tokens == sum(len(s.input_ids) for s in samples)
    assert manifest.totals.loss_tokens == sum(sum(s.loss_mask) for s in samples)
    assert manifest.totals.bytes == sum((out / s.file).stat().st_size for s in manifest.shards)
    assert all(s.tokens <= 256 for s in manifest.shards) and len(manifest.shards) > 3
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "token_counts.safetensors"]
        + [s.file.replace(".safetensors", end) for s in manifest.shards
           for end in (".safetensors", ".json", ".counts.safetensors")])

    train, val = PrecomputedDataset(out, split="train"), PrecomputedDataset(out, split="val")
    want_val = {s.id for s in samples if is_val(s.id, 7, 0.25)}
    assert set(val.ids) == want_val and set(train.ids) == {s.id for s in samples} - want_val
    c = manifest.split.counts
    assert (c["val_samples"], c["train_samples"]) == (len(val), len(train)) and 0 < len(val) < len(samples)
    assert c["val_tokens"] == sum(val.lengths) and c["train_tokens"] == sum(train.lengths)

    # DataLoader workers get a pickled copy: no open files, but the shards already verified stay verified.
    first = train[3]
    copy = pickle.loads(pickle.dumps(train))
    assert copy._verified == train._verified != set() and copy._handles == {}
    assert torch.equal(copy[3]["hidden"], first["hidden"])

    # Rank subsets: disjoint, together the whole split.
    parts = [PrecomputedDataset(out, split="train", rank=r, world=3).ids for r in range(3)]
    assert sorted(sum(parts, [])) == sorted(train.ids) and len(set(sum(parts, []))) == len(train)


# ----------------------------------------------------------------------------------------------------------------
# resume


class _Stop(Exception):
    pass


def _counting(monkeypatch) -> list[int]:
    """Count the writer's target forwards (tokens per call)."""
    calls: list[int] = []
    real = pipeline_mod.prefill_hidden

    def counted(model, token_lists, hidden_layers=()):
        calls.append(sum(len(t) for t in token_lists))
        return real(model, token_lists, hidden_layers=hidden_layers)

    monkeypatch.setattr(pipeline_mod, "prefill_hidden", counted)
    return calls


def _strip(m: Manifest) -> dict:
    d = m.to_dict()
    d.pop("created_at")
    return d


def test_interrupted_run_resumes_to_identical_output(model, model_dir, samples, tmp_path, monkeypatch):
    kw = dict(model_dir=model_dir, **KW)
    settings = dict(shard_tokens=200, batch_tokens=64)
    full = precompute(model, samples, _cfg(tmp_path / "a", **settings), **kw)
    n = len(full.shards)
    assert n >= 5

    def stop_after_three(info, skipped):
        if info.index == 2:
            raise _Stop

    with pytest.raises(_Stop):
        precompute(model, samples, _cfg(tmp_path / "b", **settings), on_shard=stop_after_three, **kw)
    b = tmp_path / "b"
    assert not (b / "manifest.json").exists()
    with pytest.raises(ManifestError, match="did not finish"):
        Manifest.load(b)
    # Damage the interrupted folder the ways a crash or a disk can: a torn temporary, a shard whose
    # sidecar never got written, a flipped byte in a finished shard.
    (b / ".tmp-shard-r0-00003.safetensors").write_bytes(b"torn")
    (b / "shard-r0-00002.json").unlink()
    with (b / "shard-r0-00000.safetensors").open("r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))

    calls = _counting(monkeypatch)
    seen: list[tuple[int, bool]] = []
    resumed = precompute(model, samples, _cfg(b, **settings),
                         on_shard=lambda info, skipped: seen.append((info.index, skipped)), **kw)
    assert sorted(seen) == sorted([(1, True)] + [(i, False) for i in range(n) if i != 1])
    # Exactly the tokens of the redone shards went through the target, nothing of shard 1.
    assert sum(calls) == full.totals.tokens - full.shards[1].tokens
    assert _strip(resumed) == _strip(full)
    for s in full.shards:
        assert (b / s.file).read_bytes() == (tmp_path / "a" / s.file).read_bytes()
        side = s.file.replace(".safetensors", ".json")
        assert (b / side).read_bytes() == (tmp_path / "a" / side).read_bytes()
    assert not list(b.glob(".tmp-*"))

    # A finished folder re-run with the same settings computes nothing; other settings are refused by name
    # before anything changes, and with overwrite=true redo everything.
    calls.clear()
    again = precompute(model, samples, _cfg(b, **settings), **kw)
    assert calls == [] and _strip(again) == _strip(full)
    before = {p.name: p.read_bytes() for p in b.iterdir()}
    with pytest.raises(PrecomputeError, match=r"other settings \(aux_layers \[\], this run \[2\]\).*overwrite=true"):
        precompute(model, samples, _cfg(b, aux_layers=[2], **settings), **kw)
    assert calls == [] and {p.name: p.read_bytes() for p in b.iterdir()} == before
    precompute(model, samples, _cfg(b, aux_layers=[2], overwrite=True, **settings), **kw)
    assert sum(calls) == full.totals.tokens

    # Storage: 2·H bytes of hidden state and 5 of ids + mask per token, 8 per sample offset, plus one
    # header per shard (tensor table + sample ids). These shards are tiny (≤ 200 tokens), so the header
    # still costs ~2.5 bytes a token; at real shard sizes (2**17 tokens) it is ~0.01.
    h, t = model.args.hidden_size, full.totals
    header = t.bytes - t.tokens * (2 * h + 5) - 8 * (t.samples + len(full.shards))
    assert header <= len(full.shards) * 400 + 20 * t.samples, header
    assert t.bytes / t.tokens <= 2 * h + 8 + 4, t.bytes / t.tokens


def test_writer_fed_shuffled_groups_writes_the_folder_precompute_writes(model, model_dir, samples, tmp_path):
    """The one folder writer fed as hybrid training feeds it (groups of samples in another order, with samples of no
    shard of its among them) writes what `precompute` writes: the same shard and sidecar bytes, the same manifest."""
    settings = dict(shard_tokens=200, batch_tokens=1, aux_layers=list(AUX), val_fraction=0.25, seed=7)
    full = precompute(model, samples, _cfg(tmp_path / "a", **settings), model_dir=model_dir, **KW)  # 1 sample/forward
    rows = to_rows(samples, model.args.vocab_size)
    spec = folder_spec(model.args, model.dtype, model_dir, "bfloat16", AUX)
    plans = plan_shards(0, [[r] for r in rows], 200, spec.settings)
    assert [p.name for p in plans] == [s.file for s in full.shards]
    writer = FolderWriter(tmp_path / "b", spec, plans, rank=0)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    foreign = to_rows([Sample("not-mine", [1, 2, 3], [0, 1, 1])], model.args.vocab_size)
    try:
        writer.begin(owner=True)
        for k in range(0, len(order), 3):
            group = [rows[i] for i in order[k:k + 3]] + foreign
            with torch.inference_mode():
                outs = [prefill_hidden(model, [r.ids.tolist()], hidden_layers=AUX) for r in group]
            hidden = torch.cat([o.hidden for o in outs])  # (T, H)
            aux = torch.cat([torch.cat([o.layers[j] for j in AUX], dim=-1) for o in outs])  # (T, k·H)
            writer.record([r.id for r in group], [int(r.ids.size) for r in group], hidden, aux)
        writer.finish()
        manifest = writer.write_manifest(plans, rows, val_fraction=0.25, seed=7, provenance=full.provenance, **KW)
    finally:
        writer.close()
    assert _strip(manifest) == _strip(full) and _strip(Manifest.load(tmp_path / "b")) == _strip(full)
    for s in full.shards:
        side = s.file.replace(".safetensors", ".json")
        for name in (s.file, side):
            assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name


def test_writer_refuses_to_finish_with_a_shard_open(model, model_dir, samples, tmp_path):
    rows = to_rows(samples[:6], model.args.vocab_size)
    spec = folder_spec(model.args, model.dtype, model_dir, "bfloat16", [])
    writer = FolderWriter(tmp_path, spec, plan_shards(0, [[r] for r in rows], 10**6, spec.settings), rank=0)
    try:
        writer.begin(owner=True)
        first = rows[0]
        writer.record([first.id], [int(first.ids.size)], torch.zeros(first.ids.size, model.args.hidden_size), None)
        with pytest.raises(RuntimeError, match="incomplete"):
            writer.finish()
    finally:
        writer.close()
    assert not list(tmp_path.glob("shard-*"))


def test_bad_samples_are_refused(model, model_dir, tmp_path):
    kw = dict(model_dir=model_dir, **KW)
    with pytest.raises(ValueError, match="duplicate sample id"):
        precompute(model, [Sample("x", [1], [1]), Sample("x", [2], [0])], _cfg(tmp_path), **kw)
    with pytest.raises(ValueError, match="2 input_ids but 1 loss_mask"):
        precompute(model, [Sample("x", [1, 2], [1])], _cfg(tmp_path), **kw)
    with pytest.raises(ValueError, match="token ids must be in 0..255"):
        precompute(model, [Sample("x", [1, 256], [1, 1])], _cfg(tmp_path), **kw)


# ----------------------------------------------------------------------------------------------------------------
# two ranks


def _one_then_two_processes(model, model_dir, one_dir, two_dir, *, n, seed, shard_tokens, batch_tokens, val,
                            tp=1):
    """Precompute the same samples (aux layer 2) in this process into one_dir, then with two torchrun processes
    (tensor-parallel when tp=2) into two_dir; returns the single process's manifest."""
    one = precompute(model, make_samples(n, seed), _cfg(one_dir, shard_tokens=shard_tokens, batch_tokens=batch_tokens,
                                                        aux_layers=[2], val_fraction=val, seed=0),
                     model_dir=model_dir, **KW)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "_precompute_worker.py"), str(model_dir), str(two_dir), str(n), str(seed),
           str(shard_tokens), str(batch_tokens), "2", str(val), str(tp)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return one


@pytest.mark.slow
def test_two_ranks_give_the_same_samples_as_one(model, model_dir, tmp_path):
    # batch_tokens=1: every sample is its own prefill, so values cannot depend on who packed with whom.
    one = _one_then_two_processes(model, model_dir, tmp_path / "one", tmp_path / "two", n=21, seed=3,
                                  shard_tokens=150, batch_tokens=1, val=0.3)

    two = Manifest.load(tmp_path / "two")
    assert {s.rank for s in two.shards} == {0, 1}
    assert two.split.counts == one.split.counts
    assert (two.totals.samples, two.totals.tokens, two.totals.loss_tokens) == (
        one.totals.samples, one.totals.tokens, one.totals.loss_tokens)

    def content(path, split):
        ds = PrecomputedDataset(path, split=split)
        return {ds.ids[i]: ds[i] for i in range(len(ds))}

    for split in ("train", "val"):
        a, b = content(tmp_path / "one", split), content(tmp_path / "two", split)
        assert a.keys() == b.keys() and a
        for k in a:
            for key in ("input_ids", "loss_mask", "hidden", "aux_hidden"):
                assert torch.equal(a[k][key], b[k][key]), (k, key)


@pytest.mark.slow
def test_tensor_parallel_precompute_matches_one_process(model, model_dir, tmp_path):
    """model.tp=2 on two processes: one data-parallel rank whose TP group computes every shard and whose tp rank 0
    alone writes; the samples and (up to summation order, in bf16) the hidden states equal one process's."""
    one = _one_then_two_processes(model, model_dir, tmp_path / "one", tmp_path / "tp", n=13, seed=5,
                                  shard_tokens=150, batch_tokens=64, val=0.2, tp=2)
    tp = Manifest.load(tmp_path / "tp")
    assert {s.rank for s in tp.shards} == {0} and tp.provenance["settings"]["tp"] == 2
    assert [(s.file, s.samples, s.tokens) for s in tp.shards] == [(s.file, s.samples, s.tokens) for s in one.shards]
    a, b = PrecomputedDataset(tmp_path / "one", split="all"), PrecomputedDataset(tmp_path / "tp", split="all")
    assert a.ids == b.ids
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key in ("hidden", "aux_hidden"):
            torch.testing.assert_close(y[key].float(), x[key].float(), rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------------------------------------------
# refusals


def _flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x01]))


def test_corrupt_shard_is_named(ref, tmp_path):
    d = _copy(ref, tmp_path)
    shard = ref[1].shards[1]
    _flip_byte(d / shard.file, -100)  # inside the hidden states, header intact
    ds = PrecomputedDataset(d, split="all")  # headers are fine: builds
    first = ref[1].shards[0].samples  # first sample of shard 1 (split "all" keeps the manifest order)
    ds[0]  # shard 0 is fine
    with pytest.raises(CorruptShardError, match=rf"{shard.file} is corrupt.*{shard.sha256}.*delete .* re-run"):
        ds[first]
    assert PrecomputedDataset(d, split="all", verify="never")[first]["hidden"].shape[0] > 0
    with pytest.raises(CorruptShardError, match=shard.file):
        PrecomputedDataset(d, split="all", verify="always")


def test_truncated_or_missing_shard(ref, tmp_path):
    d = _copy(ref, tmp_path)
    f = d / ref[1].shards[0].file
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CorruptShardError, match=rf"{f.name} has \d+ bytes, the manifest says"):
        PrecomputedDataset(d, verify="never")
    f.unlink()
    with pytest.raises(MissingShardError, match=rf"{f.name} is listed in .*manifest.json but missing"):
        PrecomputedDataset(d)


def test_manifest_of_another_run_is_blamed_not_the_shards(ref, model, model_dir, samples, tmp_path):
    """A manifest copied over from another precompute describes other shards under the same names: the error says
    the manifest does not match (the shards are good), and never tells the user to delete a shard."""
    other = tmp_path / "other"
    precompute(model, samples[:20], _cfg(other, shard_tokens=256, batch_tokens=100), model_dir=model_dir, **KW)
    d = _copy(ref, tmp_path)
    shutil.copy(other / "manifest.json", d / "manifest.json")
    for verify in ("never", "always"):
        with pytest.raises(ManifestError, match=r"manifest.json does not match the shards in .*another precompute "
                                                r"run") as err:
            PrecomputedDataset(d, split="all", verify=verify)
        assert "delete" not in str(err.value)
    # Its own manifest back: the folder reads as before.
    shutil.copy(ref[0] / "manifest.json", d / "manifest.json")
    assert len(PrecomputedDataset(d, split="all", verify="always")) == len(samples)


def test_foreign_folder_is_refused(ref, model_dir):
    out, manifest = ref
    fp = weights_fingerprint(model_dir)
    PrecomputedDataset(out, expect_target_fingerprint=fp, expect_tokenizer_fingerprint="tok-fp",
                       expect_chat_template_fingerprint="tmpl-fp")
    with pytest.raises(ManifestMismatchError, match=rf"target weights fingerprint {fp}.*expects v1-edges:other"
                                                    r".*re-run precompute for this target"):
        PrecomputedDataset(out, expect_target_fingerprint="v1-edges:other")
    with pytest.raises(ManifestMismatchError, match="tokenizer fingerprint tok-fp, but this run expects tok-2"):
        PrecomputedDataset(out, expect_tokenizer_fingerprint="tok-2")
    with pytest.raises(ManifestMismatchError, match="chat template fingerprint tmpl-fp, but this run expects t2"):
        PrecomputedDataset(out, expect_chat_template_fingerprint="t2")


def test_missing_or_bad_manifest(ref, tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        PrecomputedDataset(tmp_path / "nope")
    with pytest.raises(ManifestError, match="no manifest.json: point at the folder"):
        PrecomputedDataset(tmp_path)
    d = _copy(ref, tmp_path)
    (d / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="did not finish; re-run it with the same settings"):
        PrecomputedDataset(d)
    (d / "manifest.json").write_text("{bad")
    with pytest.raises(ManifestError, match="invalid JSON at line 1"):
        PrecomputedDataset(d)
    (d / "manifest.json").write_text(json.dumps({**ref[1].to_dict(), "format_version": 99}))
    with pytest.raises(ManifestError, match="format_version 99 is not supported"):
        PrecomputedDataset(d)


# ----------------------------------------------------------------------------------------------------------------
# bucketed batches


def _lengths(n=300, seed=0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 120, (n,), generator=g).tolist() + [500, 333]  # two over the budget


def test_buckets_respect_budget_and_cover_every_sample_once():
    lengths = _lengths()
    s = LengthBucketedBatchSampler(lengths, max_tokens=256, seed=1)
    batches = list(s)
    assert len(batches) == len(s)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) * longest <= 256 or len(b) == 1
    # Similar lengths together: the padding is small.
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded < 1.15 * sum(lengths)


def test_buckets_are_deterministic_per_seed_and_epoch():
    lengths = _lengths()
    a, b = LengthBucketedBatchSampler(lengths, 256, seed=1), LengthBucketedBatchSampler(lengths, 256, seed=1)
    assert list(a) == list(b)
    e0 = list(a)
    a.set_epoch(1)
    assert list(a) != e0
    assert list(LengthBucketedBatchSampler(lengths, 256, seed=2)) != e0
    assert list(LengthBucketedBatchSampler(lengths, 256, shuffle=False)) == list(
        LengthBucketedBatchSampler(lengths, 256, shuffle=False, seed=5))


@pytest.mark.parametrize("drop_last", [False, True])
def test_buckets_per_rank_are_disjoint_and_in_lockstep(drop_last):
    lengths = _lengths()
    world = 3
    ranks = [list(LengthBucketedBatchSampler(lengths, 256, seed=4, rank=r, world=world, drop_last=drop_last))
             for r in range(world)]
    total = len(list(LengthBucketedBatchSampler(lengths, 256, seed=4)))
    assert len({len(r) for r in ranks}) == 1  # same number of steps everywhere
    flat = [tuple(b) for r in ranks for b in r]
    if drop_last:
        assert len(flat) == total - total % world and len(set(flat)) == len(flat)
        assert len({i for b in flat for i in b}) == sum(len(b) for b in flat)  # no sample twice
    else:
        assert len(flat) == -(-total // world) * world
        assert {i for b in flat for i in b} == set(range(len(lengths)))  # every sample, a few repeated
        for r in range(world):  # a rank never gets the same batch twice
            assert len({tuple(b) for b in ranks[r]}) == len(ranks[r])


def test_bucket_sampler_resumes_mid_epoch():
    lengths = _lengths()
    s = LengthBucketedBatchSampler(lengths, 256, seed=3, rank=1, world=2)
    s.set_epoch(2)
    want = list(s)
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(5)]
    state = s.state_dict()
    assert state == {"epoch": 2, "position": 5}
    t = LengthBucketedBatchSampler(lengths, 256, seed=3, rank=1, world=2)
    t.load_state_dict(state)
    assert head + list(t) == want
    assert list(t) == want  # the next pass starts the epoch again
