"""`engine serve`: an OpenAI-compatible HTTP server over one model.

    protocol.py   the wire format: pydantic request bodies, response/chunk/error shapes
    jobs.py       a validated request -> Job (prompt ids, sampling, SnapKV policy)
    sequence.py   one request's generation as steps (prefill, then one token per step)
    scheduler.py  the worker thread: FIFO queue, admission by pages, preemption,
                  chunked prefill, batched decode, cancel
    app.py        FastAPI routes: JSON and server-sent events over the scheduler
    limits.py     body size and read deadlines, header deadline, connection cap, Host check
    render.py     chat templates rendered in killable worker processes, with a deadline
    metrics.py    /metrics through prometheus_client: latency histograms, counters, gauges
    cli.py        the `engine serve` sub-command: flags, loading, signals (graceful drain)

Python use (tests start it this way too):

    from engine.serve import build_app
    app = build_app(engine.load("x.gguf"), max_queue=4)     # an ASGI app for uvicorn
    server = serve_in_thread(app)                            # or served here: server.url, server.stop()
"""
from __future__ import annotations


def build_app(model, max_queue: int = 16, model_id: str | None = None, max_running: int = 4,
              pool_tokens: int | None = None, prompt_cache: int = 4, api_key=None, limits=None,
              allowed_hosts: set[str] | None = None, allowed_origins: list[str] | None = None):
    """A FastAPI app serving `model`; its scheduler (app.state.scheduler) starts now and
    stops with the app's lifespan. `max_running` requests decode together; their caches
    share a page pool of `pool_tokens` positions (default: max_running whole contexts);
    the caches of the last `prompt_cache` finished requests are kept for reuse. With
    `api_key` (one or several), requests need `Authorization: Bearer <key>` (app.create_app);
    `limits` (limits.Limits; default from the model's settings), `allowed_hosts` and
    `allowed_origins` as create_app. After a
    sticky device fault the scheduler runs nothing more (`scheduler.fault`, 503s) and calls
    `scheduler.on_fault(message)`, where `engine serve` shuts the server down."""
    from .app import create_app
    from .scheduler import Scheduler

    scheduler = Scheduler(model, max_queue=max_queue, max_running=max_running, pool_tokens=pool_tokens,
                          prompt_cache=prompt_cache)
    app = create_app(scheduler, model_id or default_model_id(model.path), api_key, limits, allowed_hosts,
                     allowed_origins)
    scheduler.start()
    return app


def default_model_id(path) -> str:
    """The id /v1/models lists: the GGUF file's name without `.gguf`."""
    import pathlib
    return pathlib.Path(str(path)).stem


class ServerThread:
    """An app served by uvicorn on a loopback port in a daemon thread (see serve_in_thread)."""

    def __init__(self, app, host: str = "127.0.0.1", timeout: float = 60.0):
        import socket
        import threading
        import time

        import uvicorn

        from .limits import Limits, uvicorn_config

        sock = socket.socket()
        sock.bind((host, 0))
        sock.listen(64)
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        limits = getattr(app.state, "limits", None) or Limits()
        self._server = uvicorn.Server(uvicorn_config(app, limits))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down (the app's lifespan stops its scheduler) and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout)


def serve_in_thread(app, host: str = "127.0.0.1") -> ServerThread:
    """Serve `app` on a free port of `host` from a background thread; `.url` is
    "http://host:port" once it accepts connections, `.stop()` shuts it down."""
    return ServerThread(app, host)
