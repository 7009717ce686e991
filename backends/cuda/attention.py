"""Attention ops of the CUDA backend: causal prefill attention, flash-decoding and the
SnapKV window votes; argument lists, launch geometry and scratch of
kernels/attention.cu and kernels/snapkv_votes.cu (rotations: elementwise.rotate).

KV pools are pages of any KV row format (kvrows.py: uint16 [n_pages, n_kv, page_size,
head_dim] bf16 bits, or uint8 [.., row_bytes] quantized rows), named by the ops'
k_dtype / v_dtype; the kernels are compiled per format pair (kvrows.defines) and read
the rows as stored. tq keys: the queries are rotated once (rotate.cu, into scratch)
before the kernels score them against the rotated rows; tq values: the output comes out
in the rotated basis and is rotated back once per head (the decode combine, or
rotate.cu in place after prefill). page_table is int32 [max_pages]. Queries and outputs
are f32 [n, n_q_heads * head_dim] (row-strided views allowed). row_bias (merged rows'
log-counts) is None or f32 [n_kv, n_bias] (row-strided views allowed), added to the
scaled scores of rows 0 .. n_bias-1; the kernels get its pointer, row stride and n_bias
(None: q as the unread pointer, n_bias 0). Scratch lives in `ex.cache`, allocated once
and grown when a call needs more, so a decode token allocates and uploads nothing.
"""
from __future__ import annotations

import numpy as np

from ..base import check_table
from ..kvformat import KV_DTYPES
from . import kvrows
from .elementwise import rotate, row_stride, scratch, step_args

VARIANTS = list(dict.fromkeys(      # rq4_0 rows are read as q4_0: no variants of their own
    [("attention.cu", kvrows.defines(k, v)) for k in KV_DTYPES for v in KV_DTYPES]
    + [("snapkv_votes.cu", kvrows.defines(k)) for k in KV_DTYPES]))

_i32, _f32 = np.int32, np.float32
MAX_HEAD_DIM = 256

# Decode (attention.cu: attention_decode_split, attention_decode_combine).
DEC_THREADS = 128            # 4 warps (DEC_WARPS)
DEC_HEADS = 4                # query heads per block at most (DEC_HEADS)
DEC_MAX_SPLITS = 256         # MAX_SPLITS: the combine's shared weight array
DEC_SPLIT_ROWS = 64          # a split has at least this many rows: 1-2 splits for short contexts
DEC_TARGET_BLOCKS = 1024     # enough blocks for ~8 per SM on a 132-SM GPU at long contexts

# Prefill (attention.cu: attention_prefill_d*): (largest head_dim, kernel, BQ queries per block).
PRE_THREADS = 128
PRE_BK = 32                  # cache rows per tile
PREFILL_KERNELS = ((64, "attention_prefill_d64", 64),
                   (128, "attention_prefill_d128", 32),
                   (256, "attention_prefill_d256", 16))
PRE_TARGET_BLOCKS = 1024     # a launch with fewer blocks splits its rows (about 2 waves on an H100)
PRE_SPLIT_ROWS = 256         # a split has at least this many rows

# SnapKV votes (snapkv_votes.cu: snapkv_stats, snapkv_votes).
SNAP_THREADS = 128
SNAP_QC = 32                 # window queries per block (query chunk)
SNAP_RT = 32                 # cache rows per tile
SNAP_TARGET_BLOCKS = 512     # the stats pass splits the rows until it has about this many blocks



def _kv_dims(k_pages, v_pages, n_q_heads: int, op: str, k_dtype: str = "bf16",
             v_dtype: str = "bf16") -> tuple[int, int, int]:
    """(n_kv, page_size, head_dim) of the pools, after checking what the kernels assume."""
    head_dim = kvrows.head_dim_of(k_pages, k_dtype, op)
    if v_pages is not None and (kvrows.head_dim_of(v_pages, v_dtype, op) != head_dim
                                or v_pages.shape[:3] != k_pages.shape[:3]):
        raise ValueError(f"cuda {op}: K and V pools differ: {k_dtype} {k_pages.shape}, {v_dtype} {v_pages.shape}")
    _, n_kv, page_size, _ = k_pages.shape
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"cuda {op}: head_dim must be even and at most {MAX_HEAD_DIM}, got {head_dim}")
    if n_q_heads < 1 or n_q_heads % n_kv:
        raise ValueError(f"cuda {op}: {n_q_heads} query heads is not a multiple of {n_kv} KV heads")
    return n_kv, page_size, head_dim


