"""`engine serve` when the device fails: out of memory fails the requests it hit
(503, Retry-After) and serving goes on; a sticky fault ends every request with the
fault, refuses new ones, turns /health to 503 and (the real command) exits 1.

The model runs on the CUDA backend over the CPU harness; cupy's own exception
classes are raised from below the backend's methods, so the translation
(backends/cuda/errors.py) and the server code run as they would on a GPU."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from waiting import wait_until

pytest.importorskip("uvicorn")
pytest.importorskip("cupy")

import engine  # noqa: E402
from engine.serve import build_app, serve_in_thread  # noqa: E402

from cupy.cuda.memory import OutOfMemoryError  # noqa: E402
from cupy_backends.cuda.api.runtime import CUDARuntimeError  # noqa: E402

WAIT_S = 20.0
MARK = 9                      # a prompt starting with this id runs out of memory in its prefill
BODY = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}




def post(url: str, body: dict):
    """(status, headers, JSON body) of POST /v1/completions."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def stream(url: str, body: dict) -> list:
    """The data of every server-sent event of a streamed completion (JSON, or "[DONE]")."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data = [line[len("data: "):] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def health(url: str):
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def harness_server(tiny_llama, monkeypatch, **kw):
    """(url, scheduler, model, gate): a server over the tiny model on the CUDA harness
    whose worker waits before every decode step until `gate` is set."""
    monkeypatch.setenv("SHARPI_CUDA_EXECUTOR", "cpu-harness")
    model = engine.load(tiny_llama, backend="cuda", snapkv_budget=0)
    gate, real = threading.Event(), model.forward.decode_batch

    def decode_batch(tokens, caches, **kw):
        gate.wait(WAIT_S)
        return real(tokens, caches, **kw)

    model.forward.decode_batch = decode_batch
    app = build_app(model, **kw)
    server = serve_in_thread(app)
    try:
        yield server.url, app.state.scheduler, model, gate
    finally:
        gate.set()
        server.stop()


def test_out_of_memory_fails_the_request_it_hit_and_serving_goes_on(tiny_llama, monkeypatch):
    from backends.cuda import quant
    real_embedding = quant.embedding

    def embedding(ex, table, ids, out, step=None):
        if len(ids) > 1 and ids[0] == MARK:
            raise OutOfMemoryError(96 * 2 ** 20, 700 * 2 ** 20, 0)
        return real_embedding(ex, table, ids, out, step)

    with harness_server(tiny_llama, monkeypatch, max_running=2, max_queue=2) as (url, sched, model, gate):
        freed = []
        monkeypatch.setattr(model.backend, "free_cached_memory", lambda: freed.append(1))
        monkeypatch.setattr(quant, "embedding", embedding)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(stream, url, BODY)               # decoding, held at its first step
            wait_until(lambda: any(r["state"] == "decode" for r in sched.state()["running"]), "A to decode")
            b = pool.submit(post, url, dict(BODY, prompt=[MARK, MARK, 10]))
            wait_until(lambda: sched.state()["waiting"] == 1, "B to queue")
            gate.set()
            status, headers, answer = b.result(WAIT_S)
            events = a.result(WAIT_S)
        assert status == 503 and headers["Retry-After"] == "1"
        err = answer["error"]
        assert err["code"] == "device_out_of_memory" and err["type"] == "server_overloaded"
        assert err["message"].startswith("the CUDA CPU harness ran out of memory in embedding (96 MiB requested, "
                                         "700 MiB already allocated by this process): lower --ctx")
        # A, running beside it, finished untouched
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert freed, "the device's cached memory was not given back"
        # a stream that runs out of memory: the error object, then [DONE]
        events = stream(url, dict(BODY, prompt=[MARK, 11, 12]))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "device_out_of_memory"
        # and the server goes on
        assert health(url) == (200, {"status": "ok"})
        status, _, answer = post(url, BODY)
        assert status == 200 and answer["choices"][0]["text"] == text
        s = sched.state()
        assert s["failed"] == 2 and s["completed"] == 2 and s["fault"] is None and s["kv_bytes_held"] == 0


def test_a_device_fault_ends_every_request_and_refuses_new_ones(tiny_llama, monkeypatch):
    with harness_server(tiny_llama, monkeypatch, max_running=1, max_queue=2) as (url, sched, model, gate):
        downloads, faults = [], []

        def to_host(arr):
            downloads.append(1)
            raise CUDARuntimeError(700)                  # sticky: reported at the next download

        sched.on_fault = faults.append
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(stream, url, BODY)           # running, held at its first decode step
            wait_until(lambda: any(r["state"] == "decode" for r in sched.state()["running"]), "A to decode")
            b = pool.submit(post, url, dict(BODY, prompt=[8, 9]))   # waiting: one runs at a time
            wait_until(lambda: sched.state()["waiting"] == 1, "B to queue")
            monkeypatch.setattr(model.backend.ex, "to_host", to_host)
            gate.set()
            events = a.result(WAIT_S)
            status, _, answer = b.result(WAIT_S)
        fault = ("the CUDA CPU harness faulted (cudaErrorIllegalAddress: an illegal memory access was encountered) "
                 "and its CUDA context is unusable: restart the process. Reported by download;")
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "device_fault"
        assert events[-2]["error"]["message"].startswith(fault)
        assert status == 503 and answer["error"]["code"] == "device_fault"
        assert answer["error"]["message"].startswith(fault)
        status, _, answer = post(url, BODY)              # refused: nothing runs on the device again
        assert status == 503 and answer["error"]["code"] == "device_fault"
        status, body = health(url)
        assert status == 503 and body["status"] == "error" and body["error"]["message"].startswith(fault)
        assert len(downloads) == 1 and len(faults) == 1 and faults[0].startswith(fault)
        s = sched.state()
        assert s["fault"] == faults[0] and s["failed"] == 2 and not s["running"] and s["waiting"] == 0


FAULTING_SERVE = """
import sys
from cupy_backends.cuda.api.runtime import CUDARuntimeError
from backends.cuda import runtime

def to_host(self, arr):
    raise CUDARuntimeError(719)

runtime.HarnessExecutor.to_host = to_host
from engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_serve_exits_1_after_a_device_fault(tiny_llama, tmp_path):
    """The real command: the faulted request's stream ends with the error and [DONE],
    then the server shuts down and exits 1 with the fault as its last line."""
    script = tmp_path / "faulting_engine.py"
    script.write_text(FAULTING_SERVE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log = tmp_path / "serve.log"
    env = dict(os.environ, SHARPI_CUDA_EXECUTOR="cpu-harness", PYTHONPATH=root)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(script), "serve", str(tiny_llama), "--backend", "cuda",
                                 "--port", "0"], stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=root)
    try:
        line = wait_until(lambda: next((l for l in log.read_text().splitlines() if "listening on" in l), None),
                          "engine serve to listen", timeout=60)
        url = line.split("listening on ", 1)[1].strip().removesuffix("/v1")
        events = stream(url, BODY)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "device_fault"
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    lines = log.read_text().splitlines()
    assert "Traceback" not in log.read_text()
    assert lines[-1].startswith("error: the CUDA CPU harness faulted (cudaErrorLaunchFailure: unspecified launch "
                                "failure) and its CUDA context is unusable: restart the process.")
