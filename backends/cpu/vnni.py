"""x86 tile dot products as numba intrinsics (LLVM IR): AVX-512 VNNI `vpdpbusd`, AVX2
`vpmaddubsw`/`vpmaddwd`, or plain vector IR for any other target.

One call computes the 16 outputs of one weight tile over all its blocks:
    out[row0 + r] = sum_b  d[t,b,r] * (sum_p dx[p,b] * sum_k code[t,b,k,r] * xq[p, b*L + k]
                                       + corr[b])  +  m[t,b,r] * sx[b]     for r < n_valid
with unsigned 8-bit codes (so `vpdpbusd` takes them as its u8 operand) and the
activation quantized to `planes` signed int8 planes (x ~ sum_p dx[p,b] * xq[p]);
`corr` (built by the caller) undoes the +128 of int8-family codes and recentres
the codes so that the activation's rounding error meets codes of mean ~0.
Layouts (see quant_repack):
    nibble: qs u8 [T, nb, 4, R, 4]  byte (g, r, i) = code 4g+i | code 16+4g+i << 4
    int8:   qs u8 [T, nb, G, R, 4]  byte (g, r, i) = code 4g+i + 128, L = 4G codes
    d, m:   f32 [T, nb, R], or uint16 f16 bits [T, nb, R] where f16 holds them exactly
    xq:     i8 [planes, nb*L]; xs f32 [planes + 2, nb]: dx per plane, corr, sx (the
            exact block sums of the activation).
Each 64-byte load holds 4 codes of each of the 16 rows, so one `vpdpbusd` against
4 broadcast activation bytes is 64 multiply-adds with no horizontal sum; per block
the i32 sums are scaled into a <16 x float> accumulator that stays in a register.
Every kernel computes the same exact integer sums (the float adds after them may be
ordered differently: results agree to a few ulps).
"""
from __future__ import annotations

import platform

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.config import env_setting

R = 16

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _codegen_features() -> dict:
    """CPU features numba compiles for: NUMBA_CPU_FEATURES when set, else the host's."""
    from numba.core import config
    if config.CPU_FEATURES:
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
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_V32, None))


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


def _load64(builder, qbase, g):
    ptr = builder.bitcast(builder.gep(qbase, [ir.Constant(_I64, 64 * g)]), _V8.as_pointer())
    return builder.load(ptr, align=1)


def _nibbles(builder, v):
    """Low and high nibbles of 64 bytes, as bytes."""
    m = ir.Constant(_V8, [15] * 64)
    return builder.and_(v, m), builder.and_(builder.lshr(v, ir.Constant(_V8, [4] * 64)), m)


def _avx2_block_sums(builder, qbase, x4, nibble, groups, planes):
    """Per plane, the i32 x16 row sums of one block (what the vpdpbusd chain gives)."""
    if nibble:      # i16 pair sums over the block's 8 products, then pairs of pairs
        acc = [None] * planes
        for g in range(groups):
            lo, hi = _nibbles(builder, _load64(builder, qbase, g))
            for p in range(planes):
                for half, k in ((lo, 4 * g), (hi, 16 + 4 * g)):
                    prod = _maddubs(builder, half, x4(p, k))
                    acc[p] = prod if acc[p] is None else builder.add(acc[p], prod)
        ones = ir.Constant(ir.VectorType(ir.IntType(16), 32), [1] * 32)
        return [_maddwd(builder, a, ones) for a in acc]
    acc = [None] * planes       # i32 pair sums [16 rows x 2], then pairs
    for g in range(groups):
        w = builder.zext(_load64(builder, qbase, g), _V16x64)
        for p in range(planes):
            prod = _maddwd(builder, w, builder.sext(x4(p, 4 * g), _V16x64))
            acc[p] = prod if acc[p] is None else builder.add(acc[p], prod)
    even = ir.Constant(_V32, list(range(0, 32, 2)))
    odd = ir.Constant(_V32, list(range(1, 32, 2)))
    return [builder.add(builder.shuffle_vector(a, a, even), builder.shuffle_vector(a, a, odd)) for a in acc]


