"""The HTTP layer: FastAPI routes over a Scheduler. Thin on purpose: a route
validates (protocol.py), builds a Job in a thread (jobs.py), submits it, and
turns the worker's events into a JSON response or server-sent events. `GET /` is
the chat page (static/chat.html), a client of these same routes.

Every error leaves as OpenAI's JSON shape through the handlers in `create_app`.
A client that goes away cancels its request: a stream when Starlette notices the
disconnect (the generator is cancelled), a plain request by polling while it waits.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import pathlib
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import chat_content
from . import jobs, protocol, structured
from .limits import BodyGuard, Limits, RequestGuard
from .metrics import Metrics
from .render import TemplateRenderer
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .scheduler import RETRY_AFTER_S, QueueFull, Scheduler
from .sequence import Delta, Failed, Finished

DISCONNECT_POLL_S = 0.25     # how often a waiting non-streaming request checks its client
CHAT_PAGE = pathlib.Path(__file__).parent / "static" / "chat.html"     # GET /: the chat page
OPEN_PATHS = ("/", "/health", "/metrics")   # served without the API key (as vLLM does)


class RequireKey:
    """ASGI middleware: a request outside OPEN_PATHS (and not a CORS preflight) needs
    `Authorization: Bearer <key>` for one of `keys` (the header's bytes, see api_keys),
    else 401. Plain ASGI, not Starlette's BaseHTTPMiddleware: behind that, a route never
    sees its client disconnect, and a plain request whose client left would run on."""

    def __init__(self, app, keys: list[bytes]):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            ok = False
            for expected in self.keys:           # every key compared, in constant time
                ok |= hmac.compare_digest(given, expected)
            if not ok:
                answer = JSONResponse(protocol.error("invalid or missing API key: send the header "
                                                     "'Authorization: Bearer <key>' with the server's --api-key",
                                                     "invalid_request_error", None, "invalid_api_key"),
                                      status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await answer(scope, receive, send)
        return await self.app(scope, receive, send)


class Submission:
    """A job on the scheduler with its events as an asyncio queue (filled from the
    worker thread). `close()` cancels it unless it has finished."""

    def __init__(self, scheduler: Scheduler, job):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.scheduler = scheduler

        def emit(event):
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:            # the loop has closed: the server is shutting down
                pass

        try:
            self.handle = scheduler.submit(job, emit)
        except QueueFull as e:
            raise _full(e) from None

    async def next(self, timeout: float | None = None):
        return await asyncio.wait_for(self.queue.get(), timeout)

    def close(self) -> None:
        self.scheduler.cancel(self.handle)


def served_names(model_path: str, name: str) -> set[str]:
    """Names a request's `model` may use: the served id, the file name, its stem, the path."""
    p = pathlib.Path(model_path)
    return {name, p.name, p.stem, str(p), model_path}


def api_keys(api_key) -> list[bytes]:
    """`api_key` (a str, several, or None) -> the Authorization values accepted, as UTF-8
    bytes (a client sends the header's raw bytes). An empty key is refused."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if any(not k for k in keys):
        raise ValueError("an API key must not be empty")
    return [b"Bearer " + k.encode("utf-8") for k in keys]


def create_app(scheduler: Scheduler, model_id: str, api_key=None, limits: Limits | None = None,
               allowed_hosts: set[str] | None = None, allowed_origins: list[str] | None = None) -> FastAPI:
    """The app over `scheduler`; with `api_key` (one key or several), every route but
    OPEN_PATHS needs `Authorization: Bearer <key>` (401 otherwise). `limits`: the
    server's limits (limits.py; default: the model's settings); `allowed_hosts`: the
    Host names answered (None: any); `allowed_origins`: CORS origins (None: no CORS)."""
    model = scheduler.model
    names = served_names(model.path, model_id)
    token_bytes = model.tokenizer.token_bytes
    created = protocol.now()
    limits = limits or Limits.from_settings(model.settings)
    tok = model.tokenizer
    renderer = TemplateRenderer(tok.chat_template, tok.pieces[tok.bos_id] if tok.bos_id is not None else "",
                                tok.pieces[tok.eos_id] if tok.eos_id is not None else "",
                                max_chars=model.ctx * tok.max_piece_chars + 1, timeout=limits.template_timeout)
    renderer.warm()
    prometheus = Metrics(scheduler)
    scheduler.metrics = prometheus

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)
            renderer.close()

    app = FastAPI(title="snapkv-engine", description="OpenAI-compatible API with per-request SnapKV eviction",
                  lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.renderer = renderer
    app.state.limits = limits

    app.add_middleware(BodyGuard, limits=limits)       # innermost: a client without the key sends no body
    keys = api_keys(api_key)
    if keys:
        app.add_middleware(RequireKey, keys=keys)
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(RequestGuard, limits=limits, allowed_hosts=allowed_hosts)     # outermost

    # -- errors: always OpenAI's shape ---------------------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return JSONResponse(protocol.error(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
                                               .rstrip(": "), "invalid_request_error"), status_code=400)
        # a union reports each alternative: name the field, not the alternative
        param = loc[0] if loc else None
        where = ".".join(x for x in loc if not _is_type_name(x)) or "body"
        message = f"{where}: {err.get('msg', 'invalid value')}"
        if err.get("type") == "missing":
            message = f"{where}: field required"
        return JSONResponse(protocol.error(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = str(e.detail)
        return JSONResponse(protocol.error(message, ApiError.TYPES.get(e.status_code, "invalid_request_error")),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        return JSONResponse(protocol.error(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    # -- routes --------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(CHAT_PAGE, media_type="text/html")

    @app.get("/health")
    async def health():
        """200 while serving; 503 with the reason once the device has faulted or the
        server is shutting down ("draining"); `engine serve` answers 503 "loading" before."""
        if scheduler.fault is not None:
            return JSONResponse({"status": "error", **ApiError(503, scheduler.fault, None, "device_fault").body()},
                                status_code=503)
        if scheduler.draining:
            return JSONResponse({"status": "draining", **ApiError(503, "the server is shutting down", None,
                                                                  "shutting_down").body()}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return protocol.model_list(model_id, created)

    @app.get("/state")
    async def state():
        """Extension: what the scheduler holds (running requests, queue, live caches)."""
        return scheduler.state()

    @app.get("/metrics")
    async def metrics():
        """Prometheus' text format (metrics.py): latency histograms, request and token
        counters, queue and KV pool gauges."""
        data, content_type = await run_in_threadpool(prometheus.render)
        return Response(data, headers={"Content-Type": content_type})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """Extension (vLLM's and llama.cpp's): text or a chat -> token ids."""
        _check_model(body.model)
        rendered = await _render_chat(body.messages) if body.messages else None
        ids = await run_in_threadpool(jobs.tokenize, model, body, rendered, limits)
        return {"tokens": ids, "count": len(ids), "max_model_len": model.ctx}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """Extension: token ids -> text (both vLLM's and llama.cpp's field names)."""
        _check_model(body.model)
        text = await run_in_threadpool(jobs.detokenize, model, body)
        return {"prompt": text, "content": text}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        start = time.monotonic()
        _check_model(body.model)
        _check_room(scheduler)
        job = await run_in_threadpool(jobs.completion_job, model, body, limits)
        return await _respond(request, body, job, False, start)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        start = time.monotonic()
        _check_model(body.model)
        _check_room(scheduler)
        jobs.check_stop(body.stop, limits)
        plan = structured.tool_plan(body, tok.chat_template)
        rendered = await _render_chat(body.messages, plan.tools)
        job = await run_in_threadpool(jobs.chat_job, model, body, rendered, limits, plan)
        return await _respond(request, body, job, True, start, plan)

    async def _render_chat(request_messages, tools=None) -> jobs.RenderedChat:
        """The chat template's output, and its skeleton where content must stay plain text."""
        messages = jobs.chat_messages(request_messages, model.ctx)
        text = await renderer.render(messages, tools=tools)      # (its size capped: the scan below is bounded)
        marked = None
        if limits.content_specials == "text":
            marked = await run_in_threadpool(chat_content.marked_messages, tok, messages)
        return jobs.RenderedChat(text, await renderer.render(marked, tools=tools) if marked else None)

    def _check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {model_id!r}",
                           "model", "model_not_found")

    async def _respond(request: Request, body, job, chat: bool, start: float, plan=structured.NO_TOOLS):
        """`plan.parse`: parse <tool_call> blocks out of the output (structured.py)."""
        sub = Submission(scheduler, job)
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        deadline = start + limits.request_timeout if limits.request_timeout else None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            calls = structured.CallStream(plan.choice) if plan.parse else None
            return ClosingStream(_sse(sub, rid, chat, include_usage, job.logprobs is not None, deadline, calls),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, sub, rid, chat, job.logprobs is not None, deadline, plan)

    def _timed_out() -> ApiError:
        return ApiError(504, f"the request ran longer than the server's --request-timeout of "
                             f"{limits.request_timeout:g} s and was ended", None, "request_timeout")

    def _left(deadline: float | None) -> float | None:
        return None if deadline is None else deadline - time.monotonic()

    def _logprobs(entries, chat: bool) -> dict:
        return (protocol.chat_logprobs if chat else protocol.completion_logprobs)(entries, token_bytes)

    async def _collect(request: Request, sub: Submission, rid: str, chat: bool, logprobs: bool, deadline,
                       plan=structured.NO_TOOLS):
        parts: list[str] = []
        entries: list = []
        gone = asyncio.ensure_future(_until_disconnected(request.receive))
        try:
            while True:
                left = _left(deadline)
                if left is not None and left <= 0:
                    raise _timed_out()
                try:
                    event = await sub.next(DISCONNECT_POLL_S if left is None else min(DISCONNECT_POLL_S, left))
                except asyncio.TimeoutError:
                    if gone.done():
                        return JSONResponse({}, status_code=499)     # nobody is listening
                    continue
                if isinstance(event, Delta):
                    parts.append(event.text)
                    entries += event.logprobs
                elif isinstance(event, Finished):
                    lp = _logprobs(entries + list(event.logprobs), chat) if logprobs else None
                    text = "".join(parts)
                    if plan.parse:
                        content, calls = structured.parse_calls(text)
                        if calls:
                            return protocol.chat_completion(rid, model_id, protocol.now(), content,
                                                            structured.calls_finish_reason(event.finish_reason,
                                                                                           plan.choice),
                                                            event.usage, lp, calls)
                    make = protocol.chat_completion if chat else protocol.completion
                    return make(rid, model_id, protocol.now(), text, event.finish_reason, event.usage, lp)
                elif isinstance(event, Failed):
                    raise _api_error(event)
        finally:
            gone.cancel()
            sub.close()

    async def _sse(sub: Submission, rid: str, chat: bool, include_usage: bool, logprobs: bool, deadline,
                   calls: structured.CallStream | None = None):
        t = protocol.now()

        def chunk(text: str, reason: str | None, entries=()) -> dict:
            lp = _logprobs(entries, chat) if logprobs and entries else None
            if chat:
                return protocol.chat_chunk(rid, model_id, t, {"content": text} if text else {}, reason, lp)
            return protocol.completion_chunk(rid, model_id, t, text, reason, lp)

        try:
            if chat:
                yield _event(protocol.chat_chunk(rid, model_id, t, {"role": "assistant", "content": ""}, None))
            while True:
                left = _left(deadline)
                try:
                    if left is not None and left <= 0:
                        raise asyncio.TimeoutError
                    event = await sub.next(left)
                except asyncio.TimeoutError:
                    yield _event(_timed_out().body())
                    yield "data: [DONE]\n\n"
                    return
                if isinstance(event, Delta):
                    text = event.text if calls is None else calls.feed(event.text)
                    if text or event.logprobs or calls is None:
                        yield _event(chunk(text, None, event.logprobs))
                elif isinstance(event, Finished):
                    reason = event.finish_reason
                    if calls is not None:           # the held text: calls, or content after all
                        rest, found = calls.finish()
                        if rest:
                            yield _event(chunk(rest, None))
                        if found:
                            yield _event(protocol.chat_chunk(rid, model_id, t, protocol.tool_call_deltas(found), None))
                            reason = structured.calls_finish_reason(reason, calls.choice)
                    yield _event(chunk("", reason, event.logprobs))
                    if include_usage:
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        yield _event(protocol.usage_chunk(rid, model_id, t, obj, event.usage))
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(event, Failed):       # the error object, then the end as usual
                    yield _event(_api_error(event).body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            sub.close()          # a client that went away cancels its request here

    return app


class LoadingApp:
    """The ASGI app `engine serve` serves while the model loads: 503 "loading" on every
    path (/health: {"status": "loading"}), then, once `.app` is set, that app."""

    def __init__(self):
        self.app = None

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        body = {"status": "loading", **ApiError(503, "the model is loading; retry shortly", None, "loading").body()}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


def _full(e: QueueFull) -> ApiError:
    """The 503 of a request the scheduler cannot take (Retry-After when it is only full)."""
    return ApiError(503, str(e), None, e.code, {"Retry-After": str(RETRY_AFTER_S)} if e.code == "queue_full" else None)


def _check_room(scheduler) -> None:
    """503 at once when the scheduler takes no request now (before any rendering or tokenizing)."""
    try:
        scheduler.check_room()
    except QueueFull as e:
        raise _full(e) from None


class ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its body's generator however the stream ends.
    Starlette leaves it suspended when a send raises (RequestGuard's write timeout, a
    client that reads nothing): its cleanup, which cancels the request in the scheduler,
    would wait for the garbage collector while the request decodes on."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


async def _until_disconnected(receive) -> None:
    """Returns once the client has gone. One receive() waits at a time: Request.is_disconnected,
    polled, reads the socket on every call (up to 256 KiB), so bytes a client pipelines
    behind a request that is still being answered would pile up in memory unbounded."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _api_error(failed: Failed) -> ApiError:
    headers = {"Retry-After": str(failed.retry_after)} if failed.retry_after else None
    return ApiError(failed.status, failed.message, None, failed.code, headers)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _is_type_name(part: str) -> bool:
    """Pydantic's union branch labels in an error location ('str', 'list[int]', ...)."""
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part
