"""Reasoning traces through the data path, and samples longer than the target's context, on a tiny random Qwen3
target with the Qwen3 chat template of `tests/fixtures/chat_templates/qwen3.jinja` (`tests/_templates.py`).

* Masks: a trace and its closing `</think>` are supervised, an empty think block never, and a turn whose
  reasoning the template drops from later history stays out of the loss.
* Regeneration: `chat_template_kwargs` reach the template and the provenance; an answer holding a thinking block
  is stored verbatim, so the stored conversation renders back to the prompt the target saw and the tokens it
  generated.
* Serving: mtp-serve's prompt ids for a chat request are the prefix of the training sample's ids for the same
  conversation under the same kwargs.
* Context: a sample longer than the target's `max_position_embeddings` is refused before any work (precompute,
  online training), naming file:line, id, length, context and the settings; `data.over_context=split|truncate`
  does what it says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from mtp_train.config import DataConfig, PrecomputeConfig, RegenerateConfig
from mtp_train.data.chat import load_tokenizer, render, tokenize_conversation
from mtp_train.data.samples import ContextError, SampleStream
from mtp_train.engine.generator import Generator, GeneratorLimits, GeneratorStats
from mtp_train.engine.llm import GenerationOutput
from mtp_train.engine.turns import prompt_ids
from mtp_train.models import load_model
from mtp_train.precompute import PrecomputedDataset
from mtp_train.precompute.pipeline import run_precompute
from mtp_train.regenerate import regenerate
from tests._serve import app_server
from tests._templates import build_family, trained_bpe
from tests.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 64  # the tiny target's max_position_embeddings
OFF = {"enable_thinking": False}
ON = {"enable_thinking": True}
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
TRACE = "<think>\nTwo plus two makes four.\n</think>\n\nThe answer is 4."


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[Path, Any]:
    """(folder, tokenizer): a random 3-layer Qwen3 of CONTEXT positions with the Qwen3 template's tokenizer."""
    path = tmp_path_factory.mktemp("thinking") / "qwen3"
    tok = build_family(trained_bpe(), "qwen3")
    make_tiny_checkpoint("qwen3", path, vocab_size=len(tok), max_position_embeddings=CONTEXT,
                         eos_token_id=tok.eos_token_id)
    tok.save_pretrained(path)
    return path, load_tokenizer(path)


def masked(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m], skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -------------------------------------------------------------------------------------------------- masks


