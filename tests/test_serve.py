"""`mtp-serve`: the OpenAI-compatible endpoints over our engine, on a tiny random Llama with a ChatML template.

Answers are checked against our engine's own greedy answers to the same prompt ids (and the prompt ids against our
rendering), streamed and not; bad requests get 4xx with a message and the server goes on; concurrent requests are
batched by the scheduler; a head's acceptance shows in the usage and in /metrics.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from mtp_train.engine import LLMEngine, SamplingParams
from mtp_train.engine.llm import GenerationOutput
from mtp_train.engine.turns import answer_text, prompt_ids, stop_token_ids
from tests._serve import (
    READY_TIMEOUT,
    app_server,
    exchange,
    free_port,
    metric_samples,
    read_to_close,
    served_app,
    start_serve,
    wait_ready,
)
from tests.conftest import make_chat_target, predictable_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about owls."}]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from mtp_train.data.chat import load_tokenizer
    from mtp_train.models import load_model

    path = make_chat_target(tmp_path_factory.mktemp("serve") / "tiny")
    model = load_model(path, dtype="float32", device="cpu")
    return model, load_tokenizer(path), path


@pytest.fixture(scope="module")
def server(target):
    app, worker = served_app(*target)
    with app_server(app) as url:
        yield url, worker
    worker.stop()


def greedy(model, tokenizer, prompt, max_tokens, stop=True) -> GenerationOutput:
    """Our engine's own greedy answer: what the server must return token for token."""
    stops = stop_token_ids(tokenizer, model.args.eos_token_ids) if stop else None
    return LLMEngine(model, kv_cache_gb=0.01).generate(
        [prompt], SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stops))[0]


def events(text: str) -> list[dict]:
    """The JSON chunks of an SSE body (its `[DONE]` checked and dropped)."""
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_models_lists_the_served_model_with_its_context_and_folder(server, target):
    url, _ = server
    (card,) = httpx.get(f"{url}/v1/models").json()["data"]
    assert card["id"] == "tiny" and card["max_model_len"] == 256 and card["root"] == str(target[2])


def test_chat_answers_as_our_engine_with_vllm_token_id_fields(server, target):
    model, tok, _ = target
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 12,
                                                        "temperature": 0, "return_token_ids": True}).json()
    ours = prompt_ids(tok, MESSAGES)
    assert r["prompt_token_ids"] == ours  # the server renders exactly as our stages do
    want = greedy(model, tok, ours, 12)
    (choice,) = r["choices"]
    assert choice["token_ids"] == want.output_ids and choice["finish_reason"] == want.finish_reason
    assert choice["message"] == {"role": "assistant", "content": answer_text(tok, want)}
    assert r["usage"] == {"prompt_tokens": len(ours), "completion_tokens": 12, "total_tokens": len(ours) + 12}
    plain = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12,
                                                            "temperature": 0}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["message"] == choice["message"]


def test_streamed_chat_equals_the_whole_answer(server, target):
    url, _ = server
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.text)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    with_choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert with_choices[0]["delta"]["role"] == "assistant"
    assert "".join(c["delta"].get("content", "") for c in with_choices) == whole["choices"][0]["message"]["content"]
    assert sum((c["token_ids"] for c in with_choices), []) == whole["choices"][0]["token_ids"]
    assert with_choices[-1]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_completions_take_token_ids_and_text_streamed_or_not(server, target):
    model, tok, _ = target
    url, _ = server
    prompt = prompt_ids(tok, MESSAGES)
    want = greedy(model, tok, prompt, 10)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                   "return_token_ids": True}).json()
    (choice,) = r["choices"]
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == want.output_ids
    assert choice["text"] == answer_text(tok, want)
    s = events(httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                          "return_token_ids": True, "stream": True}).text)
    assert s[0]["choices"][0]["prompt_token_ids"] == prompt
    assert sum((c["choices"][0]["token_ids"] for c in s), []) == want.output_ids
    assert "".join(c["choices"][0]["text"] for c in s) == choice["text"]
    text = "Tell me about tea."
    r = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 4, "temperature": 0,
                                                   "return_token_ids": True}).json()
    assert r["choices"][0]["prompt_token_ids"] == tok(text)["input_ids"]


