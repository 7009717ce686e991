// Paged KV rows in every format of backends/kvformat.py, addressed by byte.
// A pool is one buffer of uint32 words holding the pages' bytes unchanged:
//   pages[n_pages][n_kv_heads][page_size][row_bytes]
// Physical row r lives in page page_table[r / page_size] at offset r % page_size.
// Rows of q8_0 (34 bytes per 32 values) and tq3 (2 + 3d/8) need not start on a word,
// so neighbouring rows may share a word: readers shift bytes out of two words, and
// writers store a shared word with atomicAnd/atomicOr of their own bytes only.
//
// A shader picks its formats at compile time: K_FMT / V_FMT = one of the FMT_* codes
// (the index in kvformat.KV_DTYPES), and for tq formats TQ{4,3}_LEVELS / _BOUNDS (the
// codebook and its midpoints, kvformat.codebook / boundaries, exact f32 literals),
// all from backends/vulkan/shaders.py kv_defines(). Readers need the pools bound as
// KP / VP; k_dot needs KV_READ_K and KQ(qo, i) (the query), v_load4 KV_READ_V, and
// both kv_tables_init first.
#define FMT_BF16 0
#define FMT_Q8_0 1
#define FMT_Q4_0 2
#define FMT_TQ4 3
#define FMT_TQ3 4
#define MAX_DIM 256u             // head_dim <= 256
#ifndef KV_HEAD_DIM
#define KV_HEAD_DIM pc.head_dim  // a shader may make it a constant (attention_lanes.comp)
#endif

#include "common.glsl"      // f16_to_f32, unpack_bf16x2

#ifdef TQ4_LEVELS
const float TQ4_CB[16] = float[16](TQ4_LEVELS);
const float TQ4_BD[15] = float[15](TQ4_BOUNDS);
#endif
#ifdef TQ3_LEVELS
const float TQ3_CB[8] = float[8](TQ3_LEVELS);
const float TQ3_BD[7] = float[7](TQ3_BOUNDS);
#endif

// Bytes per row of format fmt at head_dim hd (KvFormat.row_bytes); fmt is a constant.
uint row_bytes(uint fmt, uint hd) {
    return fmt == FMT_BF16 ? 2u * hd : fmt == FMT_Q8_0 ? 34u * (hd / 32u) : fmt == FMT_Q4_0 ? 18u * (hd / 32u)
         : fmt == FMT_TQ4 ? 2u + hd / 2u : 2u + 3u * (hd / 8u);
}

// Byte offset of (page, head, offset) in a pool with rows of rb bytes.
uint kv_row(uint page, uint head, uint offset, uint n_kv, uint page_size, uint rb) {
    return ((page * n_kv + head) * page_size + offset) * rb;
}

// n <= 4 bytes of buffer B at byte o (little endian), any alignment; the word after
// o's word is read only when the bytes reach into it (never past the last byte).
#define KV_SH(o) (((o) & 3u) * 8u)
#define KV_RD(B, o, n) ((KV_SH(o) + 8u * (n) > 32u                                          \
    ? (B[(o) >> 2] >> KV_SH(o)) | (B[((o) >> 2) + 1u] << (32u - KV_SH(o))) : B[(o) >> 2] >> KV_SH(o)) \
    & ((n) >= 4u ? 0xFFFFFFFFu : (1u << (8u * (n))) - 1u))
#define KV_RD16(B, o) KV_RD(B, o, 2u)
#define KV_RD24(B, o) KV_RD(B, o, 3u)
#define KV_RD32(B, o) KV_RD(B, o, 4u)

// Store the bytes of `val` selected by `mask` into word w of B: a whole word is a plain
// store; a word shared with a row (or page) another invocation writes is changed with
// atomics that touch only our bytes.
#define KV_STORE(B, w, val, mask) {                                                  \
    if ((mask) == 0xFFFFFFFFu) B[w] = (val);                                          \
    else if ((mask) != 0u) { atomicAnd(B[w], ~(mask)); atomicOr(B[w], (val) & (mask)); } }

// f32 -> f16 bits, round to nearest even (numpy's astype(float16)), subnormals and
// overflow to inf included; NaN -> quiet NaN.
uint f32_to_f16(float f) {
    uint x = floatBitsToUint(f);
    uint sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u;
    if (a >= 0x477FF000u) return sign | 0x7C00u;                  // >= 65520: inf
    if (a >= 0x38800000u) {                                       // >= 2^-14: normal
        uint r = a - 0x38000000u;                                 // rebias 127 -> 15
        return sign | ((r + 0x0FFFu + ((r >> 13) & 1u)) >> 13);
    }
    if (a < 0x33000000u) return sign;                             // < 2^-25 (or its tie): 0
    uint m = (a & 0x7FFFFFu) | 0x800000u, s = 126u - (a >> 23);   // value = m * 2^-s units of 2^-24
    uint k = m >> s, rem = m & ((1u << s) - 1u), half_ = 1u << (s - 1u);
    return sign | (k + uint(rem > half_ || (rem == half_ && (k & 1u) == 1u)));
}

