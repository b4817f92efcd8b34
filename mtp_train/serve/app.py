"""The HTTP side of `mtp-serve`: an OpenAI-compatible FastAPI app over an `EngineWorker`.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (both streamed as server-sent
events with `stream: true`), `GET /metrics` (Prometheus text), `GET /health`. A chat request's prompt is rendered
exactly as our own stages render it (`mtp_train.engine.turns.prompt_ids`: the tokenizer's chat template with the
generation prompt, no extra special tokens), so the `prompt_token_ids` it returns with `return_token_ids` are the
ids regeneration and the loss masks work with. Answer text follows the same module's rule (the stop token an
answer ended on left out, special tokens kept). A request the server cannot take gets a 4xx whose body says why
(OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`); nothing a client sends stops the server.

Limits (`ServeLimits`): a body over `max_body_bytes` gets a 413 (read no further); a request may not choose the
template the server renders (`chat_template_kwargs.chat_template`, refused unless `trust_request_chat_template`), nor
pass the rendering's own parameters (`tokenize`, `tools`, ...); rendering and tokenizing run on a worker thread, so
that a long render holds only its own request, never the event loop. What uvicorn's connections are allowed (the
time to send a request, the header size) is `mtp_train.serve.http`'s.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtp_train.data.chat import ChatTemplateError
from mtp_train.engine.sampling import SamplingParams
from mtp_train.engine.turns import prompt_ids
from mtp_train.serve.metrics import CONTENT_TYPE, RequestCounters, render_metrics
from mtp_train.serve.protocol import ChatCompletionRequest, CompletionRequest
from mtp_train.serve.text import TextStream
from mtp_train.serve.worker import EngineWorker, Failed, Finished, Tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeLimits:
    """What one client may ask of the server (`ServeConfig`'s fields of the same names; docs/serving.md).

    Args:
        max_body_bytes: a request body larger than this gets a 413 (by Content-Length before it is read, or once
            that many bytes have come).
        request_timeout: seconds a connection has to send a whole request (request line, headers and body); then
            it gets a 408 and is closed.
        max_header_bytes: the request line and headers together (uvicorn's h11 limit; more gets a 400).
        trust_request_chat_template: take a request's `chat_template_kwargs.chat_template` (it then runs on the
            server's CPU for as long as it likes, on a worker thread).
    """

    max_body_bytes: int = 4 * 2**20
    request_timeout: float = 30.0
    max_header_bytes: int = 16 * 2**10
    trust_request_chat_template: bool = False


@dataclass
class ServedModel:
    """What the app says about the model it serves and how it fills in a request.

    Args:
        model_id: the id clients name (`model`).
        root: the weights folder (vLLM's `root` field of `/v1/models`: a client fingerprints it when local).
        tokenizer: the target's tokenizer (chat template, text prompts, answer text).
        max_context: prompt + answer tokens the model attends over.
        max_request_tokens: prompt + max_tokens the KV pool can hold for one request.
        stop_ids: what ends an answer unless `ignore_eos` (`engine.turns.stop_token_ids`).
        default_max_tokens: max_tokens of a request that names none (None: the rest of the context).
        template_kwargs: passed to the chat template of every chat request.
        limits: what one client may ask (body size, timeouts, the request's template).
    """

    model_id: str
    root: str
    tokenizer: Any
    max_context: int
    max_request_tokens: int
    stop_ids: list[int]
    default_max_tokens: int | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    limits: ServeLimits = field(default_factory=ServeLimits)


class BadRequest(Exception):
    """A request the server refuses: status and message for the client."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; the message made valid UTF-8 (an exception's text may quote a lone surrogate)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    # After a 413 the rest of the body is not wanted: closing beats reading it to find the next request.
    headers = {"connection": "close"} if status == 413 else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class _ClientGone(HTTPException):
    """The connection closed before the body was whole (the client left, or `request_timeout` closed it, which
    counts it): nobody to answer, nothing to count."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection before sending the whole body")


class _Guard:
    """The app's outer layer: a body over `max_body` is refused with a 413, a body cut short ends its request
    quietly, and an exception the handlers did not turn into a response becomes a 500 in OpenAI's shape (counted),
    so that the connection stays open for the client's next request.

    Args:
        app: the FastAPI app's inner stack.
        max_body: bytes a request body may have.
        counters: the app's request counters.
    """

    def __init__(self, app: ASGIApp, max_body: int, counters: RequestCounters) -> None:
        self.app, self.max_body, self.counters = app, max_body, counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body:
            self.counters.count(path, 413)
            await self._too_large()(scope, receive, send)
            return
        started = False
        received = 0
        body_done = False

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_body:
                    raise HTTPException(413, self._too_large_message())
            elif message["type"] == "http.disconnect" and not body_done:
                raise _ClientGone()
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded_receive, watched_send)
        except Exception as exc:
            if started:  # the response is half sent: only closing the connection can tell the client
                raise
            log.exception("request to %s failed", path)
            self.counters.count(path, 500)
            await _error(500, f"{type(exc).__name__}: {exc}")(scope, receive, send)

    def _too_large_message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_body} bytes (max_body_bytes)"

    def _too_large(self) -> JSONResponse:
        return _error(413, self._too_large_message())


def _validation_message(exc: RequestValidationError) -> str:
    """Pydantic's errors as one line: `messages.0.role: Input should be 'system', ... ; max_tokens: ...`."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "invalid request: " + "; ".join(parts)


def build_app(worker: EngineWorker, served: ServedModel) -> FastAPI:
    """The FastAPI app answering for `served` through `worker` (started by the caller)."""
    app = FastAPI(title="mtp-serve", docs_url=None, redoc_url=None)
    counters = RequestCounters()
    # The connections' layer (`serve.http`) reads the limits, and counts the requests it ends itself.
    app.state.counters, app.state.limits = counters, served.limits
    app.add_middleware(_Guard, max_body=served.limits.max_body_bytes, counters=counters)
    created = int(time.time())
    # The template's own keyword parameters (`chat_template`, `tokenize`, `tools`, ...): how the server renders,
    # which a request's `chat_template_kwargs` must not change; everything else is a variable of the template.
    render_params = set(inspect.signature(served.tokenizer.apply_chat_template).parameters) - {"self", "kwargs"}

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        counters.count(request.url.path, 400)
        return _error(400, _validation_message(exc))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        counters.count(request.url.path, exc.status)
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if not isinstance(exc, _ClientGone):
            counters.count(request.url.path, exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return _error(exc.status_code, message)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served.model_id, "object": "model", "created": created, "owned_by": "mtp_train",
            "root": served.root, "parent": None, "max_model_len": served.max_context}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_metrics(served.model_id, counters, worker.describe(), worker.engine.stats)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    def check_model(model: str | None) -> None:
        if model is not None and model != served.model_id:
            raise BadRequest(f"The model `{model}` does not exist; this server serves `{served.model_id}`", 404,
                             "model")

    def sampling(req: ChatCompletionRequest | CompletionRequest, prompt: list[int]) -> SamplingParams:
        """The engine's parameters of a request, with its limits checked."""
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        problem = req.unsupported()
        if problem:
            raise BadRequest(problem[1], param=problem[0])
        limit = req.limit()
        room = served.max_context - len(prompt)
        if limit is None:
            limit = served.default_max_tokens if served.default_max_tokens is not None else room
        if limit < 1 or len(prompt) + limit > served.max_context:
            raise BadRequest(f"this model's context is {served.max_context} tokens; the prompt has {len(prompt)} and "
                             f"max_tokens is {limit}: lower max_tokens or shorten the prompt", param="max_tokens")
        if len(prompt) + limit > served.max_request_tokens:
            raise BadRequest(f"the prompt ({len(prompt)} tokens) and max_tokens ({limit}) exceed the "
                             f"{served.max_request_tokens} tokens of KV cache one request may hold", param="max_tokens")
        stop = list(served.stop_ids) + [t for t in (req.stop_token_ids or []) if t not in served.stop_ids]
        try:
            return SamplingParams(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                                  max_new_tokens=limit, stop_token_ids=stop, ignore_eos=req.ignore_eos,
                                  seed=req.seed)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    async def run(path: str, prompt: list[int], params: SamplingParams,
                  stop: Sequence[str]) -> AsyncIterator[tuple[str, list[int], str | None, Finished | None]]:
        """(text delta, token ids delta, finish reason or None, the finish event) as the engine answers; a
        refused request raises BadRequest before anything is yielded; a request left early is aborted."""
        req = worker.submit(prompt, params)
        text = TextStream(served.tokenizer, stop, [] if params.ignore_eos else params.stop_token_ids or [])
        done = refused = False
        try:
            while True:
                event = await req.events.get()
                if isinstance(event, Failed):
                    done = refused = True
                    raise BadRequest(event.message, event.status)
                if isinstance(event, Tokens):
                    delta = text.add(event.ids)
                    if text.stopped:  # a stop string: the answer is over here
                        done = True
                        worker.abort(req)
                        yield delta, event.ids, "stop", Finished("stop")
                        return
                    yield delta, event.ids, None, None
                elif isinstance(event, Finished):
                    done = True
                    yield text.add([], final=True), [], event.reason, event
                    return
        finally:
            if not done:  # the client went away: free the engine's pages
                worker.abort(req)
            if not refused:
                counters.prompt_tokens += len(prompt)
                counters.completion_tokens += req.sent

    def usage(prompt: list[int], completion: int, fin: Finished | None) -> dict[str, Any]:
        u: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": completion,
                             "total_tokens": len(prompt) + completion}
        if hasattr(worker.engine.stats, "metrics") and fin is not None:
            steps, acc = fin.spec_steps, fin.spec_accepted
            u["speculative"] = {"verify_steps": steps, "accepted_tokens": acc,
                                "mean_acceptance_length": (1 + acc / steps) if steps else None}
        return u

    async def next_item(gen: AsyncIterator[Any]) -> Any:
        """The next item of `run`, None at its end (the first is awaited before a stream's 200 is sent, so that a
        refusal is a 4xx)."""
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def answer(path: str, req: ChatCompletionRequest | CompletionRequest, prompt: list[int],
                     chat: bool) -> JSONResponse | StreamingResponse:
        """A request's response: the whole answer as JSON, or a stream of chunks (OpenAI's shapes, vLLM's token
        id fields)."""
        params = sampling(req, prompt)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        ids_wanted = bool(req.return_token_ids)
        gen = run(path, prompt, params, req.stop_strings())
        first = await next_item(gen)
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now,
                "model": served.model_id}

        if not req.stream:
            text, ids, reason, fin = [], [], None, None
            item = first
            while item is not None:
                text.append(item[0])
                ids.extend(item[1])
                reason, fin = item[2], item[3] or fin
                item = await next_item(gen)
            body = "".join(text)
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": body}
            else:
                choice["text"] = body
            if ids_wanted:
                choice["token_ids"] = ids
                if not chat:
                    choice["prompt_token_ids"] = prompt
            out: dict[str, Any] = {**head, "object": "chat.completion" if chat else "text_completion",
                                   "choices": [choice], "usage": usage(prompt, len(ids), fin)}
            if chat and ids_wanted:
                out["prompt_token_ids"] = prompt
            counters.count(path, 200)
            return JSONResponse(out)

        async def stream() -> AsyncIterator[str]:
            try:
                async for chunk in chunks():
                    yield chunk
            finally:  # the client may have gone: close `run` now, which aborts the request
                await gen.aclose()

        async def chunks() -> AsyncIterator[str]:
            completion = 0
            first_chunk = True
            item = first
            fin = None
            if chat:  # OpenAI opens a chat stream with the role
                opening: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                       "content": ""},
                                                                 "finish_reason": None}]}
                if ids_wanted:
                    opening["prompt_token_ids"] = prompt
                    opening["choices"][0]["token_ids"] = []
                first_chunk = False
                yield sse(opening)
            while item is not None:
                delta, ids, reason, fin = item[0], item[1], item[2], item[3] or fin
                completion += len(ids)
                choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
                if chat:
                    choice["delta"] = {"content": delta} if delta or reason is None else {}
                else:
                    choice["text"] = delta
                if ids_wanted:
                    choice["token_ids"] = ids
                    if first_chunk:
                        choice["prompt_token_ids"] = prompt
                first_chunk = False
                yield sse({**head, "choices": [choice]})
                try:
                    item = await next_item(gen)
                except BadRequest as exc:  # after the 200: the error goes into the stream, as vLLM sends it
                    counters.count(path, exc.status)
                    yield sse({"error": {"message": str(exc), "type": "InternalServerError", "param": None,
                                         "code": exc.status}})
                    break
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt, completion, fin)})
            yield "data: [DONE]\n\n"

        counters.count(path, 200)
        return StreamingResponse(stream(), media_type="text/event-stream")

    def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
        """The server's template variables with the request's over them; a request's template, or the rendering's
        own parameters, refused."""
        asked = req.chat_template_kwargs or {}
        for key in asked:
            if key == "chat_template" and served.limits.trust_request_chat_template:
                continue
            if key == "chat_template":
                raise BadRequest("this server renders with its own chat template; it takes a request's "
                                 "chat_template only when started with trust_request_chat_template=true",
                                 param="chat_template_kwargs.chat_template")
            if key in render_params:
                raise BadRequest(f"`{key}` is a parameter of the server's rendering, not a variable of the chat "
                                 f"template", param=f"chat_template_kwargs.{key}")
        return {**served.template_kwargs, **asked}

    async def off_loop(fn: Any, *args: Any) -> Any:
        """`fn(*args)` on a worker thread (rendering, tokenizing: CPU work that would hold every other client),
        counted in the `preparing` gauge while it runs."""
        counters.preparing += 1
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            counters.preparing -= 1

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        check_model(req.model)
        kwargs = template_kwargs(req)
        try:
            prompt = await off_loop(prompt_ids, served.tokenizer, [m.as_dict() for m in req.messages], kwargs)
        except ChatTemplateError as exc:
            raise BadRequest(f"the chat template cannot render these messages: {exc}", param="messages") from None
        return await answer("/v1/chat/completions", req, prompt, chat=True)

    def tokenize(text: str) -> list[int]:
        return [int(t) for t in served.tokenizer(text, add_special_tokens=True)["input_ids"]]

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        check_model(req.model)
        one = req.one_prompt()
        if one is None:
            raise BadRequest("one prompt per request (a string or a list of token ids); send a batch as "
                             "concurrent requests", param="prompt")
        prompt = one if isinstance(one, list) else await off_loop(tokenize, one)
        return await answer("/v1/completions", req, prompt, chat=False)

    return app