def test_stop_strings_end_the_answer_before_them(server, target):
    model, tok, _ = target
    url, _ = server
    prompt = prompt_ids(tok, MESSAGES)
    full = answer_text(tok, greedy(model, tok, prompt, 24, stop=False))
    stop = full[5:8]  # a string the greedy answer holds (the random model's text, decoded as generated)
    cut = full[: full.find(stop)]
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                       "stop": [stop], "ignore_eos": True, "stream": stream})
        if stream:
            chunks = [c["choices"][0] for c in events(r.text)]
            text, reason = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
        else:
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (text, reason) == (cut, "stop")


def test_seeded_sampling_repeats_and_top_p_narrows_to_greedy(server, target):
    url, _ = server
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "seed": 7, "return_token_ids": True}
    a, b = (httpx.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]["token_ids"] for _ in range(2))
    assert a == b
    greedy_ids = httpx.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0}).json()
    narrow = httpx.post(f"{url}/v1/chat/completions", json={**body, "top_p": 1e-6}).json()
    assert narrow["choices"][0]["token_ids"] == greedy_ids["choices"][0]["token_ids"]


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-9"}, 404, "`gpt-9` does not exist"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}, 400, "n=2"),
    ("/v1/completions", {"prompt": [5, 300], "max_tokens": 4}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "empty"),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4}, 400, "one prompt per request"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4000}, 400, "context is 256 tokens"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    # sampling values the engine could not use: refused up front, naming the field
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 1e-300}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 1e-300}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": float("inf")}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": float("nan")}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 1e308}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": float("nan")}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**64)}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": float("inf")}, 400, "frequency_penalty"),
    # settings this server does not implement: refused, not ignored
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "`echo`"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "`best_of`"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "`suffix`"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "`tools`"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}}, 400,
     "`response_format`"),
    # text that is not valid Unicode (JSON's escapes can carry a lone surrogate)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400,
     "messages.0.content holds a lone surrogate"),
    ("/v1/completions", {"prompt": "hi \udfff"}, 400, "prompt holds a lone surrogate"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, 400, "stop.0 holds a lone surrogate"),
    ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, 400, "model holds a lone surrogate"),
    ("/v1/nowhere", {}, 404, "no such endpoint: POST /v1/nowhere"),
])
def test_bad_requests_get_4xx_with_a_message_and_the_server_goes_on(server, path, body, status, says):
    url, _ = server
    # JSON as Python writes it: Infinity and NaN (which the server's parser takes) and \ud800 escapes
    r = httpx.post(f"{url}{path}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", content=b"{not json").status_code == 400
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_concurrent_requests_are_batched_by_the_scheduler(target):
    model, tok, path = target
    app, worker = served_app(model, tok, path, start=False)  # requests queue up before the engine thread runs
    prompts = [prompt_ids(tok, [{"role": "user", "content": f"Tell me about {t}."}])
               for t in ("tea", "maps", "chess", "glass")]
    answers: dict[int, dict] = {}
    with app_server(app) as url:
        def ask(i: int) -> None:
            answers[i] = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": prompts[i], "max_tokens": 6, "temperature": 0, "return_token_ids": True}).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while worker.waiting < len(prompts):  # every request handed to the worker before it starts
            assert time.monotonic() < deadline, f"{worker.waiting} requests queued"
            time.sleep(0.01)
        worker.start()
        for t in threads:
            t.join(timeout=60)
        metrics = httpx.get(f"{url}/metrics").text
    worker.stop()
    assert worker.counters.max_batch == len(prompts)  # one prefill of all four, then decode steps of all four
    assert 'mtp_serve_engine_max_batch{model="tiny"} 4' in metrics
    for i, p in enumerate(prompts):
        assert answers[i]["choices"][0]["token_ids"] == greedy(model, tok, p, 6).output_ids


