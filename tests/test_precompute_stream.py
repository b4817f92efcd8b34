"""`mtp-precompute` streams its input: the first shard is written after a window of conversations, not the whole
file; ids are made unique by the same rule as over the whole list; the folder's token counts are those of its
shards; a finished folder is compared shard by shard with the run before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from mtp_train.config import PrecomputeConfig
from mtp_train.config.data import DataConfig
from mtp_train.config.model import ModelConfig
from mtp_train.data.chat import load_tokenizer
from mtp_train.data.samples import SampleStream, UniqueIds, build_samples
from mtp_train.models import load_model
from mtp_train.precompute import PrecomputeError, is_val, precompute
from mtp_train.precompute.manifest import TOKEN_COUNTS_NAME, Manifest, read_token_counts
from mtp_train.precompute.pipeline import run_precompute
from mtp_train.precompute.shards import counts_path
from tests._precompute_worker import make_samples
from tests.conftest import TOPICS, make_chat_target, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")
KW = dict(tokenizer_fingerprint="tok-fp", chat_template_fingerprint="tmpl-fp")


class _Stop(Exception):
    pass


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("target") / "t")


@pytest.fixture(scope="module")
def model(target):
    return load_model(target, dtype="float32", backend="torch")


def _chat(i: int, conv_id: str | None = None) -> dict:
    t = TOPICS[i % len(TOPICS)]
    return {"id": conv_id or f"c{i}", "messages": [{"role": "user", "content": f"Tell me about {t}."},
                                                   {"role": "assistant", "content": f"Here is a fact about {t}."}]}


def _cfg(target: Path, paths: list[Path], out: Path, **settings) -> PrecomputeConfig:
    return PrecomputeConfig(model=ModelConfig(path=str(target)), data=DataConfig(paths=[str(p) for p in paths]),
                            out=str(out), progress=False, max_seq_len=64, **settings)


def test_first_shard_is_written_after_a_window_not_the_whole_input(target, model, tmp_path):
    n, window = 20_000, 64
    data = write_jsonl(tmp_path / "big.jsonl", [_chat(i) for i in range(n)])
    cfg = _cfg(target, [data], tmp_path / "pc", shard_tokens=1500, batch_tokens=512, window=window)
    stream = SampleStream(load_tokenizer(target), cfg, window=window)
    tokenized_at: list[int] = []

    def first_shard(info, skipped):
        tokenized_at.append(stream.tokenized)
        raise _Stop  # the run stops here; a re-run would keep the shard

    with pytest.raises(_Stop):
        precompute(model, stream, cfg, model_dir=target, data_info=stream.info, on_shard=first_shard, **KW)
    assert (tmp_path / "pc" / "shard-r0-00000.safetensors").is_file()
    # The first shard (about 45 conversations) and the next one, whose first sample closes it, are planned from
    # the first windows read: what was tokenized is bounded by the window, not by the input's 20k conversations.
    assert len(tokenized_at) == 1 and tokenized_at[0] <= 4 * window < n
    assert stream.info == {}  # the stream never reached its end


def _reference_unique(ids: list[str]) -> list[str]:
    """The rule over the whole list, as written before it streamed."""
    taken, seen, out = set(ids), {}, []
    for i in ids:
        seen[i] = seen.get(i, 0) + 1
        if seen[i] == 1:
            out.append(i)
            continue
        k = seen[i]
        while f"{i}#{k}" in taken:
            k += 1
        seen[i] = k
        taken.add(f"{i}#{k}")
        out.append(f"{i}#{k}")
    return out


def test_ids_made_unique_one_at_a_time_as_over_the_whole_list():
    g = np.random.default_rng(0)
    pool = ["a", "b", "a#2", "a#3", "b#2", "a#2#2", "c", "b#10"]
    for _ in range(200):
        ids = [str(x) for x in g.choice(pool, size=int(g.integers(1, 30)))]
        asked: list[int] = []
        unique = UniqueIds(lambda ids=ids, asked=asked: asked.append(1) or {i for i in ids if "#" in i})
        assert [unique(i, None) for i in ids] == _reference_unique(ids)
        assert len(asked) == (len(set(ids)) < len(ids))  # the whole data is asked for only when ids repeat


def test_a_small_window_gives_the_samples_of_the_whole_file(target, tmp_path):
    """Repeated ids across windows and files, a conversation named like a rename (kept) and one dropped (its name
    is free again): the stream's samples and `data` are build_samples' whatever the window."""
    rows = [_chat(i, {3: "x", 9: "x", 14: "x#2", 20: "y", 33: "y"}.get(i)) for i in range(40)]
    rows.append({"id": "y#2", "prompt": "no answer"})  # dropped: y's repeat may take y#2
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    b = write_jsonl(tmp_path / "b.jsonl", [_chat(i, "x" if i % 2 else None) for i in range(6)])
    cfg = _cfg(target, [a, b], tmp_path / "unused")
    tok = load_tokenizer(target)
    whole, info = build_samples(tok, cfg)
    ids = [s.id for s in whole]
    assert len(set(ids)) == len(ids) and "x#3" in ids and "y#2" in ids
    for window in (1, 7, 1000):
        stream = SampleStream(tok, cfg, window=window)
        got = list(stream)
        assert [(s.id, s.input_ids, s.loss_mask) for s in got] == [(s.id, s.input_ids, s.loss_mask) for s in whole]
        assert stream.info == info


def _direct_counts(folder: Path, vocab: int, seed: int, val_fraction: float) -> dict[str, torch.Tensor]:
    """(vocab,) counts of loss-masked token ids per split, from every shard's own tensors."""
    counts = {s: torch.zeros(vocab, dtype=torch.long) for s in ("train", "val")}
    for entry in Manifest.load(folder).shards:
        with safe_open(str(folder / entry.file), "pt") as f:
            ids, mask, offsets = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("offsets")
            names = json.loads(f.metadata()["sample_ids"])
        for k, sid in enumerate(names):
            a, b = int(offsets[k]), int(offsets[k + 1])
            split = "val" if is_val(sid, seed, val_fraction) else "train"
            counts[split] += torch.bincount(ids[a:b][mask[a:b].bool()].long(), minlength=vocab)
    return counts


