"""`engine serve [MODEL] --host --port --parallel --kv-pool-tokens --prompt-cache --max-queue`,
the engine's model and SnapKV flags, plus mlx-lm's spellings: `--kv-eviction none|snapkv`,
`--kv-sink-tokens`; the limits (engine/config.py `serve_*`), keys, Host and CORS lists, TLS.

The port is bound first; while the model loads every path answers 503 "loading". SIGTERM
or SIGINT drains: new requests get 503, running ones have --shutdown-timeout seconds to
finish, the rest end with an error event and [DONE] (the scheduler's own end, as after a
device fault), then the process exits 0; a second signal exits at once (status 1).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

from .. import config as config_mod
from ..errors import DeviceFault, EngineError

# engine/config.py settings that are flags of `engine serve`
SERVE_SETTINGS = ("serve_max_body_mb", "serve_max_stop", "serve_max_stop_chars", "serve_template_timeout",
                  "serve_header_timeout", "serve_body_timeout", "serve_write_timeout", "serve_max_connections", "serve_request_timeout",
                  "serve_shutdown_timeout", "serve_content_specials")
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


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
    p.add_argument("--api-key", dest="api_key", action="append",
                   help="requests must send 'Authorization: Bearer KEY' (repeat for several keys; default: "
                        "$SHARPI_API_KEY; unset: no key); /, /health and /metrics stay open")
    p.add_argument("--api-key-file", dest="api_key_file",
                   help="a file of API keys, one a line (blank lines and lines starting with # skipped)")
    p.add_argument("--allowed-hosts", dest="allowed_hosts",
                   help="comma-separated Host header names answered (others: 421); default for a loopback "
                        "server without a key: localhost, 127.0.0.1, ::1 (against DNS rebinding); '*' = any")
    p.add_argument("--allowed-origins", dest="allowed_origins",
                   help="comma-separated origins allowed by CORS ('*' = any); default: no CORS")
    p.add_argument("--ssl-keyfile", dest="ssl_keyfile", help="TLS private key (PEM), with --ssl-certfile")
    p.add_argument("--ssl-certfile", dest="ssl_certfile", help="TLS certificate chain (PEM), with --ssl-keyfile")
    lim = p.add_argument_group("limits (engine/config.py; each also an environment variable)")
    for field in SERVE_SETTINGS:
        spec = config_mod._BY_FIELD[field]
        lim.add_argument(spec.flag, dest=field, help=f"{spec.doc.removeprefix('engine serve: ')} "
                                                     f"(default {spec.default}; env {spec.env})")
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
    settings = settings.with_overrides("flag", **{f: getattr(args, f) for f in SERVE_SETTINGS})
    keys = _api_keys(args)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise EngineError("--ssl-keyfile and --ssl-certfile go together: pass both")
    if args.ssl_certfile:                      # read now: uvicorn would fail later with a traceback
        import ssl
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (OSError, ssl.SSLError) as e:
            raise EngineError(f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: "
                              f"{e.strerror or e}") from None
    allowed_hosts = _allowed_hosts(args, keys)
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    if args.kv_eviction == "none":
        settings = settings.with_overrides("flag", snapkv_budget=0)
    elif args.kv_eviction == "snapkv" and not settings.snapkv_budget:
        settings = settings.with_overrides("flag", snapkv_budget=AUTO_BUDGET)
    try:
        import uvicorn

        from . import build_app
    except ImportError as e:
        raise EngineError(f"engine serve needs fastapi and uvicorn ({e}): run `make setup`") from None
    from .app import LoadingApp
    from .limits import Limits, is_loopback, uvicorn_config

    limits = Limits.from_settings(settings)
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    scheme = "https" if args.ssl_certfile else "http"
    if not keys and not is_loopback(host):
        print(f"engine serve: WARNING: listening on {host} without an API key: anyone who can reach port {port} "
              f"can use this server; pass --api-key or --api-key-file", file=sys.stderr, flush=True)
    front = LoadingApp()
    config = uvicorn_config(front, limits, lifespan="off", timeout_graceful_shutdown=5,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    server = _Server(config, limits.shutdown_timeout)
    loaded: dict = {}

    def load() -> None:
        try:
            model = Model(model_path_or_default(args.model), settings)
            app = build_app(model, max_queue=args.max_queue, model_id=args.model_id, max_running=args.parallel,
                            pool_tokens=args.kv_pool_tokens, prompt_cache=args.prompt_cache, api_key=keys or None,
                            limits=limits, allowed_hosts=allowed_hosts, allowed_origins=origins)
        except BaseException as e:              # reported after the server has stopped
            loaded["error"] = e
            server.should_exit = True
            return
        sched = app.state.scheduler
        loaded["app"] = app
        sched.on_fault = lambda message: setattr(server, "should_exit", True)   # uvicorn's own shutdown
        sched.on_drained = lambda: setattr(server, "should_exit", True)
        server.scheduler = sched
        policy = model.snapkv.summary() if model.snapkv else "SnapKV off (per request: kv_budget)"
        print(f"engine serve: {model.path} on {model.backend.name}, context {model.ctx}; {policy}; "
              f"{sched.max_running} requests in a batch, KV pool of {sched.pool_tokens} positions"
              f"{'; API key required' if keys else ''}", file=sys.stderr)
        front.app = app
        print(f"engine serve: listening on {scheme}://{_url_host(host)}:{port}/v1", file=sys.stderr, flush=True)

    print(f"engine serve: loading the model; {scheme}://{_url_host(host)}:{port}/health answers 503 until it "
          f"is ready", file=sys.stderr, flush=True)
    threading.Thread(target=load, name="engine-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        app = loaded.get("app")
        if app is not None:
            app.state.scheduler.stop()
            app.state.renderer.close()
    if "error" in loaded:
        raise loaded["error"]
    sched = app.state.scheduler if app is not None else None
    if sched is not None and sched.fault is not None:     # the device faulted: exit 1 with its message
        raise DeviceFault(sched.fault)
    return 0


class _Server:
    """uvicorn.Server whose first SIGTERM/SIGINT drains the scheduler (the module's
    docstring) and whose second exits at once."""

    def __new__(cls, config, shutdown_timeout: float):
        import uvicorn

        class Server(uvicorn.Server):
            scheduler = None
            signalled = False

            def handle_exit(self, sig, frame):
                if self.signalled:
                    print("engine serve: second signal: exiting now", file=sys.stderr, flush=True)
                    os._exit(1)
                self.signalled = True
                if self.scheduler is None:       # still loading: nothing to drain
                    self.should_exit = True
                    return
                print(f"engine serve: {signal.Signals(sig).name}: draining (running requests have "
                      f"{shutdown_timeout:g} s; a second signal exits now)", file=sys.stderr, flush=True)
                self.scheduler.drain(shutdown_timeout)

        return Server(config)


def _api_keys(args) -> list[str]:
    """--api-key (several), --api-key-file, else $SHARPI_API_KEY; an empty key is an error."""
    keys = list(args.api_key or ())
    if any(k == "" or k.strip() != k for k in keys):
        raise EngineError("--api-key: a key must be non-empty, without leading or trailing spaces "
                          "(an empty key would turn authentication off)")
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError) as e:
            raise EngineError(f"--api-key-file {args.api_key_file}: {getattr(e, 'strerror', None) or e}") from None
        found = [line for line in lines if line and not line.startswith("#")]
        if not found:
            raise EngineError(f"--api-key-file {args.api_key_file} holds no key")
        keys += found
    if not keys:
        env = os.environ.get("SHARPI_API_KEY")
        if env is not None and env.strip():
            keys = [env.strip()]
    return keys


def _allowed_hosts(args, keys) -> set[str] | None:
    if args.allowed_hosts is not None:
        names = {h.strip().lower().strip("[]") for h in args.allowed_hosts.split(",") if h.strip()}
        if not names:
            raise EngineError(f"--allowed-hosts {args.allowed_hosts!r} names no host (every request would get 421): "
                              f"name them, or * for any")
        return None if "*" in names else names
    from .limits import is_loopback
    if not keys and is_loopback(args.host):    # a keyless loopback server: DNS rebinding
        return LOOPBACK_NAMES | {args.host.lower().strip("[]")}
    return None


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