def make_tile_dot(nibble: bool, groups: int, planes: int, has_m: bool, kernels: str = "vnni"):
    """Intrinsic tile_dot(qs, d, m, xq, xs, t, out, row0, n_valid) for one layout.
    groups: 64-byte loads per block (4 for nibble = 32 codes; L/4 for int8).
    kernels: "vnni" (AVX-512 VNNI `vpdpbusd`), "avx2" (nibbles: `vpmaddubsw`, whose i16
    sums cannot saturate for codes <= 15 and |activation| <= 127, summed over the
    block's 8 loads in i16 (<= 30480) then widened by `vpmaddwd`; int8 codes: widened to
    i16 and multiplied by `vpmaddwd`), or "portable" (the same sums in plain vector IR)."""
    L = 32 if nibble else 4 * groups

    @intrinsic
    def tile_dot(typingctx, qs, d, m, xq, xs, t, out, row0, n_valid):
        sig = types.void(qs, d, m, xq, xs, t, out, row0, n_valid)

        def codegen(ctx, builder, signature, args):
            a_qs, a_d, a_m, a_xq, a_xs, a_out = (
                ctx.make_array(ty)(ctx, builder, v)
                for ty, v in zip((signature.args[:5] + (signature.args[6],)),
                                 args[:5] + (args[6],)))
            t_, row0_, nval_ = (builder.sext(v, _I64) if v.type.width < 64 else v
                                for v in (args[5], args[7], args[8]))
            nb = cgutils.unpack_tuple(builder, a_d.shape)[1]
            cols = builder.mul(nb, ir.Constant(_I64, L))
            if kernels == "vnni":
                fn = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_V32, [_V32, _V8, _V8]), "llvm.x86.avx512.vpdpbusd.512")

                def dpbusd(args):
                    return builder.call(fn, args)
            else:
                def dpbusd(args):
                    return _dot4_portable(builder, *args)
            qs_p = builder.bitcast(a_qs.data, _I8.as_pointer())
            d_half = signature.args[1].dtype == types.uint16
            m_half = signature.args[2].dtype == types.uint16
            xq_p = builder.bitcast(a_xq.data, _I8.as_pointer())
            xs_p = builder.bitcast(a_xs.data, _F32.as_pointer())
            blk0 = builder.mul(t_, nb)

            entry = builder.block
            loop = builder.append_basic_block("tile.loop")
            done = builder.append_basic_block("tile.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            b = builder.phi(_I64)
            acc = builder.phi(_VF)
            b.add_incoming(ir.Constant(_I64, 0), entry)
            acc.add_incoming(ir.Constant(_VF, None), entry)

            blk = builder.add(blk0, b)
            qbase = builder.gep(qs_p, [builder.mul(blk, ir.Constant(_I64, 64 * groups))])
            xbase = builder.mul(b, ir.Constant(_I64, L))

            def x4(p, k):        # 4 activation bytes of plane p at code k, broadcast
                off = builder.add(builder.add(xbase, ir.Constant(_I64, k)),
                                  builder.mul(cols, ir.Constant(_I64, p)))
                ptr = builder.bitcast(builder.gep(xq_p, [off]), _I32.as_pointer())
                w = builder.load(ptr, align=1)
                return builder.bitcast(_splat(builder, w, _V32), _V8)

            if kernels == "avx2":
                sums = _avx2_block_sums(builder, qbase, x4, nibble, groups, planes)
            else:
                sums = [ir.Constant(_V32, None)] * planes
                for g in range(groups):
                    v = _load64(builder, qbase, g)
                    if nibble:
                        lo, hi = _nibbles(builder, v)
                        for p in range(planes):
                            sums[p] = dpbusd([sums[p], lo, x4(p, 4 * g)])
                            sums[p] = dpbusd([sums[p], hi, x4(p, 16 + 4 * g)])
                    else:
                        for p in range(planes):
                            sums[p] = dpbusd([sums[p], v, x4(p, 4 * g)])

            def xs_at(row):      # xs[row, b] splat
                off = builder.add(builder.mul(nb, ir.Constant(_I64, row)), b)
                return _splat(builder, builder.load(builder.gep(xs_p, [off])), _VF)

            dot = None
            for p in range(planes):
                term = builder.fmul(builder.sitofp(sums[p], _VF), xs_at(p), flags=_FAST)
                dot = term if dot is None else builder.fadd(dot, term, flags=_FAST)
            sc_off = builder.mul(blk, ir.Constant(_I64, R))
            dv = _load_scales(builder, a_d.data, sc_off, d_half)
            dot = builder.fadd(dot, xs_at(planes), flags=_FAST)
            new = builder.fadd(acc, builder.fmul(dv, dot, flags=_FAST), flags=_FAST)
            if has_m:
                mv = _load_scales(builder, a_m.data, sc_off, m_half)
                new = builder.fadd(new, builder.fmul(mv, xs_at(planes + 1), flags=_FAST),
                                   flags=_FAST)
            b_next = builder.add(b, ir.Constant(_I64, 1))
            b.add_incoming(b_next, builder.block)
            acc.add_incoming(new, builder.block)
            builder.cbranch(builder.icmp_signed("<", b_next, nb), loop, done)

            builder.position_at_end(done)
            lanes = ir.Constant(_V32, list(range(R)))
            mask = builder.icmp_signed("<", lanes, _splat(builder, builder.trunc(nval_, _I32), _V32))
            out_p = builder.gep(builder.bitcast(a_out.data, _F32.as_pointer()), [row0_])
            mstore = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [_VF, _VF.as_pointer(), _I32, ir.VectorType(ir.IntType(1), R)]),
                "llvm.masked.store.v16f32.p0")
            builder.call(mstore, [new, builder.bitcast(out_p, _VF.as_pointer()),
                                  ir.Constant(_I32, 4), mask])
            return ctx.get_dummy_value()

        return sig, codegen

    return tile_dot
