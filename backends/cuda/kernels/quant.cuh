// Dequantization of raw GGUF blocks, 32 consecutive weights (one sub-block) at a time.
// A weight row starts at byte row * row_bytes of the raw buffer (the file's bytes
// unchanged plus 16 bytes of padding, so a load a few bytes past a block is safe).
// Exactly one QTYPE_* is defined per variant. Layouts follow ggml (ggml-quants.c);
// K-quant sub-block j of 32 decodes like dequantize_row_q*_K (as shaders/quant.glsl).
//
// Two steps, so a kernel can issue the loads early and decode later:
//   load_sub(row, sub, cols, raw)   the sub-block's bytes -> raw (aligned loads only)
//   decode_sub(raw, w)              raw -> w[32] f32, exactly as ggml's f32 dequantization
// Loads: K-quant blocks (144/176 bytes) are 16-byte aligned -> uint4; Q5_1 (24) 8-byte
// -> uint2; Q4_1 (20) 4-byte -> u32; Q4_0/Q5_0/Q8_0/Q6_K (18/22/34/210) only 2-byte
// aligned -> the covering aligned words plus a funnel shift (0 or 16 bits).
#pragma once
#include "common.cuh"

typedef unsigned long long u64;

// 32 bits starting `sh` bits into the little-endian pair (lo, hi); sh in 0..32.
__device__ __forceinline__ u32 funnel(u32 lo, u32 hi, u32 sh) {
    return (u32)((((u64)hi << 32) | lo) >> sh);
}

// Small non-negative integer v (< 2^23) -> float(v) - bias, exact: the exponent trick
// (one LOP + one FADD instead of a quarter-rate I2F). `bias` is 8388608 + offset.
__device__ __forceinline__ float u2f(u32 v, float bias) { return __uint_as_float(0x4B000000u | v) - bias; }
#define U2F_BIAS 8388608.0f

// Aligned words from the 4-byte boundary at or below p; bit offset of p within word 0.
__device__ __forceinline__ const u32* word_base(const u8* p, u32& sh) {
    sh = (u32)((u64)p & 3u) * 8u;
    return (const u32*)((u64)p & ~(u64)3);
}

#if defined(QTYPE_F32) || defined(QTYPE_F16) || defined(QTYPE_BF16)
#define FLOAT_WEIGHTS                      // rows may end mid sub-block (cols % 32 != 0)
#endif

#if defined(QTYPE_F32)
#define QK 1
#define BLOCK_BYTES 4
#define RAW_WORDS 32
#elif defined(QTYPE_F16) || defined(QTYPE_BF16)
#define QK 1
#define BLOCK_BYTES 2
#define RAW_WORDS 16
#elif defined(QTYPE_Q4_0)
#define QK 32
#define BLOCK_BYTES 18
#define RAW_WORDS 5                        // bytes [b, b+18) from the aligned word below b
#elif defined(QTYPE_Q4_1)
#define QK 32
#define BLOCK_BYTES 20
#define RAW_WORDS 5
#elif defined(QTYPE_Q5_0)
#define QK 32
#define BLOCK_BYTES 22
#define RAW_WORDS 6
#elif defined(QTYPE_Q5_1)
#define QK 32
#define BLOCK_BYTES 24
#define RAW_WORDS 6
#elif defined(QTYPE_Q8_0)
#define QK 32
#define BLOCK_BYTES 34
#define RAW_WORDS 9
#elif defined(QTYPE_Q4_K)
#define QK 256
#define BLOCK_BYTES 144
#define RAW_WORDS 12                       // header (d, dmin, scales) + 32 quant bytes
#elif defined(QTYPE_Q5_K)
#define QK 256
#define BLOCK_BYTES 176
#define RAW_WORDS 20                       // header + 32 high-bit bytes + 32 quant bytes
#elif defined(QTYPE_Q6_K)
#define QK 256
#define BLOCK_BYTES 210
#define RAW_WORDS 20                       // 9 words ql, 9 words qh, scale pair, d
#else
#error "define one QTYPE_*"
#endif

