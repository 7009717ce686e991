// Shared by every kernel: types, warp/block reductions, bf16/f16 conversions, the
// feed-forward gate activations.
// The same source compiles with NVRTC for GPUs and with g++ against the CPU
// harness (backends/cuda/harness/cuda_cpu.h), which defines the CUDA built-ins.
// No standard or CUDA headers: everything a kernel needs is here.
#pragma once

#ifndef DYN_SHARED   // the CPU harness (harness/cuda_cpu.h) defines its own
#define DYN_SHARED(type, name) extern __shared__ type name[]
#endif

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
#define NEG_INF (__int_as_float(0xff800000))      // NVRTC has no INFINITY
#define MIN_NORMAL 1.17549435e-38f                // the smallest normal float (no FLT_MIN in NVRTC)

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `red`:
// __shared__ float[32] scratch. Every thread gets the total. Starts with a barrier
// so the scratch may be reused by consecutive calls.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_warps = blockDim.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < n_warps ? red[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_warps = blockDim.x / WARP_SIZE;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < n_warps ? red[lane] : NEG_INF;
    return warp_max(v);
}

// The feed-forward gates: silu(g) = g / (1 + exp(-g)); gelu_tanh(g) = 0.5 g (1 + tanh(u)),
// u = sqrt(2/pi) (g + 0.044715 g^3), computed as the equal g / (1 + exp(-2u)): no 1 + tanh
// cancellation for negative g, and finite for every finite g (|u| -> inf gives exp 0 or
// inf, so g or -0, never inf - inf or 0 * inf). eltwise.cu and the gated mat-vec
// (matmul.cu) share them, so fused and separate gates give the same values.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ float gelu_tanh(float g) {
    const float u = 0.7978845608028654f * g * (1.0f + 0.044715f * g * g);
    return g / (1.0f + expf(-2.0f * u));
}

// One RoPE pair of a head in place: pair i (< half = rot_dim/2) is (2i, 2i+1), or with neox
// (i, i + half), rotated by cs = (cos, sin) of its angle. rope.cu and the fused key write
// (kv.cu rope_kv_write_*) share it, its products and sums rounded on their own (no FMA
// contraction, which NVRTC may apply differently in two kernels), so both give the same values.
__device__ __forceinline__ void rope_pair(float* head, int i, int half, int neox, float2 cs) {
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    const float x0 = head[i0], x1 = head[i1];
    head[i0] = __fadd_rn(__fmul_rn(x0, cs.x), -__fmul_rn(x1, cs.y));
    head[i1] = __fadd_rn(__fmul_rn(x0, cs.y), __fmul_rn(x1, cs.x));
}

// bf16 bits -> f32, exact.
__device__ __forceinline__ float bf16_to_f32(u32 h) { return __uint_as_float((h & 0xFFFFu) << 16); }

// A packed pair of bf16 (element 2i in the low half) -> (low, high).
__device__ __forceinline__ float2 bf16x2_to_f32(u32 w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}

// f32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN (backends/bf16.py).
__device__ __forceinline__ u32 f32_to_bf16(float f) {
    u32 bits = __float_as_uint(f);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return ((bits >> 16) | 0x0040u) & 0xFFFFu;
    u32 lsb = (bits >> 16) & 1u;
    return ((bits + 0x7FFFu + lsb) >> 16) & 0xFFFFu;
}

// IEEE half bits -> f32, exact. One instruction on the GPU; bit arithmetic on the harness.
__device__ __forceinline__ float f16_to_f32(u32 h) {
#if defined(__CUDA_ARCH__)
    float f;
    unsigned short hs = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
#else
    u32 sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1Fu) return __uint_as_float(sign | 0x7F800000u | (man << 13));   // inf / NaN
    if (exp == 0u) {                                                              // zero / subnormal
        float v = (float)man * 5.9604644775390625e-8f;                            // man * 2^-24
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

// f32 -> IEEE half bits, round to nearest even (numpy's astype(float16)): subnormal
// halves, overflow to inf, NaN stays NaN. Bit arithmetic on the GPU too (no cvt), so
// the harness runs exactly what a GPU runs; it is called once per stored scale.
__device__ __forceinline__ u32 f32_to_f16(float f) {
    const u32 x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u | ((ax >> 13) & 0x3FFu);        // NaN
    if (ax >= 0x477FF000u) return sign | 0x7C00u;                               // >= 65520: inf
    if (ax >= 0x38800000u) {                                                    // normal half
        const u32 r = ax - 0x38000000u;                                         // exponent rebiased
        return sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
    }
    if (ax <= 0x33000000u) return sign;                                         // <= 2^-25: zero
    const u32 m = (ax & 0x7FFFFFu) | 0x800000u, sh = 126u - (ax >> 23);        // subnormal: m * 2^-sh
    const u32 r = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
    return sign | (r + (rem > half || (rem == half && (r & 1u))));
}

// Paged bf16 KV cache: pages are u32 words holding bf16 pairs (element 2i low),
//   pages[n_pages][n_kv][page_size][head_dim / 2]
// and physical row r of a layer lives in page page_table[r / page_size] at offset
// r % page_size. The first word of (row, head): 32-bit row arithmetic (rows < 2^31),
// a 64-bit word offset (pools may pass 2^31 words).
__device__ __forceinline__ long long row_word(const int* page_table, int row, int head, int n_kv,
                                              int page_size, int hd2) {
    const long long page = page_table[row / page_size];
    return ((page * n_kv + head) * page_size + row % page_size) * hd2;
}
