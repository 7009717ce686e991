#version 450
// Per-head rotation of f32 rows for the tq KV formats (backends/kvformat.py):
// y = M x for each head_dim-wide head of each row, M = R (into the rotated basis:
// tq rows before kv_write, queries before attention / votes over tq keys) or R^T
// (back: attention outputs over tq values), R = kvformat.rotation(head_dim).
// T: f32 [2][head_dim][head_dim] = (R^T, R), uploaded once per head_dim; t_off picks
// M^T, so invocation j reads column j: y[j] = sum_i M^T[i][j] x[i] (contiguous across
// invocations). Grid: (n_heads, n, 1); invocations over j.
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer XB { float X[]; };
layout(set = 0, binding = 1) readonly buffer TB { float T[]; };
layout(set = 0, binding = 2) buffer YB { float Y[]; };
layout(push_constant) uniform P { uint head_dim, x_off, x_stride, y_off, y_stride, t_off; } pc;

shared float xs[256];

void main() {
    uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint xo = pc.x_off + t * pc.x_stride + h * hd;
    for (uint i = tid; i < hd; i += 64u) xs[i] = X[xo + i];
    barrier();
    uint yo = pc.y_off + t * pc.y_stride + h * hd;
    for (uint j = tid; j < hd; j += 64u) {
        float acc = 0.0;
        for (uint i = 0u; i < hd; i++) acc += T[pc.t_off + i * hd + j] * xs[i];
        Y[yo + j] = acc;
    }
}
