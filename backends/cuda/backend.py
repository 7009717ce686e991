"""CudaBackend: every op of backends/base.py as CUDA C kernels (kernels/*.cu).

Weights are uploaded once as raw GGUF blocks and dequantized inside the
kernels; the paged KV cache (bf16 or a quantized row format of
backends/kvformat.py, quantized on write and read as stored), the SnapKV votes
and the compaction stay on the device. Per decode token only the token id goes up (a kernel argument) and
the logits (greedy decoding: the token id, argmax_rows) come down. Kernels are launched on one stream with no host
synchronisation until a result is downloaded.

The executor (runtime.py) decides where the kernels run: `device` (a GPU
through cupy) or `cpu-harness` (the same kernel source on the CPU, for tests).

Every public method raises engine errors in place of cupy's (errors.py):
DeviceOutOfMemory, DeviceFault (sticky: restart the process), DeviceError.
"""
from __future__ import annotations

import numpy as np

from engine.config import env_setting
from engine.errors import EngineError

from ..base import check_kv_dtypes, step_slot
from ..kvformat import KV_DTYPES, KvFormat
from . import attention, elementwise, kvrows, quant
from .errors import translate_device_errors
from .runtime import make_executor

# Device memory a model needs beyond its weights, KV cache and prefill buffers: cuBLAS's
# workspace, the GEMM path's dequantisation scratch (quant.GEMM_CHUNK_ELEMENTS: 64 MiB),
# the kernels' modules and cupy's pool rounding.
RESERVE_BYTES = 256 << 20


