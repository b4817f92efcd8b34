"""`mtp-regenerate generator=openai`: regeneration through OpenAI-compatible servers, tested against `mtp-serve` on
localhost with a tiny random Llama: the records equal our engine's (greedy, multi-turn), a server killed and
restarted mid-run loses and duplicates nothing, a server whose template disagrees is refused at the first differing
token, and an unreachable endpoint or a model not served is one clear line."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, HTTPException, Request

from mtp_train.config import RegenerateConfig
from mtp_train.data.readers import Conversation
from mtp_train.engine import LLMEngine
from mtp_train.engine.generator import EngineGenerator
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import stop_token_ids
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.regenerate import part_path, regenerate
from mtp_train.remote import OpenAIGenerator, RemoteError
from tests._serve import app_server, free_port, plain_server, served_app, start_serve, wait_ready
from tests.conftest import TOPICS, make_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from mtp_train.data.chat import load_tokenizer
    from mtp_train.models import load_model

    path = make_chat_target(tmp_path_factory.mktemp("remote") / "tiny")
    return load_model(path, dtype="float32", device="cpu"), load_tokenizer(path), path


def conversations(n: int) -> list[Conversation]:
    """n conversations over the topics; every third has a second user turn (answered after the regenerated one)."""
    out = []
    for i in range(n):
        t = TOPICS[i % len(TOPICS)]
        msgs = [{"role": "user", "content": f"Tell me about {t}."}, {"role": "assistant", "content": "An old answer."}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": f"Here is a fact about {t}?"}]
        out.append(Conversation(f"c{i}", msgs, "convs.jsonl", i + 1))
    return out


def records(path: Path) -> dict[str, dict]:
    """id → the record without its provenance (what must be equal across generators)."""
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        assert r["id"] not in out, f"duplicate record {r['id']}"
        r.pop("provenance")
        out[r["id"]] = r
    return out


def engine_records(model, tok, path, convs, cfg, out: Path) -> dict[str, dict]:
    gen = EngineGenerator(LLMEngine(model, kv_cache_gb=0.01), name="tiny", path=path,
                          weights_fingerprint=weights_fingerprint(path))
    regenerate(convs, gen, tok, out, cfg, stop_ids=stop_token_ids(tok, model.args.eos_token_ids))
    return records(out)


def test_regenerating_through_mtp_serve_equals_our_engine(target, tmp_path):
    model, tok, path = target
    convs = conversations(7)
    cfg = RegenerateConfig(max_new_tokens=12, progress=False)
    want = engine_records(model, tok, path, convs, cfg, tmp_path / "engine.jsonl")
    app, worker = served_app(model, tok, path)
    with app_server(app) as url:
        gen = OpenAIGenerator.connect([url + "/v1"], concurrency=3, retries=0)
        assert gen.check_template(convs, tok, rows=3) == 3
        stats = regenerate(convs, gen, tok, tmp_path / "remote.jsonl", cfg,
                           stop_ids=stop_token_ids(tok, model.args.eos_token_ids))
    worker.stop()
    assert records(tmp_path / "remote.jsonl") == want  # identical token ids → identical texts and counts
    assert stats.generated_tokens == sum(sum(r["gen_tokens"]) for r in want.values())
    assert any(len(r["finish_reasons"]) == 2 for r in want.values())  # multi-turn rows answered turn by turn
    prov = json.loads((tmp_path / "remote.jsonl").read_text().splitlines()[0])["provenance"]["target"]
    assert prov == {"served_model": "tiny", "path": str(path), "weights_fingerprint": weights_fingerprint(path)}


def test_the_window_does_not_change_the_records_through_mtp_serve(target, tmp_path):
    """One conversation in flight, three, or the whole input: the records our engine gives (greedy, multi-turn),
    whatever order the server answers in."""
    model, tok, path = target
    convs = conversations(7)
    want = engine_records(model, tok, path, convs, RegenerateConfig(max_new_tokens=12, progress=False),
                          tmp_path / "engine.jsonl")
    app, worker = served_app(model, tok, path)
    with app_server(app) as url:
        gen = OpenAIGenerator.connect([url], concurrency=3, retries=0)
        for window in (1, 3, len(convs)):
            cfg = RegenerateConfig(max_new_tokens=12, progress=False, window=window)
            out = tmp_path / f"w{window}.jsonl"
            regenerate(convs, gen, tok, out, cfg, stop_ids=stop_token_ids(tok, model.args.eos_token_ids))
            assert records(out) == want, window
            assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [c.id for c in convs]
    worker.stop()


def test_a_server_whose_template_disagrees_is_refused_at_the_first_differing_token(target):
    model, tok, path = target
    other = tok.chat_template.replace("<|im_start|>{{ m['role'] }}\n", "<|im_start|>{{ m['role'] }}:\n")
    app, worker = served_app(model, tok, path, chat_template=other)
    with app_server(app) as url:
        gen = OpenAIGenerator.connect([url], retries=0)
        at = len(tok("<|im_start|>user", add_special_tokens=False)["input_ids"])  # where ":" comes in
        with pytest.raises(RemoteError, match=rf"renders conversation c0 \(convs.jsonl:1\) differently from our chat "
                                              rf"template: first difference at token {at} \(server: \d+ ':'"):
            gen.check_template(conversations(2), tok)
    worker.stop()


def test_an_unreachable_endpoint_or_a_model_not_served_is_one_clear_error(target):
    model, tok, path = target
    with pytest.raises(RemoteError, match="is unreachable"):
        OpenAIGenerator.connect([f"http://127.0.0.1:{free_port()}"])
    app, worker = served_app(model, tok, path)
    with app_server(app) as url:
        with pytest.raises(RemoteError, match="model 'gpt-9' is not served by .*; it serves: tiny"):
            OpenAIGenerator.connect([url], model="gpt-9")
        with pytest.raises(RemoteError, match="not an http"):
            OpenAIGenerator.connect(["localhost:1"])
    worker.stop()


def test_the_command_says_an_endpoint_is_unreachable_in_one_line_and_exits_2(target, tmp_path):
    _, _, path = target
    data = tmp_path / "convs.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "mtp_train.cli.regenerate", "generator=openai",
                        f"endpoints=[http://127.0.0.1:{port}]", f"model.path={path}", "model.fetch=null",
                        f"data.paths=[{data}]", f"out={tmp_path / 'out.jsonl'}"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("mtp-regenerate: error:")]
    assert len(errors) == 1 and f"http://127.0.0.1:{port} is unreachable" in errors[0]
    assert not (tmp_path / "out.jsonl").exists()


def _kill_at_first_record(victim: subprocess.Popen, part: Path, alive, why: object, timeout: float) -> None:
    """SIGKILL `victim` once `part` holds a whole record (the run is under way), waiting while `alive()` (bounded by
    `timeout` seconds; `why` is the failure message otherwise)."""
    deadline = time.monotonic() + timeout
    while not (part.exists() and part.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and alive(), why
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()


def test_a_server_killed_and_restarted_mid_run_loses_and_duplicates_nothing(target, tmp_path):
    model, tok, path = target
    convs = conversations(12)
    cfg = RegenerateConfig(max_new_tokens=48, progress=False)
    want = engine_records(model, tok, path, convs, cfg, tmp_path / "engine.jsonl")
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    server = start_serve(path, port, log=log)
    out = tmp_path / "remote.jsonl"
    try:
        wait_ready(url, server)
        gen = OpenAIGenerator.connect([url], concurrency=1, retries=30, backoff=0.05, timeout=60)
        failure: list[BaseException] = []

        def client() -> None:
            try:
                regenerate(convs, gen, tok, out, cfg, stop_ids=stop_token_ids(tok, model.args.eos_token_ids))
            except BaseException as exc:  # noqa: BLE001 (reported by the test below)
                failure.append(exc)

        thread = threading.Thread(target=client)
        thread.start()
        part = part_path(out, 0)
        _kill_at_first_record(server, part, thread.is_alive, failure, timeout=120)
        done_at_kill = part.read_text().count("\n")
        server = start_serve(path, port, log=log)
        thread.join(timeout=300)
        assert not thread.is_alive() and not failure, failure
    finally:
        server.kill()
        server.wait()
    assert done_at_kill < len(convs)  # killed mid-run
    assert gen.retried >= 1  # the client saw the server go
    assert records(out) == want


def test_a_client_killed_mid_run_resumes_without_losing_or_duplicating(target, tmp_path):
    from mtp_train.config import DataConfig
    from mtp_train.data.readers import read_conversations

    model, tok, path = target
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in conversations(12)))
    convs, _ = read_conversations(DataConfig(paths=[str(data)]))
    want = engine_records(model, tok, path, convs, RegenerateConfig(max_new_tokens=48, progress=False),
                          tmp_path / "engine.jsonl")
    out = tmp_path / "remote.jsonl"
    app, worker = served_app(model, tok, path)
    with app_server(app) as url:
        cmd = [sys.executable, "-m", "mtp_train.cli.regenerate", "generator=openai", f"endpoints=[{url}]",
               "concurrency=1", f"model.path={path}", "model.fetch=null", f"data.paths=[{data}]",
               "max_new_tokens=48", "progress=false", f"out={out}"]
        client = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        part = part_path(out, 0)
        _kill_at_first_record(client, part, lambda: client.poll() is None, "the client ended before a record",
                              timeout=300)
        done = part.read_text().count("\n")
        assert done < len(convs)  # killed mid-run
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    worker.stop()
    assert records(out) == want
    # the resumed run kept what the killed one wrote (a torn last line, if any, answered again)
    kept = int(re.search(r"\((\d+) already there, (\d+) written now\)", r.stdout).group(1))
    assert done - 1 <= kept <= done and f"{len(want)} records in the output" in r.stdout


def test_the_generator_setting_is_checked():
    from mtp_train.config import ConfigError

    with pytest.raises(ConfigError, match="generator=openai needs endpoints"):
        RegenerateConfig(generator="openai")
    with pytest.raises(ConfigError, match="choose one of engine, openai"):
        RegenerateConfig(generator="vllm")
    assert RegenerateConfig(generator="openai", endpoints=["http://127.0.0.1:8000"]).generator == "openai"


# --- servers that misbehave --------------------------------------------------------------------------------------


def misbehaving_app(answer, path, max_model_len=256):
    """An OpenAI-style server written for these tests: `/health`, `/v1/models` (serving "tiny" from `path`, its
    `max_model_len` as given) and `/v1/completions`, whose choice is `answer(body)` (the request's JSON; awaited
    when it is a coroutine)."""
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny", "root": str(path), "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        choice = answer(await request.json())
        if inspect.isawaitable(choice):
            choice = await choice
        return {"choices": [{"index": 0, "text": "", **choice}]}

    return app


def test_an_answer_a_server_should_not_give_is_refused_naming_the_endpoint_and_the_request(target):
    model, tok, path = target
    vocab, stop = model.args.vocab_size, stop_token_ids(tok, model.args.eos_token_ids)
    cases = {  # what the server answers to max_tokens=8 → what the refusal says
        "too long": ({"token_ids": [5] * 100001, "finish_reason": "length"}, "returned 100001 tokens for max_tokens=8"),
        "huge id": ({"token_ids": [5, 10**12], "finish_reason": "length"}, r"token id 1000000000000, outside the "
                                                                         rf"vocabulary \[0, {vocab}\)"),
        "negative id": ({"token_ids": [5, -7], "finish_reason": "length"}, r"token id -7, outside"),
        "no ids": ({"finish_reason": "stop"}, "returned no token_ids"),
        "text ids": ({"token_ids": ["5"], "finish_reason": "length"}, "not a list of integers"),
        "no reason": ({"token_ids": [5] * 8}, "finish_reason None"),
        "unknown reason": ({"token_ids": [5] * 8, "finish_reason": "eos"}, "finish_reason 'eos'"),
        "short length": ({"token_ids": [5, 6], "finish_reason": "length"}, r"'length' after 2 of max_tokens=8"),
        "stop elsewhere": ({"token_ids": [5, 6], "finish_reason": "stop"}, "not a stop token of ours"),
    }
    said: dict[str, object] = {}
    app = misbehaving_app(lambda body: said["answer"], path)
    with plain_server(app) as url:
        gen = OpenAIGenerator.connect([url], retries=0, concurrency=1)
        assert gen.vocab_size == vocab  # read from the served folder's config.json
        params = [SamplingParams(max_new_tokens=8, stop_token_ids=stop)] * 2
        for name, (answer, match) in cases.items():
            said["answer"] = answer
            with pytest.raises(RemoteError, match=match) as e:
                gen.generate([[1, 2, 3], [4, 5]], params)
            msg = str(e.value)
            assert msg.startswith(f"{url} answering request 1 of 2") and "\n" not in msg and len(msg) < 500, name
        # a capture names its sample; the stop token may come on top of max_tokens; a good answer passes
        said["answer"] = {"token_ids": [7] * 9, "finish_reason": "length"}
        with pytest.raises(RemoteError, match=rf"{url} answering sample 'c3' returned 9 tokens"):
            gen.generate([[1, 2]], params[:1], names=["sample 'c3'"])
        said["answer"] = {"token_ids": [7] * 8 + [stop[0]], "finish_reason": "stop"}
        assert gen.generate([[1, 2]], params[:1])[0].output_ids == [7] * 8 + [stop[0]]


def test_a_max_model_len_that_is_not_an_integer_is_one_clear_line(target):
    _, _, path = target
    for bad, shown in (("1,8", '"1,8"'), (0, "0"), (2048.5, "2048.5")):
        with plain_server(misbehaving_app(lambda body: {}, path, max_model_len=bad)) as url, \
                pytest.raises(RemoteError) as e:
            OpenAIGenerator.connect([url])
        msg = str(e.value)
        assert msg.startswith(f"{url}/v1/models gives max_model_len={shown} for model 'tiny': not a positive "
                              "integer") and "invalid literal" not in msg and "\n" not in msg


def test_the_command_refuses_a_bad_answer_in_one_line_and_exits_2(target, tmp_path):
    _, _, path = target
    data = tmp_path / "convs.jsonl"
    data.write_text(json.dumps({"id": "hello", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    app = misbehaving_app(lambda body: {"token_ids": [5] * 100001, "finish_reason": "length"}, path)
    with plain_server(app) as url:
        r = subprocess.run([sys.executable, "-m", "mtp_train.cli.regenerate", "generator=openai",
                            f"endpoints=[{url}]", f"model.path={path}", "model.fetch=null", f"data.paths=[{data}]",
                            "template_check_rows=0", "max_new_tokens=8", "progress=false",
                            f"out={tmp_path / 'out.jsonl'}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("mtp-regenerate: error:")]
    # the request named by its conversation and turn
    assert len(errors) == 1 and f"{url} answering conversation hello turn 1 returned 100001 tokens for max_tokens=8" \
        in errors[0]
    out = tmp_path / "out.jsonl"
    assert not any(f.is_file() and f.read_text().strip() for f in (out, part_path(out, 0)))  # no record written


# --- servers that die ---------------------------------------------------------------------------------------------


def test_a_failing_endpoint_backs_off_as_one_probes_once_and_is_dead_after_dead_after():
    from mtp_train.remote.health import LIVE, PROBE, EndpointHealth

    h = EndpointHealth("http://a", backoff=1.0, dead_after=10.0)
    assert h.admit(0.0) == LIVE
    # four requests in flight when the server went: one round, one backoff for the endpoint
    for at in (100.0, 100.1, 100.2, 100.3):
        assert not h.failed(at, sent_at=99.0, reason="refused")
    assert h.rounds == 1 and h.admit(100.5) == 0.5  # 1 s after the first failure, not 2^3 s
    assert h.admit(101.0) == PROBE
    h.start_probe()
    assert h.admit(101.0) == math.inf  # the others wait for the probe's outcome
    assert not h.failed(101.1, sent_at=101.0, reason="refused")
    assert h.rounds == 2 and h.admit(102.0) == pytest.approx(1.1)  # the next probe 2 s later
    h.succeeded(sent_at=99.5)  # an answer to a try sent before the server went says nothing of it now
    assert h.failing_since == 100.0 and h.admit(103.1) == PROBE
    h.start_probe()
    h.succeeded(sent_at=103.1)  # the probe's answer: live again, the streak forgotten
    assert h.admit(103.2) == LIVE and h.failing_since is None
    assert not h.failed(200.0, sent_at=199.0, reason="HTTP 503")
    probes = []
    while h.next_try < h.deadline:  # 1, 2, 4 s apart
        probes.append(at := h.next_try)
        assert h.admit(at) == PROBE
        h.start_probe()
        assert not h.failed(at + 0.01, sent_at=at, reason="refused")
    assert probes == pytest.approx([201.0, 203.01, 207.02]) and h.deadline == 210.0
    h.start_probe()  # a try in flight when dead_after runs out does not keep the endpoint alive
    assert not h.expired(209.9) and h.expired(210.0)
    h.declare_dead()
    assert h.admit(300.0) is None and not h.expired(300.0)
    assert h.failed(300.0, sent_at=205.0, reason="refused")  # a late failure of a try sent before: still dead
    assert h.describe(211.0) == "http://a (failing for 11.0 s, last: refused)"


def test_a_server_that_dies_mid_run_and_stays_dead_stops_the_run_in_one_line(target, tmp_path):
    model, tok, path = target
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_serve(path, port, log=tmp_path / "serve.log")
    out = tmp_path / "remote.jsonl"
    try:
        wait_ready(url, server)
        # retries far beyond what the bound needs: the endpoint's death, not the request's tries, ends the run
        gen = OpenAIGenerator.connect([url], concurrency=2, retries=1000, backoff=0.1, dead_after=2.0, timeout=60)
        failure: list[BaseException] = []

        def client() -> None:
            try:
                regenerate(conversations(12), gen, tok, out, RegenerateConfig(max_new_tokens=48, progress=False),
                           stop_ids=stop_token_ids(tok, model.args.eos_token_ids))
            except BaseException as exc:  # noqa: BLE001 (reported by the test below)
                failure.append(exc)

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        part = part_path(out, 0)
        _kill_at_first_record(server, part, thread.is_alive, failure, timeout=120)
        thread.join(timeout=120)  # generous: the run stops about dead_after after the kill
        assert not thread.is_alive(), "the run did not stop after its only endpoint died"
    finally:
        server.kill()
        server.wait()
    assert len(failure) == 1 and isinstance(failure[0], RemoteError), failure
    msg = str(failure[0])
    assert msg.startswith("no endpoint left") and f"{url} (failing for " in msg and "dead_after=2 s" in msg
    assert "\n" not in msg and gen.live_endpoints() == []


def test_with_two_endpoints_one_that_dies_the_run_finishes_on_the_other_with_every_record_once(target, tmp_path):
    model, tok, path = target
    convs = conversations(9)
    cfg = RegenerateConfig(max_new_tokens=12, progress=False)
    want = engine_records(model, tok, path, convs, cfg, tmp_path / "engine.jsonl")
    port = free_port()
    dying = f"http://127.0.0.1:{port}"
    server = start_serve(path, port, log=tmp_path / "serve.log")
    app, worker = served_app(model, tok, path)
    try:
        wait_ready(dying, server)
        with app_server(app) as live:
            # retries=1: the dead endpoint's probes are its own failures, not the requests'
            gen = OpenAIGenerator.connect([dying, live], concurrency=2, retries=1, backoff=0.1, dead_after=1.0,
                                          timeout=60)
            server.send_signal(signal.SIGKILL)  # gone once the run has its endpoints
            server.wait()
            regenerate(convs, gen, tok, tmp_path / "remote.jsonl", cfg,
                       stop_ids=stop_token_ids(tok, model.args.eos_token_ids))
    finally:
        server.kill()
        server.wait()
        worker.stop()
    assert records(tmp_path / "remote.jsonl") == want  # every record once (`records` refuses a duplicate)
    # it failed (and stayed failing, or was declared dead if the run lasted dead_after); the other answered
    assert gen.retried >= 1 and gen.health[dying].failing_since is not None and not gen.health[live].dead


def test_a_dead_endpoints_requests_still_in_flight_go_to_the_live_one(target):
    _, _, path = target
    posts: list[int] = []

    async def hangs_then_fails(body: dict) -> dict:
        posts.append(len(body["prompt"]))
        if len(posts) == 1:  # the first request is never answered: a server that stopped answering
            await asyncio.sleep(3600)
        raise HTTPException(503, "overloaded")

    good = {"token_ids": [7] * 8, "finish_reason": "length"}
    with plain_server(misbehaving_app(hangs_then_fails, path)) as dying, \
            plain_server(misbehaving_app(lambda body: good, path)) as live:
        gen = OpenAIGenerator.connect([dying, live], concurrency=2, retries=1, backoff=0.05, dead_after=0.5)
        done: list = []
        thread = threading.Thread(target=lambda: done.append(gen.generate(
            [[1, 2, 3]] * 6, [SamplingParams(max_new_tokens=8)] * 6)), daemon=True)
        thread.start()
        thread.join(timeout=120)  # generous: without the hand-over the held request waits out `timeout` (600 s)
        assert not thread.is_alive(), "a request held by the dead endpoint was never handed over"
    assert [o.output_ids for o in done[0]] == [[7] * 8] * 6
    assert gen.live_endpoints() == [live] and len(posts) >= 2
