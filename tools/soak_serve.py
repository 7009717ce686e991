"""Soak `engine serve` under a memory cap with hostile clients (issue 36's acceptance:
"Under a 2 GiB memory cap the server survives a 200 MB body, a 1M-entry stop list, 40
hostile templates and 1000 half-open connections, answering others within 2x their
unloaded latency").

    .venv/bin/python tools/soak_serve.py [--model smollm2] [--cap-gib 2] [--cap-kind as|data]
        [--body-mb 200] [--stops 1000000] [--templates 40] [--half-open 1000]
        [--probes 20] [--hold 12] [--json FILE] [-- extra `engine serve` flags]

What it does, all on loopback, every wait bounded:

1. Copies the model's GGUF to a temporary file whose `tokenizer.chat_template` is a
   nested loop that never ends (the header rewritten, tensor data copied as is), and
   starts the real `python -m engine.cli serve COPY --port 0` on it, in a subprocess
   under the cap: RLIMIT_AS (`--cap-kind as`, the default: virtual memory, what the
   idle smollm2 server's ~1.6 GB of address space fits under 2 GiB) or RLIMIT_DATA
   (`--cap-kind data`: private writable memory, for models whose mappings are larger).
   Its render workers inherit the cap (and lower it themselves).
2. Unloaded latency: the median of --probes short completions (prompt "Hello",
   4 greedy tokens), one new connection each, after two warm-up requests.
3. At once: --half-open sockets that send a partial request header and idle; a
   --body-mb body sent in 64 KiB pieces with chunked transfer encoding (no length:
   the server must count) and one that declares its Content-Length; a completion with
   --stops stop strings (a 1-character string each, so the body stays under the body
   limit and is parsed); --templates chat requests over the looping template; and a
   probe sending the short completion back to back until the phase ends (when every
   attack has its answer and at least --hold seconds have passed; at most
   --phase-timeout).
4. Checks: the server is alive and /health answers 200 afterwards; each body got 413
   within --quick-s; the stop list 400 or 413; each hostile chat 400 (template_error)
   or 503 (template_busy: every renderer busy with an earlier looping render); the
   server closed every half-open connection; every probe got 200 and their median is
   at most 2x the unloaded median; peak memory (VmHWM of the server, and server plus
   render workers sampled every 0.1 s) under the cap; no traceback in its log.

Prints a table and exits 1 when a check fails (2: the server did not start).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOOPING_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
PROBE = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


# -- the model copy with a hostile chat template ----------------------------------------------------
def with_template(src: Path, dst: Path, template: str) -> Path:
    """`src` rewritten to `dst` with `tokenizer.chat_template` = template: the metadata
    field replaced, the header re-padded to the alignment, tensor data copied byte for
    byte (tensor offsets are relative to the data section, so they stay valid)."""
    import struct

    from gguf import GGUFReader

    r = GGUFReader(str(src))
    field = r.fields.get("tokenizer.chat_template")
    align = int(r.fields["general.alignment"].parts[-1][0]) if "general.alignment" in r.fields else 32
    key = b"tokenizer.chat_template"
    value = template.encode()
    new_field = struct.pack("<Q", len(key)) + key + struct.pack("<I", 8) + struct.pack("<Q", len(value)) + value
    header_end = max(t.field.offset + sum(p.nbytes for p in t.field.parts) for t in r.tensors)
    with open(src, "rb") as f:
        header = f.read(header_end)
        if field is not None:
            start, size = field.offset, sum(p.nbytes for p in field.parts)
            header = header[:start] + new_field + header[start + size:]
        else:                                   # append one more key: the count is at bytes 16..24
            n_kv = struct.unpack_from("<Q", header, 16)[0]
            kv_end = min(t.field.offset for t in r.tensors)
            header = header[:16] + struct.pack("<Q", n_kv + 1) + header[24:kv_end] + new_field + header[kv_end:]
        header += b"\0" * (-len(header) % align)
        with open(dst, "wb") as out:
            out.write(header)
            f.seek(r.data_offset)
            shutil.copyfileobj(f, out, 16 << 20)
    return dst


# -- the server ------------------------------------------------------------------------------------
class Server:
    def __init__(self, model: Path, cap_bytes: int, cap_kind: str, flags: list[str], log: Path):
        limit = resource.RLIMIT_AS if cap_kind == "as" else resource.RLIMIT_DATA

        def cap():                              # in the child, before exec: no thread of ours runs yet
            resource.setrlimit(limit, (cap_bytes, cap_bytes))

        self.log = log
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", str(model), "--host",
                                          "127.0.0.1", "--port", "0", *flags], stdout=subprocess.DEVNULL,
                                         stderr=err, env=env, cwd=ROOT, preexec_fn=cap)
        self.url = None

    def wait_ready(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in self.log.read_text(errors="replace").splitlines():
                if "listening on " in line:
                    self.url = line.split("listening on ", 1)[1].strip().removesuffix("/v1")
                    return self.url
            time.sleep(0.1)
        return None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def _status(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmPeak", "VmSize", "VmHWM", "VmRSS", "VmData")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except OSError:
        pass
    return kids


class MemorySampler(threading.Thread):
    """Every 0.1 s: the server's status and its children's RSS; keeps the peaks."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.done = pid, threading.Event()
        self.peak = {"VmHWM": 0, "VmPeak": 0, "VmData": 0, "total_rss": 0, "workers_rss": 0}

    def sample(self) -> None:
        s = _status(self.pid)
        if not s:
            return
        workers = sum(_status(k).get("VmRSS", 0) for k in _children(self.pid))
        for k in ("VmHWM", "VmPeak", "VmData"):
            self.peak[k] = max(self.peak[k], s.get(k, 0))
        self.peak["workers_rss"] = max(self.peak["workers_rss"], workers)
        self.peak["total_rss"] = max(self.peak["total_rss"], s.get("VmRSS", 0) + workers)

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.sample()


