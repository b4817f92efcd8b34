"""`mtp-serve`'s connections: uvicorn's h11 protocol with a bound on the time a client takes to send its request.

uvicorn closes an idle keep-alive connection, and limits the size of the headers, but a client may send half a
request line or half its headers (or half its body) and hold the connection, and a task of the server, forever.
`TimedH11Protocol` gives every request `request_timeout` seconds from its first byte (a new connection's from its
opening) to be whole; then it answers 408 in OpenAI's error shape, unless a response has begun, and closes. The
requests it ends, and those uvicorn refuses as malformed HTTP, are counted in the app's `/metrics` with the others.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
from typing import Any

import h11
from uvicorn import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

from mtp_train.config.errors import ConfigError
from mtp_train.serve.app import ServeLimits, error_body
from mtp_train.serve.metrics import NO_ENDPOINT, RequestCounters

_COMPLETE = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)  # the client's side of a request that is over


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request is not whole within `request_timeout` seconds.

    Args:
        request_timeout: seconds from a request's first byte (a connection's opening, for its first request) to
            its last.
        counters: the app's request counters (`build_app`'s `app.state.counters`).
        **kwargs: uvicorn's (config, server_state, app_state, _loop).
    """

    def __init__(self, *, request_timeout: float, counters: RequestCounters, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.request_timeout = request_timeout
        self.counters = counters
        self._request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._request_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the connection's next request
        super().data_received(data)
        if self.conn.their_state in _COMPLETE:
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        # Malformed HTTP, refused by uvicorn before any request reached the app: counted, or `/metrics` would miss it.
        self.counters.count(NO_ENDPOINT, 400)
        self._disarm()
        super().send_400_response(msg)

    def _arm(self) -> None:
        self._disarm()
        self._request_timer = self.loop.call_later(self.request_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _timed_out(self) -> None:
        self._request_timer = None
        if self.transport.is_closing() or self.conn.their_state in _COMPLETE:
            return
        headers_read = self.conn.their_state is not h11.IDLE  # SEND_BODY: the app holds the request
        if not (headers_read and self.cycle is not None and self.cycle.response_started):
            body = json.dumps(error_body(408, f"the request was not whole within {self.request_timeout:g} s "
                                              f"(request_timeout); send it at once")).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            # Counted here, before the close the client sees: the app's handler, if it holds the request, ends
            # quietly (its body was cut short).
            self.counters.count(self.scope["path"] if headers_read else NO_ENDPOINT, 408)
        self.transport.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, for uvicorn to serve on; a port that is taken is a ConfigError that says so.

    Bound before the model loads: a busy port is found in a second, not after the weights are read."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; set host= to an address of "
                          f"this machine") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's own servers: TIME_WAIT is no owner
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; another process may hold the "
                          f"port: stop it, or choose another with port=<N>") from None
    sock.setblocking(False)
    return sock


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> Config:
    """uvicorn's settings for `app` (from `build_app`) under its served model's limits (`app.state.limits`): the
    timed h11 protocol, the header bound.

    Args:
        app: the FastAPI app; its `state.counters` also count what the connections end.
        host: address (informational when uvicorn is given a bound socket).
        port: TCP port (likewise).
        log_level: uvicorn's log level.
    """
    limits: ServeLimits = app.state.limits
    protocol = functools.partial(TimedH11Protocol, request_timeout=limits.request_timeout,
                                 counters=app.state.counters)
    return Config(app, host=host, port=port, log_level=log_level, http=protocol,  # type: ignore[arg-type]
                  h11_max_incomplete_event_size=limits.max_header_bytes, timeout_graceful_shutdown=5)
