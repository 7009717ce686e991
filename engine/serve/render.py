"""Chat templates rendered with a deadline, in worker processes that can be killed.

A GGUF's chat template is a program (jinja2, sandboxed): nested loops can run for
ever, `'x' * 10**9` can take a gigabyte, and neither can be interrupted inside a
thread. So the server renders in a few small worker processes (`python -m
engine.serve.render`: jinja2 and the template, nothing else): each render has a
deadline, after which its worker is killed (and a fresh one started), the output
is cut off beyond `max_chars` characters, and a worker's address space is capped
(RLIMIT_AS), so a template that allocates without bound fails with MemoryError in
its worker. Every failure is an ApiError(400, code "template_error"); a render
that waited for a free worker past its deadline is a 503.

Frames on the worker's stdin/stdout: 4-byte big-endian length + JSON.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time

from .protocol import ApiError

WORKER_MEMORY = 512 << 20       # address space a worker may add to what it holds after start-up


class TemplateWorker:
    """One worker process (started on first use, again after it was killed)."""

    def __init__(self, setup: dict):
        self.setup = setup
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def ready(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.serve.render"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=root,
                                     start_new_session=True)       # a terminal's Ctrl-C is the server's
        _write(self.proc.stdin, self.setup)

    def render(self, request: dict, timeout: float) -> dict:
        """The worker's answer, or {"error": ..., "kind": "timeout"} after `timeout` seconds
        (the worker is killed then)."""
        with self.lock:
            self.ready()
            deadline = time.monotonic() + timeout
            try:
                _write(self.proc.stdin, request)
                answer = _read(self.proc.stdout, deadline)
            except (OSError, EOFError, ValueError):
                answer = None
            if answer is None:
                timed_out = time.monotonic() >= deadline
                self.kill()
                if timed_out:
                    return {"error": f"the chat template took longer than {timeout:g} s to render "
                                     f"(the server's --template-timeout)", "kind": "timeout"}
                return {"error": "the chat template's renderer died (out of memory?)", "kind": "crash"}
            return answer

    def kill(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self.proc = None


class TemplateRenderer:
    """`await render(messages)` -> the prompt text, or ApiError. `workers` renders run
    at once; each has `timeout` seconds (waiting for a free worker included)."""

    def __init__(self, template: str | None, bos_token: str, eos_token: str, max_chars: int,
                 timeout: float = 5.0, workers: int = 2):
        self.template, self.timeout, self.max_chars = template, timeout, max_chars
        setup = {"template": template, "max_chars": max_chars, "memory": WORKER_MEMORY}
        self._vars = {"bos_token": bos_token, "eos_token": eos_token}
        self._workers = [TemplateWorker(setup) for _ in range(workers)]
        self._free: list[TemplateWorker] = list(self._workers)
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="engine-template")
        self._available: asyncio.Semaphore | None = None

    async def render(self, messages: list[dict], add_generation_prompt: bool = True,
                     tools: list[dict] | None = None) -> str:
        """`tools`: the request's tools, the template's `tools` variable (absent when None)."""
        if not self.template:
            raise ApiError(400, "this model has no chat template (tokenizer.chat_template is missing): "
                                "use /v1/completions", "messages")
        if self._available is None:
            self._available = asyncio.Semaphore(len(self._workers))
        start = time.monotonic()
        try:
            await asyncio.wait_for(self._available.acquire(), self.timeout)
        except asyncio.TimeoutError:
            raise ApiError(503, f"every chat template renderer stayed busy for {self.timeout:g} s; retry later",
                           None, "template_busy", {"Retry-After": "1"}) from None
        worker = self._free.pop()
        try:
            left = max(self.timeout - (time.monotonic() - start), 0.05)
            request = {"messages": messages, "add_generation_prompt": add_generation_prompt, **self._vars,
                       **({"tools": tools} if tools is not None else {})}
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(self._executor, worker.render, request, left)
        finally:
            self._free.append(worker)
            self._available.release()
        if answer.get("kind") == "timeout":
            answer["error"] = (f"the chat template took longer than {self.timeout:g} s to render (the server's "
                               f"--template-timeout)")
        if "error" in answer:
            code = "context_length_exceeded" if answer.get("kind") == "size" else "template_error"
            raise ApiError(400, answer["error"], "messages", code)
        return answer["text"]

    def warm(self) -> None:
        """Start the workers now (in the background), so the first chat does not wait."""
        if self.template:
            for w in self._workers:
                self._executor.submit(w.ready)

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _write(f, obj) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    f.write(struct.pack(">I", len(data)) + data)
    f.flush()


def _read_exact(f, n: int, deadline: float | None) -> bytes | None:
    fd, out = f.fileno(), bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _read(f, deadline: float | None = None):
    head = _read_exact(f, 4, deadline)
    if head is None:
        return None
    body = _read_exact(f, struct.unpack(">I", head)[0], deadline)
    return None if body is None else json.loads(body)


# -- the worker process -------------------------------------------------------------------------
def _serve(stdin, stdout) -> None:
    import resource

    import jinja2

    from engine.errors import EngineError
    from engine.tokenizer import _compile_template

    setup = _read(stdin)
    template = None
    try:
        template = _compile_template(setup["template"])
        compile_error = None
    except EngineError as e:
        compile_error = str(e)
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = held + setup["memory"]
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ValueError, OSError):
        pass                                    # a lower hard limit is already in place
    max_chars = setup["max_chars"]
    while True:
        try:
            request = _read(stdin)
        except EOFError:
            return
        if compile_error is not None:
            _write(stdout, {"error": compile_error, "kind": "template"})
            continue
        parts, n = [], 0
        try:
            for piece in template.generate(**request):
                n += len(piece)
                if n > max_chars:
                    raise OverflowError
                parts.append(piece)
            answer = {"text": "".join(parts)}
        except OverflowError:
            answer = {"error": f"the chat template's output is longer than {max_chars} characters, more than "
                               f"the context can hold", "kind": "size"}
        except MemoryError:
            answer = {"error": "the chat template ran out of memory while rendering", "kind": "memory"}
        except RecursionError:
            answer = {"error": "chat template failed: too deeply nested (recursion)", "kind": "template"}
        except jinja2.TemplateError as e:
            answer = {"error": f"chat template failed: {e}", "kind": "template"}
        except Exception as e:                  # 1/0, a bad filter argument, ...
            answer = {"error": f"chat template failed: {type(e).__name__}: {e}", "kind": "template"}
        parts = None
        _write(stdout, answer)


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
