"""Self-distillation (`mtp-regenerate`): turn-by-turn answers, resume, sampling seeds, the Hydra entry point, ranks.

The real SmolLM2 checks what the answers are (greedy equals the engine on the re-rendered prompt, generation stops
at `<|im_end|>`); everything about files, resume and seeds runs on a tiny random Llama with SmolLM2's tokenizer,
which is fast and never stops early. Both need the SmolLM2 folder (its tokenizer) and skip without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mtp_train.cli.common import CONF_DIR
from mtp_train.cli.regenerate import config_path, regenerate_main
from mtp_train.config import ConfigError, DataConfig, RegenerateConfig, register_configs
from mtp_train.data.chat import render
from mtp_train.data.readers import Conversation, read_conversations
from mtp_train.engine import LLMEngine, SamplingParams
from mtp_train.engine.generator import EngineGenerator
from mtp_train.engine.turns import stop_token_ids
from mtp_train.models import load_model
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.regenerate import (
    RegenerateError,
    consolidate,
    part_path,
    plan_order,
    regenerate,
    request_params,
    request_seed,
)
from mtp_train.regenerate.stats import DUPLICATE_ID, EXCEEDS_KV_CACHE, PROMPT_TOO_LONG

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

CHAT_ROWS = [
    {"id": "add", "prompt": "What is 2+2?"},  # SmolLM2 answers in 11 tokens, the last one <|im_end|>
    {"id": "mt", "system": "You answer in one short sentence.", "turns": ["Say hi.", "Now say bye."]},
    # Existing answers are dropped and the user turns answered again.
    {"id": "old", "messages": [{"role": "user", "content": "Capital of France?"},
                               {"role": "assistant", "content": "OLD ANSWER ONE"},
                               {"role": "user", "content": "And of Italy?"},
                               {"role": "assistant", "content": "OLD ANSWER TWO"}]},
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _timeless(records: list[dict]) -> list[dict]:
    """Records without the run's timestamp (the only field two equal runs differ in)."""
    out = []
    for r in records:
        r = json.loads(json.dumps(r))
        r["provenance"].pop("created_at")
        out.append(r)
    return out


def _compose(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("regenerate", overrides=overrides)


# ------------------------------------------------------------------------------------------- tiny chat model


@pytest.fixture(scope="module")
def tiny_chat_dir(default_model_dir, tmp_path_factory) -> Path:
    """A random 2-layer Llama with SmolLM2's vocabulary, tokenizer and chat template (EOS = `<|im_end|>`)."""
    import transformers

    out = tmp_path_factory.mktemp("tiny_chat")
    # Untied: a random tied head makes greedy decoding echo the last prompt token ("\n"), an empty answer.
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_chat_dir):
    """(engine, tokenizer, folder) of the tiny chat model; one engine serves every run (stats are per run)."""
    from transformers import AutoTokenizer

    model = load_model(tiny_chat_dir, dtype="float32", backend="torch")
    return LLMEngine(model, num_pages=256, page_size=16, max_batch_size=8), \
        AutoTokenizer.from_pretrained(tiny_chat_dir), tiny_chat_dir


@pytest.fixture(scope="module")
def convs(tmp_path_factory) -> list[Conversation]:
    rows = [{"id": f"p{i}", "prompt": f"Question number {i}: tell me something."} for i in range(5)]
    rows.insert(2, {"id": "two", "turns": ["First question?", "Second question?"]})
    path = _write_jsonl(tmp_path_factory.mktemp("data") / "convs.jsonl", rows)
    return read_conversations(DataConfig(paths=[str(path)]))[0]


def _run(tiny, convs, out, *, engine=None, settings=None, **kw):
    engine_, tok, folder = tiny
    engine = engine or engine_
    settings = settings or RegenerateConfig(max_new_tokens=6)
    stop = stop_token_ids(tok, engine.model.args.eos_token_ids)
    generator = EngineGenerator(engine, name="tiny", path=folder, weights_fingerprint=weights_fingerprint(folder))
    return regenerate(convs, generator, tok, out, settings, stop_ids=stop, **kw)


