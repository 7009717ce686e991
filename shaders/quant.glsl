// Dequantization of raw GGUF blocks, 32 consecutive weights at a time.
// The weight buffer `Wq` (uint words) holds the file's bytes unchanged; a row
// starts at row * row_bytes. Exactly one QTYPE_* is defined per variant.
// Layouts follow ggml (ggml-quants.c); K-quant sub-block j of 32 is decoded
// like dequantize_row_q*_K.

#include "common.glsl"      // f16_to_f32

uint rd8(uint off)  { return (Wq[off >> 2] >> ((off & 3u) * 8u)) & 0xFFu; }
uint rd16(uint off) { return (off & 1u) == 0u ? (Wq[off >> 2] >> ((off & 2u) * 8u)) & 0xFFFFu
                                              : rd8(off) | (rd8(off + 1u) << 8); }
uint rd32(uint off) {                      // any alignment
    uint s = (off & 3u) * 8u;
    uint lo = Wq[off >> 2];
    return s == 0u ? lo : (lo >> s) | (Wq[(off >> 2) + 1u] << (32u - s));
}
float f16(uint off) { return f16_to_f32(rd16(off)); }

// N consecutive little-endian words starting at byte offset `off` (any alignment):
// N + 1 loads instead of 2N (weight buffers carry one word of padding).
#define READ_WORDS(dst, off, N) {                                            \
    uint o_ = (off) >> 2, s_ = ((off) & 3u) * 8u, prev_ = Wq[o_];             \
    for (uint k_ = 0u; k_ < (N); k_++) {                                     \
        uint next_ = Wq[o_ + k_ + 1u];                                       \
        dst[k_] = s_ == 0u ? prev_ : (prev_ >> s_) | (next_ << (32u - s_));  \
        prev_ = next_;                                                       \
    } }

#if defined(QTYPE_F32) || defined(QTYPE_F16) || defined(QTYPE_BF16)
#define FLOAT_WEIGHTS                      // rows may end mid sub-block
#endif

#if defined(QTYPE_F32)
#define QK 1u
#define BLOCK_BYTES 4u
#elif defined(QTYPE_F16) || defined(QTYPE_BF16)
#define QK 1u
#define BLOCK_BYTES 2u
#elif defined(QTYPE_Q4_0)
#define QK 32u
#define BLOCK_BYTES 18u
#elif defined(QTYPE_Q4_1)
#define QK 32u
#define BLOCK_BYTES 20u
#elif defined(QTYPE_Q5_0)
#define QK 32u
#define BLOCK_BYTES 22u
#elif defined(QTYPE_Q5_1)
#define QK 32u
#define BLOCK_BYTES 24u
#elif defined(QTYPE_Q8_0)
#define QK 32u
#define BLOCK_BYTES 34u
#elif defined(QTYPE_Q4_K)
#define QK 256u
#define BLOCK_BYTES 144u
#elif defined(QTYPE_Q5_K)
#define QK 256u
#define BLOCK_BYTES 176u
#elif defined(QTYPE_Q6_K)
#define QK 256u
#define BLOCK_BYTES 210u
#else
#error "define one QTYPE_*"
#endif

#if defined(PADDED_BLOCKS)
// q4_0 / q4_1 / q8_0 blocks padded for 64-bit loads (CPU devices with shaderInt64;
// backends/vulkan/weights.py): the block's f16 scale (q4_1: scale, then min) in its first
// word, its codes from byte 8, the block 24 (q8_0: 40) bytes; always block-major.
#if !defined(QTYPE_Q4_0) && !defined(QTYPE_Q4_1) && !defined(QTYPE_Q8_0)
#error "padded blocks are q4_0, q4_1 or q8_0"
#endif
#undef BLOCK_BYTES
#if defined(QTYPE_Q8_0)
#define BLOCK_BYTES 40u
#else
#define BLOCK_BYTES 24u
#endif
#endif