# -- clients ---------------------------------------------------------------------------------------
def request(url: str, path: str, body, timeout: float = 60.0, method: str = "POST"):
    """(status or None, parsed JSON or text or the exception's text, seconds): a new connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        status, text = r.status, r.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return None, f"{type(e).__name__}: {e}", time.perf_counter() - t0
    finally:
        conn.close()
    took = time.perf_counter() - t0
    try:
        return status, json.loads(text), took
    except ValueError:
        return status, text, took


def _code(answer) -> str | None:
    return answer.get("error", {}).get("code") if isinstance(answer, dict) else None


def big_body(url: str, mb: float, chunked: bool, timeout: float) -> dict:
    """POST /v1/completions with an `mb` MB body of spaces in 64 KiB pieces, reading the
    answer as soon as one arrives; how far it got and what came back."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    total, piece = int(mb * 1e6), b" " * (64 << 10)
    t0 = time.perf_counter()
    sent, status, code, err = 0, None, None, None
    s = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {total}\r\n\r\n"
        s.sendall(head.encode())
        sel = selectors.DefaultSelector()
        sel.register(s, selectors.EVENT_READ)
        while sent < total and time.perf_counter() - t0 < timeout:
            if sel.select(0):
                break                            # an answer (or the close) before the body ended
            n = min(len(piece), total - sent)
            data = piece[:n]
            try:
                s.sendall(b"%x\r\n" % n + data + b"\r\n" if chunked else data)
            except OSError as e:                 # the server closed: its answer may still be readable
                err = type(e).__name__
                break
            sent += n
        else:
            if chunked and sent >= total:
                s.sendall(b"0\r\n\r\n")
        s.settimeout(max(1.0, timeout - (time.perf_counter() - t0)))
        raw = b""
        try:
            while b"\r\n\r\n" not in raw or len(raw) < raw.find(b"\r\n\r\n") + 4 + _length(raw):
                chunk = s.recv(65536)
                if not chunk:
                    break
                raw += chunk
        except OSError as e:
            err = err or type(e).__name__
        if raw.startswith(b"HTTP/1.1 "):
            status = int(raw[9:12])
            try:
                code = _code(json.loads(raw.split(b"\r\n\r\n", 1)[1]))
            except ValueError:
                pass
    finally:
        s.close()
    return {"status": status, "code": code, "seconds": time.perf_counter() - t0, "sent_mb": sent / 1e6,
            "error": err}


