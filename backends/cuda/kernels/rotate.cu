// Per-head rotations for tq KV rows (backends/kvformat.py): queries into the rotated basis
// before tq keys are scored (q' = R q), prefill outputs back out of it after tq values are
// summed (out = R^T y). A "vector" is one head's head_dim values of one row:
//   vector v = (row v / n_heads, head v % n_heads) of x (row stride x_stride)
//   out_v[p] = sum_k table[k][p] * x_v[k]         table f32 [head_dim, head_dim]
// (table = R^T gives R x, table = R gives R^T x; both read down columns, coalesced).
// out may be x itself (in place): a block reads its vectors into shared memory first.
//   rotate_vectors_1  grid (n_vec), ROT_THREADS threads: one vector per block (decode)
//   rotate_vectors_8  grid (ceil(n_vec / 8)): 8 vectors per block share each table read (prefill)
#include "common.cuh"

#define ROT_THREADS 128
#define MAX_HEAD_DIM 256

template <int NV>
__device__ __forceinline__ void rotate_block(const float* x, int x_stride, float* out, int out_stride,
                                             const float* __restrict__ table, int n_vec, int n_heads, int head_dim) {
    __shared__ float xs[NV][MAX_HEAD_DIM];
    const int v0 = blockIdx.x * NV, nv = min(NV, n_vec - v0);
    for (int i = threadIdx.x; i < NV * head_dim; i += ROT_THREADS) {
        const int r = i / head_dim, k = i % head_dim, v = v0 + r;
        xs[r][k] = r < nv ? x[(long long)(v / n_heads) * x_stride + (long long)(v % n_heads) * head_dim + k] : 0.0f;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < head_dim; p += ROT_THREADS) {
        float acc[NV];
#pragma unroll
        for (int r = 0; r < NV; ++r) acc[r] = 0.0f;
        for (int k = 0; k < head_dim; ++k) {
            const float t = table[k * head_dim + p];
#pragma unroll
            for (int r = 0; r < NV; ++r) acc[r] += t * xs[r][k];
        }
#pragma unroll
        for (int r = 0; r < NV; ++r) {
            const int v = v0 + r;
            if (r < nv) out[(long long)(v / n_heads) * out_stride + (long long)(v % n_heads) * head_dim + p] = acc[r];
        }
    }
}

#define ROTATE_ENTRY(NAME, NV)                                                                               \
    extern "C" __global__ void __launch_bounds__(ROT_THREADS) NAME(                                          \
            const float* x, int x_stride, float* out, int out_stride, const float* __restrict__ table,         \
            int n_vec, int n_heads, int head_dim) {                                                          \
        rotate_block<NV>(x, x_stride, out, out_stride, table, n_vec, n_heads, head_dim);                    \
    }
ROTATE_ENTRY(rotate_vectors_1, 1)
ROTATE_ENTRY(rotate_vectors_8, 8)
