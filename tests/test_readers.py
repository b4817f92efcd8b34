"""Conversation readers (formats, sources, readers): every record shape, every source kind, field mapping, bad rows
and the shared data."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from mtp_train.config import DataConfig
from mtp_train.data.formats import DataError, parse_record
from mtp_train.data.readers import ReadStats, iter_conversations, read_conversations

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _roles(conv) -> list[str]:
    return [m["role"] for m in conv.messages]


def _data(paths: str | Path | list, **settings) -> DataConfig:
    """The DataConfig that reads `paths` (one or a list) with the given settings."""
    return DataConfig(paths=[str(p) for p in (paths if isinstance(paths, list) else [paths])], **settings)


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------- formats


def test_sharegpt_roles_ids_and_lines():
    path = FIXTURES / "sharegpt.jsonl"
    convs, stats = read_conversations(_data(path))
    assert [c.id for c in convs] == ["sg-1", "sg-2", "sharegpt.jsonl:3", "sg-4"]
    # The blank line 4 is not a row, but line numbers still count it.
    assert [c.line for c in convs] == [1, 2, 3, 5]
    assert all(c.source == str(path) for c in convs)
    assert _roles(convs[0]) == ["user", "assistant", "user", "assistant"]
    assert convs[0].messages[3] == {"role": "assistant", "content": "2 is the only even prime."}
    assert _roles(convs[1]) == ["system", "user", "assistant"]  # system, user, chatgpt
    assert _roles(convs[2]) == ["user", "assistant", "user", "assistant"]  # human, bard, Human, model
    assert not convs[3].has_answer and convs[0].has_answer
    assert (stats.rows, stats.kept, stats.num_bad) == (4, 4, 0)


def test_messages_multi_turn_and_metadata():
    convs, _ = read_conversations(_data(FIXTURES / "messages.jsonl", format="messages"))
    assert [c.id for c in convs] == ["m-1", "m-2"]
    assert convs[0].metadata == {"finish_reason": "stop"}
    assert _roles(convs[1]) == ["system", "user", "assistant", "user", "assistant"]
    assert convs[1].messages[4]["content"] == "Rome."


def test_prompt_shapes():
    convs, stats = read_conversations(_data(FIXTURES / "prompts.jsonl"))
    assert stats.num_bad == 0
    prompt, alpaca, alpaca_no_input, gpteacher, gsm8k, mtbench, self_instruct = convs
    # A derived set's source_id is only unique together with its source file.
    assert prompt.id == "chat.jsonl:17"
    assert prompt.messages == [{"role": "user", "content": "Write a haiku about rain."}]
    assert alpaca.messages == [{"role": "user", "content": "Translate to German.\n\nGood morning"},
                               {"role": "assistant", "content": "Guten Morgen"}]
    assert alpaca_no_input.messages[0]["content"] == "Give three tips for staying healthy."
    assert gpteacher.messages[1] == {"role": "assistant", "content": "A function that calls itself."}
    assert gsm8k.messages[1]["content"].endswith("#### 5") and _roles(gsm8k) == ["user", "assistant"]
    # MT-bench: two unanswered user turns, kept apart so that a regenerator can answer them one at a time.
    assert mtbench.id == "81" and mtbench.metadata == {"category": "writing"}
    assert mtbench.messages == [{"role": "user", "content": "Write a short poem."},
                                {"role": "user", "content": "Now make it rhyme."}]
    assert self_instruct.id == "seed_task_0"
    assert self_instruct.messages[1] == {"role": "assistant", "content": "Oatmeal with fruit."}


def test_json_array_file_has_line_numbers(tmp_path):
    convs, _ = read_conversations(_data(FIXTURES / "alpaca_array.json"))
    assert [c.line for c in convs] == [2, 7]
    assert convs[1].messages[0]["content"] == "Add the numbers.\n\n1, 2"
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b",,}\n]\n')
    with pytest.raises(DataError, match=r"broken\.json:3: invalid_json"):
        read_conversations(_data(broken))


def test_explicit_format_must_match(tmp_path):
    with pytest.raises(DataError, match=r"messages\.jsonl:1: unrecognised_fields"):
        read_conversations(_data(FIXTURES / "messages.jsonl", format="sharegpt"))
    with pytest.raises(ValueError, match="format must be one of"):
        read_conversations(_data(FIXTURES / "messages.jsonl", format="alpaca"))


# ------------------------------------------------------------------------------------------------- sources


def test_saved_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"id": "b", "messages": [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    convs, stats = read_conversations(_data(tmp_path / "ds"))
    assert [c.id for c in convs] == ["a", "b"] and [c.line for c in convs] == [1, 2]
    assert convs[1].messages[1] == {"role": "assistant", "content": "ciao"}
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]),
                               "test": datasets.Dataset.from_list(rows[1:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    convs, _ = read_conversations(_data(tmp_path / "dd"))
    assert sorted(c.source.rsplit("[", 1)[1] for c in convs) == ["test]", "train]"]


def test_parquet_and_csv_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"instruction": "Say hi.", "input": None, "output": "Hi!"},
            {"instruction": "Add.", "input": "1 and 2", "output": "3"}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "alpaca.parquet"))
    ds.to_csv(str(tmp_path / "alpaca.csv"), index=False)
    for name in ("alpaca.parquet", "alpaca.csv"):
        convs, stats = read_conversations(_data(tmp_path / name))
        assert stats.num_bad == 0, name
        # A missing column value (None in parquet, empty in csv) is an absent field, not bad content.
        assert convs[0].messages == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
        assert convs[1].messages[0]["content"] == "Add.\n\n1 and 2"
        assert convs[1].id == f"{name}:2"


def test_folder_glob_and_several_paths(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "three"}])
    by_folder, _ = read_conversations(_data(tmp_path))
    by_glob, _ = read_conversations(_data(tmp_path / "*.jsonl"))
    by_list, _ = read_conversations(_data([tmp_path / "a.jsonl", tmp_path / "b.jsonl"]))
    texts = [c.messages[0]["content"] for c in by_folder]
    assert texts == ["one", "two", "three"]
    assert [c.messages for c in by_glob] == [c.messages for c in by_list] == [c.messages for c in by_folder]


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_conversations(_data([FIXTURES / "messages.jsonl", missing]))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        iter_conversations(_data(missing))  # at the call, before any row is read
    with pytest.raises(FileNotFoundError, match=r"no data files match .*\*\.parquet"):
        read_conversations(_data(tmp_path / "*.parquet"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported file type"):
        read_conversations(_data(tmp_path / "notes.txt"))


# ------------------------------------------------------------------------------------------ options, limits


def test_field_map_and_system_prompt(tmp_path):
    path = _write_jsonl(tmp_path / "custom.jsonl", [
        {"uid": "q1", "question_text": "Why is the sky blue?"},
        {"uid": "q2", "question_text": "What is 1+1?", "gold": "2"},
    ])
    convs, _ = read_conversations(_data(path, field_map={"prompt": "question_text", "id": "uid", "completion": "gold"},
                                        system_prompt="You are helpful."))
    assert [c.id for c in convs] == ["q1", "q2"]
    assert convs[0].messages == [{"role": "system", "content": "You are helpful."},
                                 {"role": "user", "content": "Why is the sky blue?"}]
    assert convs[1].messages[-1] == {"role": "assistant", "content": "2"}
    # A conversation with its own system message keeps it.
    convs, _ = read_conversations(_data(FIXTURES / "messages.jsonl", system_prompt="Other."))
    assert convs[0].messages[0] == {"role": "system", "content": "Other."}
    assert convs[1].messages[0] == {"role": "system", "content": "Be terse."}


def test_limit_and_streaming_stats():
    stats = ReadStats()
    it = iter_conversations(_data([FIXTURES / "sharegpt.jsonl", FIXTURES / "messages.jsonl"]), limit=5, stats=stats)
    first = next(it)
    assert first.id == "sg-1" and stats.kept == 1  # rows are read lazily
    rest = list(it)
    assert [c.id for c in rest] == ["sg-2", "sharegpt.jsonl:3", "sg-4", "m-1"]
    assert stats.kept == 5
    convs, _ = read_conversations(_data(FIXTURES / "messages.jsonl"), limit=1)
    assert len(convs) == 1


# ------------------------------------------------------------------------------------------------ bad rows

BAD_ROWS = FIXTURES / "bad_rows.jsonl"
EXPECTED_BAD = {  # line → reason, as written in the fixture
    2: "invalid_json", 3: "unrecognised_fields", 4: "empty_content", 5: "role_order", 6: "role_order",
    7: "non_string_content", 8: "unknown_role", 9: "not_an_object", 11: "empty_content",
}


@pytest.mark.parametrize("line", sorted(EXPECTED_BAD))
def test_bad_row_error_names_file_line_reason(tmp_path, line):
    # A copy that keeps the good first line, then the one bad line: the error must point at line 2.
    lines = BAD_ROWS.read_text().splitlines()
    path = tmp_path / "one_bad.jsonl"
    path.write_text(lines[0] + "\n" + lines[line - 1] + "\n")
    with pytest.raises(DataError) as info:
        read_conversations(_data(path))
    err = info.value
    assert (err.source, err.line, err.reason) == (str(path), 2, EXPECTED_BAD[line])
    assert str(err).startswith(f"{path}:2: {EXPECTED_BAD[line]}")


def test_bad_rows_skipped_and_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="mtp_train.data.readers"):
        convs, stats = read_conversations(_data(BAD_ROWS, on_bad_row="skip"))
    assert [c.line for c in convs] == [1, 10]
    expected: dict[str, int] = {}
    for reason in EXPECTED_BAD.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(stats.bad) == expected
    assert (stats.rows, stats.kept, stats.num_bad) == (11, 2, 9)
    assert stats.examples["role_order"] == [f"{BAD_ROWS}:5", f"{BAD_ROWS}:6"]
    assert "role_order=2" in caplog.text and f"{BAD_ROWS}:5" in caplog.text


def test_error_mode_stops_at_first_bad_row():
    with pytest.raises(DataError, match=r"bad_rows\.jsonl:2: invalid_json"):
        read_conversations(_data(BAD_ROWS))


def test_parse_record_directly():
    messages, metadata, conv_id = parse_record({"question": "Q?", "answer": "A.", "level": 3}, DataConfig())
    assert messages == [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    assert metadata == {"level": 3} and conv_id is None


@pytest.mark.parametrize("name", ["thinking", "reasoning_content"])
def test_an_assistant_turns_reasoning_is_kept_under_both_names(tmp_path, name):
    """GPT-OSS's template reads `thinking`, Qwen3's and DeepSeek's `reasoning_content`: a record with either keeps
    the text under both; turns without one (and a user turn's stray field) are read as before."""
    record = {"id": "r", "messages": [
        {"role": "user", "content": "2 + 2?", name: "not an assistant's"},
        {"role": "assistant", "content": "4.", name: "Two and two make four."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6.", name: "  "}]}
    convs, _ = read_conversations(_data(_write_jsonl(tmp_path / "r.jsonl", [record])))
    assert convs[0].messages == [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4.", "thinking": "Two and two make four.",
         "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6."}]
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello.", name: "Greet."}]}
    messages, _, _ = parse_record(sharegpt, DataConfig())
    assert messages[1] == {"role": "assistant", "content": "Hello.", "thinking": "Greet.",
                           "reasoning_content": "Greet."}


def test_reasoning_that_is_not_one_text_is_a_bad_row(tmp_path):
    def row(**fields):
        return {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A.", **fields}]}

    same, _, _ = parse_record(row(thinking="R.", reasoning_content="R."), DataConfig())
    assert same[1]["thinking"] == same[1]["reasoning_content"] == "R."
    path = _write_jsonl(tmp_path / "bad.jsonl", [row(thinking="R.", reasoning_content="S."), row(thinking=["R."]),
                                                 row(reasoning_content="\ud800")])
    convs, stats = read_conversations(_data(path, on_bad_row="skip"))
    assert not convs and stats.bad == {"conflicting_reasoning": 1, "non_string_content": 1, "invalid_text": 1}
    with pytest.raises(DataError, match=r"bad\.jsonl:1: conflicting_reasoning: messages\[1\] has different texts"):
        read_conversations(_data(path))


# ------------------------------------------------------------------------------------------ shared data


def _shared_files() -> list[Path]:
    if not SHARED_DATA.is_dir():
        return []
    return sorted([*SHARED_DATA.glob("train/*.jsonl"), *SHARED_DATA.glob("dev/*.jsonl")])


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data not present")
@pytest.mark.parametrize("path", _shared_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shared_data_first_rows_parse(tmp_path, path):
    head = tmp_path / path.name
    with path.open("rb") as src, head.open("wb") as dst:
        for _, line in zip(range(50), src):
            dst.write(line)
    convs, stats = read_conversations(_data(head, format="auto", on_bad_row="skip"))
    assert stats.num_bad == 0, stats.summary()
    assert len(convs) == stats.rows > 0
    assert all(c.messages[0]["role"] in ("user", "system") for c in convs)


def test_lone_surrogate_is_a_bad_row_named_and_skippable(tmp_path):
    r"""`"\ud800"` in JSON decodes to a string no tokenizer or UTF-8 file takes: a bad row at its line, in the
    content, a prompt field or an id, that `skip` counts."""
    good = '{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}'
    bad = ['{"messages": [{"role": "user", "content": "x \\ud800 y"}, {"role": "assistant", "content": "ok"}]}',
           '{"prompt": "fine", "completion": "\\udfff"}',
           '{"id": "\\ud83d", "prompt": "fine"}']
    path = tmp_path / "surrogates.jsonl"
    path.write_text("\n".join([good, *bad]) + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: invalid_text: .*lone surrogate '\\ud800' at character 2"):
        read_conversations(_data(path))
    convs, stats = read_conversations(_data(path, on_bad_row="skip"))
    assert [c.id for c in convs] == ["a"]
    assert dict(stats.bad) == {"invalid_text": 3}
    assert stats.examples["invalid_text"] == [f"{path}:2", f"{path}:3", f"{path}:4"]


def test_a_cut_line_is_reported_at_its_real_column(tmp_path):
    path = tmp_path / "cut.jsonl"
    line = '{"id": "a", "prompt": "hello"'
    path.write_text(line + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: invalid_json: Expecting ',' delimiter at column {len(line) + 1}"):
        read_conversations(_data(path))


def test_the_shipped_demo_prompt_sets_read_whole_and_never_touch_the_held_out_prompts():
    # Every conf/data set over the repository's own files reads through the reader with no bad row; ids are unique
    # across all of them, and no training prompt is a held-out prompt or turn (the τ the demo reports would count it).
    from omegaconf import OmegaConf

    from mtp_train.cli.common import CONF_DIR

    root = Path(CONF_DIR).parent
    sets = {p.stem: OmegaConf.load(p) for p in sorted((Path(CONF_DIR) / "data").glob("demo*.yaml"))}
    assert {"demo", "demo-640", "demo-960", "demo-heldout"} <= set(sets)
    texts: dict[str, set[str]] = {}
    ids: dict[str, str] = {}
    for name, conf in sets.items():
        if not all((root / p).is_file() for p in conf.paths):
            continue  # demo-regen: the regenerated file a run writes
        convs, stats = read_conversations(_data([str(root / p) for p in conf.paths]))
        assert not stats.bad and convs and stats.kept == stats.rows, name
        texts[name] = {m["content"] for c in convs for m in c.messages if m["role"] == "user"}
        for c in convs:
            assert ids.setdefault(c.id, c.source) == c.source, f"{c.id} in two files"
    assert len(texts["demo-960"]) == 960 and texts["demo"] < texts["demo-640"] < texts["demo-960"]
    assert not texts["demo-960"] & texts["demo-heldout"]


GOOD = '{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}'


def _nested(depth: int, close: bool = True) -> str:
    """A chat record whose `messages` holds arrays `depth` levels deep (brackets in a string beside it do not count)."""
    return '{"note": "[[[[{{", "messages": ' + "[" * depth + ("]" * depth + "}" if close else "")


@pytest.mark.parametrize("depth", [101, 100_000])
def test_a_record_nested_too_deep_is_a_bad_row_named_and_skippable(tmp_path, depth):
    # Python's parser gives a RecursionError somewhere past ~1000 levels; the reader refuses past 100 either way.
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join([GOOD, _nested(depth), GOOD]) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:2: nested_too_deep: nested deeper than 100 levels \(arrays and "
                                        rf"objects {depth + 1} deep\); flatten the record or leave the row out$"):
        read_conversations(_data(path))
    convs, stats = read_conversations(_data(path, on_bad_row="skip"))
    assert [c.line for c in convs] == [1, 3] and dict(stats.bad) == {"nested_too_deep": 1}
    assert stats.examples["nested_too_deep"] == [f"{path}:2"]


def test_a_record_nested_to_the_limit_is_read(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(_nested(99) + "\n")  # 100 levels with the record's own object
    with pytest.raises(DataError, match=r":1: unrecognised_fields: messages\[0\] is list"):
        read_conversations(_data(path))


def test_a_json_array_goes_on_after_a_record_nested_too_deep(tmp_path):
    # The element's end is found without the parser, so the rest of the file is still read.
    path = tmp_path / "deep.json"
    path.write_text("[\n" + ",\n".join([GOOD, _nested(150), _nested(100_000), GOOD.replace('"a"', '"b"')]) + "\n]\n")
    convs, stats = read_conversations(_data(path, on_bad_row="skip"))
    assert [(c.id, c.line) for c in convs] == [("a", 2), ("b", 5)]
    assert stats.examples["nested_too_deep"] == [f"{path}:3", f"{path}:4"]


@pytest.mark.parametrize("field, record", [
    ("id", '{"id": 5001, "prompt": "hi"}'),
    ("meta.scores[1]", '{"id": "x", "prompt": "hi", "meta": {"scores": [1, -5001]}}'),
])
def test_an_integer_too_long_for_python_is_a_bad_row_naming_its_field(tmp_path, field, record):
    path = tmp_path / "long.jsonl"
    path.write_text(GOOD + "\n" + record.replace("5001", "9" * 5001) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:2: integer_too_long: field {re.escape(field)} is an integer of "
                                        rf"5001 digits, more than the \d+ Python converts; write it as a string"):
        read_conversations(_data(path))
    convs, stats = read_conversations(_data(path, on_bad_row="skip"))
    assert [c.id for c in convs] == ["a"] and dict(stats.bad) == {"integer_too_long": 1}