def test_a_trace_and_its_closing_are_supervised_an_empty_block_never(qwen3):
    _, tok = qwen3
    sample = tokenize_conversation(tok, [*QUESTION, {"role": "assistant", "content": TRACE}])
    assert masked(tok, sample) == TRACE + "<|im_end|>"  # the target wrote its <think> too: the content holds it
    reasoning = {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Two plus two makes four."}
    sample = tokenize_conversation(tok, [*QUESTION, reasoning])
    assert masked(tok, sample) == "Two plus two makes four.\n</think>\n\nThe answer is 4.<|im_end|>"
    for kw in (None, OFF):  # the template's empty block (thinking off, or a turn without reasoning) stays out
        plain = tokenize_conversation(tok, [*QUESTION, {"role": "assistant", "content": "It is 4."}],
                                      template_kwargs=kw)
        assert "<think>\n\n</think>" in render(tok, [*QUESTION, {"role": "assistant", "content": "It is 4."}],
                                               template_kwargs=kw)
        assert masked(tok, plain) == "It is 4.<|im_end|>"


def test_a_turn_whose_reasoning_the_template_drops_stays_out_of_the_loss(qwen3):
    """The first answer was produced after its trace; the conversation renders it without (it is before the last
    user message), so its tokens follow a context the target never answered from: masked out, counted."""
    from mtp_train.data.chat import tokenize_conversations

    _, tok = qwen3
    conv = [*QUESTION, {"role": "assistant", "content": TRACE}, {"role": "user", "content": "And 3 * 3?"},
            {"role": "assistant", "content": "<think>\nThree threes.\n</think>\n\nIt is 9."}]
    assert "Two plus two" not in render(tok, conv)
    (sample,), stats = tokenize_conversations(tok, [conv])
    assert masked(tok, sample) == conv[-1]["content"] + "<|im_end|>"
    assert stats.history_turns_unsupervised == 1
    # Answers without reasoning render alike in history and as the last turn: both stay in the loss.
    plain = [*QUESTION, {"role": "assistant", "content": "4."}, conv[2], {"role": "assistant", "content": "9."}]
    (sample,), stats = tokenize_conversations(tok, [plain], template_kwargs=OFF)
    assert masked(tok, sample) == "4.<|im_end|>9.<|im_end|>" and stats.history_turns_unsupervised == 0


def test_history_turns_split_learns_each_turn_once_in_the_context_it_was_answered_from(qwen3, tmp_path):
    """data.history_turns=split: a turn whose trace the conversation drops is also a sample of its own, the
    conversation up to it, where it renders with its trace as the target produced it. Every turn is learnt once."""
    _, tok = qwen3
    turns = [*QUESTION, {"role": "assistant", "content": TRACE}, {"role": "user", "content": "And 3 * 3?"},
             {"role": "assistant", "content": "<think>\nThree threes.\n</think>\n\nIt is 9."},
             {"role": "user", "content": "And 1 + 1?"},
             {"role": "assistant", "content": "<think>\nOne and one.\n</think>\n\n2."}]
    data = write_rows(tmp_path / "c.jsonl", [{"id": "c", "messages": turns}])
    split = list(SampleStream(tok, PrecomputeConfig(data=DataConfig(paths=[str(data)], history_turns="split"))))
    assert [s.id for s in split] == ["c", "c@turn1", "c@turn3"]  # the message index of each such turn
    learnt = [tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m], skip_special_tokens=False)
              for s in split]
    assert learnt == [turns[5]["content"] + "<|im_end|>", TRACE + "<|im_end|>", turns[3]["content"] + "<|im_end|>"]
    for s, upto in zip(split[1:], (2, 4)):  # the conversation up to that turn, as it renders
        assert s.input_ids == tokenize_conversation(tok, turns[:upto]).input_ids
    stream = SampleStream(tok, PrecomputeConfig(data=DataConfig(paths=[str(data)])))
    (masked_only,) = list(stream)  # the default: those turns out of the loss, counted
    assert masked_only.loss_mask == split[0].loss_mask and stream.info["history_turns_unsupervised"] == 2


# ------------------------------------------------------------------------------------------- regeneration


class ScriptedTarget(Generator):
    """A generator that answers every request with the token ids of one answer text and its end token (what a
    thinking target writes), and keeps the prompts it was given."""

    def __init__(self, tok: Any, answer: str, stop_id: int) -> None:
        self.ids = [*tok(answer, add_special_tokens=False)["input_ids"], stop_id]
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params, on_finish=None) -> list[GenerationOutput]:
        outs = []
        for i, p in enumerate(prompts):
            self.prompts.append(list(p))
            out = GenerationOutput(prompt_ids=list(p), output_ids=list(self.ids), finish_reason="stop")
            outs.append(out)
            if on_finish is not None:
                on_finish(i, out)
        return outs

    @property
    def limits(self) -> GeneratorLimits:
        return GeneratorLimits(max_context=CONTEXT * 16)

    def stats(self) -> GeneratorStats:
        return GeneratorStats()

    def provenance(self) -> dict[str, Any]:
        return {"name": "scripted"}


