"""KV row formats: how one KV head's row of `head_dim` values is stored in a page.

Pages are `[n_pages, n_kv_heads, page_size, row_width]` arrays of `storage`:

    bf16   uint16 [.., head_dim]          2 bytes per value (the default)
    q8_0   uint8  [.., 34 * head_dim/32]  ggml block_q8_0 per 32 values: f16 d, 32 x int8
    q4_0   uint8  [.., 18 * head_dim/32]  ggml block_q4_0 per 32 values: f16 d, 16 bytes of
                                          nibbles (value j low nibble, value j+16 high)
    tq4    uint8  [.., 2 + head_dim/2]    TurboQuant-style: f16 s, 4-bit codes
    tq3    uint8  [.., 2 + 3*head_dim/8]  TurboQuant-style: f16 s, 3-bit codes
    rq4_0  uint8  [.., 18 * head_dim/32]  q4_0 blocks of the Walsh-Hadamard-rotated row

q8_0 and q4_0 round exactly as ggml's reference quantizers (quantize_row_q8_0_ref,
quantize_row_q4_0_ref), so a row holds the bytes llama.cpp's quantized cache would.

tq4 / tq3 (after TurboQuant, arXiv 2504.19874, its MSE quantizer without the QJL
residual): rotate the row by a fixed random orthogonal matrix R (so every coordinate
of the rotated row y = R x is close to N(0, |x|^2 / head_dim) whatever the row looked
like), quantize each coordinate of y / sigma (sigma = |x| / sqrt(head_dim)) to the
nearest level of the Lloyd-Max codebook c of the standard normal, and store one scale
s = <y, c[codes]> / |c[codes]|^2 (the least-squares fit, which never does worse than
sigma). The row reads back as x^ = R^T (s c[codes]). Attention need not rotate back
every row: q . x^ = (R q) . (s c[codes]) and sum_j p_j x^_j = R^T sum_j p_j s_j c[codes_j],
so a kernel rotates the query once and the output once per head.
Codes: tq4 packs value 2j in the low nibble of byte j and 2j+1 in the high nibble;
tq3 packs each 8 values into 3 bytes, value i of the group at bits 3i..3i+2 of the
little-endian 24-bit word.

rq4_0 is what llama.cpp's q4_0 cache stores since it rotates quantized caches (its
`attn_rot_k` / `attn_rot_v`): the row times a normalized Walsh-Hadamard matrix H
(Sylvester's construction, as ggml_gen_hadamard; block-diagonal in blocks of 64 values,
llama.cpp's block for values, or the largest power of two dividing head_dim below
that), then ggml's q4_0 quantizer. H = H^T = H^-1 spreads a row's outlier channels
over its block, so the per-32 scales fit the values better: on the default model a
third of q4_0's attention KL (README). Rows read back in the rotated basis like tq's
(q . x^ = (H q) . y), so kernels read them as q4_0 rows and rotate queries and outputs.

Everything here is numpy on the host: the oracle the backends' kernels are tested
against, and the tables (rotation, codebook) the kernels upload.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from engine.errors import ConfigError

from .bf16 import bf16_to_f32, f32_to_bf16

KV_DTYPES = ("bf16", "q8_0", "q4_0", "tq4", "tq3", "rq4_0")
QK = 32                      # values per q8_0 / q4_0 block
TQ_BITS = {"tq4": 4, "tq3": 3}
ROTATION_SEED = 20250425     # the rotation is a fixed function of head_dim
HADAMARD_BLOCK = 64          # rq4_0's Walsh-Hadamard block (llama.cpp's attn_rot_v block)


def parse_kv_dtype(text: str, what: str = "KV dtype") -> tuple[str, str]:
    """"tq4" -> ("tq4", "tq4"); "q8_0/tq4" -> keys q8_0, values tq4."""
    parts = [p.strip() for p in str(text).strip().lower().split("/")]
    if len(parts) > 2 or any(p not in KV_DTYPES for p in parts):
        raise ConfigError(f"{what} must be one of {', '.join(KV_DTYPES)} or KEYS/VALUES "
                          f"(e.g. q8_0/tq4), got {text!r}")
    return (parts[0], parts[-1])


def row_layout(name: str) -> str:
    """The dtype whose row layout a dtype's rows have: rq4_0 rows are q4_0 rows (of the
    rotated row), the others their own. Kernels that only move or read rows in the
    rotated basis treat a dtype as its layout."""
    return "q4_0" if name == "rq4_0" else name


def is_rotated(name: str) -> bool:
    """Whether a dtype's rows hold y = R x (KvFormat.rotation), read back in that basis:
    tq4, tq3, rq4_0."""
    return name in TQ_BITS or name == "rq4_0"


def rotation_kind(name: str) -> str | None:
    """Which rotation a dtype's rows use: "tq" (kvformat.rotation, shared by tq4 and tq3),
    "rq4_0" (walsh_hadamard) or None; backends key their uploaded tables by it."""
    return "tq" if name in TQ_BITS else ("rq4_0" if name == "rq4_0" else None)


def kv_dtype_name(k_dtype: str, v_dtype: str) -> str:
    """The inverse of parse_kv_dtype: "tq4" or "q8_0/tq4"."""
    return k_dtype if k_dtype == v_dtype else f"{k_dtype}/{v_dtype}"


@dataclass(frozen=True)
class KvSpec:
    """A cache's row formats: keys `k` and values `v` in every layer but the ranges of
    `layers`, each (first, last, k, v) inclusive, sorted and disjoint. Spelled as
    --kv-dtype takes it: "rq4_0", "q8_0/rq4_0", or with layer exceptions after colons,
    "rq4_0:0=q8_0/rq4_0" (layer 0's keys q8_0) or "tq4:0-1=q8_0:23=q8_0"."""
    k: str = "bf16"
    v: str = "bf16"
    layers: tuple = ()
    named: int = field(default=-1, compare=False)    # the highest layer the spelling named

    @classmethod
    def parse(cls, text, what: str = "KV dtype") -> "KvSpec":
        """The spec a spelling names, exceptions sorted, those equal to the rest dropped
        and neighbours in the same formats joined; one-line ConfigError when malformed."""
        if isinstance(text, KvSpec):
            return text
        head, *rest = str(text).strip().lower().split(":")
        k, v = parse_kv_dtype(head, what)
        layers = []
        for part in rest:
            span, _, fmt = part.partition("=")
            span = span.strip()
            m = re.fullmatch(r"([0-9]{1,6})(?:-([0-9]{1,6}))?", span) if _ else None
            if m is None:
                raise ConfigError(f"{what}: a layer exception is LAYER=FORMAT or FIRST-LAST=FORMAT "
                                  f"(e.g. rq4_0:0=q8_0/rq4_0), got {part!r} in {text!r}")
            lo, hi = int(m[1]), int(m[2] or m[1])
            if hi < lo:
                raise ConfigError(f"{what}: layer range {span} runs backwards in {text!r}")
            layers.append((lo, hi, *parse_kv_dtype(fmt, what)))
        layers.sort()
        for a, b in zip(layers, layers[1:]):
            if b[0] <= a[1]:
                raise ConfigError(f"{what}: layer {b[0]} is named twice in {text!r}")
        return replace(cls._joined(k, v, layers), named=max((hi for _, hi, *_ in layers), default=-1))

    @classmethod
    def _joined(cls, k: str, v: str, layers) -> "KvSpec":
        out = []
        for lo, hi, lk, lv in layers:
            if (lk, lv) == (k, v):
                continue
            if out and out[-1][1] + 1 == lo and out[-1][2:] == (lk, lv):
                out[-1] = (out[-1][0], hi, lk, lv)
            else:
                out.append((lo, hi, lk, lv))
        return cls(k, v, tuple(out))

    def for_layers(self, n_layers: int) -> "KvSpec":
        """The canonical spec of the same formats on an n_layers model: the rest in the
        formats most layers have (a tie: the lowest layer's), so every spelling of one
        layout has one name ("q8_0/rq4_0:1-23=rq4_0" on 24 layers is "rq4_0:0=q8_0/rq4_0")."""
        self.check_layers(n_layers)
        per = [self.at(i) for i in range(n_layers)]
        k, v = max(dict.fromkeys(per), key=per.count)
        return self._joined(k, v, [(i, i, *f) for i, f in enumerate(per)])

    @property
    def name(self) -> str:
        """The canonical spelling (parse(spec.name) == spec)."""
        parts = [kv_dtype_name(self.k, self.v)]
        for lo, hi, k, v in self.layers:
            parts.append(f"{lo}{'' if hi == lo else f'-{hi}'}={kv_dtype_name(k, v)}")
        return ":".join(parts)

    @property
    def dtypes(self) -> tuple[str, ...]:
        """Every row format the spec names, each once."""
        return tuple(dict.fromkeys([self.k, self.v] + [d for *_, k, v in self.layers for d in (k, v)]))

    def at(self, layer: int) -> tuple[str, str]:
        """(keys, values) of one layer."""
        for lo, hi, k, v in self.layers:
            if lo <= layer <= hi:
                return k, v
        return self.k, self.v

    def check_layers(self, n_layers: int) -> None:
        """ConfigError unless every layer exception names a layer of an n_layers model."""
        last = max(self.named, self.layers[-1][1] if self.layers else -1)
        if last >= n_layers:       # (also an exception in the default formats: a typo all the same)
            raise ConfigError(f"a layer exception of KV dtype {self.name} names layer {last}, but the model has "
                              f"{n_layers} layers (0-{n_layers - 1})")


@dataclass(frozen=True)
class KvFormat:
    """One storage format at one head_dim. `KvFormat.get(name, head_dim)` validates."""
    name: str
    head_dim: int

    @staticmethod
    @lru_cache(maxsize=None)
    def get(name: str, head_dim: int) -> "KvFormat":
        if name not in KV_DTYPES:
            raise ConfigError(f"KV dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
        if name in ("q8_0", "q4_0", "rq4_0") and head_dim % QK:
            raise ConfigError(f"KV dtype {name} needs a head_dim divisible by {QK}, got {head_dim}")
        if name in TQ_BITS and head_dim % 8:
            raise ConfigError(f"KV dtype {name} needs a head_dim divisible by 8, got {head_dim}")
        return KvFormat(name, head_dim)

    # -- layout ---------------------------------------------------------------------
    @property
    def storage(self):
        return np.uint16 if self.name == "bf16" else np.uint8

    @property
    def row_bytes(self) -> int:
        d = self.head_dim
        return {"bf16": 2 * d, "q8_0": 34 * d // QK, "q4_0": 18 * d // QK, "rq4_0": 18 * d // QK,
                "tq4": 2 + d // 2, "tq3": 2 + 3 * d // 8}[self.name]

    @property
    def row_width(self) -> int:
        """Elements of `storage` per row (the pages' last axis)."""
        return self.head_dim if self.name == "bf16" else self.row_bytes

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.row_bytes / self.head_dim

    @property
    def blocks(self) -> str:
        return row_layout(self.name)

    @property
    def rotated(self) -> bool:
        return is_rotated(self.name)

    @property
    def rotation(self) -> np.ndarray | None:
        """f32 [head_dim, head_dim] orthogonal R of a rotated format (y = R x, rows of R
        the rotated basis; x^ = y @ R), read-only; None for the others."""
        if self.name in TQ_BITS:
            return rotation(self.head_dim)
        return walsh_hadamard(self.head_dim) if self.name == "rq4_0" else None

    def page_shape(self, n_pages: int, n_kv_heads: int, page_size: int) -> tuple[int, int, int, int]:
        return (n_pages, n_kv_heads, page_size, self.row_width)

    # -- values ---------------------------------------------------------------------
    def quantize(self, x: np.ndarray) -> np.ndarray:
        """f32 [..., head_dim] -> storage [..., row_width]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"{self.name}: rows of {x.shape[-1]} values, expected {self.head_dim}")
        if self.name == "bf16":
            return f32_to_bf16(x)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.head_dim)
        if self.name == "rq4_0":
            rows = rows @ self.rotation.T
        out = {"q8_0": _q8_0, "q4_0": _q4_0, "rq4_0": _q4_0}.get(self.name, self._tq)(rows)
        return out.reshape(*lead, self.row_bytes)

    def dequantize(self, rows: np.ndarray) -> np.ndarray:
        """storage [..., row_width] -> f32 [..., head_dim] (what attention reads)."""
        rows = np.asarray(rows)
        if self.rotated:
            y = self.dequantize_rotated(rows)
            return (y.reshape(-1, self.head_dim) @ self.rotation).reshape(y.shape)
        return self._dequantize_blocks(rows)

    def _dequantize_blocks(self, rows: np.ndarray) -> np.ndarray:
        """bf16 / q8_0 / q4_0 (and rq4_0's q4_0 blocks) -> f32 as stored."""
        if self.name == "bf16":
            return bf16_to_f32(rows)
        lead = rows.shape[:-1]
        blocks = np.ascontiguousarray(rows, dtype=np.uint8).reshape(-1, self.head_dim // QK, self.row_bytes * QK // self.head_dim)
        d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)     # [n, nb]
        if self.blocks == "q8_0":
            q = blocks[:, :, 2:].view(np.int8).astype(np.float32)                  # [n, nb, 32]
        else:
            qs = blocks[:, :, 2:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32) - 8.0
        return (q * d[..., None]).reshape(*lead, self.head_dim)

    def dequantize_rotated(self, rows: np.ndarray) -> np.ndarray:
        """Rows of a rotated format [..., row_bytes] -> f32 [..., head_dim]: the row in
        the rotated basis (x^ = that @ self.rotation); tq: s * c[codes]."""
        if self.name == "rq4_0":
            return self._dequantize_blocks(rows)
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        lead = rows.shape[:-1]
        flat = rows.reshape(-1, self.row_bytes)
        s = flat[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)            # [n]
        codes = _unpack(flat[:, 2:], TQ_BITS[self.name], self.head_dim)
        y = codebook(TQ_BITS[self.name])[codes] * s[:, None]
        return y.reshape(*lead, self.head_dim)

    def _tq(self, rows: np.ndarray) -> np.ndarray:
        bits = TQ_BITS[self.name]
        d = self.head_dim
        y = rows @ rotation(d).T                                                     # [n, d] f32
        sigma = np.sqrt((y.astype(np.float64) ** 2).sum(axis=1) / d).astype(np.float32)
        inv = np.where(sigma > 0, 1.0 / np.where(sigma > 0, sigma, 1), 0).astype(np.float32)
        codes = np.searchsorted(boundaries(bits), y * inv[:, None]).astype(np.uint8)   # [n, d]
        c = codebook(bits)[codes]
        s = (y * c).sum(axis=1, dtype=np.float64) / np.maximum((c * c).sum(axis=1, dtype=np.float64), 1e-30)
        out = np.empty((rows.shape[0], self.row_bytes), dtype=np.uint8)
        out[:, :2] = s.astype(np.float16)[:, None].view(np.uint8)
        out[:, 2:] = _pack(codes, bits)
        return out


# -- ggml block quantizers (reference rounding) --------------------------------------
def _round_away(v: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero. (Not trunc(v + copysign(0.5, v)): for
    v = 0.49999997 the f32 sum rounds up to 1.0, where roundf gives 0.)"""
    t = np.trunc(v)
    return np.where(np.abs(v - t) >= np.float32(0.5), t + np.sign(v), t).astype(v.dtype)


def _q8_0(rows: np.ndarray) -> np.ndarray:
    n, dim = rows.shape
    xb = rows.reshape(n, dim // QK, QK)
    d = np.abs(xb).max(axis=2) / np.float32(127)                                     # f32 [n, nb]
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = _round_away(xb * inv[..., None]).astype(np.int8)
    out = np.empty((n, dim // QK, 34), dtype=np.uint8)
    out[:, :, :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(n, -1)


def _q4_0(rows: np.ndarray) -> np.ndarray:
    n, dim = rows.shape
    xb = rows.reshape(n, dim // QK, QK)
    pick = np.abs(xb).argmax(axis=2)                                                 # first largest |x|
    mx = np.take_along_axis(xb, pick[..., None], axis=2)[..., 0]
    d = (mx / np.float32(-8)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(np.trunc(xb * inv[..., None] + np.float32(8.5)), 15).astype(np.uint8)
    out = np.empty((n, dim // QK, 18), dtype=np.uint8)
    out[:, :, :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 2:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    return out.reshape(n, -1)


# -- TurboQuant tables ----------------------------------------------------------------
@lru_cache(maxsize=None)
def rotation(head_dim: int) -> np.ndarray:
    """f32 [head_dim, head_dim] orthogonal, read-only: Q of the QR factorisation of a
    seeded standard-normal matrix, signs fixed so diag(R) > 0 (a Haar-random rotation)."""
    g = np.random.default_rng(ROTATION_SEED + head_dim).standard_normal((head_dim, head_dim))
    q, r = np.linalg.qr(g)
    q *= np.sign(np.diag(r))[None, :]
    out = np.ascontiguousarray(q.T, dtype=np.float32)     # rows are the rotated basis
    out.setflags(write=False)
    return out


@lru_cache(maxsize=None)
def walsh_hadamard(head_dim: int) -> np.ndarray:
    """f32 [head_dim, head_dim] symmetric orthogonal, read-only: block-diagonal normalized
    Walsh-Hadamard matrices (Sylvester: H[i, j] = (-1)^popcount(i & j) / sqrt(b)) of b =
    the largest power of two dividing head_dim, at most HADAMARD_BLOCK."""
    b = 1
    while b < HADAMARD_BLOCK and head_dim % (2 * b) == 0:
        b *= 2
    i = np.arange(b)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    h = np.where(parity, -1.0, 1.0) / math.sqrt(b)
    out = np.ascontiguousarray(np.kron(np.eye(head_dim // b), h), dtype=np.float32)
    out.setflags(write=False)
    return out


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@lru_cache(maxsize=None)
def codebook(bits: int) -> np.ndarray:
    """f32 [2**bits] ascending, read-only: the Lloyd-Max levels of the standard normal
    (each level the mean of its cell, each boundary the midpoint of two levels)."""
    n = 1 << bits
    levels = [(-3.0 + 6.0 * (i + 0.5) / n) for i in range(n)]
    for _ in range(500):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        new = []
        for lo, hi in zip(edges, edges[1:]):
            mass = _cdf(hi) - _cdf(lo)
            new.append(((_phi(lo) if lo > -math.inf else 0.0) - (_phi(hi) if hi < math.inf else 0.0)) / mass)
        if max(abs(a - b) for a, b in zip(new, levels)) < 1e-12:
            levels = new
            break
        levels = new
    out = np.array(levels, dtype=np.float32)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=None)
def boundaries(bits: int) -> np.ndarray:
    """f32 [2**bits - 1]: the midpoints between codebook levels (code = searchsorted)."""
    c = codebook(bits)
    out = ((c[1:] + c[:-1]) / 2).astype(np.float32)
    out.setflags(write=False)
    return out


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [n, d] -> packed bytes [n, d * bits / 8]."""
    n, d = codes.shape
    if bits == 4:
        return codes[:, 0::2] | (codes[:, 1::2] << 4)
    g = codes.reshape(n, d // 8, 8).astype(np.uint32)
    word = (g << (3 * np.arange(8, dtype=np.uint32))).sum(axis=2, dtype=np.uint32)   # [n, d/8]
    return np.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], axis=2).astype(np.uint8).reshape(n, -1)


def _unpack(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    """The inverse of _pack: packed bytes [n, d * bits / 8] -> uint8 codes [n, d]."""
    n = packed.shape[0]
    if bits == 4:
        out = np.empty((n, d), dtype=np.uint8)
        out[:, 0::2] = packed & 0x0F
        out[:, 1::2] = packed >> 4
        return out
    b = packed.reshape(n, d // 8, 3).astype(np.uint32)
    word = b[:, :, 0] | (b[:, :, 1] << 8) | (b[:, :, 2] << 16)                       # [n, d/8]
    return ((word[:, :, None] >> (3 * np.arange(8, dtype=np.uint32))) & 7).astype(np.uint8).reshape(n, d)
