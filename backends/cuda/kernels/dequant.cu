// Rows of a raw GGUF weight to f32: out[i, :] = W[row_i, :], row_i = ids[i] when
// use_ids, else first_row + i. Embedding lookups (ids on the device for prefill; one
// decode token passes its id as first_row) and the dequantize-then-GEMM prefill path.
// One thread per 32-element sub-block; each warp's 32 sub-blocks go through a padded
// shared tile so the stores of the 1024 consecutive outputs are coalesced.
// Grid (n, ceil(nsub / DQ_THREADS), 1), block min(DQ_THREADS, nsub rounded up to a
// warp) (quant.py). out: strided rows.
#include "common.cuh"
#include "quant.cuh"

#define DQ_THREADS 128

extern "C" __global__ void __launch_bounds__(DQ_THREADS) dequant_rows(
        const u8* __restrict__ W, int row_bytes, int cols,
        const int* __restrict__ ids, int use_ids, int first_row,
        float* __restrict__ out, int out_stride) {
    __shared__ float tile[DQ_THREADS / WARP_SIZE][WARP_SIZE * 33];   // [warp][sub][33]
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int i = blockIdx.x;
    const long long src = use_ids ? ids[i] : first_row + i;
    const int sub0 = blockIdx.y * DQ_THREADS + warp * WARP_SIZE;      // this warp's first sub-block
    const int sub = sub0 + lane;
    float* t = tile[warp];
    if (sub * 32 < cols) {
        QRaw raw;
        load_sub(W + src * row_bytes, sub, cols, raw);
        float w[32];
        decode_sub(raw, w);
#pragma unroll
        for (int e = 0; e < 32; e++) t[lane * 33 + e] = w[e];
    }
    __syncwarp();
    float* o = out + (long long)i * out_stride + sub0 * 32;
    const int valid = cols - sub0 * 32;
#pragma unroll 4
    for (int k = 0; k < WARP_SIZE; k++) {
        if (k * 32 + lane < valid) o[k * 32 + lane] = t[k * 33 + lane];
    }
}