#if defined(QTYPE_Q4_K) || defined(QTYPE_Q5_K)
// ggml get_scale_min_k4: 6-bit scale and min of sub-block j from the 12 scale bytes at s.
void scale_min_k4(uint j, uint s, out float sc, out float mn) {
    if (j < 4u) {
        sc = float(rd8(s + j) & 63u);
        mn = float(rd8(s + j + 4u) & 63u);
    } else {
        sc = float((rd8(s + j + 4u) & 0xFu) | ((rd8(s + j - 4u) >> 6) << 4));
        mn = float((rd8(s + j + 4u) >> 4) | ((rd8(s + j) >> 6) << 4));
    }
}
#endif

#if defined(BLOCK_MAJOR)
// Block-major weights (CPU Vulkan devices; backends/vulkan/weights.py): rows in groups of
// BLOCK_MAJOR_ROWS, each group storing block 0 of its rows, then block 1, ... (a row's
// blocks are no longer contiguous). The row_base that makes dequant32 read block
// sub / (QK / 32) of `row` there, in a matrix of `rows` rows of `row_bytes` bytes.
#define BLOCK_MAJOR_ROWS 256u
#if defined(FLOAT_WEIGHTS)
#error "float weights are never stored block-major"
#endif
uint block_major_base(uint row, uint sub, uint rows, uint row_bytes) {
    uint g0 = row - row % BLOCK_MAJOR_ROWS;
    uint kb = sub / (QK / 32u);
    uint addr = g0 * row_bytes + (kb * min(BLOCK_MAJOR_ROWS, rows - g0) + row - g0) * BLOCK_BYTES;
    return addr - kb * BLOCK_BYTES;        // dequant32 adds kb * BLOCK_BYTES back (mod 2^32)
}
#endif

