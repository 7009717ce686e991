"""x86 tile dot products as numba intrinsics (LLVM IR): AVX-512 VNNI `vpdpbusd`, AVX2
`vpmaddubsw`/`vpmaddwd`, or plain vector IR for any other target.

One call computes the 16 outputs of one weight tile over all its blocks, for one
activation j (decode) or several (prefill: each block's codes unpacked once for all):
    out[j, row0 + r] = sum_b  d[t,b,r] * (sum_p dx[j,p,b] * sum_k code[t,b,k,r] * xq[j,p, b*L + k]
                                          + corr[j,b])  +  m[t,b,r] * sx[j,b]     for r < n_valid
with unsigned 8-bit codes (so `vpdpbusd` takes them as its u8 operand) and the
activation quantized to `planes` signed int8 planes (x ~ sum_p dx[p,b] * xq[p]) by
make_quant_row; `corr` undoes the offset codes are stored with and recentres the codes
so that the activation's rounding error meets codes of mean ~0.
Layouts (quant_kernels' docstring, built by quant_repack): qs u8 [T, nb, loads, R, 4],
unpacked by _block_codes into vectors of 4 codes of each of the 16 rows (nibble,
five, six bits, or a byte each); d, m the block scales [T, nb, R] (f32, f16 bits, or
K-quant 8-bit sub-block scales times the super-block's dsup, msup);
    xq, xs: the activations' int8 planes and per block dx per plane, corr and sx (the
            block sums of the activation), grouped as make_quant_row lays them out.
Each such vector holds 4 codes of each of the 16 rows, so one `vpdpbusd` against
4 broadcast activation bytes is 64 multiply-adds with no horizontal sum; per block
the i32 sums are scaled into a <16 x float> accumulator that stays in a register.
Every kernel computes the same exact integer sums (the float adds after them may be
ordered differently: results agree to a few ulps).
"""
from __future__ import annotations

import platform

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.config import env_setting

from .jit import prefetch_line

R = 16

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _codegen_features() -> dict:
    """CPU features numba compiles for: NUMBA_CPU_FEATURES when set (none at all with
    NUMBA_CPU_NAME=generic, where numba sets it to ""), else the host's."""
    from numba.core import config
    if config.CPU_FEATURES is not None:
        return {f[1:]: f[0] == "+" for f in str(config.CPU_FEATURES).split(",") if f[:1] in "+-" and f[1:]}
    return {k: bool(v) for k, v in llvm.get_host_cpu_features().items()}


def _best_kernels(features: dict) -> str:
    if features.get("avx512vnni", False):
        return "vnni"
    return "avx2" if _X86 and features.get("avx2", False) else "portable"


# The best tile kernels the compilation target runs ("vnni", "avx2" or "portable"), and
# those in use: SHARPI_CPU_KERNELS=portable forces the portable ones (tests, debugging).
AUTO_KERNELS = _best_kernels(_codegen_features())
KERNELS = AUTO_KERNELS if env_setting("cpu_kernels") == "auto" else "portable"
HAVE_VNNI = KERNELS == "vnni"
KERNEL_NAMES = {"vnni": "AVX-512 VNNI", "avx2": "AVX2", "portable": "portable vector code"}


def describe_kernels() -> str:
    """The mat-vec kernels in use, for messages and benchmark headers."""
    name = KERNEL_NAMES[KERNELS]
    return name if KERNELS == AUTO_KERNELS else f"{name}, {KERNEL_NAMES[AUTO_KERNELS]} off by SHARPI_CPU_KERNELS"


# f16 scales are widened in the kernels (fpext); x86 without F16C would need a libcall
# the JIT cannot resolve, so there the repacked scales are kept in f32.
F16_SCALES = HAVE_VNNI or not _X86 or _codegen_features().get("f16c", False)

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V8, _V32, _VF = ir.VectorType(_I8, 64), ir.VectorType(_I32, R), ir.VectorType(_F32, R)
_VH = ir.VectorType(ir.IntType(16), R)
_FAST = ("fast",)


def _splat(builder, scalar, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, vty.count), None))


def _load_scales(builder, data, off, half: bool):
    """16 scales at element `off` of an f32 array, or of f16 bits (uint16) widened."""
    if not half:
        p = builder.gep(builder.bitcast(data, _F32.as_pointer()), [off])
        return builder.load(builder.bitcast(p, _VF.as_pointer()), align=4)
    p = builder.gep(builder.bitcast(data, ir.IntType(16).as_pointer()), [off])
    h = builder.load(builder.bitcast(p, _VH.as_pointer()), align=2)
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), R)), _VF)


