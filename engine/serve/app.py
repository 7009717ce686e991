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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import jobs, protocol
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .scheduler import QueueFull, Scheduler
from .sequence import Delta, Failed, Finished

DISCONNECT_POLL_S = 0.25     # how often a waiting non-streaming request checks its client
CHAT_PAGE = pathlib.Path(__file__).parent / "static" / "chat.html"     # GET /: the chat page
OPEN_PATHS = ("/", "/health", "/metrics")   # served without the API key (as vLLM does)


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
            raise ApiError(503, str(e), None, e.code) from None

    async def next(self, timeout: float | None = None):
        return await asyncio.wait_for(self.queue.get(), timeout)

    def close(self) -> None:
        self.scheduler.cancel(self.handle)


def served_names(model_path: str, name: str) -> set[str]:
    """Names a request's `model` may use: the served id, the file name, its stem, the path."""
    p = pathlib.Path(model_path)
    return {name, p.name, p.stem, str(p), model_path}


def create_app(scheduler: Scheduler, model_id: str, api_key: str | None = None) -> FastAPI:
    """The app over `scheduler`; with `api_key`, every route but OPEN_PATHS needs
    `Authorization: Bearer <api_key>` (401 otherwise)."""
    model = scheduler.model
    names = served_names(model.path, model_id)
    token_bytes = model.tokenizer.token_bytes
    created = protocol.now()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="snapkv-engine", description="OpenAI-compatible API with per-request SnapKV eviction",
                  lifespan=lifespan)
    app.state.scheduler = scheduler

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            given = request.headers.get("authorization", "").encode("utf-8", "replace")
            if request.url.path not in OPEN_PATHS and not hmac.compare_digest(given, expected):
                return JSONResponse(protocol.error("invalid or missing API key: send the header "
                                                   "'Authorization: Bearer <key>' with the server's --api-key",
                                                   "invalid_request_error", None, "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await call_next(request)

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
        """200 while serving; 503 with the reason once the device has faulted (the
        server is going down)."""
        if scheduler.fault is not None:
            return JSONResponse({"status": "error", **ApiError(503, scheduler.fault, None, "device_fault").body()},
                                status_code=503)
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
        """Prometheus' text format: request and token counters, queue and KV pool gauges."""
        return PlainTextResponse(protocol.metrics(scheduler.state()), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """Extension (vLLM's and llama.cpp's): text or a chat -> token ids."""
        _check_model(body.model)
        ids = await run_in_threadpool(jobs.tokenize, model, body)
        return {"tokens": ids, "count": len(ids), "max_model_len": model.ctx}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """Extension: token ids -> text (both vLLM's and llama.cpp's field names)."""
        _check_model(body.model)
        text = await run_in_threadpool(jobs.detokenize, model, body)
        return {"prompt": text, "content": text}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        job = await run_in_threadpool(jobs.completion_job, model, body)
        return await _respond(request, body, job, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model)
        job = await run_in_threadpool(jobs.chat_job, model, body)
        return await _respond(request, body, job, chat=True)

    def _check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {model_id!r}",
                           "model", "model_not_found")

    async def _respond(request: Request, body, job, chat: bool):
        sub = Submission(scheduler, job)
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(sub, rid, chat, include_usage, job.logprobs is not None),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, sub, rid, chat, job.logprobs is not None)

    def _logprobs(entries, chat: bool) -> dict:
        return (protocol.chat_logprobs if chat else protocol.completion_logprobs)(entries, token_bytes)

    async def _collect(request: Request, sub: Submission, rid: str, chat: bool, logprobs: bool):
        parts: list[str] = []
        entries: list = []
        try:
            while True:
                try:
                    event = await sub.next(DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)     # nobody is listening
                    continue
                if isinstance(event, Delta):
                    parts.append(event.text)
                    entries += event.logprobs
                elif isinstance(event, Finished):
                    make = protocol.chat_completion if chat else protocol.completion
                    lp = _logprobs(entries + list(event.logprobs), chat) if logprobs else None
                    return make(rid, model_id, protocol.now(), "".join(parts), event.finish_reason, event.usage, lp)
                elif isinstance(event, Failed):
                    raise _api_error(event)
        finally:
            sub.close()

    async def _sse(sub: Submission, rid: str, chat: bool, include_usage: bool, logprobs: bool):
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
                event = await sub.next()
                if isinstance(event, Delta):
                    yield _event(chunk(event.text, None, event.logprobs))
                elif isinstance(event, Finished):
                    yield _event(chunk("", event.finish_reason, event.logprobs))
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


def _api_error(failed: Failed) -> ApiError:
    headers = {"Retry-After": str(failed.retry_after)} if failed.retry_after else None
    return ApiError(failed.status, failed.message, None, failed.code, headers)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _is_type_name(part: str) -> bool:
    """Pydantic's union branch labels in an error location ('str', 'list[int]', ...)."""
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part