// Weights row_base .. of sub-block `sub` (elements sub*32 .. sub*32+31) -> w.
// `valid`: elements in the row (only float types may end mid sub-block).
void dequant32(uint row_base, uint sub, uint valid, out float w[32]) {
#if defined(QTYPE_F32)
    uint o = (row_base >> 2) + sub * 32u;
    for (uint i = 0u; i < 32u; i++) w[i] = sub * 32u + i < valid ? uintBitsToFloat(Wq[o + i]) : 0.0;
#elif defined(QTYPE_F16) || defined(QTYPE_BF16)
    uint o = row_base + sub * 64u;
    for (uint i = 0u; i < 32u; i++) {
        uint h = sub * 32u + i < valid ? rd16(o + 2u * i) : 0u;
#if defined(QTYPE_F16)
        w[i] = f16_to_f32(h);
#else
        w[i] = uintBitsToFloat(h << 16);
#endif
    }
#elif defined(QTYPE_Q4_0) || defined(QTYPE_Q4_1)
    uint b = row_base + sub * BLOCK_BYTES;
    float d;
#if defined(PADDED_BLOCKS)
    uint dm = Wq[b >> 2];
    d = f16_to_f32(dm & 0xFFFFu);
#if defined(QTYPE_Q4_1)
    float m = f16_to_f32(dm >> 16);
#else
    float m = -8.0 * d;
#endif
    uint qs = b + 8u;
#elif defined(QTYPE_Q4_1)
    uint dm = Wq[b >> 2];                         // 20-byte blocks: word aligned
    d = f16_to_f32(dm & 0xFFFFu);
    float m = f16_to_f32(dm >> 16);
    uint qs = b + 4u;
#else
    d = f16(b);
    float m = -8.0 * d;
    uint qs = b + 2u;
#endif
    uint qw[4];
#if defined(QTYPE_Q4_1) || defined(PADDED_BLOCKS)
    for (uint k = 0u; k < 4u; k++) qw[k] = Wq[(qs >> 2) + k];
#else
    READ_WORDS(qw, qs, 4u);
#endif
    for (uint k = 0u; k < 4u; k++) {
        uint q = qw[k];
        for (uint i = 0u; i < 4u; i++) {
            uint byte = (q >> (8u * i)) & 0xFFu;
            w[4u * k + i] = float(byte & 0xFu) * d + m;
            w[16u + 4u * k + i] = float(byte >> 4) * d + m;
        }
    }
#elif defined(QTYPE_Q5_0) || defined(QTYPE_Q5_1)
    uint b = row_base + sub * BLOCK_BYTES;
    float d = f16(b);
#if defined(QTYPE_Q5_1)
    float m = f16(b + 2u);
    uint qh = rd32(b + 4u);
    uint qs = b + 8u;
#else
    float m = -16.0 * d;
    uint qh = rd32(b + 2u);
    uint qs = b + 6u;
#endif
    uint qw[4];
    READ_WORDS(qw, qs, 4u);
    for (uint k = 0u; k < 4u; k++) {
        uint q = qw[k];
        for (uint i = 0u; i < 4u; i++) {
            uint j = 4u * k + i;
            uint byte = (q >> (8u * i)) & 0xFFu;
            w[j] = float((byte & 0xFu) | (((qh >> j) & 1u) << 4)) * d + m;
            w[16u + j] = float((byte >> 4) | (((qh >> (j + 16u)) & 1u) << 4)) * d + m;
        }
    }
#elif defined(QTYPE_Q8_0)
    uint b = row_base + sub * BLOCK_BYTES;
    float d = f16(b);
    uint qw[8];
#if defined(PADDED_BLOCKS)
    for (uint k = 0u; k < 8u; k++) qw[k] = Wq[(b >> 2) + 2u + k];
#else
    READ_WORDS(qw, b + 2u, 8u);
#endif
    for (uint k = 0u; k < 8u; k++) {
        uint q = qw[k];
        for (uint i = 0u; i < 4u; i++) {
            int v = int(q << (24u - 8u * i)) >> 24;          // sign-extend byte i
            w[4u * k + i] = float(v) * d;
        }
    }
#elif defined(QTYPE_Q4_K) || defined(QTYPE_Q5_K)
    uint b = row_base + (sub >> 3) * BLOCK_BYTES;
    uint j = sub & 7u;
    float d = f16(b), dmin = f16(b + 2u);
    float sc, mn;
    scale_min_k4(j, b + 4u, sc, mn);
    float d1 = d * sc, m1 = dmin * mn;
#if defined(QTYPE_Q4_K)
    uint qs = b + 16u + 32u * (j >> 1);
#else
    uint qhb = b + 16u;
    uint qs = b + 48u + 32u * (j >> 1);
#endif
    uint shift = 4u * (j & 1u);
    for (uint k = 0u; k < 8u; k++) {
        uint q = Wq[(qs >> 2) + k];                 // K-quant blocks are word aligned
#if defined(QTYPE_Q5_K)
        uint h = Wq[(qhb >> 2) + k];
#endif
        for (uint i = 0u; i < 4u; i++) {
            uint v = (q >> (8u * i + shift)) & 0xFu;
#if defined(QTYPE_Q5_K)
            v |= ((h >> (8u * i + j)) & 1u) << 4;
#endif
            w[4u * k + i] = d1 * float(v) - m1;
        }
    }
#elif defined(QTYPE_Q6_K)
    uint b = row_base + (sub >> 3) * BLOCK_BYTES;
    uint j = sub & 7u;
    uint half_ = j >> 2, kk = j & 3u;
    uint ql = b + 64u * half_ + 32u * (kk & 1u);
    uint qh = b + 128u + 32u * half_;
    uint scb = b + 192u + 8u * half_ + 2u * kk;
    float d = f16(b + 208u);
    float s0 = d * float(int(rd8(scb) << 24) >> 24);
    float s1 = d * float(int(rd8(scb + 1u) << 24) >> 24);
    uint nshift = 4u * (kk >> 1), hshift = 2u * kk;
    uint qlw[8], qhw[8];
    READ_WORDS(qlw, ql, 8u);
    READ_WORDS(qhw, qh, 8u);
    for (uint k = 0u; k < 8u; k++) {
        uint q = qlw[k];
        uint h = qhw[k];
        for (uint i = 0u; i < 4u; i++) {
            uint l = 4u * k + i;
            int v = int(((q >> (8u * i + nshift)) & 0xFu) | (((h >> (8u * i + hshift)) & 3u) << 4)) - 32;
            w[l] = (l < 16u ? s0 : s1) * float(v);
        }
    }
#endif
}