def _length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


class HalfOpen(threading.Thread):
    """`n` connections that send part of a request header and idle; notes when the server
    closes each (an EOF or reset), holds the rest until `stop` is set."""

    def __init__(self, url: str, n: int):
        super().__init__(daemon=True)
        self.url, self.n, self.stop = url, n, threading.Event()
        self.opened = self.failed = 0
        self.closed_at: list[float] = []         # seconds after its own connect
        self.opened_all = threading.Event()

    def run(self) -> None:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        sel = selectors.DefaultSelector()
        socks = []
        try:
            for _ in range(self.n):
                try:
                    s = socket.create_connection((host, int(port)), timeout=5)
                    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
                    s.setblocking(False)
                except OSError:
                    self.failed += 1
                    continue
                socks.append(s)
                sel.register(s, selectors.EVENT_READ, time.monotonic())
                self.opened += 1
            self.opened_all.set()
            while not self.stop.is_set() and len(self.closed_at) < self.opened:
                for key, _ in sel.select(0.2):
                    try:
                        data = key.fileobj.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:                 # closed by the server (a 4xx answer would be data)
                        self.closed_at.append(time.monotonic() - key.data)
                        sel.unregister(key.fileobj)
        finally:
            self.opened_all.set()
            for s in socks:
                s.close()
            sel.close()


