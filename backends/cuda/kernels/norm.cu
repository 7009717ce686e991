// RMSNorm per group of g columns (g divides d; g == d is the usual row norm, g == head_dim
// Gemma 3's per-head Q/K norm): out[t, j*g + i] = x[t, j*g + i] / sqrt(mean over the group
// of x^2 + eps) * w[i]. x and out are strided rows; out may alias x (in place), so neither
// is __restrict__: each element is read, then written by the same thread.
//   rms_norm       a block per (row, group): grid (n, d / g), NORM_THREADS (elementwise.py).
//                  For wide groups (g > NORM_WARP_COLS): the row norm of every layer.
//   add_rms_norm   the residual add and the row norm after it (g == d): x += r, then
//                  out = rms_norm(x) * w; a block per row, as rms_norm.
//   rms_norm_warp  a warp per (row, group), NORM_WARP_WARPS per block: grid
//                  (ceil(n * (d / g) / NORM_WARP_WARPS)), NORM_WARP_WARPS * 32 threads. For
//                  g <= NORM_WARP_COLS: a lane keeps its g / 32 values in registers, one read
//                  of x, no barrier.
#include "common.cuh"

#define NORM_WARP_COLS 256       // elementwise.NORM_WARP_COLS
#define NORM_WARP_PER_LANE (NORM_WARP_COLS / WARP_SIZE)

// The second half of both block kernels: orow = xr / sqrt(mean of xr^2 + eps) * w, where
// ss is this thread's share of the sum of squares of the block's g values.
__device__ __forceinline__ void write_normed(const float* xr, float ss, const float* __restrict__ w,
                                             float* orow, int g, float eps, float* red) {
    ss = block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)g + eps);
    for (int i = threadIdx.x; i < g; i += blockDim.x) orow[i] = xr[i] * inv * w[i];
}

extern "C" __global__ void rms_norm(const float* x, int x_stride, const float* __restrict__ w,
                                    float* out, int out_stride, int g, float eps) {
    __shared__ float red[32];
    const long long col0 = (long long)blockIdx.y * g;
    const float* xr = x + (long long)blockIdx.x * x_stride + col0;
    float* orow = out + (long long)blockIdx.x * out_stride + col0;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < g; i += blockDim.x) ss += xr[i] * xr[i];
    write_normed(xr, ss, w, orow, g, eps, red);
}

extern "C" __global__ void add_rms_norm(float* x, int x_stride, const float* r, int r_stride,
                                        const float* __restrict__ w, float* out, int out_stride, int g,
                                        float eps) {
    __shared__ float red[32];
    float* xr = x + (long long)blockIdx.x * x_stride;
    const float* rr = r + (long long)blockIdx.x * r_stride;
    float* orow = out + (long long)blockIdx.x * out_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < g; i += blockDim.x) {
        const float v = xr[i] + rr[i];
        xr[i] = v;
        ss += v * v;
    }
    write_normed(xr, ss, w, orow, g, eps, red);
}

extern "C" __global__ void rms_norm_warp(const float* x, int x_stride, const float* __restrict__ w,
                                         float* out, int out_stride, int n, int n_groups, int g, float eps) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int item = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;   // (row, group)
    if (item >= n * n_groups) return;                                   // whole warps leave
    const int t = item / n_groups;
    const long long col0 = (long long)(item % n_groups) * g;
    const float* xr = x + (long long)t * x_stride + col0;
    float* orow = out + (long long)t * out_stride + col0;
    float v[NORM_WARP_PER_LANE];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_WARP_PER_LANE; ++k) {
        const int i = lane + WARP_SIZE * k;
        v[k] = i < g ? xr[i] : 0.0f;
        ss += v[k] * v[k];
    }
    const float inv = rsqrtf(warp_sum(ss) / (float)g + eps);
#pragma unroll
    for (int k = 0; k < NORM_WARP_PER_LANE; ++k) {
        const int i = lane + WARP_SIZE * k;
        if (i < g) orow[i] = v[k] * inv * w[i];
    }
}
