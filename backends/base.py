"""The Backend interface: memory plus the complete list of ops the forward pass uses.

Every op writes into preallocated outputs (`out=`) and returns nothing unless
stated. Arrays are backend arrays (numpy arrays for `reference` and `cpu`); the
forward pass only creates them through `alloc`/`upload` and only reads them back
through `download`. Activations are float32, row-major, one row per token.
Column slices of a 2-D activation (`x[:, a:b]`) are valid op inputs and outputs.

The KV cache lives in two page pools per model, allocated with `alloc_kv_pool`:
    k_pages, v_pages: storage [n_pages, n_kv_heads, page_size, row_width]
where the row format is the pool's KV dtype (backends/kvformat.py; keys and values
may differ): `KvFormat.get(dtype, head_dim)` gives `storage`, `row_width` and
`page_shape`.
    bf16   uint16 [.., head_dim]           bf16 bits (the default)
    q8_0   uint8  [.., 34 * head_dim/32]   ggml blocks: f16 scale, 32 x int8
    q4_0   uint8  [.., 18 * head_dim/32]   ggml blocks: f16 scale, 32 x 4 bits
    tq4    uint8  [.., 2 + head_dim/2]     f16 scale, 4-bit codes of the rotated row
    tq3    uint8  [.., 2 + 3*head_dim/8]   f16 scale, 3-bit codes of the rotated row
The KV ops take `k_dtype` / `v_dtype` keyword arguments (default "bf16") naming the
pools' formats: `kv_write` stores rows exactly as `KvFormat.quantize` does, attention
and `snapkv_votes` read the values `KvFormat.dequantize` gives (a kernel may work in
the rotated basis instead; it never expands the cache into a full-precision copy),
and `kv_gather` / `kv_copy_pages` move whole rows / pages whatever their width (a
quantized row carries its scales). A backend lists the dtypes it implements in its
class attribute `kv_dtypes`; `alloc_kv_pool` raises ConfigError for any other.
A backend whose kernels bind a pool buffer whole may set `max_kv_buffer_bytes` (an
int; None or absent: no limit): the engine then gives `alloc_kv_pool` several smaller
pools, each holding the pages of some layers (engine/kv/paged.PagePool's segments),
and passes every op the pool of the layer it works on.
A layer's rows are addressed through its page table:
    page_table: int32 [max_pages_per_layer]   physical row r lives in page
    page_table[r // page_size] at offset r % page_size.

A backend whose kernels take per-thread settings (the CPU backend's thread count:
numba's is per calling thread; CUDA's current device: cupy's is per thread) has
`bind_thread()`, which a thread other than the one that loaded the model (a server's
worker) calls before it runs the model.

A backend that lacks an op fails at load naming it (`check_complete`); it never
runs the op somewhere else quietly.

Optional ops (a backend may have them; the engine otherwise calls kv_write and
attention_decode once per KV head): a decode step over a layer whose KV heads hold
different row counts (adaptive head budgets) in one call, over pools seen with one
head per page ([n_pages * n_kv_heads, 1, page_size, row_width]) and a table per head:
    kv_write_heads(k_pages, v_pages, tables, k, v, starts, k_dtype, v_dtype)
        tables: int32 [n_kv_heads, max_pages]; starts: int64 [n_kv_heads] (host);
        row t of head h goes to row starts[h] + t of head h's table.
    attention_decode_heads(q, k_pages, v_pages, tables, n_rows, n_q_heads, scale, out,
                           k_dtype, v_dtype, row_bias)
        head h attends its rows 0 .. n_rows[h]-1 (int64 [n_kv_heads], host); row_bias
        as in attention_decode.
A residual add and the norm after it in one call (where each op costs a dispatch;
the engine otherwise calls add then rms_norm):
    add_rms_norm(x, r, weight, eps, out)   x += r, then out = rms_norm(x) * weight.
The feed-forward's gate and down projection in one call (the engine otherwise calls
silu_gate or gelu_gate into `scratch`, then matmul):
    gated_matmul(w, gate_up, out, act, scratch)   out = (act(gate) * up) @ w.T, where
        gate_up f32 [n, 2 * cols] holds each row's gate then up, act is "silu" or
        "gelu_tanh", and scratch, f32 [n, cols], is the backend's to write (where it runs
        the gate apart, as for long prompts).
Greedy decoding's token on the device (the engine otherwise downloads the logits and takes
their argmax on the host):
    argmax_rows(x, out)   out int32 [n] (alloc) = the index of each row's largest value in
        x (f32 [n, d]), the first of equal ones; -1 for a row holding a NaN or an infinity.

A decode step's RoPE fused into its K/V writes (optional; ForwardPass uses it for decode
steps where the backend has it: a launch or more saved a layer):
    rope_write_keys   the key formats rope_kv_write takes (a tuple of dtype names)
    rope_kv_write(qkv, positions, n_heads, rot_dim, freq_base, neox, freq_factors, k_pages,
                  v_pages, page_table, start_row, k_dtype, v_dtype, centre=None)
        qkv: f32 [n, (n_heads + 2 n_kv) head_dim], one cache's rows q | k | v; positions
        int32 [n]. As rope over q and k (q rotated in place), then, where centre (f32 [1,
        n_kv head_dim]) is given, add(k, centre), then kv_write of k and v; k itself need
        not be left rotated.
Recorded decode steps (optional; engine/replay.py uses them where a backend has both):
    record_step(values, run, max_position, readback=None) -> recording
        values: int32 [n_slots] (host), copied into a new step buffer; run() then makes
        one decode step's op calls as usual, except that some int arguments are
        StepValue (and the token ids and positions StepValues): the backend passes their
        ops the step buffer's slot instead of the value, so a replay reads the slot's new
        value. The ops run (the step happens) and
        their launches are recorded. max_position: the positions the step buffer may
        hold stay below it (tables a recorded op reads must cover them). readback: the
        array the caller downloads after every step (a backend may record its copy back).
        None where the backend could not record the step whole (the caller records again).
    replay(recording, values)   writes values into the recording's step buffer and
        runs the recorded launches again, in order, reading the new values.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from engine.errors import BackendUnavailable, ConfigError, UnsupportedError

class StepValue(int):
    """An int argument of a step being recorded (record_step): a backend that records reads
    it from slot `slot` of the step buffer at every replay; to anything else it is the int."""

    def __new__(cls, value: int, slot: int):
        self = super().__new__(cls, value)
        self.slot = slot
        return self


class StepValues:
    """int32 [n] arguments of a step being recorded (a step's token ids, their positions):
    a backend that records reads them from slots slot .. slot + n - 1 at every replay; to
    anything else (np.asarray) they are the values."""
    __slots__ = ("values", "slot")

    def __init__(self, values, slot: int):
        self.values = np.asarray(values, dtype=np.int32).reshape(-1)
        self.slot = slot

    def __array__(self, dtype=None, copy=None):
        return self.values if dtype is None else self.values.astype(dtype, copy=False)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, rows: slice) -> "StepValues":
        """Values lo .. hi - 1 (a step's rows of one cache), still read from their slots."""
        lo, hi, _ = rows.indices(len(self.values))
        return StepValues(self.values[lo:hi], self.slot + lo)


def step_slot(value) -> int | None:
    """The first slot of a StepValue or StepValues argument, else None."""
    return value.slot if isinstance(value, (StepValue, StepValues)) else None


# The complete op list. `check_complete` verifies a backend has every one.
OPS = (
    "embedding",          # token rows of a (possibly quantized) table -> f32
    "rms_norm",           # per row, or per group of columns (Gemma 3's per-head QK norm)
    "scale",              # out = x * s (Gemma's embedding scale)
    "matmul",             # quantized mat-vec (n == 1) and mat-mat (n > 1), optional bias
    "rope",               # adjacent-pair (llama) or NEOX (qwen2), in place
    "kv_write",           # K/V rows (f32) -> pages (bf16 or quantized) at physical rows
    "attention_prefill",  # causal attention of n queries over the paged cache
    "attention_decode",   # one query over the paged cache
    "silu_gate",
    "gelu_gate",          # gelu_tanh(gate) * up (Gemma)
    "add",
    "snapkv_votes",       # SnapKV window votes over the paged cache
    "kv_gather",          # KV compaction: keep rows -> leading rows
    "kv_copy_pages",      # branch a cache: copy whole pages between pools
)

# gated_matmul's activations -> the #define of its kernel variants (CUDA matmul.cu and
# Vulkan matmul.comp both spell them so)
GATE_DEFINES = {"silu": "GATE_SILU", "gelu_tanh": "GATE_GELU"}

# Ops a backend may have (see the module docstring): the engine calls them when present.
OPTIONAL_OPS = ("kv_write_heads", "attention_decode_heads", "add_rms_norm", "gated_matmul", "argmax_rows")


class Weight(Protocol):
    qtype: int              # gguf.GGMLQuantizationType value
    shape: tuple[int, int]  # (rows, cols); matmul computes x @ W.T: [n, cols] -> [n, rows]


@runtime_checkable
class Backend(Protocol):
    name: str
    kv_dtypes: tuple[str, ...]   # KV row formats this backend implements (kvformat.KV_DTYPES)

    # -- memory ---------------------------------------------------------------
    def alloc(self, shape: tuple[int, ...], dtype=np.float32) -> Any: ...
    def upload(self, host: np.ndarray) -> Any: ...
    def download(self, arr: Any) -> np.ndarray: ...
    def load_weight(self, raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> Weight:
        """raw: uint8 [rows, row_bytes] GGUF blocks (may be a read-only memory map)."""
    def alloc_kv_pool(self, n_pages: int, n_kv_heads: int, page_size: int, head_dim: int,
                      k_dtype: str = "bf16", v_dtype: str = "bf16") -> tuple[Any, Any]:
        """(k_pages, v_pages), zero-filled, each `KvFormat.get(dtype, head_dim).storage`
        [n_pages, n_kv_heads, page_size, row_width] of its dtype. ConfigError for a dtype
        not in `kv_dtypes`."""
    def update(self, arr: Any, host: np.ndarray) -> None:
        """Overwrite a whole uploaded array in place with host data of its shape and
        dtype, after the work already issued (the KV cache's page tables: the device
        buffer, and what binds it, stays)."""
    def submit(self) -> None:
        """Start the work issued so far without waiting for it (a no-op where ops run
        as they are called); download and synchronize wait."""
    def synchronize(self) -> None: ...

    # -- ops ------------------------------------------------------------------
    def embedding(self, table: Weight, ids: np.ndarray, out) -> None:
        """ids: int32 [n] (host); out: f32 [n, cols]."""
    def rms_norm(self, x, weight, eps: float, out) -> None:
        """x, out: f32 [n, d] (out may alias x); weight: f32 [g], g divides d. Each g-wide
        group of columns of a row is normalised on its own: out = x / sqrt(mean(x^2) + eps)
        * weight over the group (g == d: the usual row norm; g == head_dim: per-head norm)."""
    def scale(self, x, s: float, out) -> None:
        """x, out: f32 [n, d] (out may alias x). out = x * s."""
    def matmul(self, w: Weight, x, out, bias=None) -> None:
        """x: f32 [n, cols]; out: f32 [n, rows]; bias: f32 [rows] or None."""
    def rope(self, x, positions: np.ndarray, n_heads: int, head_dim: int, rot_dim: int,
             freq_base: float, neox: bool, freq_factors: np.ndarray | None = None) -> None:
        """x: f32 [n, >= n_heads*head_dim], rotated in place; positions: int32 [n] (host).
        Pair i (i < rot_dim/2) rotates by pos * freq_base^(-2i/rot_dim) / freq_factors[i]
        (freq_factors: f32 [rot_dim/2] on the host, Llama 3 `rope_freqs`; None = all 1).
        Adjacent mode pairs (2i, 2i+1); NEOX pairs (i, i + rot_dim/2)."""
    def kv_write(self, k_pages, v_pages, page_table, k, v, start_row: int,
                 k_dtype: str = "bf16", v_dtype: str = "bf16") -> None:
        """k, v: f32 [n, n_kv_heads*head_dim] -> rows start_row .. start_row+n-1, each
        head's row stored as `KvFormat.quantize` stores it (bit for bit)."""
    def attention_prefill(self, q, k_pages, v_pages, page_table, start_row: int,
                          n_q_heads: int, scale: float, out, window: int = 0,
                          k_dtype: str = "bf16", v_dtype: str = "bf16", row_bias=None) -> None:
        """q, out: f32 [n, n_q_heads*head_dim]. Query i sees physical rows
        0 .. start_row + i (its own K/V already written); with window > 0 only the last
        `window` of them, max(0, start_row + i - window + 1) .. start_row + i (sliding-
        window layers; their rows are never compacted, so rows are positions). Rows
        below that are never read (their pages may have been returned to the pool).
        GQA: query head h reads KV head h // (n_q_heads // n_kv_heads). K and V rows
        read as `KvFormat.dequantize` gives them. row_bias: None, or a backend f32
        [n_kv_heads, n_bias] array (from `upload`) added to the scaled scores of rows
        0 .. n_bias-1 of each KV head (merged rows' log-counts; rows >= n_bias add 0);
        never given with a window."""
    def attention_decode(self, q, k_pages, v_pages, page_table, n_rows: int,
                         n_q_heads: int, scale: float, out, window: int = 0,
                         k_dtype: str = "bf16", v_dtype: str = "bf16", row_bias=None) -> None:
        """q, out: f32 [1, n_q_heads*head_dim]; attends rows 0 .. n_rows-1, or with
        window > 0 rows max(0, n_rows - window) .. n_rows-1. row_bias as in prefill."""
    def silu_gate(self, gate, up, out) -> None:
        """out = silu(gate) * up, all f32 [n, f]."""
    def gelu_gate(self, gate, up, out) -> None:
        """out = gelu_tanh(gate) * up, all f32 [n, f];
        gelu_tanh(g) = 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g^3)))."""
    def add(self, a, b, out) -> None:
        """out = a + b, f32 [n, d] (out may alias a); b may be one row [1, d], added to
        every row of a (a layer's key centre: ForwardPass._key_centre)."""
    def snapkv_votes(self, q_window, k_pages, page_table, n_rows: int, scale: float,
                     k_dtype: str = "bf16") -> np.ndarray:
        """SnapKV votes over the dequantized keys. q_window: f32 [n_q_heads, W, head_dim] (post-RoPE queries of the
        last W of n_rows prompt rows; window query w sits at row n_rows - W + w).
        Each window query's causal softmax runs over all rows 0..its own row; the
        probabilities of prefix rows (0 .. n_rows-W-1) are summed over the window and
        over the query heads of each KV group. Returns host f32 [n_kv_heads, n_rows - W].
        Transient memory O(n_q_heads * W * n_rows)."""
    def kv_gather(self, k_pages, v_pages, page_table, keep: np.ndarray) -> None:
        """keep: int64 [n_kv_heads, n_keep] sorted rows per KV head (host). Row keep[h, j]
        of head h moves to row j (the whole row: quantized values and their scales).
        Rows j < keep[h, j] only move down, so in-order copy is safe in place."""
    def kv_copy_pages(self, src_k, src_v, dst_k, dst_v, pages: np.ndarray, dst_pages=None) -> None:
        """pages, dst_pages: int32 [n] (host; dst_pages None: the same ids).
        dst_*[dst_pages[i]] = src_*[pages[i]] for every listed page (pools of the same
        shape and storage, whatever the dtype; dst may be src itself, the two lists then
        naming different pages)."""


_INV_FREQ: dict = {}                         # (base, rot_dim, factor bytes) -> f64 [rot_dim/2], read-only


def rope_inv_freq(freq_base: float, rot_dim: int, freq_factors=None) -> np.ndarray:
    """f64 [rot_dim/2], read-only: the angle per position of each rotated pair (see
    Backend.rope). Cached: backends call it for every layer of every token."""
    factors = None if freq_factors is None else np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    key = (float(freq_base), int(rot_dim), None if factors is None else factors.tobytes())
    inv = _INV_FREQ.get(key)
    if inv is not None:
        return inv
    half = rot_dim // 2
    inv = float(freq_base) ** (-2.0 * np.arange(half, dtype=np.float64) / rot_dim)
    if factors is not None:
        if factors.shape != (half,):
            raise ValueError(f"rope: freq_factors has {factors.size} values, expected rot_dim/2 = {half}")
        inv = inv / factors
    inv.setflags(write=False)
    _INV_FREQ[key] = inv
    return inv


def check_table(page_table, page_size: int, n_rows: int, op: str) -> None:
    """ValueError unless page_table is int32 [max_pages] covering n_rows rows: the GPU
    kernels index it unchecked (`op` names the backend and op in the message)."""
    if page_table.dtype != np.int32 or page_table.ndim != 1:
        raise ValueError(f"{op}: page_table must be int32 [max_pages], got {page_table.dtype} {page_table.shape}")
    if page_table.shape[0] * page_size < n_rows:
        raise ValueError(f"{op}: {n_rows} rows need {-(-n_rows // page_size)} pages, "
                         f"the page table has {page_table.shape[0]}")


def check_kv_dtypes(backend, *dtypes: str) -> None:
    """ConfigError (one line) unless the backend's `kv_dtypes` holds every dtype given."""
    supported = tuple(getattr(backend, "kv_dtypes", ("bf16",)))
    for dtype in dtypes:
        if dtype not in supported:
            raise ConfigError(f"KV dtype {dtype} is not supported on the {backend.name} backend "
                              f"(supported: {', '.join(supported)})")


def check_head_dim(backend, head_dim: int) -> None:
    """UnsupportedError (one line) unless the backend's attention kernels take heads of
    `head_dim`: even and at most its `max_head_dim` (no attribute: any)."""
    top = getattr(backend, "max_head_dim", None)
    if top is not None and (head_dim % 2 or head_dim > top):
        raise UnsupportedError(f"backend '{backend.name}' needs an even head_dim <= {top}, "
                               f"the model's is {head_dim}")


def check_complete(backend) -> None:
    """Raise BackendUnavailable naming every op the backend lacks."""
    missing = [op for op in OPS if not callable(getattr(backend, op, None))]
    if missing:
        raise BackendUnavailable(f"backend '{backend.name}' lacks op(s): {', '.join(missing)}")