// One sub-block's bytes. aux: the funnel shift (2-byte aligned types) or the
// sub-block index within its 256-element super-block (K-quants).
struct QRaw {
    u32 q[RAW_WORDS];
    u32 aux;
};

__device__ __forceinline__ void load_uint4s(const u8* p, u32* q, int n4) {
    const uint4* v = (const uint4*)p;
#pragma unroll
    for (int k = 0; k < n4; k++) {
        uint4 t = v[k];
        q[4 * k] = t.x; q[4 * k + 1] = t.y; q[4 * k + 2] = t.z; q[4 * k + 3] = t.w;
    }
}

// Sub-block `sub` (elements sub*32 .. sub*32+31) of the row at `row` -> r.
// `cols`: elements in the row (only float types may end mid sub-block; the rest are 0).
__device__ __forceinline__ void load_sub(const u8* __restrict__ row, int sub, int cols, QRaw& r) {
#if defined(QTYPE_F32)
    const u8* p = row + sub * 128;
    const int c0 = sub * 32;
    if (c0 + 32 <= cols && ((u64)p & 15u) == 0) {
        load_uint4s(p, r.q, 8);
    } else {
        const u32* v = (const u32*)p;
#pragma unroll
        for (int i = 0; i < 32; i++) r.q[i] = c0 + i < cols ? v[i] : 0u;
    }
#elif defined(QTYPE_F16) || defined(QTYPE_BF16)
    const u8* p = row + sub * 64;
    const int c0 = sub * 32;
    if (c0 + 32 <= cols && ((u64)p & 15u) == 0) {
        load_uint4s(p, r.q, 4);
    } else {
        const u16* v = (const u16*)p;
#pragma unroll
        for (int k = 0; k < 16; k++) {
            u32 lo = c0 + 2 * k < cols ? (u32)v[2 * k] : 0u;
            u32 hi = c0 + 2 * k + 1 < cols ? (u32)v[2 * k + 1] : 0u;
            r.q[k] = lo | (hi << 16);
        }
    }
#elif defined(QTYPE_Q4_0) || defined(QTYPE_Q5_0) || defined(QTYPE_Q8_0)
    const u32* a = word_base(row + sub * BLOCK_BYTES, r.aux);
#pragma unroll
    for (int k = 0; k < RAW_WORDS; k++) r.q[k] = a[k];
#elif defined(QTYPE_Q4_1)
    const u32* a = (const u32*)(row + sub * BLOCK_BYTES);
#pragma unroll
    for (int k = 0; k < 5; k++) r.q[k] = a[k];
#elif defined(QTYPE_Q5_1)
    const uint2* a = (const uint2*)(row + sub * BLOCK_BYTES);
#pragma unroll
    for (int k = 0; k < 3; k++) {
        uint2 t = a[k];
        r.q[2 * k] = t.x; r.q[2 * k + 1] = t.y;
    }
#elif defined(QTYPE_Q4_K) || defined(QTYPE_Q5_K)
    const u8* b = row + (sub >> 3) * BLOCK_BYTES;
    const u32 j = sub & 7;
    r.aux = j;
    load_uint4s(b, r.q, 1);                                   // d, dmin, scales[12]
#if defined(QTYPE_Q4_K)
    load_uint4s(b + 16 + 32 * (j >> 1), r.q + 4, 2);          // qs: two sub-blocks, nibbles
#else
    load_uint4s(b + 16, r.q + 4, 2);                          // qh[32]: bit j of each byte
    load_uint4s(b + 48 + 32 * (j >> 1), r.q + 12, 2);         // qs
#endif
#elif defined(QTYPE_Q6_K)
    // ql[128] @0, qh[64] @128, scales[16] @192, d @208; sub-block j = 4*half + kk
    // uses ql[64*half + 32*(kk&1) ..+32] (nibble kk>>1), qh[32*half ..+32] (bits 2*kk),
    // scales[8*half + 2*kk], [..+1] (elements 0-15, 16-31).
    const u8* b = row + (sub >> 3) * BLOCK_BYTES;
    const u32 j = sub & 7, half = j >> 2, kk = j & 3;
    u32 sh;
    const u32* ql = word_base(b + 64 * half + 32 * (kk & 1), sh);
    const u32* qh = word_base(b + 128 + 32 * half, sh);
#pragma unroll
    for (int k = 0; k < 9; k++) { r.q[k] = ql[k]; r.q[9 + k] = qh[k]; }
    const u16* h = (const u16*)b;
    r.q[18] = h[96 + 4 * half + kk];                          // scale bytes 2kk, 2kk+1 of this half
    r.q[19] = h[104];                                         // d (f16)
    r.aux = sh | (j << 8);
#endif
}

