#version 450
// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight. One workgroup per row.
layout(local_size_x = 128) in;
layout(set = 0, binding = 0) readonly buffer XB { float X[]; };
layout(set = 0, binding = 1) readonly buffer WB { float Wt[]; };
layout(set = 0, binding = 2) buffer OB { float O[]; };
layout(push_constant) uniform P {
    uint n, d, x_off, x_stride, w_off, o_off, o_stride, eps_bits;
} pc;
shared float red[128];

void main() {
    uint t = gl_WorkGroupID.x, tid = gl_LocalInvocationID.x;
    uint xo = pc.x_off + t * pc.x_stride, oo = pc.o_off + t * pc.o_stride;
    float s = 0.0;
    for (uint c = tid; c < pc.d; c += 128u) { float v = X[xo + c]; s += v * v; }
    red[tid] = s;
    barrier();
    for (uint k = 64u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    float inv = 1.0 / sqrt(red[0] / float(pc.d) + uintBitsToFloat(pc.eps_bits));
    for (uint c = tid; c < pc.d; c += 128u) O[oo + c] = X[xo + c] * inv * Wt[pc.w_off + c];
}
