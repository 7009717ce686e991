#version 450
// Elementwise ops on [n, d] f32 views, one variant each:
//   OP_ADD        a + b (b_stride 0: one row of B added to every row)
//   OP_SILU_GATE  silu(a) * b
//   OP_GELU_GATE  gelu_tanh(a) * b   (silu, gelu_tanh: common.glsl)
//   OP_SCALE      a * s       (B is not read; s travels as its bits)
// `out` may alias `a`. Grid: (ceil(d / 64), n, 1).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"      // silu, gelu_tanh
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer AB { float A[]; };
layout(set = 0, binding = 1) readonly buffer BB { float B[]; };
layout(set = 0, binding = 2) buffer OB { float O[]; };
layout(push_constant) uniform P {
    uint n, d, a_off, a_stride, b_off, b_stride, o_off, o_stride, s_bits;
} pc;

void main() {
    uint c = gl_GlobalInvocationID.x, t = gl_WorkGroupID.y;
    if (c >= pc.d || t >= pc.n) return;
    float a = A[pc.a_off + t * pc.a_stride + c];
    uint o = pc.o_off + t * pc.o_stride + c;
#if defined(OP_SCALE)
    O[o] = a * uintBitsToFloat(pc.s_bits);
#else
    float b = B[pc.b_off + t * pc.b_stride + c];
#if defined(OP_ADD)
    O[o] = a + b;
#elif defined(OP_SILU_GATE)
    O[o] = silu(a) * b;
#elif defined(OP_GELU_GATE)
    O[o] = gelu_tanh(a) * b;
#else
#error "define OP_ADD, OP_SILU_GATE, OP_GELU_GATE or OP_SCALE"
#endif
#endif
}
