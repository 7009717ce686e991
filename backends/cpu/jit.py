"""numba settings and the scalar helpers every CPU kernel module shares: bit casts,
bf16 and f16 <-> f32 conversions (the rounding of backends/bf16.py and of numpy's
float16), an f32 expf that vectorises, and a software prefetch.

f16 is converted with integer arithmetic, not LLVM's `half` type: x86 without F16C
would lower that to a libcall the JIT cannot resolve (see vnni.F16_SCALES).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

# fastmath without nnan/ninf: the kernels rely on -inf (empty softmax state) and
# on NaN propagating (tests poison unused page slots with NaN).
# nogil: a kernel run by the server's worker thread lets the event loop (health checks,
# streams, disconnects) run meanwhile.
_JIT = dict(cache=True, nogil=True, fastmath={"reassoc", "contract", "arcp", "nsz", "afn"})
# No fastmath at all: quantizers that must round exactly as a C reference does
# (no reassociation, no FMA contraction, x / c never turned into x * (1 / c)).
_JIT_EXACT = dict(cache=True, nogil=True)
# @overload implementations: not cached on their own. Their dispatchers are made when a
# caller is compiled, after the package's import, outside its source-hashed cache folder
# (backends/cpu/__init__.py), where a cached copy would outlive a change to the helpers
# it inlines; the callers' cached code holds them.
_OVERLOAD = {k: v for k, v in _JIT.items() if k != "cache"}
_OVERLOAD_EXACT = {k: v for k, v in _JIT_EXACT.items() if k != "cache"}
_NEG_INF = -np.inf


# -- bit casts ---------------------------------------------------------------
@intrinsic
def _bits_f32(typingctx, bits):
    """uint32 -> float32 with the same bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _f32_bits(typingctx, value):
    """float32 -> uint32 with the same bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


# -- bf16 --------------------------------------------------------------------
@njit(inline="always", **_JIT)
def _bf16_to_f32(b):
    return _bits_f32(np.uint32(b) << np.uint32(16))


@njit(inline="always", **_JIT)
def _f32_to_bf16(x):
    """Round to nearest even; NaN stays a quiet NaN."""
    u = _f32_bits(np.float32(x))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    return np.uint16((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16))


def _as_f32(x):
    """A stored value as f32: bf16 bits (uint16) widened, f32 (dequantized scratch) as
    is, so one loop reads either."""


@overload(_as_f32, inline="always", jit_options=_OVERLOAD)
def _as_f32_impl(x):
    if x == types.uint16:
        return lambda x: _bits_f32(np.uint32(x) << np.uint32(16))
    if x == types.float32:
        return lambda x: x
    return None


# -- f16 ---------------------------------------------------------------------
_TWO_112 = np.float32(2.0 ** 112)


@njit(inline="always", **_JIT)
def _f16_to_f32(lo, hi):
    """f16 stored little-endian in bytes lo, hi -> f32, exact. Subnormals come out
    of the multiply (an f32 denormal times 2^112); inf and NaN keep their class."""
    h = np.uint32(lo) | (np.uint32(hi) << np.uint32(8))
    mag = _bits_f32((h & np.uint32(0x7FFF)) << np.uint32(13)) * _TWO_112
    if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
        mag = _bits_f32(((h & np.uint32(0x3FF)) << np.uint32(13)) | np.uint32(0x7F800000))
    if h & np.uint32(0x8000):
        mag = -mag
    return mag


@njit(inline="always", **_JIT_EXACT)
def _f32_to_f16(x):
    """f32 -> f16 bits (uint16), round to nearest even, as numpy's astype(float16):
    overflow to inf from 65520 up, NaN to a quiet NaN."""
    u = _f32_bits(np.float32(x))
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):                       # NaN
        h = np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
    elif a >= np.uint32(0x477FF000):                    # >= 65520 (and inf): inf
        h = np.uint32(0x7C00)
    elif a >= np.uint32(0x38800000):                    # normal f16 (>= 2^-14)
        h = (a - np.uint32(0x38000000) + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) \
            >> np.uint32(13)
    elif a < np.uint32(0x33000000):                     # below 2^-25: zero
        h = np.uint32(0)
    else:                                               # f16 subnormal: sig * 2^(e-150) / 2^-24
        shift = np.uint32(126) - (a >> np.uint32(23))   # 14 .. 24
        sig = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        h = sig >> shift
        rem = sig & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (h & np.uint32(1))):
            h += np.uint32(1)
    return np.uint16(sign | h)


# -- expf, prefetch ----------------------------------------------------------
@njit(inline="always", **_JIT)
def _exp_f32(x):
    """expf, all in f32 so it vectorises 16-wide (Cephes polynomial, ~1 ulp).
    Underflows to 0 below -87.3 (exp(-inf) = 0); NaN stays NaN."""
    xc = min(max(x, np.float32(-87.33654)), np.float32(88.0))
    n = np.float32(math.floor(xc * np.float32(1.442695040888963) + np.float32(0.5)))
    r = xc - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r * r + r + np.float32(1.0)) * _bits_f32(np.uint32(np.int32(n) + 127) << np.uint32(23))
    if x < np.float32(-87.33654):
        y = np.float32(0.0)
    if x != x:
        y = x
    return y


def prefetch_line(builder, ptr) -> None:
    """LLVM IR: prefetch (read, keep in all cache levels) the cache line at i8* ptr
    (never faults, also past an array's end)."""
    i32 = ir.IntType(32)
    fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
        ir.VoidType(), [ptr.type, i32, i32, i32]))
    builder.call(fn, [ptr, i32(0), i32(3), i32(1)])


@intrinsic
def _prefetch(typingctx, arr, byte_off):
    """Prefetch the cache line at arr's data + byte_off."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        prefetch_line(builder, builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [args[1]]))
        return context.get_dummy_value()
    return types.none(arr, types.int64), codegen