// a / b correctly rounded (IEEE round to nearest even) by integer long division: Vulkan
// lets a device's float division be off by 2.5 ulp, and the q8_0 / q4_0 scales must be
// ggml's to the bit. Zero, subnormal, inf and NaN operands, and results outside the
// normal range, fall back to the device's division.
float div_rn(float a, float b) {
    uint ua = floatBitsToUint(a), ub = floatBitsToUint(b);
    uint ea = (ua >> 23) & 0xFFu, eb = (ub >> 23) & 0xFFu;
    if (ea == 0u || ea == 255u || eb == 0u || eb == 255u) return a / b;
    uint ma = (ua & 0x7FFFFFu) | 0x800000u, mb = (ub & 0x7FFFFFu) | 0x800000u;
    int e = int(ea) - int(eb) + 127;
    if (ma < mb) { ma <<= 1; e -= 1; }                            // ma / mb in [1, 2)
    uint q = 0u, r = ma;
    for (int i = 0; i < 25; i++) {                                // 24 bits + the round bit
        q <<= 1;
        if (r >= mb) { r -= mb; q |= 1u; }
        r <<= 1;
    }
    uint mant = q >> 1;
    if ((q & 1u) == 1u && (r != 0u || (mant & 1u) == 1u)) mant++;
    if (mant == 0x1000000u) { mant >>= 1; e += 1; }
    if (e <= 0 || e >= 255) return a / b;
    return uintBitsToFloat(((ua ^ ub) & 0x80000000u) | (uint(e) << 23) | (mant & 0x7FFFFFu));
}

// C roundf: halves away from zero (kvformat._round_away). The caller makes v `precise`
// so that no fused multiply-add folds the product that made v into v - t.
float round_away(float v) {
    float t = trunc(v);
    precise float frac = abs(v - t);
    return frac >= 0.5 ? t + sign(v) : t;
}

// tq codebook level c and code of a normalised value v (the number of boundaries below
// v: kvformat's searchsorted), for fmt FMT_TQ4 or FMT_TQ3 (a constant).
float tq_level(uint fmt, uint c) {
#ifdef TQ4_LEVELS
    if (fmt == FMT_TQ4) return TQ4_CB[c];
#endif
#ifdef TQ3_LEVELS
    if (fmt == FMT_TQ3) return TQ3_CB[c];
#endif
    return 0.0;
}

uint tq_code(uint fmt, float v) {
    uint c = 0u;
#ifdef TQ4_LEVELS
    if (fmt == FMT_TQ4) for (uint k = 0u; k < 15u; k++) c += uint(v > TQ4_BD[k]);
#endif
#ifdef TQ3_LEVELS
    if (fmt == FMT_TQ3) for (uint k = 0u; k < 7u; k++) c += uint(v > TQ3_BD[k]);
#endif
    return c;
}

// Readers look tq levels up in shared memory (a divergent index into a constant array
// serialises on some GPUs): kv_tables_init fills k_cb / v_cb; call it, then barrier().
#if defined(KV_READ_K) && (K_FMT == FMT_TQ4 || K_FMT == FMT_TQ3)
shared float k_cb[16];
#endif
#if defined(KV_READ_V) && (V_FMT == FMT_TQ4 || V_FMT == FMT_TQ3)
shared float v_cb[16];
#endif
void kv_tables_init(uint tid) {
#if defined(KV_READ_K) && (K_FMT == FMT_TQ4 || K_FMT == FMT_TQ3)
    if (tid < (K_FMT == FMT_TQ4 ? 16u : 8u)) k_cb[tid] = tq_level(K_FMT, tid);
#endif
#if defined(KV_READ_V) && (V_FMT == FMT_TQ4 || V_FMT == FMT_TQ3)
    if (tid < (V_FMT == FMT_TQ4 ? 16u : 8u)) v_cb[tid] = tq_level(V_FMT, tid);
#endif
}

