// KV row formats (backends/kvformat.py) as the attention and votes kernels read them.
//
// Pages of every format are bytes [n_pages][n_kv][page_size][row_bytes]; physical row r
// of a layer lives in page page_table[r / page_size] at offset r % page_size (kv_row).
//   bf16  row_bytes 2*D            u32 words of bf16 pairs (value 2i low)
//   q8_0  34*D/32                  blocks: f16 d, 32 x int8          (2-byte aligned)
//   q4_0  18*D/32                  blocks: f16 d, 16 bytes of nibbles (2-byte aligned)
//   tq4   2 + D/2                  f16 s, 4-bit codes, value 2j low in byte j (2-byte aligned)
//   tq3   2 + 3*D/8                f16 s, 3 bytes per 8 codes (any alignment)
//
// A kernel reads a row in *units*: the few bytes one lane loads at once and decodes in
// registers into UNIT values. Unit u of a row holds values value(u, 0 .. UNIT-1):
//   bf16  one word, 2 values         2u, 2u+1
//   q8_0  4 int8 of a block          4u .. 4u+3             (block u / 8)
//   q4_0  4 bytes of a block         the 4 low nibbles, then the 4 high ones: in block
//                                    b = u / 4, j = u % 4: 32b + 4j + 0..3, 32b + 4j + 16..19
//   tq4   4 bytes (8 codes)          8u .. 8u+7
//   tq3   3 bytes (8 codes)          8u .. 8u+7 (bits 3i of the 24-bit word)
// load(row, u) returns a unit as one u32, scale(row, b) scale block b as f32 (block(u)
// of unit u: q8_0 u/8, q4_0 u/4, tq 0 (one scale per row)), raw(w, i, cb) value i of a
// unit before its scale (tq: cb[code], cb the codebook of kvformat.codebook(bits) staged
// in shared memory), and kv_decode<F>(w, s, cb, v) the unit's values with the scale applied. Queries are laid out (staged,
// or held in registers) in the same unit order, so a dot product is UNIT products per
// unit whatever the format, and outputs are scattered back through value().
// tq rows hold the *rotated* row y = R x: the kernels score R q against them and
// rotate their outputs back once (rotate.cu), never a row.
//
// Kernels compiled per format pair: KV_K / KV_V name the key / value formats
// (-DKV_K=KV_Q8_0; bf16 when not defined), and KvRow<KV_K> supplies the code.
#pragma once
#include "common.cuh"

#define KV_BF16 0
#define KV_Q8_0 1
#define KV_Q4_0 2
#define KV_TQ4 3
#define KV_TQ3 4

#define KV_CHUNK 2               // values of a unit decoded at once in the tiled kernels' S steps

#ifndef KV_K
#define KV_K KV_BF16
#endif
#ifndef KV_V
#define KV_V KV_BF16
#endif

// Byte offset of (row, KV head) in its pool: 32-bit row arithmetic, 64-bit offset.
__device__ __forceinline__ long long kv_row_offset(const int* page_table, int row, int head, int n_kv,
                                                   int page_size, int row_bytes) {
    const long long page = page_table[row / page_size];
    return ((page * n_kv + head) * page_size + row % page_size) * (long long)row_bytes;
}

__device__ __forceinline__ const u8* kv_row(const u8* pages, const int* page_table, int row, int head, int n_kv,
                                            int page_size, int row_bytes) {
    return pages + kv_row_offset(page_table, row, head, n_kv, page_size, row_bytes);
}

__device__ __forceinline__ u32 ld_u16(const u8* p) { return *reinterpret_cast<const u16*>(p); }
__device__ __forceinline__ u32 ld_u16x2(const u8* p) {
    const u16* h = reinterpret_cast<const u16*>(p);
    return (u32)h[0] | ((u32)h[1] << 16);
}
__device__ __forceinline__ u32 ld_u8x3(const u8* p) { return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16); }

// Small integer v (< 2^23) -> float(v) - (bias - 2^23), exact (quant.cuh's u2f).
__device__ __forceinline__ float kv_u2f(u32 v, float bias) { return __uint_as_float(0x4B000000u | v) - bias; }

template <int F> struct KvRow;

template <> struct KvRow<KV_BF16> {
    static constexpr int UNIT = 2;
    static constexpr bool SCALED = false, ROTATED = false;
    __device__ static int row_bytes(int d) { return 2 * d; }
    __device__ static int n_scales(int) { return 0; }
    __device__ static int block(int) { return 0; }
    __device__ static int value(int u, int i) { return 2 * u + i; }
    __device__ static u32 load(const u8* row, int u) { return reinterpret_cast<const u32*>(row)[u]; }
    __device__ static float scale(const u8*, int) { return 1.0f; }
    __device__ static float raw(u32 w, int i, const float*) {
        return __uint_as_float(i == 0 ? w << 16 : w & 0xFFFF0000u);
    }
};

template <> struct KvRow<KV_Q8_0> {
    static constexpr int UNIT = 4;
    static constexpr bool SCALED = true, ROTATED = false;
    __device__ static int row_bytes(int d) { return 34 * (d / 32); }
    __device__ static int n_scales(int d) { return d / 32; }
    __device__ static int block(int u) { return u >> 3; }
    __device__ static int value(int u, int i) { return 4 * u + i; }
    __device__ static u32 load(const u8* row, int u) { return ld_u16x2(row + 34 * (u >> 3) + 2 + 4 * (u & 7)); }
    __device__ static float scale(const u8* row, int b) { return f16_to_f32(ld_u16(row + 34 * b)); }
    __device__ static float raw(u32 w, int i, const float*) {                 // int8
        return kv_u2f(((w >> (8 * i)) & 0xFFu) ^ 0x80u, 8388736.0f);
    }
};

