"""Norm, elementwise, RoPE and KV-cache ops of the CUDA backend: argument lists and
launch geometry (grid, block) of kernels/norm.cu, eltwise.cu, rope.cu, kv.cu and
rotate.cu (the per-head rotations of rotated KV rows, also used by attention.py).

Activations are f32 [n, d] arrays of the executor (row-strided views allowed);
KV pools are pages of any KV row format (kvrows.py: uint16 bf16 bits, or uint8
quantized rows): kv_write quantizes on the device into the pool's format (kv.cu);
kv_gather and kv_copy_pages move whole rows / pages of any width.
"""
from __future__ import annotations

import numpy as np

from ..base import check_table, rope_inv_freq
from . import kvrows

VARIANTS = [("norm.cu", ()), ("eltwise.cu", ()), ("rope.cu", ()), ("kv.cu", ()), ("rotate.cu", ())]

NORM_THREADS = 256
NORM_WARP_COLS = 256         # norm.cu: groups up to this wide get a warp each (rms_norm_warp)
NORM_WARP_WARPS = 4          # warps (groups) per rms_norm_warp block
ELTWISE_THREADS = 256
ARGMAX_THREADS = 256         # eltwise.cu argmax_rows: a block per row
COPY_THREADS = 256
KVW_THREADS = 128            # kv.cu: kv_write_<fmt> (a block per row)
ROT_THREADS = 128            # rotate.cu: a block per vector (rotate_vectors_1) up to ROT_ONE_MAX
ROT_ONE_MAX = 64             # vectors, else 8 per block (rotate_vectors_8)
_i32, _f32 = np.int32, np.float32


