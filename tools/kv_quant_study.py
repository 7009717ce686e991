"""How much each KV row format disturbs attention, on the real keys and values of a model.

    .venv/bin/python tools/kv_quant_study.py [MODEL] [--tokens 2048] [--window 64] [--seed 0]
        [--shift 0] [--json FILE]

Prefills one needle prompt (the eval's `niah` task) with a bf16 cache, captures the
post-RoPE queries of its last `--window` positions, and for every full-attention layer
compares exact attention over the cached rows with attention over the same rows stored
in each format:

  key KL     mean KL(p || p^) in nats of the attention distributions of the window
             queries, keys in the format, values exact
  out err    |o - o^| / |o| of the attention output, keys and values in the format

Besides the engine's formats it measures TurboQuant's inner-product variant (arXiv
2504.19874, "TurboQuant_prod"): keys at b-1 bits (tq3 for b = 4) plus a 1-bit QJL sketch
of the residual r = k - k^ (sign(S r) for a Gaussian S, and |r| as f16), whose unbiased
estimate of <q, r> is added to each score. The question it answers is the one issue 11
leaves open: is the QJL residual worth its bits on this model? And one more idea:
`+center` stores keys minus their mean over the prompt (per layer and KV head), which
leaves every softmax unchanged (q . mu is the same for every key) and shrinks the rows
the quantizer sees; `+center256` uses the mean of the first 256 keys only, which is
what a cache written chunk by chunk could know when it starts writing (the engine stores
quantized keys that way since 2026-12-05). `--shift N` moves the prompt N positions later:
queries and keys turned by RoPE through N more positions (no score changes), while
`+center256` keeps the mean of the first 256 keys at positions 0..255, as a cache whose
first rows were written there would hold it, so the rows the quantizer sees are those at
the end of an (N + tokens)-token prompt.
Not a test: numbers to stdout (and --json FILE).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.bf16 import bf16_to_f32  # noqa: E402
from backends.kvformat import KvFormat  # noqa: E402
from backends.reference import ReferenceBackend  # noqa: E402

QJL_SEED = 7


def cached_rows(cache, layer: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 cache -> (K, V) f32 [n_kv_heads, n_rows, head_dim] of one layer."""
    lc = cache.layers[layer]
    pool = lc.pool                                  # the layer's segment of the cache's pool
    rows = np.arange(n_rows)
    pages = np.asarray(lc.host_table)[rows // pool.page_size]
    k = bf16_to_f32(np.asarray(pool.k_pages)[pages, :, rows % pool.page_size])     # [n, kv, d]
    v = bf16_to_f32(np.asarray(pool.v_pages)[pages, :, rows % pool.page_size])
    return k.transpose(1, 0, 2), v.transpose(1, 0, 2)


def softmax(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def qjl_scores(q: np.ndarray, k: np.ndarray, k_hat: np.ndarray) -> np.ndarray:
    """<q, k_hat> + QJL estimate of <q, k - k_hat>: sqrt(pi/2)/d |r| <S q, sign(S r)>.
    q [m, d], k, k_hat [n, d] -> [m, n]. |r| rounds through f16 as it would be stored."""
    d = k.shape[1]
    s = np.random.default_rng(QJL_SEED + d).standard_normal((d, d)).astype(np.float32)
    r = k - k_hat
    norm = np.linalg.norm(r, axis=1).astype(np.float16).astype(np.float32)          # [n]
    signs = np.where(r @ s.T >= 0, 1.0, -1.0).astype(np.float32)                    # [n, d] 1 bit each
    return q @ k_hat.T + math.sqrt(math.pi / 2) / d * (q @ s.T) @ (signs * norm[:, None]).T


def rope_shift(x: np.ndarray, shift: int, cfg, layer: int) -> np.ndarray:
    """x [..., head_dim] post-RoPE rows turned through `shift` more positions (the
    reference backend's RoPE, one head a row, every row at position `shift`)."""
    rows = x.reshape(-1, cfg.head_dim).astype(np.float64)
    ReferenceBackend().rope(rows, np.full(len(rows), shift), 1, cfg.head_dim, cfg.rot_dim,
                            cfg.layer_rope_base(layer), cfg.arch.rope_neox, cfg.rope_freq_factors)
    return rows.reshape(x.shape).astype(np.float32)


def study(model_name: str, tokens: int, window: int, seed: int, shift: int = 0) -> dict:
    import engine
    from engine.eval import tasks as T
    from engine.forward import WindowCapture

    m = engine.load(model_name, snapkv_budget=0)
    sample = T.make_sample("niah", m.tokenizer, tokens, 50.0, seed, 0)
    ids = sample.ids
    cfg = m.config
    cache = m.new_cache(kv_dtype="bf16")
    cap = WindowCapture(cfg, window, len(ids) - window)
    m.forward.window_capture = cap
    try:
        m.forward.prefill(ids, cache)
    finally:
        m.forward.window_capture = None
    d, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    scale = 1.0 / math.sqrt(d)
    variants = ["q8_0", "q4_0", "rq4_0", "tq4", "tq3", "tq3+qjl", "tq4+qjl", "q4_0+center", "rq4_0+center",
                "tq4+center", "tq3+center", "q4_0+center256", "rq4_0+center256", "tq4+center256"]
    acc = {v: {"key_kl": [], "out_err": []} for v in variants}
    for layer in cache.full_layers:
        k_first, v = cached_rows(cache, layer, len(ids))
        k = rope_shift(k_first, shift, cfg, layer) if shift else k_first
        for h in range(cfg.n_kv_heads):
            q = cap.q[layer, h * group:(h + 1) * group].reshape(-1, d)              # [group*W, d]
            if shift:
                q = rope_shift(q, shift, cfg, layer)
            p = softmax(q @ k[h].T * scale)
            o = p @ v[h]
            for name in variants:
                fmt = KvFormat.get(name.split("+")[0], d)
                mu = 0.0                        # q . mu is the same for every key: softmax unchanged
                if name.endswith("+center"):
                    mu = k[h].mean(axis=0)
                elif name.endswith("+center256"):
                    mu = k_first[h][:256].mean(axis=0)          # written at positions 0..255
                k_hat = fmt.dequantize(fmt.quantize(k[h] - mu))
                v_hat = fmt.dequantize(fmt.quantize(v[h]))
                s_hat = qjl_scores(q, k[h], k_hat) if name.endswith("+qjl") else q @ k_hat.T
                p_hat = softmax(s_hat * scale)
                kl = (p * (np.log(np.maximum(p, 1e-30)) - np.log(np.maximum(p_hat, 1e-30)))).sum(axis=1)
                acc[name]["key_kl"].append(float(kl.mean()))
                o_hat = p_hat @ v_hat
                acc[name]["out_err"].append(float(np.linalg.norm(o - o_hat) / np.linalg.norm(o)))
    qjl_bytes = d // 8 + 2                                       # sign bits + f16 |r|
    out = {"model": Path(m.path).name if hasattr(m, "path") else model_name, "tokens": len(ids),
           "window": window, "head_dim": d, "shift": shift, "variants": {}}
    for name in variants:
        fmt = KvFormat.get(name.split("+")[0], d)
        key_bytes = fmt.row_bytes + (qjl_bytes if name.endswith("+qjl") else 0)   # (+center: one f32
                                                                                  # mean per head, not per row)
        out["variants"][name] = {"key_bits": 8 * key_bytes / d,
                                 "key_kl": float(np.mean(acc[name]["key_kl"])),
                                 "key_kl_max": float(np.max(acc[name]["key_kl"])),
                                 "out_err": float(np.mean(acc[name]["out_err"]))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shift", type=int, default=0,
                    help="positions the prompt is moved later (queries and keys turned by RoPE; +center256 "
                         "keeps the mean of the keys at positions 0..255)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = study(a.model, a.tokens, a.window, a.seed, a.shift)
    print(f"{res['model']}: {res['tokens']} tokens at positions {res['shift']}.., {res['window']} window queries, "
          f"head_dim {res['head_dim']}")
    print(f"{'keys':<10} {'bits/value':>10} {'key KL (mean)':>14} {'key KL (max)':>13} {'out err':>8}")
    for name, r in res["variants"].items():
        print(f"{name:<10} {r['key_bits']:>10.2f} {r['key_kl']:>14.5f} {r['key_kl_max']:>13.5f} {r['out_err']:>8.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