#if defined(KV_READ_K)
// q . k for the key row at byte rb (K_FMT): the query element i is KQ(qo, i). tq keys
// are read in the rotated basis (the query is R q).
float k_dot(uint rb, uint qo) {
    uint hd = KV_HEAD_DIM;
    float s = 0.0;
#if K_FMT == FMT_BF16
    uint w0 = rb >> 2;
    for (uint p = 0u; p < hd / 2u; p++) {
        vec2 kk = unpack_bf16x2(KP[w0 + p]);
        s += KQ(qo, 2u * p) * kk.x + KQ(qo, 2u * p + 1u) * kk.y;
    }
    return s;
#elif K_FMT == FMT_Q8_0
    for (uint b = 0u; b < hd / 32u; b++) {
        uint o = rb + 34u * b, a = o + 2u, e = 32u * b;
        float sb = 0.0;
        for (uint k = 0u; k < 8u; k++) {
            int wd = int(KV_RD32(KP, a + 4u * k));
            sb += KQ(qo, e) * float(bitfieldExtract(wd, 0, 8)) + KQ(qo, e + 1u) * float(bitfieldExtract(wd, 8, 8))
                + KQ(qo, e + 2u) * float(bitfieldExtract(wd, 16, 8)) + KQ(qo, e + 3u) * float(bitfieldExtract(wd, 24, 8));
            e += 4u;
        }
        s += f16_to_f32(KV_RD16(KP, o)) * sb;
    }
    return s;
#elif K_FMT == FMT_Q4_0
    for (uint b = 0u; b < hd / 32u; b++) {
        uint o = rb + 18u * b, a = o + 2u, e = 32u * b;
        float sb = 0.0;
        for (uint k = 0u; k < 4u; k++) {
            uint wd = KV_RD32(KP, a + 4u * k);
            for (uint i = 0u; i < 4u; i++) {
                uint byte_ = wd >> (8u * i);
                sb += KQ(qo, e) * float(int(byte_ & 15u) - 8) + KQ(qo, e + 16u) * float(int((byte_ >> 4) & 15u) - 8);
                e++;
            }
        }
        s += f16_to_f32(KV_RD16(KP, o)) * sb;
    }
    return s;
#elif K_FMT == FMT_TQ4
    uint a = rb + 2u;
    for (uint k = 0u; k < hd / 8u; k++) {
        uint wd = KV_RD32(KP, a + 4u * k);
        for (uint m = 0u; m < 8u; m++) s += KQ(qo, 8u * k + m) * k_cb[(wd >> (4u * m)) & 15u];
    }
    return f16_to_f32(KV_RD16(KP, rb)) * s;
#elif K_FMT == FMT_TQ3
    uint a = rb + 2u;
    for (uint g = 0u; g < hd / 8u; g++) {
        uint wd = KV_RD24(KP, a + 3u * g);
        for (uint m = 0u; m < 8u; m++) s += KQ(qo, 8u * g + m) * k_cb[(wd >> (3u * m)) & 7u];
    }
    return f16_to_f32(KV_RD16(KP, rb)) * s;
#else
#error "K_FMT: one of the FMT_* codes"
#endif
}
#endif

#if defined(KV_READ_V)
#if V_FMT == FMT_TQ4 || V_FMT == FMT_TQ3
#define V_ROW_SCALE                // tq: one scale per row, which the caller folds into p
float v_row_scale(uint rb) { return f16_to_f32(KV_RD16(VP, rb)); }
#endif

// Values 4g .. 4g+3 of the value row at byte rb (V_FMT), block scales applied; tq values
// in the rotated basis and without the row's scale (V_ROW_SCALE: v_row_scale(rb)).
// (bf16 with head_dim % 4 == 2: the last group's upper pair is 0.)
vec4 v_load4(uint rb, uint g) {
#if V_FMT == FMT_BF16
    uint w = (rb >> 2) + 2u * g;
    return vec4(unpack_bf16x2(VP[w]), 4u * g + 2u < KV_HEAD_DIM ? unpack_bf16x2(VP[w + 1u]) : vec2(0.0));
#elif V_FMT == FMT_Q8_0
    uint o = rb + 34u * (g >> 3), a = o + 2u + 4u * (g & 7u);
    int wd = int(KV_RD32(VP, a));
    return f16_to_f32(KV_RD16(VP, o)) * vec4(bitfieldExtract(wd, 0, 8), bitfieldExtract(wd, 8, 8),
                                             bitfieldExtract(wd, 16, 8), bitfieldExtract(wd, 24, 8));
#elif V_FMT == FMT_Q4_0
    uint o = rb + 18u * (g >> 3), j = 4u * (g & 7u);
    uint a = o + 2u + (j & 15u);
    uint wd = KV_RD32(VP, a) >> (j < 16u ? 0u : 4u);
    return f16_to_f32(KV_RD16(VP, o)) * (vec4(wd & 15u, (wd >> 8) & 15u, (wd >> 16) & 15u, (wd >> 24) & 15u) - 8.0);
#elif V_FMT == FMT_TQ4
    uint wd = KV_RD16(VP, rb + 2u + 2u * g);
    return vec4(v_cb[wd & 15u], v_cb[(wd >> 4) & 15u], v_cb[(wd >> 8) & 15u], v_cb[(wd >> 12) & 15u]);
#elif V_FMT == FMT_TQ3
    uint wd = KV_RD24(VP, rb + 2u + 3u * (g >> 1)) >> (12u * (g & 1u));
    return vec4(v_cb[wd & 7u], v_cb[(wd >> 3) & 7u], v_cb[(wd >> 6) & 7u], v_cb[(wd >> 9) & 7u]);
#else
#error "V_FMT: one of the FMT_* codes"
#endif
}
#endif