_V16x64, _V32x64 = ir.VectorType(ir.IntType(16), 64), ir.VectorType(_I32, 64)


def _dot4_portable(builder, acc, a, b):
    """vpdpbusd in plain vector IR, for any LLVM target: acc (i32 x16) + the sums of
    4 consecutive products of unsigned bytes `a` and signed bytes `b` (i8 x64).
    u8 * s8 fits i16 exactly; the pairwise adds widen to i32 (x86 lowers them to
    pmaddwd-style code, AArch64 to widening multiply-adds)."""
    a16 = builder.zext(a, _V16x64)
    b16 = builder.sext(b, _V16x64)
    prod = builder.sext(builder.mul(a16, b16), _V32x64)                       # i32 x64
    half = builder.add(builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, 32), list(range(0, 64, 2)))),
                       builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, 32), list(range(1, 64, 2)))))
    quad = builder.add(builder.shuffle_vector(half, half, ir.Constant(_V32, list(range(0, 32, 2)))),
                       builder.shuffle_vector(half, half, ir.Constant(_V32, list(range(1, 32, 2)))))
    return builder.add(acc, quad)


def _halves(builder, v, n):
    """Split vector v into n equal parts (an AVX2 register each)."""
    w = v.type.count // n
    return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, w), list(range(k * w, k * w + w))))
            for k in range(n)]


def _concat(builder, parts):
    """Join equal vectors, in order (a power of two of them)."""
    while len(parts) > 1:
        w = parts[0].type.count
        idx = ir.Constant(ir.VectorType(_I32, 2 * w), list(range(2 * w)))
        parts = [builder.shuffle_vector(parts[k], parts[k + 1], idx) for k in range(0, len(parts), 2)]
    return parts[0]


def _avx2_call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _maddubs(builder, a, b):
    """u8 a x s8 b (i8 x64), adjacent products summed: i16 x32 (vpmaddubsw, which saturates:
    the callers keep |sum| <= 32767)."""
    return _concat(builder, [_avx2_call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(ir.IntType(16), 16),
                                        [x, y]) for x, y in zip(_halves(builder, a, 2), _halves(builder, b, 2))])


def _maddwd(builder, a, b):
    """i16 a x i16 b (x 16k), adjacent products summed exactly: i32 x 8k (vpmaddwd)."""
    n = a.type.count // 16
    return _concat(builder, [_avx2_call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), [x, y])
                             for x, y in zip(_halves(builder, a, n), _halves(builder, b, n))])


# Codes are prefetched this far ahead of the block being dotted: a decode mat-vec streams
# weights from memory, and the hardware prefetchers alone left a core at about half its
# read bandwidth (an 8960 x 1536 Q4_K mat-vec out of cache: 0.59 -> 0.42 ms on 2 cores).
PREFETCH_BYTES = 2048


def _load64(builder, qbase, g):
    ptr = builder.bitcast(builder.gep(qbase, [ir.Constant(_I64, 64 * g)]), _V8.as_pointer())
    return builder.load(ptr, align=1)


def _nibbles(builder, v):
    """Low and high nibbles of 64 bytes, as bytes."""
    m = ir.Constant(_V8, [15] * 64)
    return builder.and_(v, m), builder.and_(builder.lshr(v, ir.Constant(_V8, [4] * 64)), m)


def _block_codes(builder, qbase, layout: str, groups: int):
    """The block's codes as (i8 x64 vector, k) pairs: byte (r, i) of the vector is code
    k + i of row r (unsigned). nibble: load g holds codes 4g+i (low) and 16+4g+i (high
    nibble); five: the same + load 4 with their fifth bits (bit 2g: code 4g+i, bit 2g+1:
    code 16+4g+i); int8: each load 4 codes a byte; six (16 codes from 3 loads): loads 0
    and 1 hold the low nibbles of codes (i, 8+i) and (4+i, 12+i), load 2 their high 2 bits,
    two each in bits (0-1, 2-3) and (4-5, 6-7)."""
    if layout == "int8":
        return [(_load64(builder, qbase, g), 4 * g) for g in range(groups)]

    def c(v):
        return ir.Constant(_V8, [v] * 64)
    if layout in ("nibble", "five"):
        out = []
        for g in range(4):
            lo, hi = _nibbles(builder, _load64(builder, qbase, g))
            out += [(lo, 4 * g), (hi, 16 + 4 * g)]
        if layout == "five":            # bit b = 2g (low nibble) or 2g + 1 (high) of load 4 -> bit 4
            h = _load64(builder, qbase, 4)
            out = [(builder.or_(v, builder.and_(builder.shl(h, c(4 - b)) if b < 4 else builder.lshr(h, c(b - 4)),
                                                c(0x10))), k) for b, (v, k) in enumerate(out)]
        return out
    (lo0, hi0), (lo1, hi1) = (_nibbles(builder, _load64(builder, qbase, g)) for g in (0, 1))
    h = _load64(builder, qbase, 2)
    top = c(0x30)
    return [(builder.or_(lo0, builder.shl(builder.and_(h, c(3)), c(4))), 0),
            (builder.or_(lo1, builder.and_(h, top)), 4),
            (builder.or_(hi0, builder.and_(builder.shl(h, c(2)), top)), 8),
            (builder.or_(hi1, builder.and_(builder.lshr(h, c(2)), top)), 12)]


