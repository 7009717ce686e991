"""The numpy reference backend: the oracle for per-op tests.

Written for clarity, not speed. Every op accumulates in float64 and rounds to
float32 only when it writes its output. K/V go through pages of the cache's row
format exactly as on a real backend (bf16 bits, or the quantized rows of
backends/kvformat.py), so attention here reads the same numbers a device kernel reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf.quants import dequantize

from backends.base import check_kv_dtypes
from backends.kvformat import KV_DTYPES, KvFormat


@dataclass(frozen=True)
class ReferenceWeight:
    qtype: int               # gguf.GGMLQuantizationType value
    shape: tuple[int, int]   # (rows, cols)
    data: np.ndarray         # f32 [rows, cols], dequantized


def _page_slots(page_table: np.ndarray, page_size: int, rows: np.ndarray):
    """Physical rows int [m] -> (page index [m], offset in page [m])."""
    rows = np.asarray(rows, dtype=np.int64)
    return page_table[rows // page_size].astype(np.int64), rows % page_size


def read_rows(pages: np.ndarray, page_table: np.ndarray, rows, dtype: str = "bf16",
              head_dim: int | None = None) -> np.ndarray:
    """pages [n_pages, n_kv_heads, page_size, row_width] of KV dtype `dtype` ->
    dequantized f64 [n_kv_heads, m, head_dim]: rows 0 .. rows-1 (an int), or the physical
    rows listed (int [m]). head_dim defaults to row_width (right for bf16 only)."""
    fmt = KvFormat.get(dtype, pages.shape[-1] if head_dim is None else head_dim)
    if pages.shape[-1] != fmt.row_width:
        raise ValueError(f"{dtype} pages have rows of {pages.shape[-1]}, expected {fmt.row_width}")
    rows = np.arange(rows) if np.ndim(rows) == 0 else np.asarray(rows)
    page, offset = _page_slots(page_table, pages.shape[2], rows)
    stored = pages[page, :, offset, :]                     # [m, n_kv_heads, row_width]
    return fmt.dequantize(stored).astype(np.float64).transpose(1, 0, 2)


def _causal_softmax(logits: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """logits f64 [..., n_rows]; visible bool broadcastable -> probabilities, 0 where masked."""
    masked = np.where(visible, logits, -np.inf)
    weights = np.exp(masked - masked.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


class ReferenceBackend:
    name = "reference"
    kv_dtypes = KV_DTYPES

    # -- memory ---------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def upload(self, host: np.ndarray) -> np.ndarray:
        return np.array(host, copy=True)

    def download(self, arr: np.ndarray) -> np.ndarray:
        return np.array(arr, copy=True)

    def load_weight(self, raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> ReferenceWeight:
        data = dequantize(np.asarray(raw), qtype).astype(np.float32).reshape(shape)
        return ReferenceWeight(qtype=int(qtype), shape=(int(shape[0]), int(shape[1])), data=data)

    def alloc_kv_pool(self, n_pages: int, n_kv_heads: int, page_size: int, head_dim: int,
                      k_dtype: str = "bf16", v_dtype: str = "bf16"):
        check_kv_dtypes(self, k_dtype, v_dtype)
        return tuple(np.zeros(f.page_shape(n_pages, n_kv_heads, page_size), dtype=f.storage)
                     for f in (KvFormat.get(k_dtype, head_dim), KvFormat.get(v_dtype, head_dim)))

    def update(self, arr: np.ndarray, host: np.ndarray) -> None:
        arr[...] = host

    def submit(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    # -- ops ------------------------------------------------------------------
    def embedding(self, table: ReferenceWeight, ids: np.ndarray, out) -> None:
        out[...] = table.data[np.asarray(ids, dtype=np.int64)]

    def rms_norm(self, x, weight, eps: float, out) -> None:
        w64 = np.asarray(weight, dtype=np.float64)                          # [g]
        n, d = x.shape
        g = w64.shape[0]
        if d % g:
            raise ValueError(f"rms_norm: weight width {g} does not divide row width {d}")
        x64 = np.asarray(x, dtype=np.float64).reshape(n, d // g, g)        # [n, groups, g]
        inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
        out[...] = (x64 * inv * w64).reshape(n, d)

    def scale(self, x, s: float, out) -> None:
        out[...] = np.asarray(x, dtype=np.float64) * float(s)

    def matmul(self, w: ReferenceWeight, x, out, bias=None) -> None:
        y = np.asarray(x, dtype=np.float64) @ w.data.astype(np.float64).T
        if bias is not None:
            y += np.asarray(bias, dtype=np.float64)
        out[...] = y

    def rope(self, x, positions: np.ndarray, n_heads: int, head_dim: int, rot_dim: int,
             freq_base: float, neox: bool, freq_factors=None) -> None:
        half = rot_dim // 2
        n = x.shape[0]
        inv_freq = float(freq_base) ** (-2.0 * np.arange(half) / rot_dim)           # [half]
        if freq_factors is not None:
            inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
        angle = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq       # [n, half]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]          # [n, 1, half]
        heads = np.asarray(x[:, :n_heads * head_dim], dtype=np.float64).reshape(n, n_heads, head_dim)
        if neox:
            i0, i1 = np.arange(half), np.arange(half) + half
        else:
            i0, i1 = 2 * np.arange(half), 2 * np.arange(half) + 1
        x0, x1 = heads[:, :, i0].copy(), heads[:, :, i1].copy()
        heads[:, :, i0] = x0 * cos - x1 * sin
        heads[:, :, i1] = x0 * sin + x1 * cos
        x[:, :n_heads * head_dim] = heads.reshape(n, n_heads * head_dim)

    def kv_write(self, k_pages, v_pages, page_table, k, v, start_row: int,
                 k_dtype: str = "bf16", v_dtype: str = "bf16") -> None:
        n_kv_heads, page_size = k_pages.shape[1:3]
        n = k.shape[0]
        head_dim = k.shape[1] // n_kv_heads
        page, offset = _page_slots(page_table, page_size, start_row + np.arange(n))
        for pages, src, dtype in ((k_pages, k, k_dtype), (v_pages, v, v_dtype)):
            rows = np.asarray(src, dtype=np.float32).reshape(n, n_kv_heads, head_dim)
            pages[page, :, offset, :] = KvFormat.get(dtype, head_dim).quantize(rows)

    def _attend(self, q, k_pages, v_pages, page_table, n_rows: int, query_rows: np.ndarray,
                n_q_heads: int, scale: float, window: int, k_dtype: str, v_dtype: str,
                row_bias=None) -> np.ndarray:
        """q f32 [n, n_q_heads*head_dim]; query i sees rows 0..query_rows[i], or with
        window > 0 rows query_rows[i]-window+1 .. query_rows[i] -> f64 [n, n_q_heads*head_dim].
        Rows below the first query's window are never read."""
        n_kv_heads = k_pages.shape[1]
        n = q.shape[0]
        head_dim = q.shape[1] // n_q_heads
        group = n_q_heads // n_kv_heads
        lo = max(0, int(query_rows[0]) - window + 1) if window > 0 else 0
        rows = np.arange(lo, n_rows)                                       # [m] rows read
        keys = read_rows(k_pages, page_table, rows, k_dtype, head_dim)     # [n_kv, m, d]
        values = read_rows(v_pages, page_table, rows, v_dtype, head_dim)   # [n_kv, m, d]
        qh = np.asarray(q, dtype=np.float64).reshape(n, n_q_heads, head_dim)
        kv_of = np.arange(n_q_heads) // group                              # [n_q_heads]
        logits = qh.transpose(1, 0, 2) @ keys[kv_of].transpose(0, 2, 1) * scale   # [n_q_heads, n, m]
        if row_bias is not None:                                           # merged rows' log-counts
            bias = np.zeros((n_kv_heads, n_rows))
            n_bias = min(row_bias.shape[1], n_rows)
            bias[:, :n_bias] = row_bias[:, :n_bias]
            logits += bias[kv_of][:, None, lo:]
        visible = rows[None, :] <= query_rows[:, None]                     # [n, m]
        if window > 0:
            visible &= rows[None, :] > query_rows[:, None] - window
        probs = _causal_softmax(logits, visible[None])
        out = probs @ values[kv_of]                                        # [n_q_heads, n, d]
        return out.transpose(1, 0, 2).reshape(n, n_q_heads * head_dim)

    def attention_prefill(self, q, k_pages, v_pages, page_table, start_row: int,
                          n_q_heads: int, scale: float, out, window: int = 0,
                          k_dtype: str = "bf16", v_dtype: str = "bf16", row_bias=None) -> None:
        n = q.shape[0]
        query_rows = start_row + np.arange(n)
        out[...] = self._attend(q, k_pages, v_pages, page_table, start_row + n, query_rows,
                                n_q_heads, scale, window, k_dtype, v_dtype, row_bias)

    def attention_decode(self, q, k_pages, v_pages, page_table, n_rows: int,
                         n_q_heads: int, scale: float, out, window: int = 0,
                         k_dtype: str = "bf16", v_dtype: str = "bf16", row_bias=None) -> None:
        query_rows = np.array([n_rows - 1])
        out[...] = self._attend(q, k_pages, v_pages, page_table, n_rows, query_rows,
                                n_q_heads, scale, window, k_dtype, v_dtype, row_bias)

    def silu_gate(self, gate, up, out) -> None:
        g = np.asarray(gate, dtype=np.float64)
        out[...] = g / (1.0 + np.exp(-g)) * np.asarray(up, dtype=np.float64)

    def gelu_gate(self, gate, up, out) -> None:
        g = np.asarray(gate, dtype=np.float64)
        gelu = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
        out[...] = gelu * np.asarray(up, dtype=np.float64)

    def add(self, a, b, out) -> None:
        out[...] = np.asarray(a, dtype=np.float64) + np.asarray(b, dtype=np.float64)

    def snapkv_votes(self, q_window, k_pages, page_table, n_rows: int, scale: float,
                     k_dtype: str = "bf16") -> np.ndarray:
        n_q_heads, window, head_dim = q_window.shape
        n_kv_heads = k_pages.shape[1]
        group = n_q_heads // n_kv_heads
        prefix = n_rows - window
        keys = read_rows(k_pages, page_table, n_rows, k_dtype, head_dim)   # [n_kv, n_rows, d]
        votes = np.zeros((n_kv_heads, prefix))
        query_rows = prefix + np.arange(window)                            # [W]
        visible = np.arange(n_rows)[None, :] <= query_rows[:, None]        # [W, n_rows]
        for h in range(n_q_heads):                                         # O(W * n_rows) at a time
            logits = np.asarray(q_window[h], dtype=np.float64) @ keys[h // group].T * scale
            probs = _causal_softmax(logits, visible)                       # full causal row
            votes[h // group] += probs[:, :prefix].sum(axis=0)             # prefix columns only
        return votes.astype(np.float32)

    def kv_gather(self, k_pages, v_pages, page_table, keep: np.ndarray) -> None:
        page_size = k_pages.shape[2]
        keep = np.asarray(keep, dtype=np.int64)
        dst_page, dst_off = _page_slots(page_table, page_size, np.arange(keep.shape[1]))
        for h in range(keep.shape[0]):
            src_page, src_off = _page_slots(page_table, page_size, keep[h])
            for pages in (k_pages, v_pages):
                pages[dst_page, h, dst_off, :] = pages[src_page, h, src_off, :]

    def kv_copy_pages(self, src_k, src_v, dst_k, dst_v, pages, dst_pages=None):
        dst = pages if dst_pages is None else dst_pages
        dst_k[dst] = src_k[pages]                # the right side is gathered first: src may be dst
        dst_v[dst] = src_v[pages]