def test_a_head_shows_its_acceptance_in_usage_and_metrics(tmp_path):
    from mtp_train.config import head_type
    from mtp_train.speculative.engine import SpecEngine

    model, tok, head, path = predictable_chat_target(tmp_path / "pred")
    engine = SpecEngine(model, head_type(head.cfg.type).drafter(head, {}), 2, kv_cache_gb=0.01)
    app, worker = served_app(model, tok, path, engine=engine)
    with app_server(app) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, "temperature": 0,
                                                            "ignore_eos": True, "return_token_ids": True}).json()
        metrics = httpx.get(f"{url}/metrics").text
    worker.stop()
    spec = r["usage"]["speculative"]
    assert spec["verify_steps"] >= 1 and 1.0 < spec["mean_acceptance_length"] <= 3.0
    # greedy speculative decoding answers what plain greedy decoding answers
    assert r["choices"][0]["token_ids"] == greedy(model, tok, r["prompt_token_ids"], 16, stop=False).output_ids
    rate = [line for line in metrics.splitlines() if line.startswith("mtp_serve_spec_acceptance_rate")]
    assert rate and 0.0 < float(rate[0].split()[-1]) <= 1.0
    assert "mtp_serve_spec_accepted_tokens_total" in metrics


def test_the_command_serves_a_head_checkpoint(target, tmp_path):
    from mtp_train.cli.serve import build_server
    from mtp_train.config import HeadConfig, ModelConfig, ServeConfig
    from mtp_train.heads import build_head, save_head

    model, tok, path = target
    save_head(build_head(HeadConfig(type="mtp"), path), tmp_path / "head")
    sc = ServeConfig(model=ModelConfig(name="tiny", path=str(path), dtype="float32", device="cpu", fetch=None,
                                       kv_cache_gb=0.01), head_ckpt=str(tmp_path / "head"), k=2)
    app, worker = build_server(sc)
    worker.start()
    with app_server(app) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 10,
                                                            "temperature": 0, "return_token_ids": True}).json()
        metrics = httpx.get(f"{url}/metrics").text
    worker.stop()
    assert r["choices"][0]["token_ids"] == greedy(model, tok, r["prompt_token_ids"], 10).output_ids
    assert r["usage"]["speculative"]["verify_steps"] >= 1
    assert "mtp_serve_spec_draft_tokens_total" in metrics


@pytest.mark.parametrize(("stop", "want"), [([], "café au lait"), (["au l"], "café "), (["é"], "caf")])
def test_streamed_text_holds_back_half_characters_and_stop_strings(target, stop, want):
    from mtp_train.serve.text import TextStream

    _, tok, _ = target
    ids = tok("café au lait", add_special_tokens=False)["input_ids"]
    # byte-level pieces: some prefix of the ids ends in half of "é"
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    stream = TextStream(tok, stop)
    deltas = [stream.add([t]) for t in ids]
    deltas.append(stream.add([], final=True))
    assert "".join(deltas) == want and stream.stopped == bool(stop)
    assert not any(d.endswith("\ufffd") for d in deltas)


# ---- limits: what one client may do to the others -------------------------------------------------------------

def answer_ids(url: str, prompt: list[int], max_tokens: int = 6) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": max_tokens,
                                                               "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_request_may_not_choose_the_template_unless_the_server_trusts_it(server):
    url, _ = server
    hostile = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    for kwargs, field in [({"chat_template": hostile}, "chat_template_kwargs.chat_template"),
                          ({"tokenize": True}, "chat_template_kwargs.tokenize"),
                          ({"tools": [{"type": "function"}]}, "chat_template_kwargs.tools")]:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                            "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # a variable of the template is taken
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_a_long_render_holds_only_its_own_request(target):
    """A trusted request template that renders for seconds runs off the event loop: a request sent meanwhile is
    answered (its greedy ids) while the render still runs."""
    from mtp_train.serve import ServeLimits

    model, tok, path = target
    app, worker = served_app(model, tok, path, limits=ServeLimits(trust_request_chat_template=True))
    # Long enough (several times a greedy answer's time, even on a loaded machine) that the answer comes first.
    loops = "{% for i in range(48000) %}{% for j in range(6000) %}{% endfor %}{% endfor %}"
    heavy = loops + tok.chat_template
    prompt = prompt_ids(tok, MESSAGES)
    done: dict[str, int] = {}
    with app_server(app) as url:
        def slow() -> None:
            done["heavy"] = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"chat_template": heavy}}).status_code

        thread = threading.Thread(target=slow)
        thread.start()
        deadline = time.monotonic() + 30
        while metric_samples(httpx.get(f"{url}/metrics").text, "requests_preparing") != {'{model="tiny"}': 1}:
            assert time.monotonic() < deadline, "the heavy render never showed in /metrics"
        assert answer_ids(url, prompt) == greedy(model, tok, prompt, 6).output_ids
        # the other request was answered while the render still ran
        assert metric_samples(httpx.get(f"{url}/metrics").text, "requests_preparing") == {'{model="tiny"}': 1}
        assert "heavy" not in done
        thread.join(timeout=600)
    worker.stop()
    assert done["heavy"] == 200


