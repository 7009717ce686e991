"""CpuBackend: numpy arrays in host memory, numba kernels for every op."""
from __future__ import annotations

import os

import numpy as np

# numba's OpenMP workers spin-wait between parallel regions by default. A decode step
# runs ~150 short regions; on a busy machine a spinning worker eats the time slice the
# other thread needs, and each region's barrier then waits a scheduler tick: 2-thread
# decode of SmolLM2 measured 20-30 tok/s spinning vs ~140 tok/s sleeping (load average
# ~6 on 2 cores). Sleeping at once costs a wake-up per region instead (67 us on this
# 2-core VM against 1.6 us), so libgomp spins briefly first: 10,000 spins (~50-100 us,
# covering the host work between a decode step's regions): Qwen2.5-Coder-0.5B decode at
# 4K 30 -> 36 tok/s, prefill unchanged (100,000 spins: decode 37, prefill at 4K 25%
# slower, the workers then contending with BLAS threads); beside two busy processes as
# fast as sleeping at once. Must be set before libgomp loads (first parallel kernel);
# values already in the environment win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from backends.base import check_kv_dtypes  # noqa: E402
from backends.kvformat import KV_DTYPES, KvFormat  # noqa: E402

from . import attention_blas, ops, quant  # noqa: E402  (after the OpenMP setting)


class CpuBackend:
    name = "cpu"
    kv_dtypes = KV_DTYPES

    def __init__(self, threads: int | None = None):
        self.threads = threads
        if threads:
            # sgemm (prefill mat-mats and attention) runs on the BLAS's own threads, all
            # cores by default: held to the same count (process-wide)
            from threadpoolctl import threadpool_limits
            threadpool_limits(threads, user_api="blas")
        self.bind_thread()

    def bind_thread(self) -> None:
        """Apply `threads` to the numba kernels run from the calling thread (numba's
        count is per thread: a server's worker thread would otherwise use all cores)."""
        if self.threads:
            import numba
            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))

    # -- memory ---------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def upload(self, host):
        return np.ascontiguousarray(host)

    def download(self, arr):
        return np.array(arr, copy=True)

    def load_weight(self, raw, qtype, shape):
        return quant.load_weight(raw, qtype, shape)

    def alloc_kv_pool(self, n_pages, n_kv_heads, page_size, head_dim, k_dtype="bf16",
                      v_dtype="bf16"):
        check_kv_dtypes(self, k_dtype, v_dtype)
        # np.empty: the OS maps pool pages lazily, so unused pages cost no RSS
        return tuple(np.empty(f.page_shape(n_pages, n_kv_heads, page_size), dtype=f.storage)
                     for f in (KvFormat.get(k_dtype, head_dim), KvFormat.get(v_dtype, head_dim)))

    def update(self, arr, host):
        arr[...] = host

    def submit(self):
        pass

    def synchronize(self):
        pass

    # -- ops ------------------------------------------------------------------------
    embedding = staticmethod(quant.embedding)
    matmul = staticmethod(quant.matmul)
    rms_norm = staticmethod(ops.rms_norm)
    scale = staticmethod(ops.scale)
    rope = staticmethod(ops.rope)
    kv_write = staticmethod(ops.kv_write)
    kv_write_heads = staticmethod(ops.kv_write_heads)
    @staticmethod
    def attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                          window=0, k_dtype="bf16", v_dtype="bf16", row_bias=None):
        # long chunks: sgemms per KV head (per query block with a window; per row tile
        # for quantized rows); short ones: the tiled numba kernel
        kernel = attention_blas if q.shape[0] >= attention_blas.BLAS_MIN_QUERIES else ops
        kernel.attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                                 window, k_dtype, v_dtype, row_bias)
    attention_decode = staticmethod(ops.attention_decode)
    attention_decode_heads = staticmethod(ops.attention_decode_heads)
    silu_gate = staticmethod(ops.silu_gate)
    gelu_gate = staticmethod(ops.gelu_gate)
    add = staticmethod(ops.add)
    snapkv_votes = staticmethod(ops.snapkv_votes)
    kv_gather = staticmethod(ops.kv_gather)

    @staticmethod
    def kv_copy_pages(src_k, src_v, dst_k, dst_v, pages, dst_pages=None):
        dst = pages if dst_pages is None else dst_pages
        dst_k[dst] = src_k[pages]                # the right side is gathered first: src may be dst
        dst_v[dst] = src_v[pages]
