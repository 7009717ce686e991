// Elementwise ops over strided f32 rows: out = a + b (out may alias a), and
// out = silu(gate) * up. Grid (ceil(d / blockDim.x), n, 1).
#include "common.cuh"

extern "C" __global__ void add(const float* a, int a_stride, const float* b, int b_stride,
                               float* out, int out_stride, int d) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const long long t = blockIdx.y;
    if (i < d) out[t * out_stride + i] = a[t * a_stride + i] + b[t * b_stride + i];
}

extern "C" __global__ void silu_gate(const float* __restrict__ gate, int g_stride, const float* __restrict__ up,
                                     int u_stride, float* __restrict__ out, int out_stride, int d) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const long long t = blockIdx.y;
    if (i < d) {
        const float g = gate[t * g_stride + i];
        out[t * out_stride + i] = g / (1.0f + expf(-g)) * up[t * u_stride + i];
    }
}