def test_bad_sampling_values_batched_with_good_requests_fail_alone(target):
    """Requests queued together (one batch when the engine starts): those with values the engine cannot sample are
    refused with a 400 naming the field; the others get their greedy answers."""
    model, tok, path = target
    app, worker = served_app(model, tok, path, start=False)
    prompts = [prompt_ids(tok, [{"role": "user", "content": f"Tell me about {t}."}]) for t in ("tea", "maps")]
    bad = [("temperature", 1e-300), ("top_p", 1e-300), ("temperature", float("inf")), ("seed", 2**70)]
    results: dict[int, httpx.Response] = {}
    with app_server(app) as url:
        def ask(i: int) -> None:
            if i < len(prompts):
                body = {"prompt": prompts[i], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
            else:
                name, value = bad[i - len(prompts)]
                body = {"prompt": prompts[0], "max_tokens": 6, "temperature": 1.0, "top_p": 1.0, name: value}
            results[i] = httpx.post(f"{url}/v1/completions", timeout=60, content=json.dumps(body),
                                    headers={"content-type": "application/json"})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts) + len(bad))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while worker.waiting < len(prompts):  # the good ones queued (the bad ones never reach the engine)
            assert time.monotonic() < deadline, f"{worker.waiting} requests queued"
            time.sleep(0.01)
        worker.start()
        for t in threads:
            t.join(timeout=60)
    worker.stop()
    for i, p in enumerate(prompts):
        assert results[i].json()["choices"][0]["token_ids"] == greedy(model, tok, p, 6).output_ids
    for i, (name, _) in enumerate(bad, start=len(prompts)):
        assert results[i].status_code == 400 and name in results[i].json()["error"]["message"], results[i].text


def test_a_row_the_engine_cannot_sample_fails_only_its_own_request(target):
    """In one batch: greedy rows, a seeded sampled row, a row at top_p 1e-300 (keeps the likeliest token) and one at
    temperature 1e-300 (no distribution: inf / nan). Only the last fails; the seeded row draws what it draws alone."""
    import asyncio

    from mtp_train.engine.sampling import SamplingParams as SP
    from mtp_train.serve import EngineWorker
    from mtp_train.serve.worker import Failed, Finished, Tokens

    model, tok, _ = target
    stops = stop_token_ids(tok, model.args.eos_token_ids)
    prompt = prompt_ids(tok, MESSAGES)
    params = [SP(max_new_tokens=6, stop_token_ids=stops), SP(temperature=1.0, seed=3, max_new_tokens=6,
                                                              stop_token_ids=stops),
              SP(temperature=1.0, top_p=1e-300, max_new_tokens=6, stop_token_ids=stops),
              SP(temperature=1e-300, max_new_tokens=6, stop_token_ids=stops),
              SP(max_new_tokens=6, stop_token_ids=stops)]
    worker = EngineWorker(LLMEngine(model, kv_cache_gb=0.01), vocab_size=model.args.vocab_size)

    async def run() -> list[tuple[list[int], object]]:
        reqs = [worker.submit(prompt, p) for p in params]  # all queued: one batch
        worker.start()
        out = []
        for req in reqs:
            ids: list[int] = []
            while not isinstance(event := await req.events.get(), Finished | Failed):
                assert isinstance(event, Tokens)
                ids.extend(event.ids)
            out.append((ids, event))
        return out

    try:
        results = asyncio.run(run())
    finally:
        worker.stop()
    want_greedy = greedy(model, tok, prompt, 6).output_ids
    alone = LLMEngine(model, kv_cache_gb=0.01).generate([prompt], [SP(temperature=1.0, seed=3, max_new_tokens=6,
                                                                      stop_token_ids=stops)])[0].output_ids
    assert [r[0] for r in results[:3]] + [results[4][0]] == [want_greedy, alone, want_greedy, want_greedy]
    assert all(isinstance(r[1], Finished) for i, r in enumerate(results) if i != 3)
    failed = results[3][1]
    assert isinstance(failed, Failed) and failed.status == 500 and "temperature=1e-300" in failed.message
    assert worker.counters.failed == 1


