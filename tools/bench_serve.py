"""Serving benchmark: C concurrent clients stream completions through the official
openai client from `engine serve` (started here in-process on a loopback port, once
per --parallel value and KV budget) and, with --llama-cpp, from llama.cpp's own
server (`python -m llama_cpp.server`, llama-cpp-python[server], a subprocess on the
same model and threads). Reports aggregate generated tok/s, time to first token and
time per output token for every client count, all measured in one run.

    .venv/bin/python tools/bench_serve.py [--model smollm2] [--clients 1 2 4 8]
        [--parallel 4] [--prompt-tokens 2048] [--max-tokens 64] [--kv-budget 0 512]
        [--llama-cpp] [--threads N] [--json FILE] [--structured]

Every client sends a different prompt (the same text to both servers); the end of
text is suppressed (our `ignore_eos`, llama.cpp's logit bias) so every answer has
--max-tokens tokens; tok/s counts the text chunks the clients received (one per
token) and `pieces_min` in the JSON is the shortest answer. Not a test: numbers go
to stdout (and --json FILE).

--structured: the same clients twice per client count, free and constrained
(`response_format` json_schema: an array of at least 1024 short strings, so the
grammar never ends an answer before --max-tokens), and the ratio of their decode tok/s
(constrained / free; each stream's tokens after its first over the time since its
first, summed over the clients) and of their wall tok/s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from engine.bench import bench_prompt  # noqa: E402
from engine.serve import build_app, serve_in_thread  # noqa: E402


def one_client(url: str, prompt: str, max_tokens: int, extra: dict, out: list) -> None:
    import openai
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
    t0 = time.perf_counter()
    stamps = []
    stream = client.completions.create(model=None, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    out.append({"start": t0, "first": stamps[0] if stamps else None, "end": time.perf_counter(),
                "pieces": len(stamps)})


# --structured: long enough that no answer completes the grammar before --max-tokens
LONG_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 1024,
                                                           "items": {"type": "string", "maxLength": 16}}},
               "required": ["items"], "additionalProperties": False}
STRUCTURED = {"response_format": {"type": "json_schema", "json_schema": {"name": "items", "schema": LONG_SCHEMA,
                                                                         "strict": True}}}


class Prompts:
    """Prompt texts of prompt_tokens tokens of filler, each starting at a token no
    earlier prompt started at, so no server answers one from its prompt cache."""
    STARTS = 4096                       # distinct prompts one run can take

    def __init__(self, model, prompt_tokens: int):
        self.model, self.n, self.used = model, prompt_tokens, 0
        self.base = bench_prompt(model.tokenizer, prompt_tokens + self.STARTS)

    def take(self, clients: int) -> list[str]:
        first, self.used = self.used, self.used + clients
        if self.used > self.STARTS:
            raise RuntimeError("bench_serve: out of distinct prompts")
        return [self.model.tokenizer.decode(self.base[i:i + self.n]) for i in range(first, first + clients)]


def run(url: str, prompts: list[str], max_tokens: int, extra: dict) -> dict:
    out: list = []
    threads = [threading.Thread(target=one_client, args=(url, p, max_tokens, extra, out)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if len(out) != len(prompts) or any(r["first"] is None for r in out):
        raise RuntimeError(f"{len(prompts) - len(out)} of {len(prompts)} clients failed or got no text")
    ttft = [r["first"] - r["start"] for r in out]
    tpot = [(r["end"] - r["first"]) / max(r["pieces"] - 1, 1) for r in out]
    decode = sum((r["pieces"] - 1) / (r["end"] - r["first"]) for r in out if r["pieces"] > 1 and r["end"] > r["first"])
    return {"clients": len(prompts), "wall_s": wall, "tok_s": sum(r["pieces"] for r in out) / wall,
            "decode_tok_s": decode,
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "tpot_median_ms": 1e3 * statistics.median(tpot),
            "pieces_min": min(r["pieces"] for r in out)}


class LlamaCppServer:
    """llama.cpp's server (llama-cpp-python) on a free loopback port, as a subprocess."""

    def __init__(self, path: str, ctx: int, threads: int):
        import socket
        import subprocess
        import tempfile
        import urllib.request
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(ctx), "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--n_batch", "512",
               "--interrupt_requests", "False"]      # its default cuts a stream off when the next request comes
        self.log = tempfile.TemporaryFile("w+")           # its load log is long: a pipe would fill and block it
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError("llama.cpp server exited: " + self.log.read()[-2000:])
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("llama.cpp server did not come up in 180 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
        self.log.close()


def show(row: dict) -> None:
    print(f"{row['server'] + ('+json' if row.get('structured') else ''):>10} {row['parallel']:>8} "
          f"{row['kv_budget']:>9} {row['clients']:>7} | "
          f"{row['tok_s']:>7.1f} {row['decode_tok_s']:>8.1f} {row['wall_s']:>7.1f} {row['ttft_median_s']:>8.2f}s "
          f"{row['ttft_max_s']:>8.2f}s {row['tpot_median_ms']:>7.0f}ms", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--parallel", type=int, nargs="+", default=[4])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-budget", type=int, nargs="+", default=[0], help="per-request kv_budget (0: full cache)")
    p.add_argument("--llama-cpp", dest="llama_cpp", action="store_true", help="also llama.cpp's own server")
    p.add_argument("--threads", type=int)
    p.add_argument("--json", type=Path)
    p.add_argument("--structured", action="store_true",
                   help="free vs constrained (json_schema) requests, and their tok/s ratio")
    a = p.parse_args()
    ctx = a.prompt_tokens + a.max_tokens + 64
    model = engine.load(a.model, threads=a.threads, ctx=ctx, snapkv_budget=0)
    threads = model.settings.threads or os.cpu_count()
    prompts = Prompts(model, a.prompt_tokens)
    rows = []
    print(f"clients {a.clients}, {a.prompt_tokens}-token prompts, {a.max_tokens} tokens each, "
          f"{threads} threads")
    print(f"{'server':>10} {'parallel':>8} {'kv_budget':>9} {'clients':>7} | {'tok/s':>7} {'decode':>8} {'wall s':>7} "
          f"{'TTFT med':>9} {'TTFT max':>9} {'TPOT med':>9}")
    for n in a.parallel:
        server = serve_in_thread(build_app(model, max_queue=64, max_running=n))
        url = server.url + "/v1"
        try:
            run(url, prompts.take(1), 4, {"ignore_eos": True})      # warm-up (numba, scratch)
            if a.structured:                                        # (llguidance's tokenizer)
                run(url, prompts.take(1), 4, {"ignore_eos": True, **STRUCTURED})
            for budget in a.kv_budget:
                extra = {"ignore_eos": True, **({"kv_budget": budget} if budget else {})}
                for c in a.clients:
                    for structured in (False, True) if a.structured else (False,):
                        body = {**extra, **STRUCTURED} if structured else extra
                        rows.append(dict(server="ours", parallel=n, kv_budget=budget, structured=structured,
                                         **run(url, prompts.take(c), a.max_tokens, body)))
                        show(rows[-1])
        finally:
            server.stop(30)
    if a.llama_cpp:
        server = LlamaCppServer(model.path, ctx, threads)
        url = server.url + "/v1"
        extra = {"logit_bias": {str(i): -100.0 for i in model.tokenizer.eot_ids}}
        try:
            run(url, prompts.take(1), 4, extra)
            for c in a.clients:
                rows.append(dict(server="llama.cpp", parallel=1, kv_budget=0,
                                 **run(url, prompts.take(c), a.max_tokens, extra)))
                show(rows[-1])
        finally:
            server.stop()
    ratios = []
    if a.structured:
        free = {(r["parallel"], r["kv_budget"], r["clients"]): r for r in rows if r["server"] == "ours"
                and not r["structured"]}
        print("constrained / free (json_schema vs none):")
        for r in rows:
            f = free.get((r["parallel"], r["kv_budget"], r["clients"]))
            if r.get("structured") and f is not None:
                ratios.append({"parallel": r["parallel"], "kv_budget": r["kv_budget"], "clients": r["clients"],
                               "decode_ratio": r["decode_tok_s"] / f["decode_tok_s"],
                               "wall_ratio": r["tok_s"] / f["tok_s"]})
                q = ratios[-1]
                print(f"  parallel {q['parallel']} kv_budget {q['kv_budget']} clients {q['clients']}: decode "
                      f"{q['decode_ratio']:.3f}x ({r['decode_tok_s']:.1f} vs {f['decode_tok_s']:.1f} tok/s), "
                      f"wall {q['wall_ratio']:.3f}x")
    if a.json:
        a.json.write_text(json.dumps({"prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                                      "threads": threads, "rows": rows, "structured_ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