def _avx2_block_sums(builder, codes, x4, small: bool, planes):
    """Per plane, the i32 x16 row sums of one block (what the vpdpbusd chain gives).
    small: codes <= 15 (nibbles), whose i16 pair sums cannot saturate over a block."""
    acc = [None] * planes
    if small:       # i16 pair sums over the block's 8 products, then pairs of pairs
        for v, k in codes:
            for p in range(planes):
                prod = _maddubs(builder, v, x4(p, k))
                acc[p] = prod if acc[p] is None else builder.add(acc[p], prod)
        ones = ir.Constant(ir.VectorType(ir.IntType(16), 32), [1] * 32)
        return [_maddwd(builder, a, ones) for a in acc]
    for v, k in codes:          # i32 pair sums [16 rows x 2], then pairs
        w = builder.zext(v, _V16x64)
        for p in range(planes):
            prod = _maddwd(builder, w, builder.sext(x4(p, k), _V16x64))
            acc[p] = prod if acc[p] is None else builder.add(acc[p], prod)
    even = ir.Constant(_V32, list(range(0, 32, 2)))
    odd = ir.Constant(_V32, list(range(1, 32, 2)))
    return [builder.add(builder.shuffle_vector(a, a, even), builder.shuffle_vector(a, a, odd)) for a in acc]