@pytest.mark.parametrize("kwargs", [ON, OFF])
def test_regeneration_passes_the_thinking_switch_and_stores_what_the_target_generated(qwen3, tmp_path, kwargs):
    path, tok = qwen3
    answer = TRACE if kwargs == ON else "The answer is 4."
    target = ScriptedTarget(tok, answer, tok.convert_tokens_to_ids("<|im_end|>"))
    data = write_rows(tmp_path / "q.jsonl", [{"id": "q", "messages": QUESTION}])
    cfg = RegenerateConfig(data=DataConfig(paths=[str(data)]), chat_template_kwargs=dict(kwargs), max_new_tokens=32)
    from mtp_train.data.readers import read_conversations

    convs, _ = read_conversations(cfg.data)
    out = tmp_path / "regen.jsonl"
    stats = regenerate(convs, target, tok, out, cfg, stop_ids=target.ids[-1:])
    assert stats.not_rendered_back == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    # The switch reached the template: thinking off puts the empty block into the prompt, on leaves it out.
    (prompt,) = target.prompts
    assert prompt == prompt_ids(tok, QUESTION, kwargs)
    assert tok.decode(prompt).endswith("<think>\n\n</think>\n\n") == (kwargs == OFF)
    assert record["provenance"]["chat_template_kwargs"] == kwargs
    # Stored verbatim: the conversation renders back to the prompt the target saw, then exactly its tokens.
    assert record["messages"][-1] == {"role": "assistant", "content": answer}
    sample = tokenize_conversation(tok, record["messages"], template_kwargs=kwargs)
    assert sample.input_ids[:len(prompt) + len(target.ids)] == prompt + target.ids
    # ... and the loss covers the generated tokens: the trace, its </think>, the answer and the end token.
    assert sample.loss_mask[len(prompt):len(prompt) + len(target.ids)] == [1] * len(target.ids)
    assert masked(tok, sample) == tok.decode(target.ids, skip_special_tokens=False)


@pytest.mark.parametrize("kwargs", [ON, OFF])
def test_a_regenerated_multi_turn_conversation_trains_each_turn_on_what_the_target_saw(qwen3, tmp_path, kwargs):
    """Turn 2 is asked after turn 1's answer, whose trace the template drops from the history (thinking on): the
    stored conversation renders to turn 2's prompt and its tokens, and turn 1, answered after a trace this
    rendering no longer shows, stays out of the loss. Without traces (thinking off) both turns are learnt."""
    from mtp_train.data.chat import tokenize_conversations
    from mtp_train.data.readers import read_conversations

    _, tok = qwen3
    answer = TRACE if kwargs == ON else "The answer is 4."
    target = ScriptedTarget(tok, answer, tok.convert_tokens_to_ids("<|im_end|>"))
    rows = [{"id": "q", "messages": [*QUESTION, {"role": "assistant", "content": "old"},
                                     {"role": "user", "content": "And 3 * 3?"}]}]
    cfg = RegenerateConfig(data=DataConfig(paths=[str(write_rows(tmp_path / "q.jsonl", rows))]),
                           chat_template_kwargs=dict(kwargs))
    convs, _ = read_conversations(cfg.data)
    regenerate(convs, target, tok, tmp_path / "regen.jsonl", cfg, stop_ids=target.ids[-1:])
    (record,) = [json.loads(line) for line in (tmp_path / "regen.jsonl").read_text().splitlines()]
    first, second = target.prompts
    assert "Two plus two" not in tok.decode(second)  # the history the target saw holds no trace
    (sample,), stats = tokenize_conversations(tok, [record["messages"]], template_kwargs=kwargs)
    end = len(second) + len(target.ids)
    assert sample.input_ids[:end] == second + target.ids
    learnt = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert learnt == (target.ids if kwargs == ON else [*target.ids, *target.ids])
    assert stats.history_turns_unsupervised == (kwargs == ON)


def test_an_answer_the_template_rewrites_is_counted(qwen3, tmp_path, caplog):
    """Qwen3's template strips the newlines around a trace: an answer with more of them is kept as generated, and
    counted and named, since its conversation no longer renders to the tokens the target wrote."""
    from mtp_train.data.readers import read_conversations

    _, tok = qwen3
    target = ScriptedTarget(tok, "<think>\n\nTwo plus two.\n\n</think>\n\n4.", tok.convert_tokens_to_ids("<|im_end|>"))
    data = write_rows(tmp_path / "q.jsonl", [{"id": "q", "messages": QUESTION}])
    cfg = RegenerateConfig(data=DataConfig(paths=[str(data)]))
    convs, _ = read_conversations(cfg.data)
    stats = regenerate(convs, target, tok, tmp_path / "regen.jsonl", cfg, stop_ids=target.ids[-1:])
    assert stats.not_rendered_back == 1 and "answers render back otherwise" in stats.summary()
    assert "record q turn 1 does not render back" in caplog.text


