#version 450
// out[t, r] = sum_c x[t, c] * W[r, c] (+ bias[r]); W dequantized from raw GGUF blocks.
// Variants: one QTYPE_* (see quant.glsl), TN = tokens per workgroup (1: mat-vec,
// >1: mat-mat), and the layout (launch geometry: shaders.matmul_geometry):
//
// GPUs (default): a workgroup of WG invocations holds WG / LPR row slots of LPR lanes
// each (LPR = 1 << pc.lpr_log2, chosen per matrix). The LPR lanes of a row walk its
// 32-element sub-blocks together (lane l: sub-blocks l, l + LPR, ...), so
// neighbouring invocations read neighbouring blocks of the same row; each dequantized
// sub-block serves TN tokens. Partial sums meet in shared memory (a tree over the LPR
// lanes): no subgroup size is assumed. Grid: (ceil(rows / (WG / LPR)), ceil(n / TN), 1).
//
// ROW_PER_LANE (CPU Vulkan devices such as lavapipe, which run a workgroup's
// invocations as SIMD lanes of one CPU thread and load memory lane by lane): a
// workgroup of LX invocations, each computing TR rows x TN tokens, walks the
// sub-blocks in step, so each activation value it loads serves TR rows and each
// dequantized block serves TN tokens. Grid: (ceil(rows / (LX * TR)), ceil(n / TN), 1).
// TR (specialization constant 0) is chosen per matrix (shaders.matmul_geometry). With
// BLOCK_MAJOR (quant.glsl) the weights are stored block-major per group of 256 rows, so
// the blocks a workgroup reads at one step are one or two contiguous runs.
//
// GATE_SILU / GATE_GELU (the FFN's down projection, one dispatch instead of two): each
// token's x row holds [gate | up] (2 * cols values) and column c's value is act(gate[c]) *
// up[c] (common.glsl), computed as it is loaded; every workgroup computes it for the
// columns its rows need, which beside their weights is little.
#extension GL_GOOGLE_include_directive : require
#if defined(PADDED_BLOCKS)
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#define WQ64
#endif
#ifndef TN
#define TN 1u
#endif
#define WG 64u
#define LX 8u
layout(constant_id = 0) const uint TR = 32u;   // ROW_PER_LANE: rows per lane (shaders.matmul_geometry)
#if defined(ROW_PER_LANE)
layout(local_size_x = 8) in;
#else
layout(local_size_x = 64) in;
#endif
layout(set = 0, binding = 0) readonly buffer WB { uint Wq[]; };
#if defined(PADDED_BLOCKS)
layout(set = 0, binding = 0) readonly buffer WB64 { uint64_t Wq64[]; };   // the same buffer
#endif
layout(set = 0, binding = 1) readonly buffer XB { float X[]; };
#if defined(PADDED_BLOCKS)
layout(set = 0, binding = 1) readonly buffer XB64 { uint64_t X64[]; };    // the same buffer
#endif
layout(set = 0, binding = 2) buffer OB { float O[]; };
layout(set = 0, binding = 3) readonly buffer BB { float B[]; };
layout(push_constant) uniform P {
    uint rows, cols, n, row_bytes;
    uint x_off, x_stride, o_off, o_stride;
    uint b_off, has_bias, lpr_log2;
} pc;
#include "quant.glsl"

#if defined(GATE_SILU)
#define GATED
#define X_AT(o) (silu(X[o]) * X[(o) + pc.cols])
#elif defined(GATE_GELU)
#define GATED
#define X_AT(o) (gelu_tanh(X[o]) * X[(o) + pc.cols])
#else
#define X_AT(o) X[o]
#endif

