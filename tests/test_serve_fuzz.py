"""`mtp-serve` under random and adversarial requests: bad JSON, wrong types, huge and non-finite numbers, lone
surrogates, deep nesting, bodies over the limit, bogus fields, malformed HTTP and half-sent requests, from many
clients at once. A fixed number of seeded cases (no wall-time bound); afterwards the server answers a fixed greedy
request with the same token ids as before, no case got a 500, and `/metrics` counts every request sent, by status.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from mtp_train.engine.turns import prompt_ids
from tests._serve import app_server, metric_samples, read_to_close, served_app
from tests.conftest import make_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = 240  # requests of the fuzz (each on a connection of its own)
CLIENTS = 8  # sent at once
MAX_BODY = 8192
TIMEOUT = 1.0  # the server's request_timeout: what a half-sent request waits for its 408
MESSAGES = [{"role": "user", "content": "Tell me about owls."}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class Case:
    """One request as bytes, and what it must get: `statuses` allowed, `says` in the error message (if any)."""

    kind: str
    data: bytes
    statuses: frozenset[int]
    says: str = ""


def http_bytes(path: str, body: bytes, method: str = "POST", chunked: bool = False) -> bytes:
    """A whole HTTP/1.1 request (closing the connection after it)."""
    head = f"{method} {path} HTTP/1.1\r\nhost: fuzz\r\ncontent-type: application/json\r\nconnection: close\r\n"
    if chunked:
        parts = [body[i:i + 1000] for i in range(0, len(body), 1000)]
        return (head + "transfer-encoding: chunked\r\n\r\n").encode() + b"".join(
            b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body


def random_value(rng: random.Random, depth: int = 0) -> object:
    """A JSON value of a random type (strings with lone surrogates and non-finite numbers included)."""
    kind = rng.randrange(9 if depth < 3 else 6)
    return [lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-2**80, 2**80),
            lambda: rng.choice([1e308, -1e308, 1e-320, float("inf"), float("-inf"), float("nan"), -0.0, 3.5]),
            lambda: rng.choice(["", "x" * rng.randrange(50), "\ud800", "a\udfffb", "\u00e9\u4e2d\U0001f600"]),
            lambda: rng.randrange(300),
            lambda: [random_value(rng, depth + 1) for _ in range(rng.randrange(4))],
            lambda: {rng.choice(["a", "\ud801", "type", "text"]): random_value(rng, depth + 1)
                     for _ in range(rng.randrange(3))},
            lambda: [rng.randrange(-5, 400) for _ in range(rng.randrange(6))]][kind]()


def valid_body(rng: random.Random, chat: bool) -> dict:
    """A request the server serves: random sampling settings within bounds, a few tokens."""
    body: dict = {"max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.5, 1.0, 1.7]),
                  "top_p": rng.choice([1.0, 0.9, 1e-8]), "top_k": rng.choice([0, -1, 5]),
                  "seed": rng.choice([None, 0, 2**63 - 1, -(2**63)]), "stream": rng.random() < 0.3,
                  "return_token_ids": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "Tell me about tea.", "\u00e9t\u00e9"])}]
    else:
        body["prompt"] = rng.choice(["Tell me", [5, 6, 7], [[5, 6]]])
    return body


def make_case(rng: random.Random) -> Case:  # noqa: PLR0911 (one return per kind)
    """One random case of a random kind."""
    chat = rng.random() < 0.5
    path = CHAT if chat else COMPLETIONS
    kind = rng.choice(["valid", "bad_json", "wrong_type", "huge_number", "surrogate", "deep", "oversize",
                       "oversize_chunked", "bogus_field", "half", "garbage", "wrong_route"])
    body = valid_body(rng, chat)
    if kind == "valid":
        return Case(kind, http_bytes(path, json.dumps(body).encode()), frozenset({200}))
    if kind == "bad_json":
        text = json.dumps(body)
        cut = text[: rng.randrange(1, len(text))] + rng.choice(["", "}", ",,", "\x00", "'"])
        return Case(kind, http_bytes(path, cut.encode("utf-8", "surrogatepass")), frozenset({400}))
    if kind == "wrong_type":
        field = rng.choice(["messages", "prompt", "max_tokens", "temperature", "stop", "stream", "seed",
                            "stop_token_ids", "stream_options", "chat_template_kwargs", "n", "model"])
        body[field] = random_value(rng)
        return Case(kind, http_bytes(path, json.dumps(body).encode()), frozenset({200, 400, 404}))
    if kind == "huge_number":
        field = rng.choice(["max_tokens", "temperature", "top_p", "top_k", "seed", "n", "frequency_penalty"])
        body[field] = rng.choice([10**30, -(10**30), 1e308, float("inf"), float("nan"), 1e-300, 2**64])
        return Case(kind, http_bytes(path, json.dumps(body).encode()), frozenset({400}))
    if kind == "surrogate":
        lone = rng.choice(["\ud800", "\udbff", "\udc00", "x\udfff"])
        if chat:
            body["messages"][0]["content"] += lone
        else:
            body["prompt"] = "Tell me " + lone
        return Case(kind, http_bytes(path, json.dumps(body).encode()), frozenset({400}), "lone surrogate")
    if kind == "deep":
        depth = rng.choice([50, 900, 3000, MAX_BODY // 2 - 100])
        nested = "[" * depth + "]" * depth
        where = rng.choice(["body", "kwargs", "content"])
        text = nested if where == "body" else json.dumps(body)[:-1] + (
            f', "chat_template_kwargs": {{"x": {nested}}}}}' if where == "kwargs" else f', "messages": {nested}}}')
        return Case(kind, http_bytes(path, text.encode()), frozenset({200, 400}))
    if kind in ("oversize", "oversize_chunked"):
        body["stop"] = ["x" * rng.randint(MAX_BODY, 3 * MAX_BODY)]
        return Case(kind, http_bytes(path, json.dumps(body).encode(), chunked=kind == "oversize_chunked"),
                    frozenset({413}), "max_body_bytes")
    if kind == "bogus_field":
        for _ in range(rng.randint(1, 4)):
            body[rng.choice(["zzz", "user", "metadata", "echo", "best_of", "logit_bias", "foo\u00e9"])] = \
                random_value(rng)
        return Case(kind, http_bytes(path, json.dumps(body).encode()), frozenset({200, 400}))
    if kind == "half":
        whole = http_bytes(path, json.dumps(body).encode())
        return Case(kind, whole[: rng.randrange(0, len(whole) - 1)], frozenset({408}), "request_timeout")
    if kind == "garbage":
        junk = rng.choice([b"\x16\x03\x01\x00\xa5\x01\x00\x00", b"GET / HTTP/1.1\r\n\r\n", b"POST\r\n\r\n",
                           b"POST /v1/completions HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
                           b"POST /v1/completions HTTP/1.1\r\nbad header\r\n\r\n"])
        return Case(kind, junk, frozenset({400}))
    method, route = rng.choice([("GET", CHAT), ("POST", "/v1/models"), ("POST", "/v2/nothing"), ("PUT", "/metrics")])
    return Case(kind, http_bytes(route, b"{}", method=method), frozenset({404, 405}))


def send(url: str, case: Case) -> int:
    """Send one case on a fresh connection; return the status it got (checked against the case)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(case.data)
        if case.kind == "half":  # the client waits: the server must end it
            reply = read_to_close(sock)
            status = int(reply.split(b" ", 2)[1])
            body = reply.split(b"\r\n\r\n", 1)[1]
        else:
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            status, body = resp.status, resp.read()
    assert status in case.statuses, (case.kind, case.data[:300], status, body[:300])
    if status != 200 and body.startswith(b"{"):
        assert case.says in json.loads(body)["error"]["message"], (case.kind, body[:300])
    return status


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from mtp_train.data.chat import load_tokenizer
    from mtp_train.models import load_model

    path = make_chat_target(tmp_path_factory.mktemp("fuzz") / "tiny")
    return load_model(path, dtype="float32", device="cpu"), load_tokenizer(path), path


