"""KV row formats on the CUDA backend: what the kernels need to know about each format
of backends/kvformat.py (kernels/kvrow.cuh reads them), the variant defines that select
a format pair, and the tables of the rotated formats (rotation; tq: codebook, boundaries)
on the device. rq4_0 rows are q4_0 rows (of the Walsh-Hadamard-rotated row): the
kernels read and write them as q4_0, the host rotates rows before kv_write, queries
before scoring and outputs back, as for tq.

Pools are `KvFormat.get(dtype, head_dim).page_shape(...)` arrays of its storage: uint16
[n_pages, n_kv, page_size, head_dim] for bf16, uint8 [n_pages, n_kv, page_size, row_bytes]
for the quantized formats. The kernels take every pool as bytes; a row is read in units
(kvrow.cuh), so `unit` values per unit and the scales of `n_scales` blocks per row.

The tables are uploaded once per executor (and per head_dim for a rotation) and
kept in `ex.cache["kv_tables"]`:
    rotation(ex, dt, d)   (rot_t, rot): f32 [d, d] R^T and R of the dtype's rotation; a kernel computing
                          out[p] = sum_k table[k, p] x[k] gets R x from rot_t, R^T x from rot
    codebook_dev(ex, dt)  f32 [16] kvformat.codebook(bits), zero-padded (tq); a dummy otherwise
    bounds_dev(ex, dt)    f32 [15] kvformat.boundaries(bits), padded with +inf (tq); a dummy otherwise
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import ConfigError

from ..kvformat import KV_DTYPES, QK, TQ_BITS, KvFormat, boundaries, codebook, rotation_kind


@dataclass(frozen=True)
class RowSpec:
    """One KV dtype as the kernels see it (kvrow.cuh, KvRow<F>)."""
    name: str
    define: str          # the KV_* constant of kvrow.cuh
    unit: int            # values per unit (one lane's load)
    scaled: bool         # rows carry f16 scales
    rotated: bool        # rows hold the rotated row y = R x (tq, rq4_0)
    coded: bool          # codebook levels, one scale per row (tq)

    def n_scales(self, head_dim: int) -> int:
        """Scale blocks per row."""
        if not self.scaled:
            return 0
        return 1 if self.coded else head_dim // QK


SPECS = {
    "bf16": RowSpec("bf16", "KV_BF16", 2, False, False, False),
    "q8_0": RowSpec("q8_0", "KV_Q8_0", 4, True, False, False),
    "q4_0": RowSpec("q4_0", "KV_Q4_0", 8, True, False, False),
    "tq4": RowSpec("tq4", "KV_TQ4", 8, True, True, True),
    "tq3": RowSpec("tq3", "KV_TQ3", 8, True, True, True),
    "rq4_0": RowSpec("rq4_0", "KV_Q4_0", 8, True, True, False),    # q4_0 rows, rotated
}
assert tuple(SPECS) == KV_DTYPES


def defines(k_dtype: str, v_dtype: str | None = None) -> tuple[str, ...]:
    """The -D defines of a kernel variant for keys k_dtype (and values v_dtype); bf16 is
    the default and adds none, so the bf16 variants keep the key (file, ())."""
    out = () if k_dtype == "bf16" else (f"KV_K={SPECS[k_dtype].define}",)
    if v_dtype is not None and v_dtype != "bf16":
        out += (f"KV_V={SPECS[v_dtype].define}",)
    return out


def head_dim_of(pages, dtype: str, what: str) -> int:
    """head_dim of a pool of KV dtype `dtype` (ValueError naming `what` when the array is
    not such a pool)."""
    if dtype not in SPECS:
        raise ValueError(f"cuda {what}: unknown KV dtype {dtype!r} (one of {', '.join(KV_DTYPES)})")
    storage = np.uint16 if dtype == "bf16" else np.uint8
    if pages.ndim != 4 or pages.dtype != storage:
        raise ValueError(f"cuda {what}: {dtype} KV pools must be {np.dtype(storage).name} "
                         f"[n_pages, n_kv, page_size, row_width], got {pages.dtype} {pages.shape}")
    width = pages.shape[3]
    head_dim = {"bf16": width, "q8_0": width * QK // 34, "q4_0": width * QK // 18, "rq4_0": width * QK // 18,
                "tq4": 2 * (width - 2), "tq3": 8 * (width - 2) // 3}[dtype]
    if head_dim < 1 or _row_width(dtype, head_dim) != width:
        raise ValueError(f"cuda {what}: rows of {width} {pages.dtype} are no {dtype} row")
    return head_dim


def _row_width(dtype: str, head_dim: int) -> int | None:
    try:
        return KvFormat.get(dtype, head_dim).row_width
    except ConfigError:                              # no such row at this head_dim
        return None


def row_bytes(pages) -> int:
    return int(pages.shape[3]) * pages.itemsize


# -- tables on the device ------------------------------------------------------------

def _tables(ex) -> dict:
    return ex.cache.setdefault("kv_tables", {})


def _upload(ex, key, make):
    """The device copy of make() kept under `key`, uploaded on first use."""
    tables = _tables(ex)
    if key not in tables:
        tables[key] = ex.asarray(make())
    return tables[key]


def rotation(ex, dtype: str, head_dim: int):
    """(rot_t, rot) f32 [head_dim, head_dim] on the device: R^T and R of a rotated dtype
    (KvFormat.rotation: tq4 and tq3 share one)."""
    r = KvFormat.get(dtype, head_dim).rotation
    kind = rotation_kind(dtype)
    return (_upload(ex, ("rot_t", kind, head_dim), lambda: np.ascontiguousarray(r.T)),
            _upload(ex, ("rot", kind, head_dim), lambda: np.ascontiguousarray(r)))


def codebook_dev(ex, dtype: str):
    """f32 [16] levels of a tq dtype (zero-padded); for the other dtypes any valid
    pointer (the tq4 table: their kernels never read it)."""
    bits = TQ_BITS.get(dtype, 4)

    def make():
        out = np.zeros(16, np.float32)
        out[:1 << bits] = codebook(bits)
        return out
    return _upload(ex, ("codebook", bits), make)


def bounds_dev(ex, dtype: str):
    """f32 [15] boundaries of a tq dtype (+inf past 2^bits - 1: never below a value)."""
    bits = TQ_BITS.get(dtype, 4)

    def make():
        out = np.full(15, np.inf, np.float32)
        out[:(1 << bits) - 1] = boundaries(bits)
        return out
    return _upload(ex, ("bounds", bits), make)


def upload_tables(ex, head_dim: int, *dtypes: str) -> int:
    """Everything the kernels of `dtypes` read at this head_dim, uploaded now if not yet:
    returns the bytes uploaded (the backend counts them at alloc_kv_pool)."""
    before = sum(a.nbytes for a in _tables(ex).values())
    for dtype in dtypes:
        if SPECS[dtype].rotated:
            rotation(ex, dtype, head_dim)
        if SPECS[dtype].coded:
            codebook_dev(ex, dtype)
            bounds_dev(ex, dtype)
    return sum(a.nbytes for a in _tables(ex).values()) - before
