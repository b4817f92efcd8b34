"""`mtp-regenerate` streams its input: a window of conversations in flight, each record written as soon as it is
complete, the data read no further than the window needs; the compact id sets and merge order behind resume."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtp_train.config import DataConfig, RegenerateConfig
from mtp_train.data.readers import Conversation, ReadStats, iter_conversations
from mtp_train.engine import LLMEngine
from mtp_train.engine.generator import EngineGenerator
from mtp_train.engine.turns import stop_token_ids
from mtp_train.regenerate import IdSet, RecordOrder, consolidate, part_path, plan_order, record_id, regenerate
from tests.conftest import TOPICS, make_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from mtp_train.data.chat import load_tokenizer
    from mtp_train.models import load_model

    path = make_chat_target(tmp_path_factory.mktemp("stream") / "tiny")
    return load_model(path, dtype="float32", device="cpu"), load_tokenizer(path), path


class FirstRecord(Exception):
    """Raised by the test's reader to stop a run once it has written a record."""


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        r["provenance"].pop("created_at")
        out.append(r)
    return out


def test_the_first_record_is_written_before_more_than_the_window_is_read(target, tmp_path):
    model, tok, path = target
    data = tmp_path / "convs.jsonl"
    with data.open("w") as fh:
        for i in range(20_000):
            fh.write(json.dumps({"id": f"c{i}", "prompt": f"Tell me about {TOPICS[i % len(TOPICS)]}."}) + "\n")
    out = tmp_path / "regen.jsonl"
    part = part_path(out, 0)
    window = 4
    cfg = RegenerateConfig(max_new_tokens=3, window=window, progress=False)
    stop = stop_token_ids(tok, model.args.eos_token_ids)
    stats = ReadStats()
    read_at_first_record: list[int] = []

    def reader() -> Iterator[Conversation]:
        """The data as `mtp-regenerate` reads it, counting what was taken when the first record appears."""
        for n, conv in enumerate(iter_conversations(DataConfig(paths=[str(data)]), stats=stats)):
            if part.exists() and part.stat().st_size:
                read_at_first_record.append(n)
                raise FirstRecord
            yield conv

    gen = EngineGenerator(LLMEngine(model, kv_cache_gb=0.01, max_batch_size=8), name="tiny", path=path,
                          weights_fingerprint="x")
    with pytest.raises(FirstRecord):
        regenerate(reader(), gen, tok, out, cfg, stop_ids=stop)
    # The window's conversations and the one its first free slot asked for; the reader parsed no further.
    assert read_at_first_record and read_at_first_record[0] <= window + 1
    assert stats.rows <= window + 2
    written = part.read_text().count("\n")
    assert 1 <= written <= window

    # A run stopped there resumes: the records written are kept, the rest answered, the same as a fresh run.
    limited = DataConfig(paths=[str(data)])
    resumed = regenerate(iter_conversations(limited, limit=12), gen, tok, out, cfg, stop_ids=stop)
    assert (resumed.done_before, resumed.written, resumed.records) == (written, 12 - written, 12)
    fresh = tmp_path / "fresh.jsonl"
    regenerate(iter_conversations(limited, limit=12), gen, tok, fresh, RegenerateConfig(max_new_tokens=3),
               stop_ids=stop)
    assert _records(out) == _records(fresh)
    assert [r["id"] for r in _records(out)] == [f"c{i}" for i in range(12)]  # merged in the data's order
    assert not part.exists()


def test_id_set_grows_and_answers_membership():
    ids = IdSet(capacity=8)
    assert all(ids.add(f"conv-{i}") for i in range(5000))
    assert not ids.add("conv-17") and len(ids) == 5000
    assert "conv-4999" in ids and "conv-5000" not in ids and 3 not in ids


def test_record_order_places_records_by_first_conversation_and_sample():
    convs = [Conversation(i, [], "f", 1) for i in ("b", "a", "b", "c")]
    order = plan_order(convs, 2)
    assert [order.get(record_id(c, k, 2)) for c in "abc" for k in (0, 1)] == [(1, 0), (1, 1), (0, 0), (0, 1),
                                                                            (3, 0), (3, 1)]
    assert order.get("a") is None and order.get("zz#0") is None
    built = RecordOrder(1)
    built.add("x", 7)
    assert built.get("x") == (7, 0) and len(built) == 1


def test_without_an_order_the_merge_keeps_the_order_met(tmp_path):
    def rec(rid):
        return json.dumps({"id": rid, "messages": [], "provenance": {}}) + "\n"

    out = tmp_path / "o.jsonl"
    out.write_text(rec("c") + rec("a"))
    part_path(out, 0).write_text(rec("b") + rec("a"))
    assert consolidate(out) == 3  # start-up: the data is not read yet
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["c", "a", "b"]
    assert not part_path(out, 0).exists()