#if defined(PADDED_BLOCKS) && defined(WQ64)
// Dot product of a padded block with 32 activations straight from its codes (matmul's
// ROW_PER_LANE layout; `Wq64`: the weight buffer as 64-bit words). Codes are read 64 bits
// at a time: a CPU device loads memory lane by lane, one access per word whatever its
// width, so a q4_1 block costs 3 accesses instead of 5 (q8_0: 5 instead of 10). A code is
// isolated by a mask alone, in place, and converted with its place value 2^DOT_SHIFT(j),
// which the activation carries instead (xp[j] = x[j] * 2^-DOT_SHIFT(j): exact, powers of
// two). Codes are unsigned (q4_0: offset 8; q8_0: bytes XOR 0x80, offset 128); the offset
// and q4_1's min are applied once per block through the activations' sum `xsum`.
#if defined(QTYPE_Q8_0)
#define DOT_SHIFT(j) (((j) & 3u) == 3u ? 16u : 8u * ((j) & 3u))   // byte 3 from the word >> 8
#else
#define DOT_SHIFT(j) (8u * ((j) & 3u))                            // high nibbles from the word >> 4
#endif
// dot[t] = sum_j W[row, sub*32 + j] * x_t[j] for the TN tokens' activations.
void dot32(uint row_base, uint sub, float xp[TN * 32u], float xsum[TN], out float dot[TN]) {
    uint b = row_base + sub * BLOCK_BYTES;
    uint dm = Wq[b >> 2];
    float d = f16_to_f32(dm & 0xFFFFu);
#if defined(QTYPE_Q8_0)
    uint qw[8];
    for (uint k = 0u; k < 4u; k++) {
        uint64_t q2 = Wq64[(b >> 3) + 1u + k];
        qw[2u * k] = uint(q2) ^ 0x80808080u;
        qw[2u * k + 1u] = uint(q2 >> 32) ^ 0x80808080u;
    }
    for (uint t = 0u; t < TN; t++) {
        float s = 0.0;
        for (uint k = 0u; k < 8u; k++) {
            uint q = qw[k], j = t * 32u + 4u * k;
            s += float(int(q & 0xFFu)) * xp[j] + float(int(q & 0xFF00u)) * xp[j + 1u]
               + float(int(q & 0xFF0000u)) * xp[j + 2u] + float(int((q >> 8) & 0xFF0000u)) * xp[j + 3u];
        }
        dot[t] = d * (s - 128.0 * xsum[t]);
    }
#else
    uint qw[4];
    for (uint k = 0u; k < 2u; k++) {
        uint64_t q2 = Wq64[(b >> 3) + 1u + k];
        qw[2u * k] = uint(q2);
        qw[2u * k + 1u] = uint(q2 >> 32);
    }
    for (uint t = 0u; t < TN; t++) {
        float s = 0.0;
        for (uint k = 0u; k < 4u; k++) {
            uint lo = qw[k], hi = qw[k] >> 4, j = t * 32u + 4u * k;
            for (uint i = 0u; i < 4u; i++) {
                uint mask = 0xFu << (8u * i);
                s += float(int(lo & mask)) * xp[j + i] + float(int(hi & mask)) * xp[j + 16u + i];
            }
        }
#if defined(QTYPE_Q4_1)
        dot[t] = d * s + f16_to_f32(dm >> 16) * xsum[t];
#else
        dot[t] = d * (s - 8.0 * xsum[t]);
#endif
    }
#endif
}
#endif
