#version 450
// K/V rows (f32 views) -> bf16 pairs at physical rows start_row .. start_row+n-1.
// Grid: (n_kv, n, 1); threads over head_dim/2 pairs.
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer KPB { uint KP[]; };
layout(set = 0, binding = 1) buffer VPB { uint VP[]; };
layout(set = 0, binding = 2) readonly buffer PTB { int PT[]; };
layout(set = 0, binding = 3) readonly buffer KB { float K[]; };
layout(set = 0, binding = 4) readonly buffer VB { float V[]; };
layout(push_constant) uniform P {
    uint n, n_kv, head_dim, page_size, start_row, k_off, k_stride, v_off, v_stride;
} pc;
#include "common.glsl"
#include "kv.glsl"

void main() {
    uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y;
    uint hd2 = pc.head_dim / 2u;
    uint r = pc.start_row + t;
    uint dst = kv_word(uint(PT[r / pc.page_size]), h, r % pc.page_size, pc.n_kv, pc.page_size, hd2);
    uint ko = pc.k_off + t * pc.k_stride + h * pc.head_dim;
    uint vo = pc.v_off + t * pc.v_stride + h * pc.head_dim;
    for (uint p = gl_LocalInvocationID.x; p < hd2; p += 64u) {
        KP[dst + p] = f32_to_bf16(K[ko + 2u * p]) | (f32_to_bf16(K[ko + 2u * p + 1u]) << 16);
        VP[dst + p] = f32_to_bf16(V[vo + 2u * p]) | (f32_to_bf16(V[vo + 2u * p + 1u]) << 16);
    }
}
