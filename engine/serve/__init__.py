"""`engine serve`: an OpenAI-compatible HTTP server over one model.

    protocol.py   the wire format: pydantic request bodies, response/chunk/error shapes
    jobs.py       a validated request -> Job (prompt ids, sampling, SnapKV policy)
    sequence.py   one request's generation as steps (prefill, then one token per step)
    scheduler.py  the worker thread: FIFO queue, admission by pages, chunked prefill,
                  batched decode, cancel
    app.py        FastAPI routes: JSON and server-sent events over the scheduler
    cli.py        the `engine serve` sub-command

Python use (tests start it this way too):

    from engine.serve import build_app
    app = build_app(engine.load("x.gguf"), max_queue=4)     # an ASGI app for uvicorn
"""
from __future__ import annotations


def build_app(model, max_queue: int = 16, model_id: str | None = None, max_running: int = 4,
              pool_tokens: int | None = None, prompt_cache: int = 4):
    """A FastAPI app serving `model`; its scheduler (app.state.scheduler) starts now and
    stops with the app's lifespan. `max_running` requests decode together; their caches
    share a page pool of `pool_tokens` positions (default: max_running whole contexts);
    the caches of the last `prompt_cache` finished requests are kept for reuse."""
    from .app import create_app
    from .scheduler import Scheduler

    scheduler = Scheduler(model, max_queue=max_queue, max_running=max_running, pool_tokens=pool_tokens,
                          prompt_cache=prompt_cache)
    app = create_app(scheduler, model_id or default_model_id(model.path))
    scheduler.start()
    return app


def default_model_id(path) -> str:
    """The id /v1/models lists: the GGUF file's name without `.gguf`."""
    import pathlib
    return pathlib.Path(str(path)).stem