// r -> w[32], element i of the sub-block in w[i].
__device__ __forceinline__ void decode_sub(const QRaw& r, float* w) {
#if defined(QTYPE_F32)
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = __uint_as_float(r.q[i]);
#elif defined(QTYPE_F16)
#pragma unroll
    for (int k = 0; k < 16; k++) {
        w[2 * k] = f16_to_f32(r.q[k] & 0xFFFFu);
        w[2 * k + 1] = f16_to_f32(r.q[k] >> 16);
    }
#elif defined(QTYPE_BF16)
#pragma unroll
    for (int k = 0; k < 16; k++) {
        float2 v = bf16x2_to_f32(r.q[k]);
        w[2 * k] = v.x;
        w[2 * k + 1] = v.y;
    }
#elif defined(QTYPE_Q4_0) || defined(QTYPE_Q4_1)
    // qs[16]: byte l holds element l (low nibble) and l + 16 (high nibble).
#if defined(QTYPE_Q4_0)
    const u32 sh = r.aux;
    const float d = f16_to_f32(funnel(r.q[0], r.q[1], sh) & 0xFFFFu);
    const float bias = U2F_BIAS + 8.0f;                       // (q - 8) * d
#else
    const float d = f16_to_f32(r.q[0] & 0xFFFFu), m = f16_to_f32(r.q[0] >> 16);
    const float bias = U2F_BIAS;                              // q * d + m
#endif
#pragma unroll
    for (int k = 0; k < 4; k++) {
#if defined(QTYPE_Q4_0)
        const u32 q = funnel(r.q[k], r.q[k + 1], sh + 16);    // qs bytes 4k..4k+3 (block byte 2 + 4k)
#else
        const u32 q = r.q[k + 1];
#endif
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float lo = u2f((q >> (8 * i)) & 0xFu, bias), hi = u2f((q >> (8 * i + 4)) & 0xFu, bias);
#if defined(QTYPE_Q4_0)
            w[4 * k + i] = lo * d;
            w[16 + 4 * k + i] = hi * d;
#else
            w[4 * k + i] = lo * d + m;
            w[16 + 4 * k + i] = hi * d + m;
#endif
        }
    }
#elif defined(QTYPE_Q5_0) || defined(QTYPE_Q5_1)
    // qh: bit l is the fifth bit of element l; qs as Q4_0.
#if defined(QTYPE_Q5_0)
    const u32 sh = r.aux;
    const float d = f16_to_f32(funnel(r.q[0], r.q[1], sh) & 0xFFFFu);
    const u32 qh = funnel(r.q[0], r.q[1], sh + 16);           // block byte 2
    const float bias = U2F_BIAS + 16.0f;                      // (q - 16) * d
#else
    const float d = f16_to_f32(r.q[0] & 0xFFFFu), m = f16_to_f32(r.q[0] >> 16);
    const u32 qh = r.q[1];
    const float bias = U2F_BIAS;                              // q * d + m
