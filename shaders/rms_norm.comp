#version 450
// RMS norm over groups of g columns: out[t, j*g .. j*g+g-1] = x / sqrt(mean(x^2) + eps) * weight
// over that group (g == d: the usual row norm; g == head_dim: Gemma 3's per-head Q/K norm).
// `out` may alias `x`: each element is read and written by the same thread, the write
// after the reduction. One workgroup per (group, row). Grid: (d / g, n, 1).
// Variant ADD (the backend's add_rms_norm: a residual add and the next norm in one
// dispatch): first x += r (R, binding 3, with x's strides), then the norm of the sum.
layout(local_size_x = 128) in;
#if defined(ADD)
layout(set = 0, binding = 0) buffer XB { float X[]; };
layout(set = 0, binding = 3) readonly buffer RB { float R[]; };
#else
layout(set = 0, binding = 0) readonly buffer XB { float X[]; };
#endif
layout(set = 0, binding = 1) readonly buffer WB { float Wt[]; };
layout(set = 0, binding = 2) buffer OB { float O[]; };
layout(push_constant) uniform P {
    uint n, g, x_off, x_stride, w_off, o_off, o_stride, eps_bits, r_off, r_stride;
} pc;
shared float red[128];

void main() {
    uint j = gl_WorkGroupID.x, t = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
    uint xo = pc.x_off + t * pc.x_stride + j * pc.g, oo = pc.o_off + t * pc.o_stride + j * pc.g;
    float s = 0.0;
#if defined(ADD)
    uint ro = pc.r_off + t * pc.r_stride + j * pc.g;
    for (uint c = tid; c < pc.g; c += 128u) { float v = X[xo + c] + R[ro + c]; X[xo + c] = v; s += v * v; }
#else
    for (uint c = tid; c < pc.g; c += 128u) { float v = X[xo + c]; s += v * v; }
#endif
    red[tid] = s;
    barrier();
    for (uint k = 64u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    float inv = 1.0 / sqrt(red[0] / float(pc.g) + uintBitsToFloat(pc.eps_bits));
    for (uint c = tid; c < pc.g; c += 128u) O[oo + c] = X[xo + c] * inv * Wt[pc.w_off + c];
}