# --------------------------------------------------------------------------------------------- real SmolLM2


@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    from transformers import AutoTokenizer

    return load_model(default_model_dir, dtype="float32", backend="torch"), \
        AutoTokenizer.from_pretrained(default_model_dir)


def test_turn_by_turn_answers_equal_the_engine_on_rerendered_prompts(smollm2, default_model_dir, tmp_path):
    model, tok = smollm2
    data = _write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    out = tmp_path / "out" / "regen.jsonl"
    stats = regenerate_main(_compose([f"model.path={default_model_dir}", f"data.paths=[{data}]", f"out={out}",
                                      "max_new_tokens=12", "model.kv_cache_gb=0.05", "progress=false"]))
    recs = _records(out)
    assert [r["id"] for r in recs] == ["add", "mt", "old"]
    roles = [[m["role"] for m in r["messages"]] for r in recs]
    assert roles == [["user", "assistant"], ["system", "user", "assistant", "user", "assistant"],
                     ["user", "assistant", "user", "assistant"]]
    assert "OLD ANSWER" not in out.read_text()
    assert recs[2]["source"] == {"file": str(data), "line": 3, "id": "old"}

    # Re-render every turn's prompt from the stored conversation and generate directly, one batch per turn.
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and stop_token_ids(tok, model.args.eos_token_ids) == [2]
    engine = LLMEngine(model, kv_cache_gb=0.05)
    for turn in (0, 1):
        cases = []
        for r in recs:
            msgs = r["messages"]
            users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
            if turn < len(users):
                text = render(tok, msgs[: users[turn] + 1], add_generation_prompt=True)
                cases.append((r, turn, msgs[users[turn] + 1]["content"], text))
        prompts = [tok(text, add_special_tokens=False)["input_ids"] for *_, text in cases]
        direct = engine.generate(prompts, SamplingParams(max_new_tokens=12))
        for (r, t, answer, text), res in zip(cases, direct):
            ids = res.output_ids[:-1] if res.finish_reason == "stop" else res.output_ids
            text_out = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert text_out == answer, (r["id"], t)
            assert (r["finish_reasons"][t], r["gen_tokens"][t]) == (res.finish_reason, len(res.output_ids))
            if t == 1:  # the second prompt carries the first answer
                assert r["messages"][1]["content"] in text
    finishes = [f for r in recs for f in r["finish_reasons"]]
    assert "stop" in finishes  # ended on <|im_end|>, which is not part of the stored text
    assert not any("<|im_end|>" in m["content"] for r in recs for m in r["messages"])

    assert stats["requests"] == 5 and stats["written"] == stats["records"] == 3 and stats["skipped"] == {}
    assert stats["generated_tokens"] == sum(sum(r["gen_tokens"]) for r in recs)
    prov = recs[0]["provenance"]
    assert prov["target"]["weights_fingerprint"] == weights_fingerprint(default_model_dir)
    assert prov["sampling"] == {"n": 1, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 12, "seed": 0}
    assert prov["stop_token_ids"] == [2] and {"tokenizer_fingerprint", "chat_template_fingerprint",
                                              "package_version", "created_at"} <= set(prov)
    saved = OmegaConf.load(config_path(out))
    assert saved.max_new_tokens == 12 and saved.data.paths == [str(data)]
    # The output reads back as conversations (messages format) for the next stage.
    back, _ = read_conversations(DataConfig(paths=[str(out)]))
    assert [c.messages for c in back] == [r["messages"] for r in recs]


# ------------------------------------------------------------------------------------------------- resume