@translate_device_errors
class CudaBackend:
    """backend name "cuda". `device`: CUDA device index (default 0); `executor`:
    "device" or "cpu-harness" (default: SHARPI_CUDA_EXECUTOR, i.e. "device")."""

    name = "cuda"
    reserve_bytes = RESERVE_BYTES        # device memory a KV pool leaves free (the server's check)
    kv_dtypes = KV_DTYPES     # every row format, keys and values independently (kvrows.py)
    max_head_dim = 256        # the attention kernels' per-thread slices (base.check_head_dim)
    rope_write_keys = elementwise.ROPE_WRITE_KEYS   # rope_kv_write's key formats (kv.cu)

    def __init__(self, device: int = 0, executor: str | None = None):
        self.ex = make_executor(executor or env_setting("cuda_executor"), device)
        self.bytes_to_device = 0                           # host<->device traffic counters
        self.bytes_to_host = 0
        self._step = None                                  # the step buffer of the recording under way
        self._max_position = 0                             # ... and the positions it may hold

    def bind_thread(self) -> None:
        """The device current in the calling thread (backends/base.py): a thread other than
        the one that loaded the model (a server's worker) launches on the model's device."""
        bind = getattr(self.ex, "bind_thread", None)      # the CPU harness: one "device", nothing to do
        if bind is not None:
            bind()

    @property
    def launches(self) -> int:
        """Kernel launches the ops have made (a replayed step makes none: engine/replay.py)."""
        return self.ex.launches

    # -- recorded steps (backends/base.py, engine/replay.py) ---------------------------
    def record_step(self, values: np.ndarray, run, max_position: int, readback=None):
        """run() as one step whose StepValue arguments the kernels read from a new step
        buffer (int32, `values`), its launches recorded; the recording for `replay`.
        `readback` (the array downloaded after each step) needs nothing here."""
        step = self.upload(np.ascontiguousarray(values, dtype=np.int32))
        self._step, self._max_position = step, max_position
        self.ex.begin_recording()
        try:
            run()
        finally:
            recorded = self.ex.end_recording()
            self._step, self._max_position = None, 0
        return None if recorded is None else (recorded, step)     # None: a GEMM ran (over MV_MAX_TOKENS rows)

    def replay(self, recording, values: np.ndarray) -> None:
        """The recorded step again, its step buffer rewritten with `values` first."""
        recorded, step = recording
        self.update(step, values)
        self.ex.replay(recorded)

    def _slot(self, value) -> tuple | None:
        """(step buffer, first slot) of a StepValue(s) argument while a step is recorded, else None."""
        slot = step_slot(value)
        return None if self._step is None or slot is None else (self._step, slot)

    # -- memory -----------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32):
        return self.ex.zeros(shape, dtype)

    def upload(self, host: np.ndarray):
        host = np.asarray(host)
        self.bytes_to_device += host.nbytes
        return self.ex.asarray(host)

    def download(self, arr) -> np.ndarray:
        out = self.ex.to_host(arr)
        self.bytes_to_host += out.nbytes
        return out

    def load_weight(self, raw, qtype, shape):
        w = quant.load_weight(self.ex, raw, qtype, shape)
        self.bytes_to_device += w.nbytes
        return w

    def alloc_kv_pool(self, n_pages, n_kv_heads, page_size, head_dim, k_dtype="bf16", v_dtype="bf16"):
        check_kv_dtypes(self, k_dtype, v_dtype)
        if head_dim % 2 or head_dim > self.max_head_dim:     # Model checks it at load (check_head_dim)
            raise ValueError(f"backend '{self.name}' needs an even head_dim <= {self.max_head_dim}, got {head_dim}")
        fmts = (KvFormat.get(k_dtype, head_dim), KvFormat.get(v_dtype, head_dim))
        self.bytes_to_device += kvrows.upload_tables(self.ex, head_dim, k_dtype, v_dtype)   # tq: once
        return tuple(self.ex.zeros(f.page_shape(n_pages, n_kv_heads, page_size), f.storage) for f in fmts)

    def update(self, arr, host: np.ndarray) -> None:
        host = np.asarray(host, dtype=arr.dtype)
        self.bytes_to_device += host.nbytes
        arr[...] = self.ex.asarray(host)                  # stream-ordered after the work issued

    def submit(self) -> None:
        pass                                              # kernels start as they are launched

    def synchronize(self) -> None:
        self.ex.synchronize()

    def free_cached_memory(self) -> None:
        """Give the device memory cupy's pool holds unused back to the driver (a server
        calls it after a request failed for memory; cupy reuses the blocks otherwise)."""
        cp = getattr(self.ex, "cp", None)                 # the device executor's cupy; none on the harness
        if cp is not None:
            cp.get_default_memory_pool().free_all_blocks()

    def free_memory_bytes(self) -> int | None:
        """Device memory free now (cupy's unused pool blocks included); None on the harness."""
        return self.ex.free_bytes()

    def check_fits(self, weight_bytes: int, kv_bytes: int, ctx: int, work_bytes: int = 0, chunk: int = 0,
                   largest_buffer: int = 0) -> bool:
        """Before anything is allocated: the weights, one KV cache for `ctx` tokens, a
        prefill chunk's buffers (`work_bytes` for `chunk` tokens) and RESERVE_BYTES must
        fit in the device's free memory (EngineError with the numbers). False on the
        harness (host memory: the caller checks it)."""
        free = self.ex.free_bytes()
        if free is None:
            return False
        need = weight_bytes + kv_bytes + work_bytes + RESERVE_BYTES
        if need > free:
            mib = 2 ** 20
            raise EngineError(f"model does not fit on {self.ex.label}: weights "
                              f"{weight_bytes / mib:.0f} MiB + KV cache for {ctx} tokens {kv_bytes / mib:.0f} MiB "
                              f"+ buffers for a {chunk}-token prefill chunk {work_bytes / mib:.0f} MiB "
                              f"+ {RESERVE_BYTES // mib} MiB reserve = {need / mib:.0f} MiB, but only "
                              f"{free / mib:.0f} MiB are free (lower --ctx or --prefill-chunk, or use --kv-budget)")
        return True

    # -- ops --------------------------------------------------------------------------
    def embedding(self, table, ids, out) -> None:
        step = self._slot(ids)                             # a recorded step's tokens (StepValues)
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        quant.embedding(self.ex, table, ids, out, step)
        if ids.size > 1:                                   # one id travels as a kernel argument
            self.bytes_to_device += ids.nbytes

    def rms_norm(self, x, weight, eps: float, out) -> None:
        elementwise.rms_norm(self.ex, x, weight, eps, out)

    def add_rms_norm(self, x, r, weight, eps: float, out) -> None:
        elementwise.add_rms_norm(self.ex, x, r, weight, eps, out)

    def scale(self, x, s: float, out) -> None:
        elementwise.scale(self.ex, x, s, out)

    def matmul(self, w, x, out, bias=None) -> None:
        quant.matmul(self.ex, w, x, out, bias)

    def gated_matmul(self, w, gate_up, out, act: str, scratch) -> None:
        quant.gated_matmul(self.ex, w, gate_up, out, act, scratch)

    def rope(self, x, positions, n_heads: int, head_dim: int, rot_dim: int, freq_base: float,
             neox: bool, freq_factors=None) -> None:
        step = self._slot(positions)                       # a recorded step's positions (StepValues)
        self.bytes_to_device += elementwise.rope(self.ex, x, positions, n_heads, head_dim, rot_dim,
                                                 freq_base, neox, freq_factors, step, self._max_position)

    def kv_write(self, k_pages, v_pages, page_table, k, v, start_row: int,
                 k_dtype: str = "bf16", v_dtype: str = "bf16") -> None:
        check_kv_dtypes(self, k_dtype, v_dtype)
        elementwise.kv_write(self.ex, k_pages, v_pages, page_table, k, v, start_row, k_dtype, v_dtype,
                             self._slot(start_row))

    def rope_kv_write(self, qkv, positions, n_heads: int, rot_dim: int, freq_base: float, neox: bool,
                      freq_factors, k_pages, v_pages, page_table, start_row: int, k_dtype: str = "bf16",
                      v_dtype: str = "bf16", centre=None) -> None:
        check_kv_dtypes(self, k_dtype, v_dtype)
        self.bytes_to_device += elementwise.rope_kv_write(
            self.ex, qkv, positions, n_heads, rot_dim, freq_base, neox, freq_factors, k_pages, v_pages, page_table,
            start_row, k_dtype, v_dtype, centre, self._slot(positions), self._slot(start_row), self._max_position)

    def attention_prefill(self, q, k_pages, v_pages, page_table, start_row: int,
                          n_q_heads: int, scale: float, out, window: int = 0,
                          k_dtype: str = "bf16", v_dtype: str = "bf16", row_bias=None) -> None:
        check_kv_dtypes(self, k_dtype, v_dtype)
        attention.attention_prefill(self.ex, q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                                    window, k_dtype, v_dtype, row_bias)

    def attention_decode(self, q, k_pages, v_pages, page_table, n_rows: int,
                         n_q_heads: int, scale: float, out, window: int = 0,
                         k_dtype: str = "bf16", v_dtype: str = "bf16", row_bias=None) -> None:
        check_kv_dtypes(self, k_dtype, v_dtype)
        attention.attention_decode(self.ex, q, k_pages, v_pages, page_table, n_rows, n_q_heads, scale, out,
                                   window, k_dtype, v_dtype, row_bias, self._slot(n_rows))

    def silu_gate(self, gate, up, out) -> None:
        elementwise.silu_gate(self.ex, gate, up, out)

    def gelu_gate(self, gate, up, out) -> None:
        elementwise.gelu_gate(self.ex, gate, up, out)

    def add(self, a, b, out) -> None:
        elementwise.add(self.ex, a, b, out)

    def argmax_rows(self, x, out) -> None:
        elementwise.argmax_rows(self.ex, x, out)

    def snapkv_votes(self, q_window, k_pages, page_table, n_rows: int, scale: float,
                     k_dtype: str = "bf16") -> np.ndarray:
        check_kv_dtypes(self, k_dtype)
        if isinstance(q_window, np.ndarray):                # the forward pass's host capture
            self.bytes_to_device += q_window.nbytes
        votes = attention.snapkv_votes(self.ex, q_window, k_pages, page_table, n_rows, scale, k_dtype)
        self.bytes_to_host += votes.nbytes
        return votes

    def kv_gather(self, k_pages, v_pages, page_table, keep) -> None:
        self.bytes_to_device += elementwise.kv_gather(self.ex, k_pages, v_pages, page_table, keep)

    def kv_copy_pages(self, src_k, src_v, dst_k, dst_v, pages, dst_pages=None) -> None:
        self.bytes_to_device += elementwise.kv_copy_pages(self.ex, src_k, src_v, dst_k, dst_v, pages, dst_pages)