#if defined(ROW_PER_LANE)
void main() {
    uint row0 = gl_WorkGroupID.x * (LX * TR) + gl_LocalInvocationID.x;   // rows row0 + LX*r
    uint tok0 = gl_WorkGroupID.y * TN;
    uint ntok = min(TN, pc.n - tok0);
    if (row0 >= pc.rows) return;
    float acc[TR * TN];
    for (uint i = 0u; i < TR * TN; i++) acc[i] = 0.0;
    uint nsub = (pc.cols + 31u) / 32u;
    float xs[TN * 32u];
    float w[32];
    for (uint sub = 0u; sub < nsub; sub++) {
        uint c0 = sub * 32u;
        for (uint t = 0u; t < TN; t++) {
            uint xo = pc.x_off + (tok0 + min(t, ntok - 1u)) * pc.x_stride + c0;
#if defined(PADDED_BLOCKS) && !defined(GATED)
            if ((xo & 1u) == 0u) {                   // the same for every lane: 64-bit loads
                for (uint i = 0u; i < 16u; i++) {
                    uint64_t v = X64[(xo >> 1) + i];
                    xs[t * 32u + 2u * i] = uintBitsToFloat(uint(v));
                    xs[t * 32u + 2u * i + 1u] = uintBitsToFloat(uint(v >> 32));
                }
                continue;
            }
#endif
            for (uint i = 0u; i < 32u; i++) {
#if defined(FLOAT_WEIGHTS)
                xs[t * 32u + i] = c0 + i < pc.cols ? X_AT(xo + i) : 0.0;
#else
                xs[t * 32u + i] = X_AT(xo + i);
#endif
            }
        }
#if defined(PADDED_BLOCKS)
        float xp[TN * 32u], xsum[TN];
        for (uint t = 0u; t < TN; t++) {
            xsum[t] = 0.0;
            for (uint i = 0u; i < 32u; i++) {
                xsum[t] += xs[t * 32u + i];
                xp[t * 32u + i] = xs[t * 32u + i] * uintBitsToFloat((127u - DOT_SHIFT(i)) << 23);
            }
        }
#endif
        for (uint r = 0u; r < TR; r++) {
            uint row = min(row0 + LX * r, pc.rows - 1u);
#if defined(BLOCK_MAJOR)
            uint base = block_major_base(row, sub, pc.rows, pc.row_bytes);
#else
            uint base = row * pc.row_bytes;
#endif
#if defined(PADDED_BLOCKS)
            float dot[TN];
            dot32(base, sub, xp, xsum, dot);
            for (uint t = 0u; t < TN; t++) acc[r * TN + t] += dot[t];
#else
            dequant32(base, sub, pc.cols, w);
            for (uint t = 0u; t < TN; t++) {
                float s = 0.0;
                for (uint i = 0u; i < 32u; i++) s += w[i] * xs[t * 32u + i];
                acc[r * TN + t] += s;
            }
#endif
        }
    }
    for (uint r = 0u; r < TR; r++) {
        uint row = row0 + LX * r;
        if (row >= pc.rows) break;
        float bias = pc.has_bias != 0u ? B[pc.b_off + row] : 0.0;
        for (uint t = 0u; t < ntok; t++) O[pc.o_off + (tok0 + t) * pc.o_stride + row] = acc[r * TN + t] + bias;
    }
}
#else
#if defined(BLOCK_MAJOR)
#error "block-major weights are read by the ROW_PER_LANE layout only"
#endif
shared float part[TN * WG];

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint lpr = 1u << pc.lpr_log2;
    uint lane = lid & (lpr - 1u);
    uint row = gl_WorkGroupID.x * (WG >> pc.lpr_log2) + (lid >> pc.lpr_log2);
    uint tok0 = gl_WorkGroupID.y * TN;
    uint ntok = min(TN, pc.n - tok0);
    float acc[TN];
    for (uint t = 0u; t < TN; t++) acc[t] = 0.0;
    if (row < pc.rows) {                       // no early return: every lane meets the barriers
        uint nsub = (pc.cols + 31u) / 32u;
        float w[32];
        for (uint sub = lane; sub < nsub; sub += lpr) {
            dequant32(row * pc.row_bytes, sub, pc.cols, w);
            uint c0 = sub * 32u;
            for (uint t = 0u; t < TN; t++) {
                uint xo = pc.x_off + (tok0 + min(t, ntok - 1u)) * pc.x_stride + c0;
                float s = 0.0;
#if defined(FLOAT_WEIGHTS)
                for (uint i = 0u; i < 32u; i++) s += c0 + i < pc.cols ? w[i] * X_AT(xo + i) : 0.0;
#else
                for (uint i = 0u; i < 32u; i++) s += w[i] * X_AT(xo + i);
#endif
                acc[t] += s;
            }
        }
    }
    for (uint t = 0u; t < TN; t++) part[t * WG + lid] = acc[t];
    barrier();
    for (uint h = lpr >> 1; h > 0u; h >>= 1) {
        if (lane < h) {
            for (uint t = 0u; t < TN; t++) part[t * WG + lid] += part[t * WG + lid + h];
        }
        barrier();
    }
    if (lane == 0u && row < pc.rows) {
        float bias = pc.has_bias != 0u ? B[pc.b_off + row] : 0.0;
        for (uint t = 0u; t < ntok; t++) O[pc.o_off + (tok0 + t) * pc.o_stride + row] = part[t * WG + lid] + bias;
    }
}
#endif