@pytest.mark.parametrize("kwargs", [ON, OFF])
def test_the_switch_reaches_an_openai_compatible_server(qwen3, tmp_path, kwargs):
    """Through OpenAI-compatible servers (mtp-serve here, as vLLM / SGLang): the prompts are our token ids,
    rendered with the kwargs, and the template check sends the kwargs in the chat request body, so a server that
    renders them otherwise is refused before any answer."""
    from mtp_train.data.readers import Conversation
    from mtp_train.engine.turns import stop_token_ids
    from mtp_train.remote import OpenAIGenerator
    from tests._serve import served_app

    path, tok = qwen3
    model = load_model(path, dtype="float32", device="cpu")
    convs = [Conversation("q", QUESTION, "q.jsonl", 1)]
    cfg = RegenerateConfig(max_new_tokens=4, progress=False, chat_template_kwargs=dict(kwargs))
    app, worker = served_app(model, tok, path)
    try:
        with app_server(app) as url:
            gen = OpenAIGenerator.connect([url], retries=0)
            assert gen.check_template(convs, tok, dict(kwargs)) == 1  # the server rendered with the kwargs too
            out = tmp_path / "regen.jsonl"
            regenerate(convs, gen, tok, out, cfg, stop_ids=stop_token_ids(tok, model.args.eos_token_ids))
    finally:
        worker.stop()
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["provenance"]["chat_template_kwargs"] == kwargs
    rendered = tokenize_conversation(tok, record["messages"], template_kwargs=kwargs).input_ids
    prompt = prompt_ids(tok, QUESTION, kwargs)
    assert rendered[:len(prompt)] == prompt


# ------------------------------------------------------------------------------------------------ serving


@pytest.mark.parametrize("kwargs", [ON, OFF])
def test_the_served_prompt_is_the_prefix_of_the_trained_sample(qwen3, kwargs):
    """mtp-serve renders a chat request (its messages, the server's kwargs and the request's over them) into the
    very ids the training sample of that conversation starts with, so the head drafts after what it learnt."""
    from mtp_train.engine import LLMEngine
    from mtp_train.engine.turns import stop_token_ids
    from mtp_train.serve import EngineWorker, ServedModel, ServeLimits, build_app

    path, tok = qwen3
    model = load_model(path, dtype="float32", device="cpu")
    engine = LLMEngine(model, kv_cache_gb=0.01)
    worker = EngineWorker(engine, vocab_size=model.args.vocab_size)
    served = ServedModel(model_id="tiny", root=str(path), tokenizer=tok, max_context=CONTEXT,
                         max_request_tokens=engine.scheduler.max_request_tokens,
                         stop_ids=stop_token_ids(tok, model.args.eos_token_ids), template_kwargs=dict(kwargs),
                         limits=ServeLimits())
    worker.start()
    history = [*QUESTION, {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 * 3?"}]
    answer = TRACE if kwargs == ON else "It is 9."
    trained = tokenize_conversation(tok, [*history, {"role": "assistant", "content": answer}],
                                    template_kwargs=kwargs)
    try:
        with app_server(build_app(worker, served)) as url:
            for body in ({}, {"chat_template_kwargs": dict(kwargs)}):  # the server's kwargs, or the request's too
                r = httpx.post(f"{url}/v1/chat/completions", json={
                    "messages": history, "max_tokens": 1, "return_token_ids": True, **body}).json()
                ids = r["prompt_token_ids"]
                assert ids == trained.input_ids[:len(ids)]
                assert trained.loss_mask[len(ids)] == 1  # the answer's first token, right after the prompt, is learnt
    finally:
        worker.stop()


def test_the_server_takes_the_kwargs_the_head_was_trained_with_or_warns(qwen3, tmp_path, caplog):
    """A head records where its samples came from: an online run's settings, an offline run's precompute folder
    (whose manifest keeps the command's config). mtp-serve renders with those kwargs when none are set, and warns
    when the ones set differ."""
    from mtp_train.config import HeadConfig
    from mtp_train.heads import build_head
    from mtp_train.heads.checkpoint import save_head
    from mtp_train.serve.template import served_template_kwargs, trained_template_kwargs

    path, _ = qwen3
    head = build_head(HeadConfig(type="mtp", init="last_layer"), path)
    online = save_head(head, tmp_path / "online", {"data_online": {"chat_template_kwargs": OFF}})
    folder = tmp_path / "pc"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"provenance": {"config": {"chat_template_kwargs": ON}}}))
    offline = save_head(head, tmp_path / "offline", {"data_dir": str(folder)})
    unknown = save_head(head, tmp_path / "unknown", {"data_dir": str(tmp_path / "gone")})
    assert trained_template_kwargs(online) == OFF and trained_template_kwargs(offline) == ON
    assert trained_template_kwargs(unknown) is None
    assert served_template_kwargs(online, {}) == OFF  # none set: the head's
    assert served_template_kwargs(None, {}) == {} and served_template_kwargs(unknown, ON) == ON
    assert "trained on conversations rendered with" not in caplog.text
    assert served_template_kwargs(offline, OFF) == OFF  # set: kept, and the difference named
    assert f"{offline} was trained on conversations rendered with chat_template_kwargs={ON}" in caplog.text


