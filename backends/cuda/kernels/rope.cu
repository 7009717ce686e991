// RoPE in place over the first n_heads heads of each row of x (strided rows).
// Pair i < rot_dim/2 of a head rotates by angle(pos, i), read from a table of
// (cos, sin) computed in float64 on the host: f32 [cap][rot_dim/2][2].
// Adjacent mode pairs (2i, 2i+1) (llama); NEOX pairs (i, i + rot_dim/2) (qwen2).
// Positions: positions[t] when use_positions, else pos0 + t.
// Grid (n, n_heads, 1), block: rot_dim/2 rounded up to 32 (at most 256 threads: rot_dim <= 512).
#include "common.cuh"

extern "C" __global__ void rope(float* x, int x_stride, const float* __restrict__ table,
                                const int* __restrict__ positions, int use_positions, int pos0,
                                int head_dim, int rot_dim, int neox) {
    const int half = rot_dim / 2;
    const int i = threadIdx.x;
    if (i >= half) return;
    const int t = blockIdx.x;
    const int pos = use_positions ? positions[t] : pos0 + t;
    const float2 cs = reinterpret_cast<const float2*>(table)[(long long)pos * half + i];
    rope_pair(x + (long long)t * x_stride + (long long)blockIdx.y * head_dim, i, half, neox, cs);
}
