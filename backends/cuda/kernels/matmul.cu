// Quantized mat-vec for decode and short prompts (n <= MV_MAX_TOKENS tokens):
//   out[t, r] = sum_c x[t, c] * W[r, c] (+ bias[r])
// W is raw GGUF blocks (quant.cuh, one QTYPE_* per variant). One warp per output row;
// lane l takes sub-blocks l, l + 32, ... (32 weights each, so a warp step reads 32
// consecutive sub-blocks), dequantizes in registers and uses each weight for every
// token. The x columns of a step (1024 per token) are staged in shared memory by the
// block, padded to MV_XS_SUB floats per sub-block so the lanes' float4 reads of their
// own sub-block are bank-conflict free (x straight from global would be 32 cache
// lines per warp load). Software pipelined: a lane issues the loads of its next
// step's sub-block before the math of the current one, so the weight fetch overlaps
// the math, the barriers and the next staging. warp_sum at the end.
// Grid (ceil(rows / warps), 1, 1), block warps * 32 (quant.py), dynamic shared
// memory n * 32 * MV_XS_SUB floats. x, out: strided rows; cols % 32 != 0 only for
// float types (the tail is zero in both x and W).
//
// GATE_SILU / GATE_GELU variants (the FFN's down projection in one launch): x holds each
// token's [gate | up] (2 * cols columns, x_stride apart) and the staged value of column
// c is act(gate[c]) * up[c] (common.cuh), so the separate gate kernel and its output
// buffer drop out of the step. Each block computes the activation of every column for
// its own rows (warps of them): cheap beside reading the block's weights.
//
// add_bias: out[t, r] += bias[r], after the GEMM path. Grid (n, ceil(rows / 256), 1), block 256.
#include "common.cuh"
#include "quant.cuh"

#define MV_MAX_TOKENS 8
#define MV_XS_SUB 36                       // floats per staged sub-block (32 + 4 padding)

#if defined(GATE_SILU)
#define X_AT(row, col) (silu((row)[col]) * (row)[cols + (col)])
#elif defined(GATE_GELU)
#define X_AT(row, col) (gelu_tanh((row)[col]) * (row)[cols + (col)])
#else
#define X_AT(row, col) ((row)[col])
#endif

extern "C" __global__ void __launch_bounds__(256) matvec(
        const u8* __restrict__ W, int row_bytes, int rows, int cols,
        const float* __restrict__ x, int x_stride, int n,
        const float* __restrict__ bias, int has_bias,
        float* __restrict__ out, int out_stride) {
    DYN_SHARED(float, xs);                 // [n][32][MV_XS_SUB] x of the current step
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const u8* wrow = W + (long long)min(row, rows - 1) * row_bytes;   // spare warps re-read the last row
    const int nsub = (cols + 31) / 32;

    float acc[MV_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MV_MAX_TOKENS; t++) acc[t] = 0.0f;

    QRaw raw;                              // this lane's sub-block of the current step
    if (lane < nsub) load_sub(wrow, lane, cols, raw);
    for (int s0 = 0; s0 < nsub; s0 += WARP_SIZE) {
        const int sub = s0 + lane;
        __syncthreads();                   // the previous step's reads of xs are done
        for (int i = threadIdx.x; i < n * 1024; i += blockDim.x) {
            const int t = i >> 10, c = i & 1023, col = s0 * 32 + c;
            xs[t * (32 * MV_XS_SUB) + (c >> 5) * MV_XS_SUB + (c & 31)] =
                col < cols ? X_AT(x + (long long)t * x_stride, col) : 0.0f;
        }
        __syncthreads();
        QRaw next;                         // the next step's, in flight during this step's math
        if (sub + WARP_SIZE < nsub) load_sub(wrow, sub + WARP_SIZE, cols, next);
        if (sub < nsub) {
            float w[32];
            decode_sub(raw, w);
            const float4* xv = (const float4*)(xs + lane * MV_XS_SUB);
#pragma unroll
            for (int q = 0; q < 8; q++) {
#pragma unroll
                for (int t = 0; t < MV_MAX_TOKENS; t++) {
                    if (t < n) {
                        const float4 u = xv[t * (32 * MV_XS_SUB / 4) + q];
                        acc[t] += w[4 * q] * u.x + w[4 * q + 1] * u.y + w[4 * q + 2] * u.z + w[4 * q + 3] * u.w;
                    }
                }
            }
        }
        raw = next;
    }

    // Lane t writes token t (all lanes hold every total after warp_sum).
    float mine = 0.0f;
#pragma unroll
    for (int t = 0; t < MV_MAX_TOKENS; t++) {
        if (t < n) {
            const float v = warp_sum(acc[t]);
            if (lane == t) mine = v;
        }
    }
    if (row < rows && lane < n)
        out[(long long)lane * out_stride + row] = mine + (has_bias ? bias[row] : 0.0f);
}

extern "C" __global__ void add_bias(float* __restrict__ out, int out_stride, const float* __restrict__ bias,
                                    int rows) {
    const int r = blockIdx.y * blockDim.x + threadIdx.x;
    if (r < rows) out[(long long)blockIdx.x * out_stride + r] += bias[r];
}