# ------------------------------------------------------------------------------------------------ context


LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 14)


def context_data(tmp_path: Path) -> Path:
    """Three short conversations, then one far longer than the target's context (the last row)."""
    rows = [{"id": f"s{i}", "messages": [*QUESTION, {"role": "assistant", "content": f"It is {i}."}]}
            for i in range(3)]
    rows.append({"id": "long", "messages": [*QUESTION, {"role": "assistant", "content": LONG}]})
    return write_rows(tmp_path / "convs.jsonl", rows)


def precompute_cfg(data: Path, out: Path, **kw) -> PrecomputeConfig:
    over = kw.pop("over_context", "error")
    return PrecomputeConfig(data=DataConfig(paths=[str(data)], over_context=over), out=str(out), progress=False,
                            val_fraction=0.0, window=1, **{"max_seq_len": 4096, **kw})


def test_precompute_refuses_a_sample_longer_than_the_context_before_any_work(qwen3, tmp_path):
    path, tok = qwen3
    data = context_data(tmp_path)
    model = load_model(path, dtype="float32", device="cpu")
    out = tmp_path / "pc"
    with pytest.raises(ContextError) as err:
        # One conversation a window: the long row is the fourth window, and still nothing is written.
        run_precompute(model, tok, path, precompute_cfg(data, out), rank=0, world=1, tp_rank=0, tp_size=1,
                       config_dict={})
    n = len(tokenize_conversation(tok, [*QUESTION, {"role": "assistant", "content": LONG}]).input_ids)
    msg = str(err.value)
    for part in (f"{data}:4", "'long'", f"{n} tokens", f"context of {CONTEXT}", "data.over_context=split",
                 "max_seq_len=4096"):
        assert part in msg, (part, msg)
    assert not out.exists()
    # A max_seq_len within the context cuts the sample as ever: nothing to refuse.
    manifest = run_precompute(model, tok, path, precompute_cfg(data, out, max_seq_len=CONTEXT), rank=0, world=1,
                              tp_rank=0, tp_size=1, config_dict={})
    assert manifest.totals.samples == 4 and "longer_than_context" not in manifest.data


