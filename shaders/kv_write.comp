#version 450
// K/V rows (f32 views) -> physical rows start_row .. start_row+n-1 (start_row: STEP[step_at - 1]
// when step_at > 0, a recorded step's buffer; else the push constant), each KV head's row
// stored as KvFormat.quantize stores it (K_FMT, V_FMT: kv.glsl): bf16 round to nearest
// even; q8_0 / q4_0 ggml's reference rounding, scales by correctly rounded division;
// tq rows arrive rotated (y = R x, from kv_rotate), are normalised by sigma = |y| /
// sqrt(head_dim), coded against the codebook's boundaries and scaled by the least-squares
// s = <y, c> / |c|^2 (f16, round to nearest even).
// One workgroup per (KV head, token, keys|values): grid (n_kv, n, 2). Each word of the
// row is stored by one invocation; a word shared with a neighbouring row (q8_0, tq3
// rows need not fill whole words) changes only in its own bytes (KV_STORE).
// ROPE (a decode step's RoPE fused into its write; keys of an unrotated format): K is the
// step's q | k | v rows; a key is rotated by RoPE at its row's position (rope.comp's table
// and arithmetic) and, when centred, moved by the layer's key centre C before it is
// encoded; workgroups z >= 2 rotate query head x * n_group + z - 2 of the row in place.
// Grid (n_kv, n, 2 + n_group).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer KPB { uint KP[]; };
layout(set = 0, binding = 1) buffer VPB { uint VP[]; };
layout(set = 0, binding = 2) readonly buffer PTB { int PT[]; };
#ifdef ROPE
layout(set = 0, binding = 3) buffer KB { float K[]; };
#else
layout(set = 0, binding = 3) readonly buffer KB { float K[]; };
#endif
layout(set = 0, binding = 4) readonly buffer VB { float V[]; };
layout(set = 0, binding = 5) readonly buffer STB { int STEP[]; };
#ifdef ROPE
layout(set = 0, binding = 6) readonly buffer TB { vec2 CS[]; };
layout(set = 0, binding = 7) readonly buffer PB { int POS[]; };
layout(set = 0, binding = 8) readonly buffer CB { float C[]; };
#endif
layout(push_constant) uniform P {
    uint n, n_kv, head_dim, page_size, start_row, k_off, k_stride, v_off, v_stride, step_at;
#ifdef ROPE
    uint q_off, n_group, rot_dim, neox, pos0, use_pos, c_off, centred;   // positions as rope.comp's
#endif
} pc;
#include "common.glsl"
#include "kv.glsl"

shared float xs[MAX_DIM];               // the row (tq: rotated)
shared uint codes[MAX_DIM];             // per value: bf16 bits, int8 byte, 4-bit q, or tq code
shared uint scales[MAX_DIM / 32u];      // f16 bits per 32-block (tq: [0], the row's)
shared float inv[MAX_DIM / 32u];        // 1 / d per block (tq: [0] = 1 / sigma)
shared float red[64];

float sum64(float v, uint tid) {
    red[tid] = v;
    barrier();
    for (uint w = 32u; w > 0u; w >>= 1) {
        if (tid < w) red[tid] += red[tid + w];
        barrier();
    }
    float s = red[0];
    barrier();
    return s;
}

// xs -> codes, scales (fmt a constant: each call compiles to one format's code).
void encode(uint fmt, uint hd, uint tid) {
    if (fmt == FMT_BF16) {
        for (uint i = tid; i < hd; i += 64u) codes[i] = f32_to_bf16(xs[i]);
    } else if (fmt == FMT_Q8_0 || fmt == FMT_Q4_0) {
        if (tid < hd / 32u) {
            float amax = 0.0, mx = 0.0;                   // largest |x|, the first x reaching it
            for (uint i = 32u * tid; i < 32u * tid + 32u; i++) {
                float v = xs[i];
                if (abs(v) > amax) { amax = abs(v); mx = v; }
            }
            float d = fmt == FMT_Q8_0 ? div_rn(amax, 127.0) : div_rn(mx, -8.0);
            scales[tid] = f32_to_f16(d);
            inv[tid] = d != 0.0 ? div_rn(1.0, d) : 0.0;
        }
        barrier();
        for (uint i = tid; i < hd; i += 64u) {
            precise float v = xs[i] * inv[i / 32u];
            if (fmt == FMT_Q8_0) {
                codes[i] = uint(int(round_away(v))) & 0xFFu;
            } else {
                precise float u = v + 8.5;
                codes[i] = min(uint(trunc(u)), 15u);
            }
        }
    } else {
        float ss = 0.0;
        for (uint i = tid; i < hd; i += 64u) ss += xs[i] * xs[i];
        ss = sum64(ss, tid);
        if (tid == 0u) {
            float sigma = sqrt(ss / float(hd));
            inv[0] = sigma > 0.0 ? div_rn(1.0, sigma) : 0.0;
        }
        barrier();
        float yc = 0.0, cc = 0.0;
        for (uint i = tid; i < hd; i += 64u) {
            precise float v = xs[i] * inv[0];
            uint c = tq_code(fmt, v);
            float level = tq_level(fmt, c);
            codes[i] = c;
            yc += xs[i] * level;
            cc += level * level;
        }
        yc = sum64(yc, tid);
        cc = sum64(cc, tid);
        if (tid == 0u) scales[0] = f32_to_f16(div_rn(yc, max(cc, 1e-30)));
    }
}

