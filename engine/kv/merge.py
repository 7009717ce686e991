"""Merged rows: what eviction drops, kept as a few summary rows per KV head.

SnapKV keeps the rows the observation window attends to; a head that attends
broadly (Gemma 3 270M's first global layer puts 18% of its last-token attention
on rows a budget of 2048 drops at 16K) still loses that mass, and with it the
answer. Here the dropped rows of each KV head are clustered by their keys
(weighted k-means, a fixed seed) and each cluster of c rows becomes one row:
the mean key, the mean value, and a logit bias of log(c) that attention adds to
the row's scaled score. For a query q the row then weighs c * exp(q . mean k),
which by Jensen's inequality is at most the dropped rows' own sum of
exp(q . k_i): a sharp head that ignored the dropped rows still ignores their
summary, a broad head gets most of their mass back. A merged row with count c
that is dropped again counts c times in the next merge (its bias is log c).

Cost: one pass of `iters` Lloyd iterations over the dropped rows' keys per KV
head (for 14,000 rows of 256 dims and 64 clusters about 1 s on this 2-core machine).
"""
from __future__ import annotations

import numpy as np

ITERS = 10
EMPTY_BIAS = np.float32(-1e30)    # a slot a head could not fill (fewer distinct rows than clusters)


def kmeans(x: np.ndarray, w: np.ndarray, k: int, iters: int = ITERS, seed: int = 0) -> np.ndarray:
    """Weighted k-means of the rows of x (f64 [m, d], weights w [m] > 0) into k <= m
    clusters -> int [m] cluster of each row. Seeds are k distinct rows drawn with a
    fixed seed; a cluster left empty is re-seeded with the row farthest from its centre."""
    rng = np.random.default_rng(seed)
    centres = x[rng.choice(x.shape[0], k, replace=False)]
    x2 = (x * x).sum(axis=1)
    for _ in range(iters):
        d2 = x2[:, None] - 2.0 * (x @ centres.T) + (centres * centres).sum(axis=1)[None, :]
        assign = d2.argmin(axis=1)
        member = np.zeros((x.shape[0], k))
        member[np.arange(x.shape[0]), assign] = w
        counts = member.sum(axis=0)
        sums = member.T @ x
        empty = counts == 0
        centres = np.where(empty[:, None], centres, sums / np.maximum(counts, 1e-300)[:, None])
        if empty.any():
            far = np.argsort(d2[np.arange(x.shape[0]), assign])[::-1][:int(empty.sum())]
            centres[empty] = x[far]
    return assign


def merged_rows(keys: np.ndarray, values: np.ndarray, bias: np.ndarray | None, keep: np.ndarray,
                n_merge: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's merged rows.

    keys, values: f64 [n_kv_heads, n_rows, head_dim], the layer's rows before compaction;
    bias: f32 [n_kv_heads, n_bias] log-counts of its first rows (earlier merged rows) or None;
    keep: int [n_kv_heads, n_keep] the rows that stay, or one array per KV head.
    Returns (k, v: f32 [n_kv_heads, c, head_dim], log-counts f32 [n_kv_heads, c]) with
    c = min(n_merge, most dropped rows of a head); a head with fewer dropped rows (or
    fewer distinct ones) than c fills its last slots with zero rows of bias EMPTY_BIAS
    (never attended)."""
    n_kv, n_rows, head_dim = keys.shape
    counts = np.ones((n_kv, n_rows))
    if bias is not None:
        counts[:, :bias.shape[1]] = np.exp(bias.astype(np.float64))
    c = min(n_merge, n_rows - min(len(k) for k in keep))
    mk = np.zeros((n_kv, c, head_dim), dtype=np.float32)
    mv = np.zeros_like(mk)
    log_count = np.full((n_kv, c), EMPTY_BIAS, dtype=np.float32)
    if c <= 0:
        return mk, mv, log_count
    for h in range(n_kv):
        dropped = np.setdiff1d(np.arange(n_rows), keep[h])
        if dropped.size == 0:
            continue
        w = counts[h, dropped]
        assign = kmeans(keys[h, dropped], w, min(c, dropped.size))
        total = np.bincount(assign, weights=w, minlength=c)
        for j in np.flatnonzero(total > 0):
            sel = assign == j
            ws = w[sel] / total[j]
            mk[h, j] = ws @ keys[h, dropped[sel]]
            mv[h, j] = ws @ values[h, dropped[sel]]
            log_count[h, j] = np.log(total[j])
    return mk, mv, log_count
