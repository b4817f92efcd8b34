"""`make bench-scale`'s pure parts: the synthetic conversations (read back by the package's reader), the growth
exponent, the first-sample checks and the summary's goals. The stage runs themselves are the bench's, not the
suite's (they take minutes)."""

from __future__ import annotations

import json
import math

import pytest

from bench.scale import (
    GIB,
    Run,
    first_record,
    first_shard,
    first_step,
    growth_exponent,
    labels_of,
    summarize,
    write_conversations,
)
from mtp_train.config import DataConfig
from mtp_train.data.readers import read_conversations


def test_conversations_are_read_by_the_package_as_messages(tmp_path):
    path = write_conversations(tmp_path / "c.jsonl", 50, seed=1)
    convs, stats = read_conversations(DataConfig(name="scale", paths=[str(path)], format="messages"))
    assert len(convs) == 50 and not stats.bad
    assert len({c.id for c in convs}) == 50
    assert len({c.messages[0]["content"] for c in convs}) == 50  # no two prompts alike
    for c in convs:
        assert [m["role"] for m in c.messages] == ["user", "assistant"]
        assert 3 <= len(c.messages[0]["content"].split()) <= 12
    assert path.read_bytes() == write_conversations(tmp_path / "d.jsonl", 50, seed=1).read_bytes()


@pytest.mark.parametrize("slope", [0.0, 0.5, 1.0, 2.0])
def test_growth_exponent_recovers_a_power_law(slope):
    sizes = [1e4, 1e5, 1e6]
    assert growth_exponent(sizes, [3.0 * n**slope for n in sizes]) == pytest.approx(slope)


def test_growth_exponent_needs_two_sizes():
    assert growth_exponent([1e4], [2.0]) is None
    assert growth_exponent([1e4, 1e5], [2.0, None]) is None
    assert growth_exponent([1e4, 1e4], [2.0, 4.0]) is None


def test_first_sample_checks(tmp_path):
    out = tmp_path / "r" / "out.jsonl"
    out.parent.mkdir()
    seen = first_record(out)
    assert not seen()
    part = out.with_name("out.jsonl.rank0")
    part.write_text('{"id": "a"')  # a line being written is not a record yet
    assert not seen()
    part.write_text('{"id": "a"}\n')
    assert seen()

    pc = tmp_path / "pc"
    shard = first_shard(pc)
    assert not shard()
    pc.mkdir()
    (pc / "shard-r0-00000.safetensors").write_bytes(b"x")  # the shard without its sidecar is not done
    assert not shard()
    (pc / "shard-r0-00000.json").write_text("{}")
    assert shard()

    step = first_step(tmp_path / "t")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    assert step()


def test_labels():
    assert labels_of(["regenerate", "train"], ["eagle3", "mtp"]) == ["regenerate", "train:eagle3", "train:mtp"]
    with pytest.raises(ValueError, match="unknown stage"):
        labels_of(["eval"], ["mtp"])


def test_summary_goals_compare_the_largest_size_with_the_smallest():
    runs = [Run("precompute", 10**4, 10.0, 2 * GIB, None), Run("precompute", 10**5, 12.0, int(2.5 * GIB), None),
            Run("precompute", 10**6, 40.0, int(3.5 * GIB), None),
            Run("train:mtp", 10**4, 5.0, GIB, None), Run("train:mtp", 10**6, None, 0, None, "no first sample")]
    s = summarize(runs, ["precompute", "train:mtp"], [10**4, 10**5, 10**6])
    g = s["precompute"]["goals"]
    assert g["at_size"] == 10**6 and g["against_size"] == 10**4 and g["complete"]
    assert not g["first_sample_ok"] and not g["peak_ok"] and g["peak_growth_gib"] == pytest.approx(1.5)
    assert s["precompute"]["time_exponent"] == pytest.approx(growth_exponent([1e4, 1e5, 1e6], [10, 12, 40]))
    assert math.isclose(s["precompute"]["memory_exponent"],
                        growth_exponent([1e4, 1e5, 1e6], [2.0, 2.5, 3.5]), rel_tol=1e-6)
    mtp = s["train:mtp"]
    assert mtp["points"][2]["seconds"] is None and mtp["points"][2]["notes"] == ["no first sample"]
    assert mtp["goals"]["at_size"] == 10**4 and not mtp["goals"]["complete"]
