"""One JSON request to an OpenAI-compatible endpoint, and what a failure means: retry elsewhere, or stop the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # overloaded, restarting or behind a failing router
MAX_BACKOFF = 60.0  # seconds: the longest wait between two tries


class RemoteError(RuntimeError):
    """A failure the user has to act on (an endpoint unreachable, a model not served, a request refused, a template
    that disagrees); its message is one line that says which endpoint and what to do."""


@dataclass
class Retryable(Exception):
    """A failure another try may not have: a dropped connection, a timeout, 429 or 5xx."""

    reason: str
    retry_after: float | None = None  # what a 429 / 503's Retry-After header asked for

    def __str__(self) -> str:
        return self.reason


def one_line(text: str, limit: int = 300) -> str:
    """`text` with its line breaks and runs of spaces folded, cut at `limit` characters (a server's error body or
    a transport error can hold several lines; our errors are one)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def base_url(endpoint: str) -> str:
    """`http://host:port` of an endpoint given as that, with a trailing slash, or with `/v1`."""
    url = endpoint.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise RemoteError(f"endpoint {endpoint!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
    return url


def backoff_seconds(base: float, failures: int, retry_after: float | None = None) -> float:
    """The wait after the `failures`-th failure in a row: base · 2^(failures-1), at most MAX_BACKOFF, at least what
    the server asked for."""
    wait = min(base * 2 ** max(failures - 1, 0), MAX_BACKOFF)
    return max(wait, retry_after or 0.0)


def _message(r: httpx.Response) -> str:
    """The error message of an OpenAI-style error body, else the start of the body."""
    try:
        body = r.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message") if isinstance(err, dict) else None
        return str(msg or body)[:500]
    except ValueError:
        return r.text[:500]


async def request_json(client: httpx.AsyncClient, method: str, url: str, body: Any = None) -> Any:
    """The JSON answer of one request; raises Retryable (try again) or RemoteError (a 4xx: the request is wrong)."""
    try:
        r = await client.request(method, url, json=body)
    except httpx.TimeoutException as exc:
        raise Retryable(f"{url}: timed out ({type(exc).__name__})") from None
    except httpx.TransportError as exc:  # refused, reset, closed mid-answer: the server died or restarts
        raise Retryable(one_line(f"{url}: {type(exc).__name__}: {exc}")) from None
    if r.status_code in RETRY_STATUS:
        after = r.headers.get("retry-after")
        try:
            wait = float(after) if after else None
        except ValueError:
            wait = None
        raise Retryable(one_line(f"{url}: HTTP {r.status_code}: {_message(r)}"), wait)
    if r.status_code >= 400:
        raise RemoteError(one_line(f"{url} refused the request: HTTP {r.status_code}: {_message(r)}", 800))
    try:
        return r.json()
    except ValueError:
        raise Retryable(f"{url}: an answer that is not JSON ({r.text[:80]!r})") from None
