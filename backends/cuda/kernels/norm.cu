// RMSNorm: out[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w. One block per token.
// Grid (n, 1, 1), block NORM_THREADS (elementwise.py). x and out are strided rows.
#include "common.cuh"

extern "C" __global__ void rms_norm(const float* __restrict__ x, int x_stride, const float* __restrict__ w,
                                    float* __restrict__ out, int out_stride, int d, float eps) {
    __shared__ float red[32];
    const float* xr = x + (long long)blockIdx.x * x_stride;
    float* orow = out + (long long)blockIdx.x * out_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = xr[i] * inv * w[i];
}