def test_a_lone_surrogate_is_a_400_and_the_connection_stays_open(server, target):
    model, tok, _ = target
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    prompt = prompt_ids(tok, MESSAGES)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for path, body, field in [
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]},
                 "messages.0.content"),
                ("/v1/completions", {"prompt": "hi \ud800"}, "prompt"),
                ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"\ud800": 1}},
                 "chat_template_kwargs.\\ud800")]:
            status, headers, data = exchange(sock, "POST", path, json.dumps(body).encode())
            assert status == 400 and headers.get("connection") != "close", data
            assert f"{field} holds a lone surrogate" in json.loads(data)["error"]["message"]
        # the same connection serves the next request
        status, _, data = exchange(sock, "POST", "/v1/completions", json.dumps({
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}).encode())
        assert status == 200 and json.loads(data)["choices"][0]["token_ids"] == greedy(model, tok, prompt, 4).output_ids


def test_a_body_over_the_limit_is_a_413(target):
    from mtp_train.serve import ServeLimits

    model, tok, path = target
    app, worker = served_app(model, tok, path, limits=ServeLimits(max_body_bytes=4096))
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 2}).encode()
    with app_server(app) as url:
        r = httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "4096 bytes (max_body_bytes)" in r.json()["error"]["message"], r.text
        # without a Content-Length (chunked): refused once the limit is passed
        r = httpx.post(f"{url}/v1/completions", content=iter([big[:3000], big[3000:]]),
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
        statuses = metric_samples(httpx.get(f"{url}/metrics").text, "requests_total")
    worker.stop()
    assert statuses['{model="tiny",endpoint="/v1/completions",status="413"}'] == 2


def test_a_busy_port_is_one_line_and_exit_2(target, tmp_path):
    _, _, path = target
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        log = tmp_path / "serve.log"
        proc = start_serve(path, port, log=log)
        try:
            rc = proc.wait(timeout=READY_TIMEOUT)
        finally:
            proc.kill()
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert rc == 2, lines
    assert lines[-1].startswith(f"mtp-serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "port=<N>" in lines[-1] and not any("Traceback" in line or "ERROR" in line for line in lines)


def test_half_sent_requests_are_answered_408_and_closed_after_request_timeout(target, tmp_path):
    """mtp-serve with request_timeout=1: connections that sent half a request line, half their headers, nothing at
    all, or half their body are each answered 408 and closed; a whole request meanwhile is answered; /metrics
    counts them."""
    model, tok, path = target
    port = free_port()
    proc = start_serve(path, port, "request_timeout=1", log=tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    halves = [b"POST /v1/comp", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le", b"",
              b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 100\r\n\r\n{\"prompt\": "]
    try:
        wait_ready(url, proc)
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in halves * 3]
        for sock, half in zip(socks, halves * 3):
            sock.sendall(half)
        prompt = prompt_ids(tok, MESSAGES)
        assert answer_ids(url, prompt, 4) == greedy(model, tok, prompt, 4).output_ids
        for sock in socks:
            with sock:
                reply = read_to_close(sock)  # the server closes it: recv returns b"" (30 s bound: the socket's)
            assert reply.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in reply, reply
        statuses = metric_samples(httpx.get(f"{url}/metrics").text, "requests_total")
    finally:
        proc.kill()
        proc.wait()
    assert statuses['{model="tiny",endpoint="none",status="408"}'] == 9
    assert statuses['{model="tiny",endpoint="/v1/completions",status="408"}'] == 3