def make_tile_dot(layout: str, groups: int, planes: int, has_m: bool, kernels: str = "vnni",
                  tokens: int = 1):
    """Intrinsic tile_dot(qs, d, m, dsup, msup, xq, xs, j0, n, t, out, row0, n_valid) for one
    layout: the 16 outputs of tile t for activations j = j0 .. j0 + tokens - 1, each block's
    codes unpacked once and dotted with every one of them (prefill's mat-mat: `tokens`
    accumulators in registers), written to out[j, row0 : row0 + n_valid] for j < n (xq and
    xs hold rows up to j0 + tokens).
    layout: "nibble", "five", "six" or "int8" (see _block_codes); groups: 64-byte loads per
    block (4 for nibble = 32 codes, 5 for five = 32, 3 for six = 16; L/4 for int8).
    d, m: per-block scales (f32 or f16 bits), or K-quant sub-block scales (uint8 or int8)
    that multiply the super-block scales dsup, msup [T, nb / (256 / L), R] (f32 or f16 bits);
    unused (any array) otherwise. xq, xs: the activations quantized by make_quant_row with
    the same `tokens` (j0 a multiple of it); out f32 [n, rows] with unit stride along a row.
    kernels: "vnni" (AVX-512 VNNI `vpdpbusd`), "avx2" (nibbles: `vpmaddubsw`, whose i16
    sums cannot saturate for codes <= 15 and |activation| <= 127, summed over the
    block's 8 loads in i16 (<= 30480) then widened by `vpmaddwd`; wider codes: widened to
    i16 and multiplied by `vpmaddwd`), or "portable" (the same sums in plain vector IR)."""
    L = {"nibble": 32, "five": 32, "int8": 4 * groups, "six": 16}[layout]

    @intrinsic
    def tile_dot(typingctx, qs, d, m, dsup, msup, xq, xs, j0, n, t, out, row0, n_valid):
        sig = types.void(qs, d, m, dsup, msup, xq, xs, j0, n, t, out, row0, n_valid)
        sub_scales = d.dtype in (types.uint8, types.int8)

        def codegen(ctx, builder, signature, args):
            a_qs, a_d, a_m, a_dsup, a_msup, a_xq, a_xs = (
                ctx.make_array(ty)(ctx, builder, v) for ty, v in zip(signature.args[:7], args[:7]))
            a_out = ctx.make_array(signature.args[10])(ctx, builder, args[10])
            j0_, n_, t_, row0_, nval_ = (builder.sext(v, _I64) if v.type.width < 64 else v
                                         for v in (args[7], args[8], args[9], args[11], args[12]))
            nb = cgutils.unpack_tuple(builder, a_d.shape)[1]
            if kernels == "vnni":
                fn = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_V32, [_V32, _V8, _V8]), "llvm.x86.avx512.vpdpbusd.512")

                def dpbusd(args):
                    return builder.call(fn, args)
            else:
                def dpbusd(args):
                    return _dot4_portable(builder, *args)

            def row_ptr(a, j):        # element 0 of a[j], as a byte pointer (strides in bytes)
                stride = cgutils.unpack_tuple(builder, a.strides)[0]
                return builder.gep(builder.bitcast(a.data, _I8.as_pointer()),
                                   [builder.mul(builder.add(j0_, ir.Constant(_I64, j)), stride)])
            qs_p = builder.bitcast(a_qs.data, _I8.as_pointer())
            # the group of activations j0 .. j0 + tokens - 1 (make_quant_row's layout): one base
            # pointer, every byte of a block at a constant offset from it
            xq_g = builder.gep(builder.bitcast(a_xq.data, _I8.as_pointer()),
                               [builder.mul(j0_, builder.mul(nb, ir.Constant(_I64, planes * L)))])
            xs_g = builder.gep(builder.bitcast(a_xs.data, _F32.as_pointer()),
                               [builder.mul(j0_, builder.mul(nb, ir.Constant(_I64, planes + 2)))])
            blk0 = builder.mul(t_, nb)
            ksub = ir.Constant(_I64, 256 // L)                     # sub-blocks a super-block
            sup0 = builder.mul(t_, builder.udiv(nb, ksub)) if sub_scales else None   # tile t's first super-block

            def scales(a_sc, a_sup, sc_ty, sup_ty, b, blk):
                """The 16 rows' scales of block b: per block, or sub-block x super-block."""
                if not sub_scales:
                    return _load_scales(builder, a_sc.data, builder.mul(blk, ir.Constant(_I64, R)),
                                        sc_ty.dtype == types.uint16)
                p = builder.gep(builder.bitcast(a_sc.data, _I8.as_pointer()), [builder.mul(blk, ir.Constant(_I64, R))])
                raw = builder.load(builder.bitcast(p, ir.VectorType(_I8, R).as_pointer()), align=1)
                sub = (builder.sitofp if sc_ty.dtype == types.int8 else builder.uitofp)(raw, _VF)
                sup = builder.add(sup0, builder.udiv(b, ksub))
                return builder.fmul(_load_scales(builder, a_sup.data, builder.mul(sup, ir.Constant(_I64, R)),
                                                 sup_ty.dtype == types.uint16), sub)

            entry = builder.block
            loop = builder.append_basic_block("tile.loop")
            done = builder.append_basic_block("tile.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            b = builder.phi(_I64)
            acc = [builder.phi(_VF) for _ in range(tokens)]
            b.add_incoming(ir.Constant(_I64, 0), entry)
            for a in acc:
                a.add_incoming(ir.Constant(_VF, None), entry)

            blk = builder.add(blk0, b)
            qbase = builder.gep(qs_p, [builder.mul(blk, ir.Constant(_I64, 64 * groups))])
            xq_b = builder.gep(xq_g, [builder.mul(b, ir.Constant(_I64, planes * tokens * L))])
            xs_b = builder.gep(xs_g, [builder.mul(b, ir.Constant(_I64, (planes + 2) * tokens))])
            for line in range(groups):
                prefetch_line(builder, builder.gep(qbase, [ir.Constant(_I64, PREFETCH_BYTES + 64 * line)]))
            codes = _block_codes(builder, qbase, layout, groups)
            dv = scales(a_d, a_dsup, signature.args[1], signature.args[3], b, blk)
            mv = scales(a_m, a_msup, signature.args[2], signature.args[4], b, blk) if has_m else None
            new = []
            for j in range(tokens):
                def x4(p, k):        # 4 activation bytes of plane p at code k, broadcast
                    off = ir.Constant(_I64, (p * tokens + j) * L + k)
                    ptr = builder.bitcast(builder.gep(xq_b, [off]), _I32.as_pointer())
                    w = builder.load(ptr, align=1)
                    return builder.bitcast(_splat(builder, w, _V32), _V8)

                if kernels == "avx2":
                    sums = _avx2_block_sums(builder, codes, x4, layout == "nibble", planes)
                else:
                    sums = [ir.Constant(_V32, None)] * planes
                    for v, k in codes:
                        for p in range(planes):
                            sums[p] = dpbusd([sums[p], v, x4(p, k)])

                def xs_at(row):      # xs row `row` of activation j, block b, splat
                    off = ir.Constant(_I64, row * tokens + j)
                    return _splat(builder, builder.load(builder.gep(xs_b, [off])), _VF)

                dot = None
                for p in range(planes):
                    term = builder.fmul(builder.sitofp(sums[p], _VF), xs_at(p), flags=_FAST)
                    dot = term if dot is None else builder.fadd(dot, term, flags=_FAST)
                dot = builder.fadd(dot, xs_at(planes), flags=_FAST)
                nj = builder.fadd(acc[j], builder.fmul(dv, dot, flags=_FAST), flags=_FAST)
                if has_m:
                    nj = builder.fadd(nj, builder.fmul(mv, xs_at(planes + 1), flags=_FAST), flags=_FAST)
                new.append(nj)
            b_next = builder.add(b, ir.Constant(_I64, 1))
            b.add_incoming(b_next, builder.block)
            for a, nj in zip(acc, new):
                a.add_incoming(nj, builder.block)
            builder.cbranch(builder.icmp_signed("<", b_next, nb), loop, done)

            builder.position_at_end(done)
            lanes = ir.Constant(_V32, list(range(R)))
            mask = builder.icmp_signed("<", lanes, _splat(builder, builder.trunc(nval_, _I32), _V32))
            mstore = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [_VF, _VF.as_pointer(), _I32, ir.VectorType(ir.IntType(1), R)]),
                "llvm.masked.store.v16f32.p0")
            for j, nj in enumerate(new):
                live = builder.icmp_signed("<", builder.add(j0_, ir.Constant(_I64, j)), n_)
                with builder.if_then(live, likely=True):
                    out_p = builder.gep(builder.bitcast(row_ptr(a_out, j), _F32.as_pointer()), [row0_])
                    builder.call(mstore, [nj, builder.bitcast(out_p, _VF.as_pointer()), ir.Constant(_I32, 4), mask])
            return ctx.get_dummy_value()

        return sig, codegen

    return tile_dot