// Byte i of the encoded row (kvformat's layouts).
uint row_byte(uint fmt, uint i) {
    if (fmt == FMT_BF16) return (codes[i >> 1] >> (8u * (i & 1u))) & 0xFFu;
    if (fmt == FMT_Q8_0 || fmt == FMT_Q4_0) {
        uint bb = fmt == FMT_Q8_0 ? 34u : 18u, b = i / bb, j = i % bb;
        if (j < 2u) return (scales[b] >> (8u * j)) & 0xFFu;
        uint e = 32u * b + j - 2u;
        return fmt == FMT_Q8_0 ? codes[e] : codes[e] | (codes[e + 16u] << 4);
    }
    if (i < 2u) return (scales[0] >> (8u * i)) & 0xFFu;
    if (fmt == FMT_TQ4) return codes[2u * i - 4u] | (codes[2u * i - 3u] << 4);
    uint g = (i - 2u) / 3u, k = (i - 2u) % 3u, word = 0u;
    for (uint m = 0u; m < 8u; m++) word |= codes[8u * g + m] << (3u * m);
    return (word >> (8u * k)) & 0xFFu;
}

// The encoded row -> bytes [start, start + rb) of pool B, one word per invocation.
#define WRITE_ROW(B, FMT) {                                                          \
    uint rb = row_bytes(FMT, hd), start = kv_row(page, h, off, pc.n_kv, pc.page_size, rb); \
    for (uint w = (start >> 2) + tid; w <= (start + rb - 1u) >> 2; w += 64u) {       \
        uint val = 0u, mask = 0u;                                                    \
        for (uint p = 0u; p < 4u; p++) {                                             \
            uint at = 4u * w + p;                                                    \
            if (at >= start && at < start + rb) {                                    \
                val |= row_byte(FMT, at - start) << (8u * p);                        \
                mask |= 0xFFu << (8u * p);                                           \
            }                                                                        \
        }                                                                            \
        KV_STORE(B, w, val, mask)                                                    \
    } }

void main() {
    uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint r = (pc.step_at != 0u ? uint(STEP[pc.step_at - 1u]) : pc.start_row) + t;
    uint page = uint(PT[r / pc.page_size]), off = r % pc.page_size;
#ifdef ROPE
    uint half_ = pc.rot_dim / 2u;
    uint pos = pc.use_pos != 0u ? uint(POS[pc.use_pos - 1u + t]) : pc.pos0 + t;
    if (gl_WorkGroupID.z >= 2u) {                         // a query head, in place (as rope.comp)
        uint base = pc.q_off + t * pc.k_stride + (h * pc.n_group + gl_WorkGroupID.z - 2u) * hd;
        for (uint i = tid; i < half_; i += 64u) {
            vec2 cs = CS[pos * half_ + i];
            uvec2 at = base + rope_places(i, half_, pc.neox);
            vec2 r = rope_rotate(K[at.x], K[at.y], cs);
            K[at.x] = r.x;
            K[at.y] = r.y;
        }
        return;
    }
#endif
    if (gl_WorkGroupID.z == 0u) {
        uint xo = pc.k_off + t * pc.k_stride + h * hd;
        for (uint i = tid; i < hd; i += 64u) xs[i] = K[xo + i];
        barrier();
#ifdef ROPE
        for (uint i = tid; i < half_; i += 64u) {
            vec2 cs = CS[pos * half_ + i];
            uvec2 at = rope_places(i, half_, pc.neox);
            vec2 r = rope_rotate(xs[at.x], xs[at.y], cs);
            xs[at.x] = r.x;
            xs[at.y] = r.y;
        }
        barrier();
        if (pc.centred != 0u) {
            for (uint i = tid; i < hd; i += 64u) xs[i] += C[pc.c_off + h * hd + i];
            barrier();
        }
#endif
        encode(K_FMT, hd, tid);
        barrier();
        WRITE_ROW(KP, K_FMT)
    } else {
        uint xo = pc.v_off + t * pc.v_stride + h * hd;
        for (uint i = tid; i < hd; i += 64u) xs[i] = V[xo + i];
        barrier();
        encode(V_FMT, hd, tid);
        barrier();
        WRITE_ROW(VP, V_FMT)
    }
}
