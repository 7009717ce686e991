"""Benchmark CPU decode attention over the paged KV cache.

    .venv/bin/python tools/bench_attention.py [--rows 128 2048 8000] [--layers 30]
        [--page-size 64] [--threads N] [--kv-dtype bf16 q8_0 q4_0 tq4 tq3]

Shape: 9 query heads, 3 KV heads, head_dim 64 (SmolLM2-135M). For each KV dtype
and row count it times one layer (same pool again and again: cache-warm) and a
whole token (one call per layer over `--layers` distinct pools: the KV cache
streams from memory as in real decode), and reports effective GB/s of K+V read
(the bytes actually stored, scales included).
Not a test: numbers go to stdout (and --json FILE).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.cpu import ops  # noqa: E402
from backends.kvformat import KV_DTYPES, KvFormat  # noqa: E402


def make_pages(rng, n_rows, n_kv, page_size, head_dim, kv_dtype):
    """K and V pages of normal rows in `kv_dtype` (quantized once: copy for more layers)."""
    n_pages = -(-n_rows // page_size)
    fmt = KvFormat.get(kv_dtype, head_dim)
    x = rng.standard_normal((n_pages, n_kv, page_size, head_dim)).astype(np.float32)
    k_pages = fmt.quantize(x)
    v_pages = np.ascontiguousarray(k_pages[::-1])
    return k_pages, v_pages


def make_layer(rng, pages):
    k_pages, v_pages = pages
    page_table = rng.permutation(k_pages.shape[0]).astype(np.int32)
    return k_pages.copy(), v_pages.copy(), page_table


def timeit(fn, min_time=0.3, min_reps=5):
    """(best wall, median wall, best process CPU time) per call, seconds. CPU time
    (all threads) is the steadier number on a shared machine."""
    fn()
    times, cpu = [], []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return float(np.min(times)), float(np.median(times)), float(np.min(cpu))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 2048, 8000])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--page-size", type=int, default=64)   # the engine's default
    p.add_argument("--threads", type=int, help="numba threads (default: numba's)")
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-dtype", nargs="+", default=["bf16"], choices=KV_DTYPES)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import numba
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    hq, hkv, hd = args.q_heads, args.kv_heads, args.head_dim
    scale = 1.0 / math.sqrt(hd)
    q = rng.standard_normal((1, hq * hd)).astype(np.float32)
    out = np.empty_like(q)
    print(f"attention_decode: {hq} q heads / {hkv} kv heads x {hd}, page {args.page_size}, "
          f"{numba.get_num_threads()} threads ({numba.config.THREADING_LAYER})")
    print(f"best (median) wall of repeated runs; GB/s from the best; cpu = best process "
          f"CPU time; token = {args.layers} layers")
    print(f"{'dtype':>5} {'rows':>6} {'KV MB/layer':>11} {'layer us':>19} {'cpu us':>8} {'GB/s':>6} "
          f"{'token ms':>17} {'GB/s':>6}")
    results = []
    for kv_dtype in args.kv_dtype:
        for n_rows in args.rows:
            pages = make_pages(rng, n_rows, hkv, args.page_size, hd, kv_dtype)
            layers = [make_layer(rng, pages) for _ in range(args.layers)]
            del pages
            nbytes = n_rows * hkv * KvFormat.get(kv_dtype, hd).row_bytes * 2      # K and V

            def one_layer(kp=layers[0][0], vp=layers[0][1], pt=layers[0][2]):
                ops.attention_decode(q, kp, vp, pt, n_rows, hq, scale, out, 0, kv_dtype, kv_dtype)

            def whole_token():
                for kp, vp, pt in layers:
                    ops.attention_decode(q, kp, vp, pt, n_rows, hq, scale, out, 0, kv_dtype, kv_dtype)

            t_layer, med_layer, cpu_layer = timeit(one_layer)
            t_token, med_token, _ = timeit(whole_token)
            row = dict(kv_dtype=kv_dtype, rows=n_rows, kv_mb_layer=nbytes / 1e6,
                       layer_us=t_layer * 1e6, layer_us_median=med_layer * 1e6,
                       layer_cpu_us=cpu_layer * 1e6,
                       layer_gbs=nbytes / t_layer / 1e9,
                       token_ms=t_token * 1e3, token_ms_median=med_token * 1e3,
                       token_gbs=nbytes * args.layers / t_token / 1e9)
            results.append(row)
            print(f"{kv_dtype:>5} {n_rows:>6} {row['kv_mb_layer']:>11.2f} "
                  f"{row['layer_us']:>8.1f} ({row['layer_us_median']:>8.1f}) {row['layer_cpu_us']:>8.1f} "
                  f"{row['layer_gbs']:>6.1f} "
                  f"{row['token_ms']:>7.2f} ({row['token_ms_median']:>7.2f}) {row['token_gbs']:>6.1f}",
                  flush=True)
            del layers
    if args.json:
        args.json.write_text(json.dumps(dict(shape=dict(q_heads=hq, kv_heads=hkv, head_dim=hd,
                                                        page_size=args.page_size,
                                                        layers=args.layers),
                                             results=results), indent=2))


if __name__ == "__main__":
    main()
