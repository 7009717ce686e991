// Elementwise ops over strided f32 rows, grid (n, ceil(d / blockDim.x), 1): tokens on x,
// whose limit is 2^31 - 1 (y and z stop at 65535):
//   add        out = a + b (out may alias a)
//   scale      out = x * s (out may alias x)
//   silu_gate  out = silu(gate) * up
//   gelu_gate  out = gelu_tanh(gate) * up (Gemma)
#include "common.cuh"

#define SQRT_2_OVER_PI 0.7978845608028654f

extern "C" __global__ void add(const float* a, int a_stride, const float* b, int b_stride,
                               float* out, int out_stride, int d) {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const long long t = blockIdx.x;
    if (i < d) out[t * out_stride + i] = a[t * a_stride + i] + b[t * b_stride + i];
}

extern "C" __global__ void scale(const float* x, int x_stride, float* out, int out_stride, int d, float s) {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const long long t = blockIdx.x;
    if (i < d) out[t * out_stride + i] = x[t * x_stride + i] * s;
}

extern "C" __global__ void silu_gate(const float* __restrict__ gate, int g_stride, const float* __restrict__ up,
                                     int u_stride, float* __restrict__ out, int out_stride, int d) {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const long long t = blockIdx.x;
    if (i < d) {
        const float g = gate[t * g_stride + i];
        out[t * out_stride + i] = g / (1.0f + expf(-g)) * up[t * u_stride + i];
    }
}

// gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), computed as the
// equal g / (1 + exp(-2u)): no 1 + tanh cancellation for negative g, and finite for every
// finite g (|u| -> inf gives exp 0 or inf, so g or -0, never inf - inf or 0 * inf).
extern "C" __global__ void gelu_gate(const float* __restrict__ gate, int g_stride, const float* __restrict__ up,
                                     int u_stride, float* __restrict__ out, int out_stride, int d) {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const long long t = blockIdx.x;
    if (i < d) {
        const float g = gate[t * g_stride + i];
        const float u = SQRT_2_OVER_PI * g * (1.0f + 0.044715f * g * g);
        out[t * out_stride + i] = g / (1.0f + expf(-2.0f * u)) * up[t * u_stride + i];
    }
}
