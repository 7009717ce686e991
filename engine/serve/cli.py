"""`engine serve [MODEL] --host --port --parallel --kv-pool-tokens --prompt-cache --max-queue`,
the engine's model and SnapKV flags, plus mlx-lm's spellings: `--kv-eviction none|snapkv`,
`--kv-sink-tokens`."""
from __future__ import annotations

import argparse
import os
import socket
import sys

from ..errors import DeviceFault, EngineError


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ..cli import _add_model_args, _add_snapkv_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port)")
    p.add_argument("--parallel", "-np", dest="parallel", type=int, default=4,
                   help="requests decoded together in one batch (default 4)")
    p.add_argument("--kv-pool-tokens", dest="kv_pool_tokens", type=int,
                   help="positions of KV pages shared by all requests (default: --parallel whole contexts); "
                        "a request waits until its prompt fits; when pages run short the newest running "
                        "request is preempted and resumes later")
    p.add_argument("--prompt-cache", dest="prompt_cache", type=int, default=4,
                   help="caches of the last N requests kept in the pool (an evicting one's whole prompt, "
                        "taken before compaction), so a request that extends one (the next chat turn) runs "
                        "only its new tokens (default 4; 0 = off)")
    p.add_argument("--max-queue", dest="max_queue", type=int, default=16,
                   help="requests that may wait behind the running ones; more get 503 (default 16)")
    p.add_argument("--model-id", dest="model_id", help="the id /v1/models lists (default: the file name)")
    p.add_argument("--api-key", dest="api_key", default=os.environ.get("SHARPI_API_KEY") or None,
                   help="requests must send 'Authorization: Bearer KEY' (default: $SHARPI_API_KEY; "
                        "unset: no key); /, /health and /metrics stay open")
    _add_snapkv_args(p)
    g = p.add_argument_group("mlx-lm spellings")
    g.add_argument("--kv-eviction", dest="kv_eviction", choices=("none", "snapkv"),
                   help="none = --kv-budget 0; snapkv = eviction on (budget from --kv-budget, else 2048)")
    g.add_argument("--kv-sink-tokens", dest="snapkv_sinks", help="the same as --kv-sinks")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    from ..cli import _settings
    from ..model import AUTO_BUDGET, Model
    from ..model_path import model_path_or_default

    if not 0 <= args.port <= 65535:
        raise EngineError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise EngineError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.parallel < 1:
        raise EngineError(f"--parallel must be >= 1, got {args.parallel}")
    if args.prompt_cache < 0:
        raise EngineError(f"--prompt-cache must be >= 0, got {args.prompt_cache}")
    if args.kv_pool_tokens is not None and args.kv_pool_tokens < 1:
        raise EngineError(f"--kv-pool-tokens must be >= 1, got {args.kv_pool_tokens}")
    if args.kv_eviction == "none" and args.snapkv_budget not in (None, "0"):
        raise EngineError("--kv-eviction none contradicts --kv-budget: pass one of them")
    settings = _settings(args)
    if args.kv_eviction == "none":
        settings = settings.with_overrides("flag", snapkv_budget=0)
    elif args.kv_eviction == "snapkv" and not settings.snapkv_budget:
        settings = settings.with_overrides("flag", snapkv_budget=AUTO_BUDGET)
    try:
        import uvicorn

        from . import build_app
    except ImportError as e:
        raise EngineError(f"engine serve needs fastapi and uvicorn ({e}): run `make setup`") from None
    sock = _listen(args.host, args.port)
    model = Model(model_path_or_default(args.model), settings)
    app = build_app(model, max_queue=args.max_queue, model_id=args.model_id, max_running=args.parallel,
                    pool_tokens=args.kv_pool_tokens, prompt_cache=args.prompt_cache, api_key=args.api_key)
    host, port = sock.getsockname()[:2]
    policy = model.snapkv.summary() if model.snapkv else "SnapKV off (per request: kv_budget)"
    sched = app.state.scheduler
    print(f"engine serve: {model.path} on {model.backend.name}, context {model.ctx}; {policy}; "
          f"{sched.max_running} requests in a batch, KV pool of {sched.pool_tokens} positions"
          f"{'; API key required' if args.api_key else ''}", file=sys.stderr)
    print(f"engine serve: listening on http://{_url_host(host)}:{port}/v1", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    sched.on_fault = lambda message: setattr(server, "should_exit", True)   # uvicorn's own shutdown
    server.run(sockets=[sock])
    if sched.fault is not None:                   # the device faulted: exit 1 with its message
        raise DeviceFault(sched.fault)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port fails at once, in one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise EngineError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise EngineError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