def test_token_counts_are_those_of_the_shards(model, target, tmp_path):
    vocab = model.args.vocab_size
    samples = make_samples(60, seed=4, vocab=vocab)
    out = tmp_path / "pc"
    cfg = PrecomputeConfig(out=str(out), progress=False, shard_tokens=150, batch_tokens=64, val_fraction=0.3, seed=5)
    m = precompute(model, samples, cfg, model_dir=target, data_info={}, **KW)
    assert m.token_counts is not None and m.token_counts["file"] == TOKEN_COUNTS_NAME
    want = _direct_counts(out, vocab, 5, 0.3)
    for split in ("train", "val"):
        assert torch.equal(read_token_counts(out, split, vocab), want[split])
        assert int(want[split].sum()) == m.split.counts[f"{split}_loss_tokens"] > 0

    # Resumed under another split rule (the shards are kept: the rule is not in their plans) with a counts file
    # lost and one torn: the counts are those of the new split, and the shards were not computed again.
    (out / "manifest.json").unlink()
    counts_path(out / m.shards[0].file).unlink()
    counts_path(out / m.shards[1].file).write_bytes(b"torn")
    before = {s.file: (out / s.file).read_bytes() for s in m.shards}
    skipped: list[bool] = []
    cfg = PrecomputeConfig(out=str(out), progress=False, shard_tokens=150, batch_tokens=64, val_fraction=0.5, seed=5)
    m2 = precompute(model, samples, cfg, model_dir=target, data_info={}, on_shard=lambda i, s: skipped.append(s),
                    **KW)
    assert all(skipped) and len(skipped) == len(m.shards)
    assert {s.file: (out / s.file).read_bytes() for s in m2.shards} == before
    want = _direct_counts(out, vocab, 5, 0.5)
    for split in ("train", "val"):
        assert torch.equal(read_token_counts(out, split, vocab), want[split])


def test_a_finished_folder_of_other_samples_is_refused_before_any_write(model, target, tmp_path):
    samples = make_samples(30, seed=2, vocab=model.args.vocab_size)
    out = tmp_path / "pc"
    cfg = PrecomputeConfig(out=str(out), progress=False, shard_tokens=120, batch_tokens=64, val_fraction=0.0)
    m = precompute(model, samples, cfg, model_dir=target, data_info={}, **KW)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    started: list[int] = []
    for other in (samples[:-1], samples + make_samples(1, seed=9), samples[:5] + samples[6:]):
        with pytest.raises(PrecomputeError, match=rf"other samples \({len(m.shards)} shards of 30 samples; .*"
                                                  r"overwrite=true"):
            precompute(model, other, cfg, model_dir=target, data_info={}, on_start=lambda: started.append(1), **KW)
    assert not started and {p.name: p.read_bytes() for p in out.iterdir()} == before
    # The same samples again: the finished folder is returned, nothing written.
    again = precompute(model, samples, cfg, model_dir=target, data_info={}, on_start=lambda: started.append(1), **KW)
    assert not started and again.to_dict() == m.to_dict()


def test_run_precompute_streams_the_data_into_the_same_folder(model, target, tmp_path):
    """`run_precompute` (what the command calls) over files with repeated ids and a small window writes the folder
    that the samples of the whole file, planned at once, give."""
    data = write_jsonl(tmp_path / "d.jsonl", [_chat(i, "dup" if i % 5 == 0 else None) for i in range(50)])
    settings = dict(shard_tokens=200, batch_tokens=64, val_fraction=0.25, seed=1)
    tok = load_tokenizer(target)
    streamed = run_precompute(model, tok, target, _cfg(target, [data], tmp_path / "a", window=3, **settings),
                              rank=0, world=1, tp_rank=0, tp_size=1, config_dict={})
    samples, info = build_samples(tok, _cfg(target, [data], tmp_path / "x"))
    whole = precompute(model, samples, _cfg(target, [data], tmp_path / "b", **settings), model_dir=target,
                       data_info=info, tokenizer_fingerprint=streamed.tokenizer.fingerprint,
                       chat_template_fingerprint=streamed.tokenizer.chat_template_fingerprint,
                       provenance=streamed.provenance)
    a, b = streamed.to_dict(), whole.to_dict()
    for d in (a, b):
        d.pop("created_at")
        d["provenance"].pop("config", None)
    assert a == b and streamed.data["duplicate_ids"] == 1
    for s in streamed.shards:
        for name in (s.file, s.file.replace(".safetensors", ".json"), TOKEN_COUNTS_NAME):
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