template <> struct KvRow<KV_Q4_0> {
    static constexpr int UNIT = 8;
    static constexpr bool SCALED = true, ROTATED = false;
    __device__ static int row_bytes(int d) { return 18 * (d / 32); }
    __device__ static int n_scales(int d) { return d / 32; }
    __device__ static int block(int u) { return u >> 2; }
    __device__ static int value(int u, int i) { return 32 * (u >> 2) + 4 * (u & 3) + (i & 3) + 16 * (i >> 2); }
    __device__ static u32 load(const u8* row, int u) { return ld_u16x2(row + 18 * (u >> 2) + 2 + 4 * (u & 3)); }
    __device__ static float scale(const u8* row, int b) { return f16_to_f32(ld_u16(row + 18 * b)); }
    __device__ static float raw(u32 w, int i, const float*) {                 // nibble - 8
        return kv_u2f((w >> (8 * (i & 3) + 4 * (i >> 2))) & 0xFu, 8388616.0f);
    }
};

template <> struct KvRow<KV_TQ4> {
    static constexpr int UNIT = 8;
    static constexpr bool SCALED = true, ROTATED = true;
    __device__ static int row_bytes(int d) { return 2 + d / 2; }
    __device__ static int n_scales(int) { return 1; }
    __device__ static int block(int) { return 0; }
    __device__ static int value(int u, int i) { return 8 * u + i; }
    __device__ static u32 load(const u8* row, int u) { return ld_u16x2(row + 2 + 4 * u); }
    __device__ static float scale(const u8* row, int) { return f16_to_f32(ld_u16(row)); }
    __device__ static float raw(u32 w, int i, const float* cb) { return cb[(w >> (4 * i)) & 0xFu]; }
};

template <> struct KvRow<KV_TQ3> {
    static constexpr int UNIT = 8;
    static constexpr bool SCALED = true, ROTATED = true;
    __device__ static int row_bytes(int d) { return 2 + 3 * (d / 8); }
    __device__ static int n_scales(int) { return 1; }
    __device__ static int block(int) { return 0; }
    __device__ static int value(int u, int i) { return 8 * u + i; }
    __device__ static u32 load(const u8* row, int u) { return ld_u8x3(row + 2 + 3 * u); }
    __device__ static float scale(const u8* row, int) { return f16_to_f32((u32)row[0] | ((u32)row[1] << 8)); }
    __device__ static float raw(u32 w, int i, const float* cb) { return cb[(w >> (3 * i)) & 0x7u]; }
};

// Values e0 .. e0+N-1 of a unit of format F with its scale s applied -> v[0 .. N-1].
template <int F, int N = KvRow<F>::UNIT>
__device__ __forceinline__ void kv_decode(u32 w, float s, const float* cb, float* v, int e0 = 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = KvRow<F>::SCALED ? KvRow<F>::raw(w, e0 + i, cb) * s : KvRow<F>::raw(w, e0 + i, cb);
}

// The codebook of format F (16 floats, kvformat.codebook(bits) zero-padded) -> shared
// memory; threads 0..15 copy, the caller's next __syncthreads publishes it.
template <int F>
__device__ __forceinline__ void stage_codebook(float* dst, const float* __restrict__ cb) {
    if constexpr (KvRow<F>::ROTATED) {
        if (threadIdx.x < 16) dst[threadIdx.x] = cb[threadIdx.x];
    }
}

// Tile staging (prefill, votes): units u0 .. u0+nu-1 of rows r0 .. r0+n_tile-1 of KV head g
// (zeros at and past row_end) -> words[j * ws + p]; their scale blocks block(u0) ..
// block(u0+nu-1) -> scales[j * ss + b - block(u0)] (SCALED formats). A warp per row.
template <int F, int THREADS>
__device__ __forceinline__ void stage_units(u32* words, int ws, float* scales, int ss, const u8* __restrict__ pages,
                                            const int* __restrict__ page_table, int r0, int n_tile, int row_end,
                                            int g, int n_kv, int page_size, int row_bytes, int u0, int nu) {
    typedef KvRow<F> R;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int b0 = R::block(u0), nb = R::SCALED ? R::block(u0 + nu - 1) - b0 + 1 : 0;
    for (int j = warp; j < n_tile; j += THREADS / WARP_SIZE) {
        u32* dst = words + j * ws;
        float* sd = scales + j * ss;
        if (r0 + j < row_end) {
            if constexpr (F == KV_BF16) {            // word addressing: fewer registers than bytes
                const u32* src = reinterpret_cast<const u32*>(pages) +
                                 row_word(page_table, r0 + j, g, n_kv, page_size, row_bytes / 4) + u0;
                for (int p = lane; p < nu; p += WARP_SIZE) dst[p] = src[p];
            } else {
                const u8* row = kv_row(pages, page_table, r0 + j, g, n_kv, page_size, row_bytes);
                for (int p = lane; p < nu; p += WARP_SIZE) dst[p] = R::load(row, u0 + p);
                if (lane < nb) sd[lane] = R::scale(row, b0 + lane);
            }
        } else {
            for (int p = lane; p < nu; p += WARP_SIZE) dst[p] = 0u;
            if (R::SCALED && lane < nb) sd[lane] = 0.0f;
        }
    }
}

// v[0 .. N-1] = p[0 .. N-1] from shared memory, N even and p 8-byte aligned (16 for N >= 4).
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float* v) {
    if (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4 t = reinterpret_cast<const float4*>(p)[i / 4];
            v[i] = t.x; v[i + 1] = t.y; v[i + 2] = t.z; v[i + 3] = t.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 2) {
            const float2 t = reinterpret_cast<const float2*>(p)[i / 2];
            v[i] = t.x; v[i + 1] = t.y;
        }
    }
}