def row_stride(a) -> np.int32:
    """Elements between consecutive rows of a 2-D view (columns must be contiguous)."""
    if a.ndim != 2 or a.strides[1] != a.itemsize:
        raise ValueError(f"cuda: expected a 2-D array with contiguous rows, got shape {a.shape} "
                         f"strides {a.strides}")
    return _i32(a.strides[0] // a.itemsize)


GRID_X_MAX, GRID_YZ_MAX = 2**31 - 1, 65535     # CUDA's grid limits (a larger launch is refused)


def check_grid(op: str, grid: tuple, what: str) -> tuple:
    """grid, or ValueError naming CUDA's limit when a dimension passes it. Launches put
    their unbounded count (tokens, pages, rows) on x; `what` says what sets y / z."""
    if grid[0] > GRID_X_MAX or any(g > GRID_YZ_MAX for g in grid[1:]):
        raise ValueError(f"cuda {op}: launch grid {tuple(int(g) for g in grid)} is over CUDA's limits "
                         f"(x <= 2^31-1, y and z <= {GRID_YZ_MAX}); y: {what}")
    return grid


def step_args(step: tuple | None, unread) -> tuple:
    """The (step pointer, slot) kernel arguments of a value a recorded step reads from its
    step buffer: step None -> (unread, -1), the kernel then takes its scalar argument."""
    if step is None:
        return unread, _i32(-1)
    buf, slot = step
    return buf, _i32(slot)


def scratch(ex, key: str, n_floats: int):
    """f32 [>= n_floats] kept in ex.cache[key]; reallocated only to grow."""
    buf = ex.cache.get(key)
    if buf is None or buf.shape[0] < n_floats:
        buf = ex.cache[key] = ex.empty((n_floats,), np.float32)
    return buf


def rotate(ex, x, x_stride, out, out_stride, table, n_vec: int, n_heads: int, head_dim: int) -> None:
    """Vector v = (row v // n_heads, head v % n_heads) of x -> out: out_v[p] = sum_k
    table[k, p] x_v[k] (table rot_t: R x; rot: R^T x). out may be x (in place)."""
    if n_vec <= ROT_ONE_MAX:
        name, grid = "rotate_vectors_1", n_vec
    else:
        name, grid = "rotate_vectors_8", -(-n_vec // 8)
    ex.function("rotate.cu", name)((grid,), (ROT_THREADS,), (x, _i32(x_stride), out, _i32(out_stride), table,
                                                              _i32(n_vec), _i32(n_heads), _i32(head_dim)))


def threads_for(n: int, cap: int) -> int:
    """n rounded up to a whole warp, at most cap."""
    return int(min(cap, max(32, -(-n // 32) * 32)))


def rms_norm(ex, x, weight, eps: float, out) -> None:
    """x, out: f32 [n, d] (out may alias x); weight: f32 [g], g divides d: each g-wide
    group of a row is normalised on its own."""
    n, d = x.shape
    g = weight.shape[0] if weight.ndim == 1 else 0
    if out.shape != (n, d) or g < 1 or d % g:
        raise ValueError(f"cuda rms_norm: x {x.shape}, weight {weight.shape} (its length must divide "
                         f"the row), out {out.shape}")
    if n == 0:
        return
    n_groups = d // g
    if g <= NORM_WARP_COLS:                          # a warp per (row, group)
        warps = NORM_WARP_WARPS
        ex.function("norm.cu", "rms_norm_warp")(
            (-(-n * n_groups // warps),), (warps * 32,),
            (x, row_stride(x), weight, out, row_stride(out), _i32(n), _i32(n_groups), _i32(g), _f32(eps)))
    else:                                            # a block per (row, group)
        grid = check_grid("rms_norm", (n, n_groups), f"{n_groups} groups of {g} per row")
        ex.function("norm.cu", "rms_norm")(grid, (threads_for(g, NORM_THREADS),),
                                           (x, row_stride(x), weight, out, row_stride(out), _i32(g), _f32(eps)))


def add_rms_norm(ex, x, r, weight, eps: float, out) -> None:
    """x += r, then out = rms_norm(x) * weight over whole rows (weight: f32 [d]); one
    launch (norm.cu add_rms_norm)."""
    n, d = x.shape
    if r.shape != (n, d) or out.shape != (n, d) or weight.shape != (d,):
        raise ValueError(f"cuda add_rms_norm: x {x.shape}, r {r.shape}, weight {weight.shape}, out {out.shape}")
    if n == 0:
        return
    ex.function("norm.cu", "add_rms_norm")((n,), (threads_for(d, NORM_THREADS),),
                                           (x, row_stride(x), r, row_stride(r), weight, out, row_stride(out),
                                            _i32(d), _f32(eps)))


def scale(ex, x, s: float, out) -> None:
    """out = x * s, f32 [n, d] (out may alias x)."""
    n, d = x.shape
    if out.shape != (n, d):
        raise ValueError(f"cuda scale: shapes {x.shape}, {out.shape}")
    if n == 0:
        return
    grid = _eltwise_grid("scale", n, d)
    ex.function("eltwise.cu", "scale")(grid, (ELTWISE_THREADS,),
                                       (x, row_stride(x), out, row_stride(out), _i32(d), _f32(s)))


def _eltwise_grid(op: str, n: int, d: int) -> tuple[int, int]:
    """eltwise.cu: a row per x (any number of tokens), ELTWISE_THREADS columns per y."""
    blocks = -(-d // ELTWISE_THREADS)
    return check_grid(op, (n, blocks), f"{blocks} blocks of {ELTWISE_THREADS} columns for rows of {d}")


def _eltwise(ex, name: str, a, b, out) -> None:
    """out = name(a, b) over f32 [n, d] views; b [1, d] (add only) serves every row."""
    n, d = a.shape
    one_row = name == "add" and b.shape == (1, d)
    if (b.shape != (n, d) and not one_row) or out.shape != (n, d):
        raise ValueError(f"cuda {name}: shapes {a.shape}, {b.shape}, {out.shape}")
    if n == 0:
        return
    grid = _eltwise_grid(name, n, d)
    ex.function("eltwise.cu", name)(grid, (ELTWISE_THREADS,),
                                    (a, row_stride(a), b, _i32(0) if one_row else row_stride(b), out,
                                     row_stride(out), _i32(d)))


def add(ex, a, b, out) -> None:
    """out = a + b, f32 [n, d] (out may alias a); b [1, d] is added to every row."""
    _eltwise(ex, "add", a, b, out)


def argmax_rows(ex, x, out) -> None:
    """out int32 [n] = the index of each row's largest value in x (f32 [n, d], strided rows),
    the first of equal ones; -1 for a row holding a NaN or an infinity (eltwise.cu)."""
    n, d = x.shape
    if out.shape != (n,) or out.dtype != np.int32 or d == 0:
        raise ValueError(f"cuda argmax_rows: x {x.shape}, out {out.shape} {out.dtype}")
    if n:
        ex.function("eltwise.cu", "argmax_rows")((n,), (ARGMAX_THREADS,), (x, row_stride(x), _i32(d), out))


def silu_gate(ex, gate, up, out) -> None:
    _eltwise(ex, "silu_gate", gate, up, out)


def gelu_gate(ex, gate, up, out) -> None:
    _eltwise(ex, "gelu_gate", gate, up, out)


def _rope_table(ex, base: float, rot_dim: int, max_pos: int, factors):
    """(cos, sin) f32 [cap, rot_dim/2, 2] on the device, computed in float64 on the
    host, uploaded once per (base, rot_dim, factors) and regrown when a position
    passes the capacity (doubling)."""
    inv_freq = rope_inv_freq(base, rot_dim, factors)                        # f64 [rot_dim/2]
    tables = ex.cache.setdefault("rope_tables", {})
    key = (int(rot_dim), inv_freq.tobytes())
    have = tables.get(key)
    if have is not None and have[1] > max_pos:
        return have[0], 0
    cap = max(4096, 1 << int(max_pos).bit_length())
    angle = np.arange(cap, dtype=np.float64)[:, None] * inv_freq[None, :]
    host = np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)
    tables[key] = (ex.asarray(host), cap)
    return tables[key][0], host.nbytes


def _rope_inputs(ex, positions: np.ndarray, freq_base: float, rot_dim: int, freq_factors, step: tuple | None,
                 max_position: int) -> tuple:
    """(table, positions pointer, use_positions, pos0, bytes uploaded) of rope.cu's arguments:
    the (cos, sin) table covering the positions (and, for a recorded step, those below
    max_position); the positions as a recorded step's slots, none for consecutive ones
    (pos0 + t), else an upload."""
    n = len(positions)
    table, uploaded = _rope_table(ex, freq_base, rot_dim, max(int(positions.max()), max_position - 1), freq_factors)
    pos0 = int(positions[0])
    if step is not None:
        buf, slot = step
        return table, buf[slot:slot + n], 1, pos0, uploaded
    if np.array_equal(positions, pos0 + np.arange(n, dtype=np.int32)):
        return table, table, 0, pos0, uploaded           # any valid pointer; not read
    return table, ex.asarray(positions), 1, pos0, uploaded + positions.nbytes


def rope(ex, x, positions: np.ndarray, n_heads: int, head_dim: int, rot_dim: int, freq_base: float,
         neox: bool, freq_factors=None, step: tuple | None = None, max_position: int = 0) -> int:
    """Returns the bytes uploaded (a grown table, or non-contiguous positions). step: None,
    or (step buffer, slot) whose slots slot .. slot+n-1 hold the rows' positions (a recorded
    step; the table then covers positions below max_position, so replays never outgrow it)."""
    positions = np.asarray(positions, dtype=np.int32).reshape(-1)
    n = x.shape[0]
    if n == 0:
        return 0
    if x.shape[1] < n_heads * head_dim or rot_dim > head_dim or rot_dim % 2 or rot_dim > 512:
        raise ValueError(f"cuda rope: x {x.shape}, {n_heads} heads of {head_dim}, rot_dim {rot_dim}")
    table, pos_dev, use, pos0, uploaded = _rope_inputs(ex, positions, freq_base, rot_dim, freq_factors, step,
                                                       max_position)
    ex.function("rope.cu", "rope")((n, n_heads), (threads_for(rot_dim // 2, 256),),
                                   (x, row_stride(x), table, pos_dev, _i32(use), _i32(pos0),
                                    _i32(head_dim), _i32(rot_dim), _i32(int(bool(neox)))))
    return uploaded


def _kv_pools(k_pages, v_pages, k_dtype: str, v_dtype: str, op: str) -> tuple[int, int, int]:
    """(head_dim, n_kv, page_size) of a K and a V pool that match, else ValueError."""
    head_dim = kvrows.head_dim_of(k_pages, k_dtype, op)
    if kvrows.head_dim_of(v_pages, v_dtype, op) != head_dim or v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(f"cuda {op}: K and V pools differ: {k_dtype} {k_pages.shape}, {v_dtype} {v_pages.shape}")
    if head_dim % 2:
        raise ValueError(f"cuda {op}: head_dim must be even, got {head_dim}")
    _, n_kv, page_size, _ = k_pages.shape
    return head_dim, n_kv, page_size


def kv_write(ex, k_pages, v_pages, page_table, k, v, start_row: int, k_dtype: str = "bf16",
             v_dtype: str = "bf16", step: tuple | None = None) -> None:
    """k, v: f32 [n, n_kv*head_dim] -> rows start_row .. start_row+n-1 of the pools, each
    head's row quantized on the device as KvFormat.quantize does (kv.cu). step: None, or
    (step buffer, slot) whose int32 the kernels read as start_row (a recorded step)."""
    head_dim, n_kv, page_size = _kv_pools(k_pages, v_pages, k_dtype, v_dtype, "kv_write")
    n = k.shape[0]
    if n == 0:
        return
    if k.shape[1] < n_kv * head_dim or v.shape != k.shape:
        raise ValueError(f"cuda kv_write: k {k.shape}, v {v.shape}, {n_kv} KV heads of {head_dim}")
    if step is None:
        check_table(page_table, page_size, start_row + n, "cuda kv_write")
    at = step_args(step, page_table)
    if k_dtype == v_dtype == "bf16":                 # both pools in one launch
        ex.function("kv.cu", "kv_write")((n, n_kv), (threads_for(head_dim // 2, 128),),
                                         (k_pages, v_pages, page_table, k, row_stride(k), v, row_stride(v),
                                          _i32(n_kv), _i32(head_dim), _i32(page_size), _i32(start_row), *at))
        return
    _write_pool(ex, k_pages, page_table, k, k_dtype, "k", n_kv, head_dim, page_size, start_row, at)
    _write_pool(ex, v_pages, page_table, v, v_dtype, "v", n_kv, head_dim, page_size, start_row, at)


def _write_pool(ex, pages, page_table, x, dtype: str, role: str, n_kv: int, head_dim: int, page_size: int,
                start_row: int, at: tuple) -> None:
    """One pool's rows of kv_write: kv_write_<fmt> (rq4_0: rotate.cu first, then q4_0's)."""
    n = x.shape[0]
    cb = kvrows.codebook_dev(ex, dtype)
    rot_t = kvrows.rotation(ex, dtype, head_dim)[0] if kvrows.SPECS[dtype].rotated else cb     # else unread
    kernel = dtype
    if dtype == "rq4_0":                             # rotate the rows (rotate.cu), then write them as q4_0
        width = n_kv * head_dim
        y = scratch(ex, f"kv_write_rotated_{role}", n * width)[:n * width].reshape(n, width)
        rotate(ex, x, row_stride(x), y, width, rot_t, n * n_kv, n_kv, head_dim)
        x, kernel = y, "q4_0"
    ex.function("kv.cu", f"kv_write_{kernel}")(
        (n, n_kv), (KVW_THREADS,),
        (pages, page_table, x, row_stride(x), _i32(n_kv), _i32(head_dim), _i32(page_size), _i32(start_row),
         rot_t, cb, kvrows.bounds_dev(ex, dtype), *at))


ROPE_WRITE_KEYS = ("bf16", "q8_0", "q4_0")     # key formats rope_kv_write fuses (kv.cu rope_kv_write_*)


def rope_kv_write(ex, qkv, positions: np.ndarray, n_heads: int, rot_dim: int, freq_base: float, neox: bool,
                  freq_factors, k_pages, v_pages, page_table, start_row: int, k_dtype: str, v_dtype: str,
                  centre=None, step_positions: tuple | None = None, step_row: tuple | None = None,
                  max_position: int = 0) -> int:
    """One cache's rows of a decode step, qkv f32 [n, (n_heads + 2 n_kv) head_dim] (q | k
    | v): RoPE on q in place and on k as it is written, k moved by centre (f32 [1, n_kv
    head_dim] or None), K and V rows stored as kv_write stores them, in one launch (values of
    a rotated format in their own, as kv_write does). k_dtype one of ROPE_WRITE_KEYS. steps
    as rope's and kv_write's. Returns the bytes uploaded."""
    head_dim, n_kv, page_size = _kv_pools(k_pages, v_pages, k_dtype, v_dtype, "rope_kv_write")
    positions = np.asarray(positions, dtype=np.int32).reshape(-1)
    n, kv_dim = qkv.shape[0], n_kv * head_dim
    if n == 0:
        return 0
    if k_dtype not in ROPE_WRITE_KEYS or qkv.shape[1] != n_heads * head_dim + 2 * kv_dim or n_heads % n_kv \
            or rot_dim > head_dim or rot_dim % 2 or len(positions) != n \
            or (centre is not None and centre.shape != (1, kv_dim)):
        raise ValueError(f"cuda rope_kv_write: qkv {qkv.shape}, {n_heads} query heads over {k_pages.shape}, "
                         f"keys {k_dtype}, rot_dim {rot_dim}, {len(positions)} positions")
    table, pos_dev, use, pos0, uploaded = _rope_inputs(ex, positions, freq_base, rot_dim, freq_factors,
                                                       step_positions, max_position)
    if step_row is None:
        check_table(page_table, page_size, start_row + n, "cuda rope_kv_write")
    at = step_args(step_row, page_table)
    fused_v = v_dtype if v_dtype in ROPE_WRITE_KEYS else "none"
    k_off = n_heads * head_dim
    grid = check_grid("rope_kv_write", (n, n_kv + n_heads), "KV + query heads")
    ex.function("kv.cu", f"rope_kv_write_{k_dtype}_{fused_v}")(
        grid, (KVW_THREADS,),
        (k_pages, v_pages, page_table, qkv, row_stride(qkv), _i32(k_off), _i32(k_off + kv_dim), _i32(n_kv),
         _i32(head_dim), _i32(page_size), _i32(start_row), table, pos_dev, _i32(use), _i32(pos0), _i32(rot_dim),
         _i32(int(bool(neox))), table if centre is None else centre, _i32(centre is not None), *at))
    if fused_v == "none":
        _write_pool(ex, v_pages, page_table, qkv[:, k_off + kv_dim:], v_dtype, "v", n_kv, head_dim, page_size,
                    start_row, at)
    return uploaded


def _move_unit(*byte_counts: int) -> tuple[str, type]:
    """The widest copy unit (kernel suffix, numpy type) dividing every byte count."""
    for suffix, t in (("u32", np.uint32), ("u16", np.uint16)):
        if all(b % np.dtype(t).itemsize == 0 for b in byte_counts):
            return suffix, t
    return "u8", np.uint8


def kv_gather(ex, k_pages, v_pages, page_table, keep) -> int:
    """keep: int [n_kv, n_keep] host; whole rows (any format: the bytes of the row) of each
    head move to rows 0 .. n_keep-1. Returns the bytes uploaded (the keep sets)."""
    if k_pages.ndim != 4 or v_pages.ndim != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"cuda kv_gather: pools {k_pages.shape}, {v_pages.shape}")
    _, n_kv, page_size, _ = k_pages.shape
    keep = np.ascontiguousarray(keep, dtype=np.int32)
    if keep.ndim != 2 or keep.shape[0] != n_kv:
        raise ValueError(f"cuda kv_gather: keep {keep.shape}, expected ({n_kv}, n_keep)")
    n_keep = keep.shape[1]
    if n_keep == 0:
        return 0
    kb, vb = kvrows.row_bytes(k_pages), kvrows.row_bytes(v_pages)
    suffix, unit = _move_unit(kb, vb)
    kw, vw = kb // np.dtype(unit).itemsize, vb // np.dtype(unit).itemsize
    keep_dev = ex.asarray(keep)
    tmp = ex.empty((n_kv * n_keep * (kw + vw),), unit)          # K rows, then V rows
    grid, block = (n_keep, n_kv), (threads_for(max(kw, vw), 128),)
    dims = (_i32(n_keep), _i32(n_kv), _i32(page_size), _i32(kw), _i32(vw))
    ex.function("kv.cu", f"kv_gather_read_{suffix}")(grid, block,
                                                      (k_pages, v_pages, page_table, keep_dev, tmp) + dims)
    ex.function("kv.cu", f"kv_gather_write_{suffix}")(grid, block, (k_pages, v_pages, page_table, tmp) + dims)
    return keep.nbytes


def kv_copy_pages(ex, src_k, src_v, dst_k, dst_v, pages, dst_pages=None) -> int:
    """dst pools' pages dst_pages (None: the same ids) = src pools' pages `pages` (each
    pool of its own format; dst may be src). Returns the bytes uploaded (the page lists)."""
    pages = np.ascontiguousarray(pages, dtype=np.int32).reshape(-1)
    dst_pages = pages if dst_pages is None else np.ascontiguousarray(dst_pages, dtype=np.int32).reshape(-1)
    if dst_pages.shape != pages.shape:
        raise ValueError(f"cuda kv_copy_pages: {pages.size} source pages but {dst_pages.size} destinations")
    if pages.size == 0:
        return 0
    if src_k.shape != dst_k.shape or src_v.shape != dst_v.shape or src_k.dtype != dst_k.dtype \
            or src_v.dtype != dst_v.dtype:
        raise ValueError(f"cuda kv_copy_pages: source pools {src_k.shape}, {src_v.shape} and destination pools "
                         f"{dst_k.shape}, {dst_v.shape} differ")
    kpb, vpb = (a[0].size * a.itemsize for a in (src_k, src_v))                 # bytes per page
    suffix, unit = _move_unit(kpb, vpb)
    kpw, vpw = kpb // np.dtype(unit).itemsize, vpb // np.dtype(unit).itemsize
    ids = np.concatenate([pages, dst_pages])                                     # sources, then destinations
    blocks = -(-max(kpw, vpw) // COPY_THREADS)
    grid = check_grid("kv_copy_pages", (pages.size, blocks),                   # a page per x (millions fit)
                      f"{blocks} blocks of {COPY_THREADS} {suffix} units for a page of {max(kpb, vpb)} bytes")
    ex.function("kv.cu", f"kv_copy_pages_{suffix}")(
        grid, (COPY_THREADS,),
        (src_k, src_v, dst_k, dst_v, ex.asarray(ids), _i32(kpw), _i32(vpw)))
    return ids.nbytes
