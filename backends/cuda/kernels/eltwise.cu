// Elementwise ops over strided f32 rows, grid (n, ceil(d / blockDim.x), 1): tokens on x,
// whose limit is 2^31 - 1 (y and z stop at 65535):
//   add        out = a + b (out may alias a; b_stride 0: one row of b added to every row)
//   scale      out = x * s (out may alias x)
//   silu_gate  out = silu(gate) * up
//   gelu_gate  out = gelu_tanh(gate) * up (Gemma)
//   argmax_rows (below: a block per row)
// (silu and gelu_tanh: common.cuh)
#include "common.cuh"

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
    if (i < d) out[t * out_stride + i] = silu(gate[t * g_stride + i]) * up[t * u_stride + i];
}

extern "C" __global__ void gelu_gate(const float* __restrict__ gate, int g_stride, const float* __restrict__ up,
                                     int u_stride, float* __restrict__ out, int out_stride, int d) {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const long long t = blockIdx.x;
    if (i < d) out[t * out_stride + i] = gelu_tanh(gate[t * g_stride + i]) * up[t * u_stride + i];
}

// argmax_rows: out[t] = the index of row t's largest value, the first of equal ones, or -1
// when the row holds a NaN or an infinity (the engine reports non-finite logits then), so
// greedy decoding downloads one int a token instead of the vocabulary's logits.
// Grid (n, 1, 1): rows on x; block ARGMAX_THREADS (a multiple of 32, at most 1024).
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int x_stride, int d, int* __restrict__ out) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ int bad_any;
    const float* row = x + (long long)blockIdx.x * x_stride;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (threadIdx.x == 0) bad_any = 0;
    __syncthreads();
    float bv = NEG_INF;
    int bi = d, bad = 0;                               // bi = d: none yet (a thread that saw only -inf)
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = row[i];
        bad |= !(v - v == 0.0f);                       // NaN or +-inf
        if (v > bv) { bv = v; bi = i; }                // strictly greater: this thread's first
    }
    if (bad) bad_any = 1;
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {      // larger value, then smaller index
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x / WARP_SIZE;
        bv = lane < n_warps ? best_v[lane] : NEG_INF;
        bi = lane < n_warps ? best_i[lane] : d;
#pragma unroll
        for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) out[blockIdx.x] = bad_any || bi >= d ? -1 : bi;
    }
}