#endif
#pragma unroll
    for (int k = 0; k < 4; k++) {
#if defined(QTYPE_Q5_0)
        const u32 q = funnel(r.q[k + 1], r.q[k + 2], sh + 16);   // block byte 6 + 4k
#else
        const u32 q = r.q[k + 2];
#endif
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int l = 4 * k + i;
            const u32 vlo = ((q >> (8 * i)) & 0xFu) | (((qh >> l) & 1u) << 4);
            const u32 vhi = ((q >> (8 * i + 4)) & 0xFu) | (((qh >> (l + 16)) & 1u) << 4);
#if defined(QTYPE_Q5_0)
            w[l] = u2f(vlo, bias) * d;
            w[16 + l] = u2f(vhi, bias) * d;
#else
            w[l] = u2f(vlo, bias) * d + m;
            w[16 + l] = u2f(vhi, bias) * d + m;
#endif
        }
    }
#elif defined(QTYPE_Q8_0)
    const u32 sh = r.aux;
    const float d = f16_to_f32(funnel(r.q[0], r.q[1], sh) & 0xFFFFu);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const u32 q = funnel(r.q[k], r.q[k + 1], sh + 16) ^ 0x80808080u;   // int8 + 128
#pragma unroll
        for (int i = 0; i < 4; i++) w[4 * k + i] = u2f((q >> (8 * i)) & 0xFFu, U2F_BIAS + 128.0f) * d;
    }
#elif defined(QTYPE_Q4_K) || defined(QTYPE_Q5_K)
    // ggml get_scale_min_k4 for sub-block j from scales bytes 0-3 (s0), 4-7 (s1), 8-11 (s2).
    const u32 j = r.aux, jb = 8u * (j & 3u);
    const u32 s0 = r.q[1] >> jb, s1 = r.q[2] >> jb, s2 = r.q[3] >> jb;
    const u32 sc = j < 4u ? s0 & 63u : (s2 & 0xFu) | (((s0 >> 6) & 3u) << 4);
    const u32 mn = j < 4u ? s1 & 63u : ((s2 >> 4) & 0xFu) | (((s1 >> 6) & 3u) << 4);
    const float d1 = f16_to_f32(r.q[0] & 0xFFFFu) * (float)sc;   // exact: f16 * 6-bit
    const float m1 = f16_to_f32(r.q[0] >> 16) * (float)mn;
    const u32 nshift = 4u * (j & 1u);
#pragma unroll
    for (int k = 0; k < 8; k++) {
#if defined(QTYPE_Q4_K)
        const u32 q = r.q[4 + k] >> nshift;
#else
        const u32 q = r.q[12 + k] >> nshift;
        const u32 h = r.q[4 + k] >> j;
#endif
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = (q >> (8 * i)) & 0xFu;
#if defined(QTYPE_Q5_K)
            v |= ((h >> (8 * i)) & 1u) << 4;
#endif
            w[4 * k + i] = d1 * u2f(v, U2F_BIAS) - m1;
        }
    }
#elif defined(QTYPE_Q6_K)
    const u32 sh = r.aux & 0xFFu, j = r.aux >> 8, kk = j & 3u;
    const u32 nshift = 4u * (kk >> 1), hshift = 2u * kk;
    const float d = f16_to_f32(r.q[19]);
    const float s0 = d * (float)((int)(r.q[18] << 24) >> 24);   // exact: f16 * int8
    const float s1 = d * (float)((int)(r.q[18] << 16) >> 24);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const u32 q = funnel(r.q[k], r.q[k + 1], sh) >> nshift;
        const u32 h = funnel(r.q[9 + k], r.q[10 + k], sh) >> hshift;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 v = ((q >> (8 * i)) & 0xFu) | (((h >> (8 * i)) & 3u) << 4);
            w[4 * k + i] = (k < 4 ? s0 : s1) * u2f(v, U2F_BIAS + 32.0f);
        }
    }
#endif
}