def test_resume_keeps_finished_records_and_answers_only_the_rest(tiny, convs, tmp_path):
    out = tmp_path / "regen.jsonl"
    first = _run(tiny, convs[:2], out)
    before = _lines(out)
    assert first.written == 2 and len(before) == 2

    second = _run(tiny, convs[:4], out)
    after = _lines(out)
    assert after[:2] == before  # byte for byte
    assert [json.loads(line)["id"] for line in after] == [c.id for c in convs[:4]]
    # Only the two new conversations were answered (the third has two turns: three requests).
    assert (second.done_before, second.written, second.requests) == (2, 2, 3)
    assert second.generated_tokens == sum(sum(json.loads(line)["gen_tokens"]) for line in after[2:])
    assert not part_path(out, 0).exists()

    third = _run(tiny, convs[:4], out)
    assert (third.requests, third.written, third.done_before) == (0, 0, 4) and _lines(out) == after
    # The same records as a run that did all four at once.
    fresh = tmp_path / "fresh.jsonl"
    _run(tiny, convs[:4], fresh)
    assert _timeless(_records(out)) == _timeless(_records(fresh))


def test_torn_last_line_is_repaired(tiny, convs, tmp_path, caplog):
    ref = tmp_path / "ref.jsonl"
    _run(tiny, convs[:4], ref)
    lines = _lines(ref)

    # A run killed while writing: two records merged into `out`, one whole and one torn in the part file.
    out = tmp_path / "regen.jsonl"
    out.write_text("".join(lines[:2]))
    part_path(out, 0).write_text(lines[2] + lines[3][: len(lines[3]) // 2])
    stats = _run(tiny, convs[:4], out)
    assert "torn last line" in caplog.text
    assert (stats.done_before, stats.requests) == (3, 1)
    assert _lines(out)[:3] == lines[:3] and _timeless(_records(out)) == _timeless(_records(ref))
    assert not part_path(out, 0).exists()

    # A torn line at the end of `out` itself.
    caplog.clear()
    good = _lines(out)
    with out.open("a") as fh:
        fh.write('{"id": "p4", "messages": [{"ro')
    stats = _run(tiny, convs[:4], out)
    assert "torn last line" in caplog.text and stats.requests == 0
    assert _lines(out) == good

    # Damage before the last line is not a torn write: refused, naming the line.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "not json\n" + lines[1])
    with pytest.raises(RegenerateError, match=r"bad\.jsonl:2"):
        _run(tiny, convs[:4], bad)


def test_merge_orders_by_conversation_and_keeps_foreign_records(tmp_path):
    def rec(rid):
        return json.dumps({"id": rid, "messages": [], "provenance": {}}) + "\n"

    out = tmp_path / "o.jsonl"
    out.write_text(rec("b") + rec("zz-foreign"))
    part_path(out, 1).write_text(rec("c") + rec("a"))
    part_path(out, 0).write_text(rec("b"))  # a duplicate of a merged record (killed before the parts were removed)
    # Repeated ids (skipped when answering) push later conversations' positions past the number of records.
    convs = [Conversation(id=i, messages=[], source="f", line=1) for i in ("a", "a", "a", "a", "b", "c")]
    assert consolidate(out, plan_order(convs, 1)) == 4
    assert [r["id"] for r in _records(out)] == ["a", "b", "c", "zz-foreign"]
    assert not part_path(out, 0).exists() and not part_path(out, 1).exists()


def test_resume_with_other_settings_is_refused(tiny, convs, tmp_path):
    out = tmp_path / "regen.jsonl"
    started = []
    _run(tiny, convs[:1], out, on_start=lambda: started.append(1))
    kept = _lines(out)
    with pytest.raises(RegenerateError, match=r"regen\.jsonl:1 .*max_new_tokens: 6 != 5"):
        _run(tiny, convs[:2], out, settings=RegenerateConfig(max_new_tokens=5), on_start=lambda: started.append(2))
    assert started == [1] and _lines(out) == kept  # refused before anything (the saved config too) changed


# ----------------------------------------------------------------------------------------------- sampling


def test_n_samples_are_distinct_records_and_reproducible(tiny, convs, tmp_path):
    settings = RegenerateConfig(n=2, temperature=0.8, top_p=0.95, max_new_tokens=6, seed=3)
    a = tmp_path / "a.jsonl"
    stats = _run(tiny, convs[:3], a, settings=settings)
    recs = _records(a)
    assert [r["id"] for r in recs] == ["p0#0", "p0#1", "p1#0", "p1#1", "two#0", "two#1"]
    assert stats.written == 6 and stats.requests == 8
    assert all(recs[i]["messages"][-1] != recs[i + 1]["messages"][-1] for i in (0, 2, 4))

    # The same text with a batch of one, and when resumed from a partial run: seeds are per request.
    engine, _, _ = tiny
    single = LLMEngine(engine.model, num_pages=64, max_batch_size=1)
    b = tmp_path / "b.jsonl"
    _run(tiny, convs[:3], b, engine=single, settings=settings)
    c = tmp_path / "c.jsonl"
    _run(tiny, convs[1:2], c, settings=settings)  # another conversation first: other engine sequence ids
    _run(tiny, convs[:3], c, settings=settings)
    assert _timeless(_records(b)) == _timeless(recs) == _timeless(_records(c))

    d = tmp_path / "d.jsonl"
    _run(tiny, convs[:3], d, settings=RegenerateConfig(n=2, temperature=0.8, top_p=0.95, max_new_tokens=6, seed=4))
    assert [r["messages"] for r in _records(d)] != [r["messages"] for r in recs]
    assert request_seed(3, "p0", 0, 0) != request_seed(3, "p0", 1, 0) != request_seed(3, "p0", 0, 1)


@pytest.mark.parametrize("settings", [dict(max_new_tokens=6),
                                      dict(n=2, temperature=0.8, top_p=0.95, max_new_tokens=6, seed=3)],
                         ids=["greedy", "sampled"])
def test_the_window_does_not_change_the_records(tiny, convs, tmp_path, settings):
    """One conversation in flight, three, or the whole input at once (the default window): the same records, in the
    same merged order (each request's seed is its own, each turn asked after the dialogue's own answers)."""
    runs = []
    for window in (1, 3, RegenerateConfig().window):
        out = tmp_path / f"w{window}.jsonl"
        stats = _run(tiny, convs, out, settings=RegenerateConfig(window=window, **settings))
        runs.append(_timeless(_records(out)))
        assert stats.written == len(convs) * settings.get("n", 1) and stats.requests == (len(convs) + 1) * \
            settings.get("n", 1)
    assert runs[0] == runs[1] == runs[2]
    assert [r["source"]["id"] for r in runs[0]][:: settings.get("n", 1)] == [c.id for c in convs]


def test_n_above_one_needs_temperature():
    with pytest.raises(ConfigError, match="temperature > 0"):
        RegenerateConfig(n=2, temperature=0.0)
    with pytest.raises(ConfigError, match="temperature > 0"):
        regenerate_main(_compose(["n=2", "temperature=0"]))
    with pytest.raises(ValueError, match="top_p"):
        request_params(RegenerateConfig(top_p=0.0), None, [])
    with pytest.raises(ValueError, match="top_p"):  # before anything is loaded (the model folder does not exist)
        regenerate_main(_compose(["top_p=0", "model.path=/nonexistent", "model.fetch=null"]))


# ----------------------------------------------------------------------------------------------- skipping


def test_too_long_prompts_are_skipped_and_counted(tiny, tmp_path):
    long = "word " * 200
    convs = [Conversation("short", [{"role": "user", "content": "Hi?"}], "f", 1),
             Conversation("long", [{"role": "user", "content": long}], "f", 2),
             Conversation("late", [{"role": "user", "content": "Hi?"}, {"role": "user", "content": long}], "f", 3),
             Conversation("short", [{"role": "user", "content": "Again?"}], "f", 4)]
    out = tmp_path / "regen.jsonl"
    stats = _run(tiny, convs, out, settings=RegenerateConfig(max_new_tokens=6, max_prompt_tokens=100))
    assert [r["id"] for r in _records(out)] == ["short"]
    # "late" is skipped at its second turn: only complete conversations are written.
    assert dict(stats.skipped) == {PROMPT_TOO_LONG: 2, DUPLICATE_ID: 1}
    assert stats.requests == 2

    engine, _, _ = tiny
    small = LLMEngine(engine.model, num_pages=3, page_size=16)  # 48 tokens: a 40-token prompt + 6 fit, 200 do not
    stats = _run(tiny, convs[:2], tmp_path / "kv.jsonl", engine=small)
    assert dict(stats.skipped) == {EXCEEDS_KV_CACHE: 1} and stats.written == 1


def test_no_conversations_names_the_data_paths(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(RegenerateError, match="empty.jsonl"):
        regenerate_main(_compose([f"data.paths=[{empty}]", f"out={tmp_path / 'o.jsonl'}", "model.fetch=null"]))


# -------------------------------------------------------------------------------------------- entry point


def _cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    # `main` as the console script calls it: imported from the package, not run as __main__.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, "-c", "from mtp_train.cli.regenerate import main; main()", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=kw.get("cwd", ROOT))


def test_entry_point_runs_and_reports_config_errors(tiny_chat_dir, tmp_path):
    data = _write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    out = tmp_path / "regen.jsonl"
    res = _cli([f"model.path={tiny_chat_dir}", f"data.paths=[{data}]", f"out={out}", "max_new_tokens=4", "limit=2",
                "model.kv_cache_gb=0.01"], cwd=tmp_path)  # from elsewhere: the config folder is found anyway
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert [r["id"] for r in _records(out)] == ["add", "mt"]
    assert "2 records in the output" in res.stdout
    saved = OmegaConf.load(config_path(out))  # the resolved config of the run, with its overrides
    assert saved.out == str(out) and saved.max_new_tokens == 4 and saved.limit == 2

    res = _cli(["max_new_tokenz=3"])
    assert res.returncode != 0 and "max_new_tokenz" in res.stderr

    res = _cli([f"model.path={tiny_chat_dir}", "n=2", "temperature=0", f"out={tmp_path / 'x.jsonl'}"])
    assert res.returncode == 2, res.stderr[-2000:]
    assert "mtp-regenerate: error: n=2 samples" in res.stderr and "Traceback" not in res.stderr


# ----------------------------------------------------------------------------------------------- two ranks


@pytest.mark.slow
def test_two_ranks_give_the_same_records_as_one(tiny_chat_dir, convs, tmp_path):
    rows = [{"id": c.id, "messages": c.messages} for c in convs]
    data = _write_jsonl(tmp_path / "convs.jsonl", rows)
    common = [f"model.path={tiny_chat_dir}", f"data.paths=[{data}]", "max_new_tokens=5", "n=2", "temperature=0.9",
              "seed=7", "model.kv_cache_gb=0.01", "progress=false"]
    one = tmp_path / "one.jsonl"
    regenerate_main(_compose([*common, f"out={one}"]))

    two = tmp_path / "two.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mtp_train.cli.regenerate", *common, f"out={two}"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _timeless(_records(two)) == _timeless(_records(one)) and len(_records(one)) == 2 * len(convs)
    assert not list(tmp_path.glob("two.jsonl.rank*"))
    assert f"{2 * len(convs)} records in the output" in res.stdout

    # Resumed with two ranks after losing the last records: only those are answered again.
    lines = _lines(two)
    two.write_text("".join(lines[:-3]))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _lines(two)[:-3] == lines[:-3] and _timeless(_records(two)) == _timeless(_records(one))
    assert "3 written now" in res.stdout
