"""What one request or one client may hold, enforced before the app allocates for it.

    Limits           the server's limits (from the settings, engine/config.py `serve_*`)
    RequestGuard     ASGI middleware, outermost: the Host allow-list; a response write that
                     waits past write_timeout for a client that does not read ends the
                     request (its stream's cleanup cancels it)
    BodyGuard        ASGI middleware, innermost (behind the API key's check, so a client
                     without the key never holds a body buffer): the body read here, at
                     most max_body_bytes (413, by Content-Length before reading when it is
                     sent), the whole of it within body_timeout (408), then replayed to the app
    GuardedH11       uvicorn's h11 protocol with a header deadline (a connection that has not
                     sent its request headers within header_timeout is closed) and a
                     connection cap (over max_connections, the connection waiting longest
                     for its headers or still sending its body is closed)
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import Settings
from .protocol import error

log = logging.getLogger("engine.serve")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request or client may hold; the defaults are engine/config.py's (Settings)."""
    max_body_bytes: int = int(Settings.serve_max_body_mb * (1 << 20))
    max_stop: int = Settings.serve_max_stop
    max_stop_chars: int = Settings.serve_max_stop_chars
    template_timeout: float = Settings.serve_template_timeout
    header_timeout: float = Settings.serve_header_timeout
    body_timeout: float = Settings.serve_body_timeout
    write_timeout: float = Settings.serve_write_timeout
    max_connections: int = Settings.serve_max_connections
    request_timeout: float = Settings.serve_request_timeout          # 0: none
    shutdown_timeout: float = Settings.serve_shutdown_timeout
    content_specials: str = Settings.serve_content_specials          # "text" | "parse"

    @classmethod
    def from_settings(cls, s) -> "Limits":
        return cls(max_body_bytes=int(s.serve_max_body_mb * (1 << 20)), max_stop=s.serve_max_stop,
                   max_stop_chars=s.serve_max_stop_chars, template_timeout=s.serve_template_timeout,
                   header_timeout=s.serve_header_timeout, body_timeout=s.serve_body_timeout,
                   write_timeout=s.serve_write_timeout,
                   max_connections=s.serve_max_connections, request_timeout=s.serve_request_timeout,
                   shutdown_timeout=s.serve_shutdown_timeout, content_specials=s.serve_content_specials)


async def _answer(send, status: int, message: str, code: str, headers=()) -> None:
    body = json.dumps(error(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class _ClientStalled(Exception):
    """A response write waited past write_timeout: the client does not read."""


class RequestGuard:
    """ASGI middleware in front of the app (see the module's docstring). `allowed_hosts`:
    Host header names accepted (None: any), against DNS rebinding of a keyless server."""

    def __init__(self, app, limits: Limits, allowed_hosts: set[str] | None = None):
        self.app, self.limits, self.allowed_hosts = app, limits, allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        timeout = self.limits.write_timeout

        async def timed_send(message):
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise _ClientStalled from None
        try:
            return await self._guarded(scope, receive, timed_send)
        except _ClientStalled:      # the app's cleanup ran (a stream's request is cancelled); uvicorn closes
            log.warning("engine serve: a client read nothing for %g s (--write-timeout): its request ended",
                        timeout)

    async def _guarded(self, scope, receive, send):
        headers = dict(scope["headers"])
        if self.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.strip("[]").lower() not in self.allowed_hosts:
                return await _answer(send, 421, f"Host {host!r} is not served here (a server without an API key "
                                                "answers only its own names: --allowed-hosts)", "host_not_allowed")
        return await self.app(scope, receive, send)


class BodyGuard:
    """ASGI middleware in front of the app's routes (see the module's docstring)."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        limit = self.limits.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _answer(send, 413, f"the request body is larger than the server's limit of "
                                            f"{limit} bytes (--max-body-mb)", "body_too_large")
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout   # for the whole body
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                return await _answer(send, 408, f"the request body did not arrive within "
                                                f"{self.limits.body_timeout:g} s (--body-timeout)", "body_timeout")
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > limit:
                return await _answer(send, 413, f"the request body is larger than the server's limit of "
                                                f"{limit} bytes (--max-body-mb)", "body_too_large")
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False
        chunks = None

        async def replay():
            nonlocal replayed, body
            if not replayed:
                replayed = True
                data, body = body, b""
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


# what a connection past the cap gets when no other can give way (before it is closed)
_FULL_BODY = json.dumps(error("the server is answering as many connections as it holds (--max-connections); "
                              "retry shortly", "invalid_request_error", None, "too_many_connections")).encode()
FULL_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
               b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_FULL_BODY), _FULL_BODY))


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, plus: request headers must arrive within `header_timeout`
    of the connection's start (or of the previous response), and at most `max_connections`
    connections are held: over the cap, the connection that has waited longest for its
    request headers, or the one whose body has been arriving longest, is closed to make
    room (so idle, half-open or slowly sending sockets cannot lock clients out); only when
    every connection has its request and is being answered is the new one refused. The
    values come from the Config (`config.header_timeout`, `config.max_connections`, set
    by `uvicorn_config`)."""

    def __init__(self, config, *args, **kw):
        super().__init__(config, *args, **kw)
        self._header_timeout = getattr(config, "header_timeout", None)
        self._max_connections = getattr(config, "max_connections", None)
        self._header_task = None
        self._waiting_since: float | None = None     # loop time since when no request headers came
        self._request_since: float | None = None     # loop time the current request's headers came

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self._max_connections is not None and len(self.connections) > self._max_connections:
            # a closed connection stays in `connections` until its connection_lost runs
            live = [c for c in self.connections if c.transport is not None and not c.transport.is_closing()]
            if len(live) > self._max_connections:
                waiting = [(since, c) for c in live if c is not self and (since := c._idle_since()) is not None]
                if not waiting:              # every one is being answered: say so, then close
                    transport.write(FULL_ANSWER)
                    transport.close()
                    return
                oldest = min(waiting, key=lambda w: w[0])[1]
                oldest._disarm()
                oldest.transport.close()
        self._arm()

    def _idle_since(self) -> float | None:
        """Since when this connection has held its place without a request to answer:
        waiting for headers, or still sending its body (None: being answered)."""
        if self._waiting_since is not None:
            return self._waiting_since
        if self._request_since is not None and self.conn.their_state is h11.SEND_BODY:
            return self._request_since
        return None

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since = self.loop.time()
        if self._header_timeout:
            self._header_task = self.loop.call_later(self._header_timeout, self._too_slow)

    def _disarm(self) -> None:
        self._waiting_since = None
        if self._header_task is not None:
            self._header_task.cancel()
            self._header_task = None

    def _too_slow(self) -> None:
        self._header_task = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self.cycle is not None:
            self._disarm()                       # a request's headers have arrived
            self._request_since = self.loop.time()

    def on_response_complete(self) -> None:
        super().on_response_complete()          # may start a pipelined request's cycle at once
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(app, limits: Limits, **kw):
    """A uvicorn.Config serving `app` with GuardedH11 and these limits."""
    import uvicorn

    config = uvicorn.Config(app, http=GuardedH11, log_level=kw.pop("log_level", "warning"),
                            h11_max_incomplete_event_size=64 << 10, **kw)
    config.header_timeout = limits.header_timeout
    config.max_connections = limits.max_connections
    return config