class Probe(threading.Thread):
    """The short completion, back to back, until `stop`: (status, seconds) each."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.results = url, threading.Event(), []

    def run(self) -> None:
        while not self.stop.is_set():
            status, answer, took = request(self.url, "/v1/completions", PROBE, timeout=60)
            self.results.append((status, took, answer if status != 200 else None))
            if status != 200:
                self.stop.wait(0.05)             # refused: do not spin


def stop_list(url: str, n: int) -> dict:
    body = json.dumps({**PROBE, "stop": [chr(97 + i % 26) for i in range(n)]}).encode()
    status, answer, took = request(url, "/v1/completions", body, timeout=60)
    return {"status": status, "code": _code(answer), "seconds": took, "body_mb": len(body) / 1e6,
            "param": answer.get("error", {}).get("param") if isinstance(answer, dict) else None}


def hostile_chats(url: str, n: int) -> list[dict]:
    out = [None] * n

    def one(i):
        status, answer, took = request(url, "/v1/chat/completions", CHAT, timeout=60)
        out[i] = {"status": status, "code": _code(answer), "seconds": took}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return [o or {"status": None, "code": "no answer within 90 s", "seconds": None} for o in out]


# -- the run ---------------------------------------------------------------------------------------
def run(args) -> dict:
    from engine.model_path import model_path_or_default

    need = args.half_open + args.templates + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    cap = int(args.cap_gib * (1 << 30))
    tmp = Path(tempfile.mkdtemp(prefix="soak_serve-"))
    result = {"model": None, "cap_bytes": cap, "cap_kind": args.cap_kind, "checks": {}}
    server = None
    try:
        src = Path(model_path_or_default(args.model))
        result["model"] = str(src)
        model = with_template(src, tmp / src.name, LOOPING_TEMPLATE)
        server = Server(model, cap, args.cap_kind, args.serve_flags, tmp / "serve.log")
        t_start = time.monotonic()
        url = server.wait_ready(args.start_timeout)
        if url is None:
            result["error"] = "the server did not start: " + server.log.read_text(errors="replace")[-2000:]
            return result
        result["start_s"] = time.monotonic() - t_start
        mem = MemorySampler(server.proc.pid)
        mem.start()
        for _ in range(2):                       # warm-up
            request(url, "/v1/completions", PROBE)
        result["idle"] = _status(server.proc.pid)
        unloaded = [request(url, "/v1/completions", PROBE)[2] for _ in range(args.probes)]
        result["unloaded_median_s"] = statistics.median(unloaded)

        # the attack
        half = HalfOpen(url, args.half_open)
        probe = Probe(url)
        answers: dict = {}
        jobs = {}                                # an attack with a count of 0 is left out
        if args.body_mb:
            jobs["body_chunked"] = lambda: big_body(url, args.body_mb, True, args.quick_s * 4)
            jobs["body_length"] = lambda: big_body(url, args.body_mb, False, args.quick_s * 4)
        if args.stops:
            jobs["stops"] = lambda: stop_list(url, args.stops)
        if args.templates:
            jobs["templates"] = lambda: hostile_chats(url, args.templates)
        workers = [threading.Thread(target=lambda k=k, f=f: answers.__setitem__(k, f()), daemon=True)
                   for k, f in jobs.items()]
        t0 = time.monotonic()
        half.start()
        half.opened_all.wait(30)
        probe.start()
        for w in workers:
            w.start()
        deadline = t0 + args.phase_timeout
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        while time.monotonic() < min(t0 + args.hold, deadline):
            time.sleep(0.1)
        result["phase_s"] = time.monotonic() - t0
        probe.stop.set()
        probe.join(65)
        while half.is_alive() and len(half.closed_at) < half.opened and time.monotonic() < deadline:
            time.sleep(0.1)
        half.stop.set()
        half.join(10)
        result["after"] = [request(url, "/v1/completions", PROBE)[2] for _ in range(5)]
        health = request(url, "/health", None, method="GET", timeout=10)
        mem.sample()
        mem.done.set()
        alive = server.proc.poll() is None
        final = _status(server.proc.pid)
        result["final"] = final
        result["mem_peak"] = dict(mem.peak, VmHWM=max(mem.peak["VmHWM"], final.get("VmHWM", 0)))

        # the checks
        checks = result["checks"]
        checks["server alive, /health 200 after"] = (alive and health[0] == 200,
                                                     f"alive={alive}, /health {health[0]}")
        for k in ("body_chunked", "body_length") if args.body_mb else ():
            b = answers.get(k) or {}
            checks[f"{args.body_mb:g} MB body ({k.split('_')[1]}): 413 quickly"] = (
                b.get("status") == 413 and b.get("seconds", 1e9) <= args.quick_s,
                f"{b.get('status')} {b.get('code')} in {b.get('seconds', 0):.2f} s after {b.get('sent_mb', 0):.1f} MB"
                + (f" ({b['error']})" if b.get("error") else ""))
        s = answers.get("stops") or {}
        if args.stops:
            checks[f"{args.stops:,} stop strings: 400/413"] = (
                s.get("status") in (400, 413), f"{s.get('status')} {s.get('code') or ''} param={s.get('param')} "
                                               f"({s.get('body_mb', 0):.1f} MB body) in {s.get('seconds', 0):.2f} s")
        t = answers.get("templates") or []
        counts: dict = {}
        for a in t:
            key = f"{a['status']} {a['code']}"
            counts[key] = counts.get(key, 0) + 1
        ok_t = len(t) == args.templates and all((a["status"], a["code"]) in ((400, "template_error"),
                                                                             (503, "template_busy")) for a in t)
        slowest = max((a["seconds"] or 1e9 for a in t), default=0)
        if args.templates:
            checks[f"{args.templates} looping templates: 400 or 503 busy"] = (
                ok_t, ", ".join(f"{v} x {k}" for k, v in sorted(counts.items())) + f"; slowest {slowest:.1f} s")
        closed = sorted(half.closed_at)
        if args.half_open:
            checks[f"{args.half_open} half-open connections: closed by the server"] = (
                half.opened == args.half_open and len(closed) == half.opened,
                f"opened {half.opened} (failed {half.failed}), closed {len(closed)}"
                + (f": {sum(c < 1 for c in closed)} within 1 s (over the cap), last after {closed[-1]:.1f} s"
                   if closed else ""))
        loaded = [took for status, took, _ in probe.results if status == 200]
        bad = [(status, a) for status, _, a in probe.results if status != 200]
        result["probe"] = {"n": len(probe.results), "failed": len(bad), "median_s": statistics.median(loaded) if loaded else None,
                           "max_s": max(loaded, default=None), "failures": [str(b)[:200] for b in bad[:5]]}
        med = result["probe"]["median_s"]
        ratio = med / result["unloaded_median_s"] if med else None
        result["ratio"] = ratio
        checks["probe under load: all 200, median <= 2x unloaded"] = (
            not bad and bool(loaded) and ratio is not None and ratio <= 2.0,
            f"{len(probe.results)} probes, {len(bad)} failed; median of the 200s {_ms(med)} vs unloaded {_ms(result['unloaded_median_s'])}"
            f" = {ratio:.2f}x; max {_ms(result['probe']['max_s'])}" if ratio is not None else f"{len(bad)} failed")
        peak = result["mem_peak"]
        checks[f"memory under the {args.cap_gib:g} GiB cap"] = (
            peak["VmHWM"] < cap and peak["total_rss"] < cap,
            f"server VmHWM {_mib(peak['VmHWM'])}, +workers RSS {_mib(peak['total_rss'])}, "
            f"VmPeak {_mib(peak['VmPeak'])}, VmData {_mib(peak['VmData'])}")
        log = server.log.read_text(errors="replace")
        bad_lines = [line for line in log.splitlines() if "Traceback" in line or "MemoryError" in line]
        checks["no traceback or MemoryError in the server's log"] = (not bad_lines, f"{len(bad_lines)} lines")
        result["answers"] = {k: v for k, v in answers.items() if k != "templates"}
        result["template_answers"] = counts
        return result
    finally:
        if server is not None:
            result["exit_status"] = server.stop()
            result["log_tail"] = server.log.read_text(errors="replace")[-3000:]
        shutil.rmtree(tmp, ignore_errors=True)


def _ms(s):
    return "-" if s is None else f"{s * 1000:.0f} ms"


def _mib(b):
    return f"{b / (1 << 20):.0f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model name or GGUF path (default smollm2)")
    p.add_argument("--cap-gib", type=float, default=2.0, help="the memory cap in GiB (default 2)")
    p.add_argument("--cap-kind", choices=("as", "data"), default="as",
                   help="as = RLIMIT_AS (address space, default); data = RLIMIT_DATA (private writable memory)")
    p.add_argument("--body-mb", type=float, default=200.0)
    p.add_argument("--stops", type=int, default=1_000_000)
    p.add_argument("--templates", type=int, default=40)
    p.add_argument("--half-open", dest="half_open", type=int, default=1000)
    p.add_argument("--probes", type=int, default=20, help="requests in the unloaded median (default 20)")
    p.add_argument("--hold", type=float, default=12.0,
                   help="the attack phase lasts at least this long (default 12 s: past the 10 s header timeout)")
    p.add_argument("--phase-timeout", dest="phase_timeout", type=float, default=100.0)
    p.add_argument("--quick-s", dest="quick_s", type=float, default=5.0, help="a 413 within this (default 5 s)")
    p.add_argument("--start-timeout", dest="start_timeout", type=float, default=120.0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("serve_flags", nargs="*", help="after --: more `engine serve` flags")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    result = run(args)
    result["total_s"] = time.monotonic() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if "error" in result:
        print(f"soak_serve: {result['error']}", file=sys.stderr)
        return 2
    idle = result.get("idle", {})
    print(f"soak_serve: {result['model']}, cap {args.cap_gib:g} GiB ({'RLIMIT_AS' if args.cap_kind == 'as' else 'RLIMIT_DATA'}); "
          f"server idle VmSize {_mib(idle.get('VmSize', 0))}, VmPeak {_mib(idle.get('VmPeak', 0))}, "
          f"VmRSS {_mib(idle.get('VmRSS', 0))}; attack phase {result.get('phase_s', 0):.1f} s, whole run "
          f"{result['total_s']:.0f} s")
    rows = [(("PASS" if ok else "FAIL"), name, detail) for name, (ok, detail) in result["checks"].items()]
    w = max(len(r[1]) for r in rows)
    print(f"{'':4}  {'check':{w}}  measured")
    for ok, name, detail in rows:
        print(f"{ok:4}  {name:{w}}  {detail}")
    failed = [name for name, (ok, _) in result["checks"].items() if not ok]
    if failed:
        print(f"soak_serve: {len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
