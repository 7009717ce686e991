#version 450
// out[t, r] = sum_c x[t, c] * W[r, c] (+ bias[r]); W dequantized from raw GGUF blocks.
// Variants: one QTYPE_* (see quant.glsl) and TN = tokens per invocation (1: mat-vec,
// >1: mat-mat). Register blocking: each invocation computes TR rows x TN tokens and
// walks the 32-element sub-blocks in step with its workgroup, so each activation
// value it loads serves TR rows and each dequantized block serves TN tokens.
// Grid: (ceil(rows / (32 * TR)), ceil(n / TN), 1).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 32) in;
layout(set = 0, binding = 0) readonly buffer WB { uint Wq[]; };
layout(set = 0, binding = 1) readonly buffer XB { float X[]; };
layout(set = 0, binding = 2) buffer OB { float O[]; };
layout(set = 0, binding = 3) readonly buffer BB { float B[]; };
layout(push_constant) uniform P {
    uint rows, cols, n, row_bytes;
    uint x_off, x_stride, o_off, o_stride;
    uint b_off, has_bias;
} pc;
#include "quant.glsl"
#ifndef TN
#define TN 1u
#endif
#ifndef TR
#define TR 8u
#endif

void main() {
    uint row0 = (gl_WorkGroupID.x * TR) * 32u + gl_LocalInvocationID.x;   // rows row0 + 32*r
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
            for (uint i = 0u; i < 32u; i++) {
#if defined(FLOAT_WEIGHTS)
                xs[t * 32u + i] = c0 + i < pc.cols ? X[xo + i] : 0.0;
#else
                xs[t * 32u + i] = X[xo + i];
#endif
            }
        }
        for (uint r = 0u; r < TR; r++) {
            uint row = min(row0 + 32u * r, pc.rows - 1u);
            dequant32(row * pc.row_bytes, sub, pc.cols, w);
            for (uint t = 0u; t < TN; t++) {
                float s = 0.0;
                for (uint i = 0u; i < 32u; i++) s += w[i] * xs[t * 32u + i];
                acc[r * TN + t] += s;
            }
        }
    }
    for (uint r = 0u; r < TR; r++) {
        uint row = row0 + 32u * r;
        if (row >= pc.rows) break;
        float bias = pc.has_bias != 0u ? B[pc.b_off + row] : 0.0;
        for (uint t = 0u; t < ntok; t++) O[pc.o_off + (tok0 + t) * pc.o_stride + row] = acc[r * TN + t] + bias;
    }
}