def test_the_command_says_it_in_one_line_and_exits_2(qwen3, tmp_path):
    import subprocess
    import sys

    path, _ = qwen3
    data = context_data(tmp_path)
    out = tmp_path / "pc"
    r = subprocess.run([sys.executable, "-m", "mtp_train.cli.precompute", f"model.path={path}", "model.fetch=null",
                        "model.device=cpu", f"data.paths=[{data}]", f"out={out}", "max_seq_len=4096", "progress=false"],
                       capture_output=True, text=True)
    errors = [line for line in r.stderr.splitlines() if line.startswith("mtp-precompute: error: ")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{data}:4 conversation 'long'" in errors[0] and "data.over_context=split" in errors[0]
    assert not any(out.glob("*.safetensors"))


def test_split_gives_windows_within_the_context_whose_masks_add_up(qwen3, tmp_path):
    path, tok = qwen3
    data = context_data(tmp_path)
    whole = tokenize_conversation(tok, [*QUESTION, {"role": "assistant", "content": LONG}])
    assert len(whole.input_ids) > 2 * CONTEXT
    samples = list(SampleStream(tok, precompute_cfg(data, tmp_path / "x", over_context="split"), context=CONTEXT))
    windows = [s for s in samples if s.id.startswith("long@")]
    assert [s.id for s in windows] == [f"long@{k}" for k in range(len(windows))]
    assert all(0 < len(s.input_ids) <= CONTEXT for s in windows)
    assert sum(sum(s.loss_mask) for s in windows) == sum(whole.loss_mask)
    assert [t for s in windows for t in s.input_ids] == whole.input_ids  # every window had assistant tokens
    # Each window is a sample of its own: precompute runs it from position 0, within the target's positions.
    model = load_model(path, dtype="float32", device="cpu")
    out = tmp_path / "split"
    manifest = run_precompute(model, tok, path, precompute_cfg(data, out, over_context="split"), rank=0, world=1,
                              tp_rank=0, tp_size=1, config_dict={})
    assert manifest.data["longer_than_context"] == 1 and manifest.data["context"] == CONTEXT
    ds = PrecomputedDataset(out, split="all")
    lengths = {ds[i]["id"]: int(ds[i]["input_ids"].numel()) for i in range(len(ds))}
    assert max(lengths.values()) <= CONTEXT and sum(k.startswith("long@") for k in lengths) == len(windows)


def test_truncate_keeps_the_first_context_tokens(qwen3, tmp_path):
    _, tok = qwen3
    data = context_data(tmp_path)
    whole = tokenize_conversation(tok, [*QUESTION, {"role": "assistant", "content": LONG}])
    samples = list(SampleStream(tok, precompute_cfg(data, tmp_path / "x", over_context="truncate"), context=CONTEXT))
    (long,) = [s for s in samples if s.id == "long"]
    assert long.input_ids == whole.input_ids[:CONTEXT] and long.loss_mask == whole.loss_mask[:CONTEXT]


def test_online_training_refuses_it_before_the_target_runs(qwen3, tmp_path):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.cli.train import train_main
    from mtp_train.config import ConfigError, register_configs

    path, _ = qwen3
    data = context_data(tmp_path)
    register_configs()
    overrides = [f"model.path={path}", "model.device=cpu", "model.backend=torch", "data.source=online",
                 f"data.paths=[{data}]", "data.online.max_seq_len=4096", f"out={tmp_path / 'run'}",
                 "wandb.mode=disabled", "train.progress=false", "train.max_steps=1", "spec_eval.prompts=[]"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with pytest.raises(ContextError, match=r"'long': \d+ tokens.*data.online.max_seq_len=4096"):
        train_main(cfg)
    with pytest.raises(ConfigError, match="data.over_context='cut'"):
        DataConfig(over_context="cut")


def test_precompute_refuses_a_longer_sample_it_is_given_directly(qwen3, tmp_path):
    """Samples handed to `precompute` without the stream's check never run past the target's positions."""
    from mtp_train.data.samples import Sample
    from mtp_train.precompute.pipeline import precompute

    path, tok = qwen3
    model = load_model(path, dtype="float32", device="cpu")
    ok = Sample("ok", [5] * 8, [1] * 8)
    long = Sample("long", [5] * (CONTEXT + 1), [1] * (CONTEXT + 1))
    with pytest.raises(ContextError, match=rf"sample 'long': {CONTEXT + 1} tokens, longer than the target's context"):
        precompute(model, [ok, long], PrecomputeConfig(out=str(tmp_path / "pc"), progress=False), model_dir=path,
                   data_info={}, tokenizer_fingerprint="t", chat_template_fingerprint="c")
