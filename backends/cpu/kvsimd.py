"""Vector IR for dequantizing pieces of quantized KV rows (numba intrinsics).

numba's scalar loops do not vectorise these well: a 32-value block loop is fully
unrolled before the loop vectoriser sees it, and the unrolled stores may alias the
loads (uint8 page, f32 scratch) so SLP gives up; tq's codebook lookup would need
gathers, which LLVM's cost model refuses on AMD. So each piece is written here as
plain LLVM vector IR (what LLVM lowers for any target), and the 16-entry / 8-entry
codebook lookup is one `vpermps` where the CPU has it (AVX-512F: one zmm permute;
AVX2: ymm permutes), a tree of selects elsewhere.

    q8_block(row, byte0, d, out, at)    out[at:at+32] = d * int8 row[byte0+2 : byte0+34]
    q4_block(row, byte0, d, out, at)    out[at:at+16] = d * (low nibbles - 8),
                                        out[at+16:at+32] = d * (high nibbles - 8)
                                        of row[byte0+2 : byte0+18]
    tq4_16(row, byte0, s, cb, out, lo, hi)   out[lo:lo+16] = s * cb[low nibbles],
                                        out[hi:hi+16] = s * cb[high nibbles] of row[byte0 : byte0+16]
    tq3_8(row, byte0, s, cb, out, at, stride)   for the 8 24-bit groups at row[byte0 : byte0+24]:
                                        out[at + k*stride : +8] = s * cb[bit field k], k = 0..7
row: uint8 1-D, out: f32 1-D, cb: f32 [16]. Every load and store touches exactly
the bytes named (no over-read past a row).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .vnni import _codegen_features

_FEATURES = _codegen_features()
HAVE_AVX512F = bool(_FEATURES.get("avx512f", False))
HAVE_AVX2 = bool(_FEATURES.get("avx2", False))
HAVE_F16C = bool(_FEATURES.get("f16c", False))

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_FAST = ("fast",)


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(builder, scalar, n):
    vty = _vec(scalar.type, n)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_vec(_I32, n), [0] * n))


def _const(t, n, value):
    return ir.Constant(_vec(t, n), [value] * n)


def _idx64(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def _byte_ptr(ctx, builder, arrty, arr, offset):
    a = ctx.make_array(arrty)(ctx, builder, arr)
    return builder.gep(builder.bitcast(a.data, _I8.as_pointer()), [_idx64(builder, offset)])


def _f32_ptr(ctx, builder, arrty, arr, offset):
    a = ctx.make_array(arrty)(ctx, builder, arr)
    return builder.gep(builder.bitcast(a.data, _F32.as_pointer()), [_idx64(builder, offset)])


def _load(builder, ptr, vty):
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _store(builder, value, ptr):
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=4)


def _lanes(builder, v, idx):
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, len(idx)), list(idx)))


def _permps8(builder, table8, idx8):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_vec(_F32, 8), [_vec(_F32, 8), _vec(_I32, 8)]),
        "llvm.x86.avx2.permps")
    return builder.call(fn, [table8, idx8])


def _lookup(builder, table, idx, entries):
    """table <16 x float> (entries used), idx <n x i32> in [0, entries) -> <n x float>."""
    n = idx.type.count
    if HAVE_AVX512F and n == 16:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_vec(_F32, 16), [_vec(_F32, 16), _vec(_I32, 16)]),
            "llvm.x86.avx512.permvar.sf.512")
        return builder.call(fn, [table, idx])
    if HAVE_AVX2 and n in (8, 16):
        lo_t = _lanes(builder, table, range(8))
        hi_t = _lanes(builder, table, range(8, 16))
        parts = []
        for p in range(n // 8):
            i8 = _lanes(builder, idx, range(8 * p, 8 * p + 8))
            v = _permps8(builder, lo_t, i8)          # vpermps uses the low 3 bits of each index
            if entries > 8:
                high = builder.icmp_unsigned("!=", builder.and_(i8, _const(_I32, 8, 8)), _const(_I32, 8, 0))
                v = builder.select(high, _permps8(builder, hi_t, i8), v)
            parts.append(v)
        if len(parts) == 1:
            return parts[0]
        return builder.shuffle_vector(parts[0], parts[1], ir.Constant(_vec(_I32, 16), list(range(16))))
    # portable: a binary tree of selects on the index bits
    level = [_splat(builder, builder.extract_element(table, ir.Constant(_I32, e)), n)
             for e in range(entries)]
    bit = 1
    while len(level) > 1:
        on = builder.icmp_unsigned("!=", builder.and_(idx, _const(_I32, n, bit)), _const(_I32, n, 0))
        level = [builder.select(on, b, a) for a, b in zip(level[::2], level[1::2])]
        bit <<= 1
    return level[0]


def _load_table(ctx, builder, arrty, arr):
    return builder.load(builder.bitcast(_f32_ptr(ctx, builder, arrty, arr, ir.Constant(_I64, 0)),
                                        _vec(_F32, 16).as_pointer()), align=4)


@intrinsic
def q8_block(typingctx, row, byte0, d, out, at):
    sig = types.void(row, byte0, d, out, at)

    def codegen(ctx, builder, signature, args):
        a_row, a_b0, a_d, a_out, a_at = args
        start = builder.add(_idx64(builder, a_b0), ir.Constant(_I64, 2))
        q = _load(builder, _byte_ptr(ctx, builder, signature.args[0], a_row, start), _vec(_I8, 32))
        f = builder.fmul(builder.sitofp(q, _vec(_F32, 32)), _splat(builder, a_d, 32), flags=_FAST)
        _store(builder, f, _f32_ptr(ctx, builder, signature.args[3], a_out, a_at))
        return ctx.get_dummy_value()
    return sig, codegen


@intrinsic
def q4_block(typingctx, row, byte0, d, out, at):
    sig = types.void(row, byte0, d, out, at)

    def codegen(ctx, builder, signature, args):
        a_row, a_b0, a_d, a_out, a_at = args
        start = builder.add(_idx64(builder, a_b0), ir.Constant(_I64, 2))
        q = _load(builder, _byte_ptr(ctx, builder, signature.args[0], a_row, start), _vec(_I8, 16))
        dv = _splat(builder, a_d, 16)
        eight = _const(_F32, 16, 8.0)
        at = _idx64(builder, a_at)
        for half, nib in enumerate((builder.and_(q, _const(_I8, 16, 15)),
                                    builder.lshr(q, _const(_I8, 16, 4)))):
            f = builder.fsub(builder.uitofp(nib, _vec(_F32, 16)), eight, flags=_FAST)
            f = builder.fmul(f, dv, flags=_FAST)
            _store(builder, f, _f32_ptr(ctx, builder, signature.args[3], a_out,
                                        builder.add(at, ir.Constant(_I64, 16 * half))))
        return ctx.get_dummy_value()
    return sig, codegen


@intrinsic
def tq4_16(typingctx, row, byte0, s, cb, out, lo, hi):
    sig = types.void(row, byte0, s, cb, out, lo, hi)

    def codegen(ctx, builder, signature, args):
        a_row, a_b0, a_s, a_cb, a_out, a_lo, a_hi = args
        q = _load(builder, _byte_ptr(ctx, builder, signature.args[0], a_row, a_b0), _vec(_I8, 16))
        table = _load_table(ctx, builder, signature.args[3], a_cb)
        sv = _splat(builder, a_s, 16)
        for nib, at in ((builder.and_(q, _const(_I8, 16, 15)), a_lo),
                        (builder.lshr(q, _const(_I8, 16, 4)), a_hi)):
            f = _lookup(builder, table, builder.zext(nib, _vec(_I32, 16)), 16)
            _store(builder, builder.fmul(f, sv, flags=_FAST),
                   _f32_ptr(ctx, builder, signature.args[4], a_out, at))
        return ctx.get_dummy_value()
    return sig, codegen


@intrinsic
def tq3_8(typingctx, row, byte0, s, cb, out, at, stride):
    sig = types.void(row, byte0, s, cb, out, at, stride)

    def codegen(ctx, builder, signature, args):
        a_row, a_b0, a_s, a_cb, a_out, a_at, a_stride = args
        raw = _load(builder, _byte_ptr(ctx, builder, signature.args[0], a_row, a_b0), _vec(_I8, 24))
        word = None
        for k in range(3):                           # byte k of each 3-byte group
            b = builder.zext(_lanes(builder, raw, range(k, 24, 3)), _vec(_I32, 8))
            if k:
                b = builder.shl(b, _const(_I32, 8, 8 * k))
            word = b if word is None else builder.or_(word, b)
        table = _load_table(ctx, builder, signature.args[3], a_cb)
        sv = _splat(builder, a_s, 8)
        at = _idx64(builder, a_at)
        stride = _idx64(builder, a_stride)
        for k in range(8):
            idx = builder.and_(builder.lshr(word, _const(_I32, 8, 3 * k)), _const(_I32, 8, 7))
            f = builder.fmul(_lookup(builder, table, idx, 8), sv, flags=_FAST)
            off = builder.add(at, builder.mul(stride, ir.Constant(_I64, k)))
            _store(builder, f, _f32_ptr(ctx, builder, signature.args[4], a_out, off))
        return ctx.get_dummy_value()
    return sig, codegen


@intrinsic
def f16_at(typingctx, row, byte0):
    """The f16 at row[byte0 : byte0+2] (little-endian) as f32, by `vcvtph2ps` (F16C hosts
    only: elsewhere LLVM would call a runtime routine the JIT cannot resolve)."""
    sig = types.float32(row, byte0)

    def codegen(ctx, builder, signature, args):
        ptr = builder.bitcast(_byte_ptr(ctx, builder, signature.args[0], args[0], args[1]),
                              ir.HalfType().as_pointer())
        return builder.fpext(builder.load(ptr, align=1), _F32)
    return sig, codegen
