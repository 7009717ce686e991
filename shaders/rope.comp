#version 450
// RoPE in place on x[t, h*head_dim ...] for h < n_heads. cos/sin come from a
// device table [max_pos][rot_dim/2] of (cos, sin) pairs computed in float64 on
// the host once per (base, rot_dim, frequency factors). Position of row t: POS[use_pos - 1 + t] when
// use_pos > 0 (1: a positions buffer; 1 + s: slot s of a recorded step's buffer), else pos0 + t.
// Adjacent pairs (2i, 2i+1), or NEOX pairs (i, i + rot_dim/2). Grid: (n_heads, n, 1).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer XB { float X[]; };
layout(set = 0, binding = 1) readonly buffer TB { vec2 CS[]; };
layout(set = 0, binding = 2) readonly buffer PB { int POS[]; };
layout(push_constant) uniform P {
    uint n, n_heads, head_dim, rot_dim, neox, x_off, x_stride, pos0, use_pos;
} pc;
#include "common.glsl"

void main() {
    uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y;
    uint half_ = pc.rot_dim / 2u;
    uint pos = pc.use_pos != 0u ? uint(POS[pc.use_pos - 1u + t]) : pc.pos0 + t;
    uint base = pc.x_off + t * pc.x_stride + h * pc.head_dim;
    for (uint i = gl_LocalInvocationID.x; i < half_; i += 64u) {
        vec2 cs = CS[pos * half_ + i];
        uvec2 at = base + rope_places(i, half_, pc.neox);
        vec2 r = rope_rotate(X[at.x], X[at.y], cs);
        X[at.x] = r.x;
        X[at.y] = r.y;
    }
}