def _check_rows(a, n: int, width: int, what: str, op: str) -> None:
    if a.dtype != np.float32 or a.ndim != 2 or a.shape != (n, width) or a.strides[1] != a.itemsize:
        raise ValueError(f"cuda {op}: {what} must be f32 [{n}, {width}] (n_q_heads * head_dim) with contiguous "
                         f"rows, got {a.dtype} {a.shape} strides {a.strides}")


def _bias_args(row_bias, n_kv: int, unread, op: str) -> tuple:
    """(pointer, row stride, n_bias) kernel arguments of row_bias: None or f32
    [n_kv, n_bias] with contiguous rows; None or n_bias 0 -> (unread, 0, 0)."""
    if row_bias is None:
        return unread, _i32(0), _i32(0)
    if (row_bias.dtype != np.float32 or row_bias.ndim != 2 or row_bias.shape[0] != n_kv
            or (row_bias.shape[1] > 1 and row_bias.strides[1] != row_bias.itemsize)):
        raise ValueError(f"cuda {op}: row_bias must be f32 [n_kv_heads ({n_kv}), n_bias] with contiguous rows, "
                         f"got {row_bias.dtype} {row_bias.shape} strides {row_bias.strides}")
    if row_bias.shape[1] == 0:
        return unread, _i32(0), _i32(0)
    return row_bias, _i32(row_bias.strides[0] // row_bias.itemsize), _i32(row_bias.shape[1])


def _codebooks(ex, *dtypes):
    return tuple(kvrows.codebook_dev(ex, d) for d in dtypes)


def _partials(ex, key: str, n_vec: int, n_splits: int, head_dim: int) -> tuple:
    """Scratch `key` as the split kernels' partials: acc f32 [n_vec, n_splits, head_dim], then
    (max, sum) f32 [n_vec, n_splits, 2] (what attention_decode_combine reads)."""
    n_acc = n_vec * n_splits * head_dim
    buf = scratch(ex, key, n_vec * n_splits * (head_dim + 2))
    return buf[:n_acc], buf[n_acc:]


def _combine(ex, defines, v_dtype: str, head_dim: int, part_acc, part_ml, out, n_vec: int, n_splits: int,
             at: tuple, window: int, split_blocks: int) -> None:
    """attention_decode_combine: each of n_vec vectors' splits merged into its row of out
    (dense), tq values rotated back from their basis there. at: step_args."""
    v_rot = kvrows.rotation(ex, v_dtype, head_dim)[1] if kvrows.SPECS[v_dtype].coded else part_ml   # unread
    ex.function("attention.cu", "attention_decode_combine", defines)(
        (n_vec,), (DEC_THREADS,), (part_acc, part_ml, v_rot, out, _i32(n_splits), _i32(head_dim), *at,
                                   _i32(window), _i32(split_blocks)))


# -- prefill -------------------------------------------------------------------------------

def prefill_kernel(head_dim: int) -> tuple[str, int]:
    """(kernel name, BQ) for a head_dim."""
    return next((name, bq) for max_hd, name, bq in PREFILL_KERNELS if head_dim <= max_hd)


def prefill_smem_bytes(bq: int, head_dim: int, k_dtype: str = "bf16", v_dtype: str = "bf16") -> int:
    """Dynamic shared memory of attention_prefill_d* (PrefillShape in attention.cu): Q
    [BQ][head_dim] f32, one K-or-V tile of units [32][ws] u32 (ws: the larger of the two
    formats' head_dim/unit | 1; bf16: head_dim/2 | 1) and scales [32][ss] f32 (n_scales | 1
    of the scaled formats), S [BQ][32 + 16/QT] f32 (QT = BQ/8), m, l, alpha [BQ] f32, and
    the two codebooks [32] f32 when a format is tq."""
    qt = bq // 8
    fmts = (kvrows.SPECS[k_dtype], kvrows.SPECS[v_dtype])
    ws = max((head_dim // f.unit) | 1 for f in fmts)
    ss = max((f.n_scales(head_dim) | 1) if f.scaled else 0 for f in fmts)
    cb = 32 if any(f.coded for f in fmts) else 0
    return 4 * (bq * head_dim + PRE_BK * (ws + ss) + bq * (PRE_BK + 16 // qt) + 3 * bq + cb)


def prefill_splits(n: int, start_row: int, window: int, bq: int, n_q_heads: int) -> int:
    """Splits of each block's rows (grid z): 1 while the grid of ceil(n / bq) x n_q_heads
    blocks is large enough; else up to PRE_TARGET_BLOCKS blocks in all, each split of the
    longest block's rows (start_row + n, or its window) at least PRE_SPLIT_ROWS long. A
    2026-12-05 H100 run: 36 blocks on 132 SMs at 32K (chunks of 256, 9 heads), prefill
    at 1,042 tok/s against 10,856 at 2K."""
    blocks = -(-n // bq) * n_q_heads
    rows = start_row + n if window <= 0 else min(start_row + n, window + bq - 1)
    return max(1, min(DEC_MAX_SPLITS, -(-PRE_TARGET_BLOCKS // blocks), rows // PRE_SPLIT_ROWS))


def attention_prefill(ex, q, k_pages, v_pages, page_table, start_row: int, n_q_heads: int, scale: float,
                      out, window: int = 0, k_dtype: str = "bf16", v_dtype: str = "bf16",
                      row_bias=None) -> None:
    """q, out: f32 [n, n_q_heads*head_dim]; query i sees rows 0 .. start_row + i, or with
    window > 0 only rows max(0, start_row + i - window + 1) .. start_row + i (a block's
    tiles start at its first query's lowest row: O(window) tiles per block). row_bias:
    None or f32 [n_kv, n_bias], added to the scaled scores of rows < n_bias. A small grid
    over long rows splits them (prefill_splits; dense `out` only) and merges the splits with
    the decode combine."""
    n_kv, page_size, head_dim = _kv_dims(k_pages, v_pages, n_q_heads, "attention_prefill", k_dtype, v_dtype)
    n = q.shape[0]
    _check_rows(q, n, n_q_heads * head_dim, "q", "attention_prefill")
    _check_rows(out, n, n_q_heads * head_dim, "out", "attention_prefill")
    if start_row < 0 or window < 0:
        raise ValueError(f"cuda attention_prefill: start_row {start_row} and window {window} must be >= 0")
    if n == 0:
        return
    check_table(page_table, page_size, start_row + n, "cuda attention_prefill")
    bias = _bias_args(row_bias, n_kv, q, "attention_prefill")
    k_spec, v_spec = kvrows.SPECS[k_dtype], kvrows.SPECS[v_dtype]
    width = n_q_heads * head_dim
    q_in, q_stride = q, row_stride(q)
    if k_spec.rotated:                               # q' = R q, once per query head
        q_in, q_stride = scratch(ex, "attention_prefill_q", n * width)[:n * width].reshape(n, width), width
        rotate(ex, q, row_stride(q), q_in, q_stride, kvrows.rotation(ex, k_dtype, head_dim)[0],
               n * n_q_heads, n_q_heads, head_dim)
    name, bq = prefill_kernel(head_dim)
    defines = kvrows.defines(k_dtype, v_dtype)
    n_splits = prefill_splits(n, start_row, window, bq, n_q_heads) if row_stride(out) == width else 1
    part_acc = part_ml = out                         # unread with one split
    if n_splits > 1:                                 # query i's head h as the combine's vector i * n_q_heads + h
        part_acc, part_ml = _partials(ex, "attention_prefill_splits", n * n_q_heads, n_splits, head_dim)
    ex.function("attention.cu", name, defines)(
        (-(-n // bq), n_q_heads, n_splits), (PRE_THREADS,),
        (q_in, _i32(q_stride), k_pages, v_pages, page_table, *_codebooks(ex, k_dtype, v_dtype), out,
         row_stride(out), *bias, _i32(n), _i32(start_row), _i32(n_q_heads), _i32(n_kv), _i32(head_dim),
         _i32(page_size), _i32(window), _f32(scale), part_acc, part_ml, _i32(n_splits)),
        shared_mem=prefill_smem_bytes(bq, head_dim, k_dtype, v_dtype))
    if n_splits > 1:
        _combine(ex, defines, v_dtype, head_dim, part_acc, part_ml, out, n * n_q_heads, n_splits,
                 step_args(None, part_ml), window, 0)
    if v_spec.rotated and not (n_splits > 1 and v_spec.coded):      # out = R^T y, in place
        rotate(ex, out, row_stride(out), out, row_stride(out), kvrows.rotation(ex, v_dtype, head_dim)[1],
               n * n_q_heads, n_q_heads, head_dim)


# -- decode ----------------------------------------------------------------------------------

def decode_geometry(n_rows: int, n_q_heads: int, n_kv: int) -> tuple[int, int, int, int]:
    """(n_chunks, heads_per_block, n_splits, rows_per_split): a KV group's query heads in
    n_chunks blocks of at most DEC_HEADS; the rows in n_splits contiguous ranges, none empty."""
    group = n_q_heads // n_kv
    n_chunks = -(-group // DEC_HEADS)
    heads_per_block = -(-group // n_chunks)
    rows_per_split = -(-n_rows // decode_split_bound(n_rows, n_q_heads, n_kv))
    return n_chunks, heads_per_block, -(-n_rows // rows_per_split), rows_per_split


def decode_split_bound(n_rows: int, n_q_heads: int, n_kv: int) -> int:
    """The splits wanted for n_rows before rounding to whole splits of rows: what a recorded
    decode step launches for a table of n_rows, at least decode_geometry's count for every
    row count up to it. The wanted count grows with the rows; the rounded one does not
    (Qwen2.5 at 20,032 rows: 254 splits, at 16,384: 256)."""
    n_chunks = -(-(n_q_heads // n_kv) // DEC_HEADS)
    want = -(-DEC_TARGET_BLOCKS // (n_kv * n_chunks))
    return max(1, min(DEC_MAX_SPLITS, want, -(-n_rows // DEC_SPLIT_ROWS)))


def attention_decode(ex, q, k_pages, v_pages, page_table, n_rows: int, n_q_heads: int, scale: float,
                     out, window: int = 0, k_dtype: str = "bf16", v_dtype: str = "bf16",
                     row_bias=None, step: tuple | None = None) -> None:
    """q, out: f32 [1, n_q_heads*head_dim]; attends rows 0 .. n_rows-1, or with window > 0
    rows max(0, n_rows - window) .. n_rows-1: the splits cover only those. row_bias as in
    attention_prefill. step: None, or (step buffer, slot) whose int32 the kernels read as
    n_rows (a recorded step: the launches then serve any n_rows the page table holds)."""
    n_kv, page_size, head_dim = _kv_dims(k_pages, v_pages, n_q_heads, "attention_decode", k_dtype, v_dtype)
    _check_rows(q, 1, n_q_heads * head_dim, "q", "attention_decode")
    _check_rows(out, 1, n_q_heads * head_dim, "out", "attention_decode")
    if n_rows < 1 or window < 0:
        raise ValueError(f"cuda attention_decode: n_rows must be >= 1 and window >= 0, got {n_rows}, {window}")
    check_table(page_table, page_size, n_rows, "cuda attention_decode")
    bias = _bias_args(row_bias, n_kv, q, "attention_decode")
    row0 = max(0, n_rows - window) if window > 0 else 0
    n_chunks, heads_per_block, n_splits, rows_per_split = decode_geometry(n_rows - row0, n_q_heads, n_kv)
    launch_splits = n_splits
    if step is not None:                             # the grid of the longest rows the table holds
        capacity = page_table.shape[0] * page_size
        launch_splits = decode_split_bound(min(capacity, window) if window > 0 else capacity, n_q_heads, n_kv)
    at = step_args(step, page_table)
    # partials sized once for DEC_MAX_SPLITS, so a growing context never reallocates
    part_acc, part_ml = _partials(ex, "attention_decode", n_q_heads, DEC_MAX_SPLITS, head_dim)
    k_spec, v_spec = kvrows.SPECS[k_dtype], kvrows.SPECS[v_dtype]
    defines = kvrows.defines(k_dtype, v_dtype)
    if k_spec.rotated:                               # q' = R q, once per query head
        width = n_q_heads * head_dim
        q_rot = scratch(ex, "attention_decode_q", width)[:width].reshape(1, width)
        rotate(ex, q, width, q_rot, width, kvrows.rotation(ex, k_dtype, head_dim)[0], n_q_heads, n_q_heads, head_dim)
        q = q_rot
    ex.function("attention.cu", "attention_decode_split", defines)(
        (n_kv * n_chunks, launch_splits), (DEC_THREADS,),
        (q, k_pages, v_pages, page_table, *_codebooks(ex, k_dtype, v_dtype), *bias, out, part_acc, part_ml,
         _i32(row0), _i32(n_rows), _i32(rows_per_split), _i32(n_q_heads), _i32(n_kv), _i32(head_dim),
         _i32(page_size), _i32(heads_per_block), _f32(scale), *at, _i32(window)))
    # tq values: the combine rotates them back; rq4_0 values (read as q4_0 rows): rotate.cu after
    if launch_splits > 1 or v_spec.coded:            # else the first kernel wrote out
        _combine(ex, defines, v_dtype, head_dim, part_acc, part_ml, out, n_q_heads, n_splits, at, window,
                 n_kv * n_chunks)
    if v_spec.rotated and not v_spec.coded:          # out = R^T y, in place
        rotate(ex, out, row_stride(out), out, row_stride(out), kvrows.rotation(ex, v_dtype, head_dim)[1],
               n_q_heads, n_q_heads, head_dim)


# -- SnapKV votes --------------------------------------------------------------------------

def votes_geometry(n_rows: int, n_queries: int, n_kv: int) -> tuple[int, int, int]:
    """Stats pass: (n_qchunks, n_splits, rows_per_split) for n_queries window queries per
    KV group; rows_per_split is a multiple of SNAP_RT."""
    n_qchunks = -(-n_queries // SNAP_QC)
    n_tiles = -(-n_rows // SNAP_RT)
    n_splits = max(1, min(n_tiles, -(-SNAP_TARGET_BLOCKS // (n_kv * n_qchunks))))
    tiles_per_split = -(-n_tiles // n_splits)
    return n_qchunks, -(-n_tiles // tiles_per_split), tiles_per_split * SNAP_RT


def snapkv_votes(ex, q_window, k_pages, page_table, n_rows: int, scale: float, k_dtype: str = "bf16") -> np.ndarray:
    """q_window: f32 [n_q_heads, W, head_dim] (executor array, or host numpy: uploaded);
    returns host f32 [n_kv, n_rows - W] (see Backend.snapkv_votes)."""
    if isinstance(q_window, np.ndarray):
        q_window = ex.asarray(np.ascontiguousarray(q_window, dtype=np.float32))
    if q_window.ndim != 3 or q_window.dtype != np.float32 or not q_window.flags.c_contiguous:
        raise ValueError(f"cuda snapkv_votes: q_window must be contiguous f32 [n_q_heads, W, head_dim], got "
                         f"{q_window.dtype} {q_window.shape}")
    n_q_heads, window, q_dim = q_window.shape
    n_kv, page_size, head_dim = _kv_dims(k_pages, None, n_q_heads, "snapkv_votes", k_dtype)
    if q_dim != head_dim:
        raise ValueError(f"cuda snapkv_votes: q_window head_dim {q_dim} != the cache's {head_dim}")
    if not 1 <= window <= n_rows:
        raise ValueError(f"cuda snapkv_votes: window {window} must be in 1 .. n_rows ({n_rows})")
    prefix = n_rows - window
    if prefix == 0:
        return np.zeros((n_kv, 0), np.float32)
    check_table(page_table, page_size, n_rows, "cuda snapkv_votes")
    n_queries = n_q_heads // n_kv * window
    n_qchunks, n_splits, rows_per_split = votes_geometry(n_rows, n_queries, n_kv)
    # stats f32 [n_q_heads * W, n_splits, 2] (max, sum), then votes f32 [n_kv, prefix]
    n_stats = n_q_heads * window * n_splits * 2
    buf = scratch(ex, "snapkv_votes", n_stats + n_kv * prefix)
    stats, votes = buf[:n_stats], buf[n_stats:n_stats + n_kv * prefix]
    if kvrows.SPECS[k_dtype].rotated:                # q' = R q for every window query
        n_vec = n_q_heads * window
        q_rot = scratch(ex, "snapkv_votes_q", n_vec * head_dim)[:n_vec * head_dim].reshape(n_vec, head_dim)
        rotate(ex, q_window.reshape(n_vec, head_dim), head_dim, q_rot, head_dim,
               kvrows.rotation(ex, k_dtype, head_dim)[0], n_vec, 1, head_dim)
        q_window = q_rot
    dims = (_i32(n_q_heads), _i32(n_kv), _i32(head_dim), _i32(page_size), _i32(n_rows), _i32(window))
    defines, cb = kvrows.defines(k_dtype), kvrows.codebook_dev(ex, k_dtype)
    ex.function("snapkv_votes.cu", "snapkv_stats", defines)(
        (n_kv * n_qchunks, n_splits), (SNAP_THREADS,),
        (q_window, k_pages, page_table, cb, stats) + dims + (_i32(rows_per_split), _f32(scale)))
    ex.function("snapkv_votes.cu", "snapkv_votes", defines)(
        (-(-prefix // SNAP_RT), n_kv), (SNAP_THREADS,),
        (q_window, k_pages, page_table, cb, stats, votes) + dims + (_i32(n_splits), _f32(scale)))
    return ex.to_host(votes).reshape(n_kv, prefix)
