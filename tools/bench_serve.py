"""Serving benchmark: C concurrent clients stream completions from `engine serve`
(started here in-process on a loopback port, once per --parallel value) through the
official openai client. Reports aggregate generated tok/s, time to first token and
time per output token, so batched decode (--parallel N) can be compared with one
request at a time (--parallel 1) on the same machine in one run.

    .venv/bin/python tools/bench_serve.py [--model smollm2] [--clients 4]
        [--parallel 1 4] [--prompt-tokens 512] [--max-tokens 64] [--kv-budget 0]

Not a test: numbers go to stdout (and --json FILE).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from engine.bench import bench_prompt  # noqa: E402
from engine.serve import build_app, serve_in_thread  # noqa: E402


def one_client(url: str, prompt: list[int], max_tokens: int, extra: dict, out: list) -> None:
    import openai
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    stamps = []
    stream = client.completions.create(model=None, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, **extra})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    out.append({"start": t0, "first": stamps[0] if stamps else None, "end": time.perf_counter(),
                "pieces": len(stamps)})


def run(model, url: str, clients: int, prompt_tokens: int, max_tokens: int, extra: dict) -> dict:
    base = bench_prompt(model.tokenizer, prompt_tokens + clients)
    prompts = [base[i:i + prompt_tokens] for i in range(clients)]      # a different prompt per client
    out: list = []
    threads = [threading.Thread(target=one_client, args=(url, p, max_tokens, extra, out)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if len(out) != clients:
        raise RuntimeError(f"{clients - len(out)} clients failed")
    ttft = [r["first"] - r["start"] for r in out]
    tpot = [(r["end"] - r["first"]) / max(max_tokens - 1, 1) for r in out]
    return {"wall_s": wall, "tok_s": clients * max_tokens / wall,
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "tpot_median_ms": 1e3 * statistics.median(tpot)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--parallel", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-budget", type=int, default=0, help="per-request kv_budget (0: full cache)")
    p.add_argument("--threads", type=int)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    model = engine.load(a.model, threads=a.threads, ctx=a.prompt_tokens + a.max_tokens + 64, snapkv_budget=0)
    extra = {"kv_budget": a.kv_budget} if a.kv_budget else {}
    rows = []
    print(f"{a.clients} clients, {a.prompt_tokens}-token prompts, {a.max_tokens} tokens each, "
          f"kv_budget {a.kv_budget or 'off'}")
    print(f"{'parallel':>8} | {'tok/s':>7} {'wall s':>7} {'TTFT med':>9} {'TTFT max':>9} {'TPOT med':>9}")
    for n in a.parallel:
        server = serve_in_thread(build_app(model, max_queue=64, max_running=n))
        url = server.url + "/v1"
        try:
            run(model, url, 1, 32, 4, extra)                            # warm-up (numba, scratch)
            r = dict(parallel=n, **run(model, url, a.clients, a.prompt_tokens, a.max_tokens, extra))
        finally:
            server.stop(30)
        rows.append(r)
        print(f"{n:>8} | {r['tok_s']:>7.1f} {r['wall_s']:>7.1f} {r['ttft_median_s']:>8.2f}s "
              f"{r['ttft_max_s']:>8.2f}s {r['tpot_median_ms']:>7.0f}ms", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"clients": a.clients, "prompt_tokens": a.prompt_tokens,
                                      "max_tokens": a.max_tokens, "kv_budget": a.kv_budget, "rows": rows},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