def make_quant_row(L: int, planes: int, step: float, tokens: int = 1):
    """Intrinsic quant_row(x, i, code_off, c0, xq, xs): activation x[i] (f32, unit stride
    along the row) quantized per block of L into `planes` int8 planes, as the tile kernels
    take them, activations in groups of `tokens` (i = g * tokens + j), flat arrays:
        xq i8  [groups, nb, planes, tokens, L]   codes of activation j of group g, block b
        xs f32 [groups, nb, planes + 2, tokens]  dx per plane, corr, sx
    so that a tile kernel finds every byte of a group's block at a constant offset. Per block
    dx = max|x| / 127 and plane p + 1 codes the rounding residual of plane p in steps
    `step` times finer (|codes| <= 127); sx is the block's sum and, with codes stored as
    c + code_off (c ~ c0 on average), corr = -code_off * sx_hat + c0 * (sx - sx_hat), where
    sx_hat is the sum of the dequantized activation: d * (dot_q + corr) + m * sx is then
    the dot of d * c + m with x up to d * sum (c - c0) * (x - xhat), the rounding error
    only meeting centred codes. One block is a few vector instructions (the reductions
    in tree order, the same for every row)."""
    VL, VI8 = ir.VectorType(_F32, L), ir.VectorType(_I8, L)
    units, u = [], 1.0
    for _ in range(planes):                  # each plane's step, in units of dx (f32 as numpy)
        units.append(u)
        u = float(np.float32(u) / np.float32(step))

    @intrinsic
    def quant_row(typingctx, x, i, code_off, c0, xq, xs):
        sig = types.void(x, i, code_off, c0, xq, xs)

        def codegen(ctx, builder, signature, args):
            a_x, a_xq, a_xs = (ctx.make_array(signature.args[k])(ctx, builder, args[k]) for k in (0, 4, 5))
            i_ = builder.sext(args[1], _I64) if args[1].type.width < 64 else args[1]
            off_, c0_ = (ctx.cast(builder, args[k], signature.args[k], types.float32) for k in (2, 3))

            cols = cgutils.unpack_tuple(builder, a_x.shape)[1]
            nb = builder.udiv(cols, ir.Constant(_I64, L))
            x_stride = cgutils.unpack_tuple(builder, a_x.strides)[0]          # bytes
            xr = builder.bitcast(builder.gep(builder.bitcast(a_x.data, _I8.as_pointer()),
                                             [builder.mul(i_, x_stride)]), _F32.as_pointer())
            g_, j_ = builder.udiv(i_, ir.Constant(_I64, tokens)), builder.urem(i_, ir.Constant(_I64, tokens))
            gb = builder.mul(g_, nb)                                   # the group's first block
            xq0 = builder.gep(builder.bitcast(a_xq.data, _I8.as_pointer()), [builder.mul(j_, ir.Constant(_I64, L))])
            xs0 = builder.gep(builder.bitcast(a_xs.data, _F32.as_pointer()), [j_])

            def fn(name, ret, *argt):
                return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(argt)), name)
            fadd_r = fn(f"llvm.vector.reduce.fadd.v{L}f32", _F32, _F32, VL)
            fmax_r = fn(f"llvm.vector.reduce.fmax.v{L}f32", _F32, VL)
            fabs = fn(f"llvm.fabs.v{L}f32", VL, VL)
            rint = fn(f"llvm.rint.v{L}f32", VL, VL)

            def f32(v):
                return ir.Constant(_F32, float(v))

            entry = builder.block
            loop = builder.append_basic_block("quant.loop")
            done = builder.append_basic_block("quant.done")
            builder.cbranch(builder.icmp_signed(">", nb, ir.Constant(_I64, 0)), loop, done)
            builder.position_at_end(loop)
            b = builder.phi(_I64)
            b.add_incoming(ir.Constant(_I64, 0), entry)
            o = builder.mul(b, ir.Constant(_I64, L))
            xv = builder.load(builder.bitcast(builder.gep(xr, [o]), VL.as_pointer()), align=4)
            gbb = builder.add(gb, b)
            q_blk = builder.gep(xq0, [builder.mul(gbb, ir.Constant(_I64, planes * tokens * L))])
            s_blk = builder.gep(xs0, [builder.mul(gbb, ir.Constant(_I64, (planes + 2) * tokens))])

            def s_at(r):                     # xs row r of this activation and block
                return builder.gep(s_blk, [ir.Constant(_I64, r * tokens)])
            sx = builder.call(fadd_r, [f32(-0.0), xv], fastmath=_FAST)
            amax = builder.call(fmax_r, [builder.call(fabs, [xv])], fastmath=("nnan",))
            dx = builder.fdiv(amax, f32(127))
            # a block whose step is subnormal (|x| < 1.5e-36: a GELU or SiLU gate deep in its
            # tail) codes as zeros: 1/dx would overflow to inf and turn its zeros into NaN
            inv = builder.select(builder.fcmp_ordered(">=", dx, f32(2.0 ** -126)), builder.fdiv(f32(1), dx), f32(0))
            res = builder.fmul(xv, _splat(builder, inv, VL))
            qsum = None
            for p in range(planes):
                q = builder.call(rint, [res])
                qp = builder.bitcast(builder.gep(q_blk, [ir.Constant(_I64, p * tokens * L)]), VI8.as_pointer())
                builder.store(builder.fptosi(q, VI8), qp, align=1)
                psum = builder.call(fadd_r, [f32(-0.0), q], fastmath=_FAST)     # integers: exact
                builder.store(builder.fmul(dx, f32(units[p])), s_at(p))
                term = builder.fmul(psum, f32(units[p]))
                qsum = term if qsum is None else builder.fadd(qsum, term)
                if p + 1 < planes:
                    res = builder.fmul(builder.fsub(res, q), _splat(builder, f32(step), VL))
            sx_hat = builder.fmul(qsum, dx)
            corr = builder.fadd(builder.fmul(builder.fneg(off_), sx_hat),
                                builder.fmul(c0_, builder.fsub(sx, sx_hat)))
            builder.store(corr, s_at(planes))
            builder.store(sx, s_at(planes + 1))
            b_next = builder.add(b, ir.Constant(_I64, 1))
            b.add_incoming(b_next, builder.block)
            builder.cbranch(builder.icmp_signed("<", b_next, nb), loop, done)
            builder.position_at_end(done)
            return ctx.get_dummy_value()

        return sig, codegen

    return quant_row