def counted(url: str) -> Counter[int]:
    """`requests_total` of the server's /metrics, by status (every endpoint)."""
    out: Counter[int] = Counter()
    for labels, value in metric_samples(httpx.get(f"{url}/metrics").text, "requests_total").items():
        out[int(labels.split('status="')[1].split('"')[0])] += int(value)
    return out


def test_the_server_survives_fuzz_and_counts_every_request(target):
    from mtp_train.serve import ServeLimits

    model, tok, path = target
    app, worker = served_app(model, tok, path, limits=ServeLimits(max_body_bytes=MAX_BODY, request_timeout=TIMEOUT))
    rng = random.Random(20240501)
    cases = [make_case(rng) for _ in range(CASES)]
    fixed = {"prompt": prompt_ids(tok, MESSAGES), "max_tokens": 8, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True}
    with app_server(app) as url:
        before = httpx.post(f"{url}{COMPLETIONS}", json=fixed).json()["choices"][0]["token_ids"]
        start = counted(url)
        with ThreadPoolExecutor(CLIENTS) as pool:
            got = Counter(pool.map(lambda c: send(url, c), cases))
        end = counted(url)
        after = httpx.post(f"{url}{COMPLETIONS}", json=fixed).json()["choices"][0]["token_ids"]
    worker.stop()
    assert after == before and len(before) == 8
    assert 500 not in got and sum(got.values()) == CASES
    assert end - start == got  # every request counted once, with the status its client got
    kinds = Counter(c.kind for c in cases)
    assert min(kinds.values()) >= 5, kinds  # every kind was tried
