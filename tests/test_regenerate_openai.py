"""`mtp-regenerate generator=openai`: regeneration through OpenAI-compatible servers, tested against `mtp-serve` on
localhost with a tiny random Llama: the records equal our engine's (greedy, multi-turn), a server killed and
restarted mid-run loses and duplicates nothing, a server whose template disagrees is refused at the first differing
token, and an unreachable endpoint or a model not served is one clear line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mtp_train.config import RegenerateConfig
from mtp_train.data.readers import Conversation
from mtp_train.engine import LLMEngine
from mtp_train.engine.generator import EngineGenerator
from mtp_train.engine.turns import stop_token_ids
from mtp_train.models.fingerprint import weights_fingerprint
from mtp_train.regenerate import part_path, regenerate
from mtp_train.remote import OpenAIGenerator, RemoteError
from tests._serve import app_server, free_port, served_app, start_serve, wait_ready
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
        deadline = time.monotonic() + 120
        while not (part.exists() and part.read_text().count("\n") >= 1):  # a record written: the run is under way
            assert time.monotonic() < deadline and thread.is_alive(), failure
            time.sleep(0.01)
        server.send_signal(signal.SIGKILL)
        server.wait()
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
        deadline = time.monotonic() + 300
        while not (part.exists() and part.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and client.poll() is None, "the client ended before a record"
            time.sleep(0.01)
        client.send_signal(signal.SIGKILL)
        client.wait()
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
