#version 450
// SnapKV window votes over the paged cache, in two passes (one variant each), over
// keys in their row format (K_FMT: kv.glsl); for tq keys Q holds the rotated queries.
// Window query w of head h sits at row P + w (P = n_rows - W) and its causal
// softmax runs over rows 0 .. P + w (the whole row, never the prefix alone).
//  PASS_STATS: one workgroup per (h, w): softmax max and sum -> STATS[h*W + w].
//              Grid: (n_q_heads, W, 1).
//  PASS_VOTES: one thread per prefix row r < P of KV head g: sum over the group's
//              query heads and the W queries of exp(s - max) / sum -> VOTES[g*P + r].
//              Grid: (ceil(P / 64), n_kv, 1).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer QB { float Q[]; };   // [n_q_heads, W, head_dim]
layout(set = 0, binding = 1) readonly buffer KPB { uint KP[]; };
layout(set = 0, binding = 2) readonly buffer PTB { int PT[]; };
layout(set = 0, binding = 3) buffer SB { vec2 STATS[]; };          // (max, sum) per (h, w)
layout(set = 0, binding = 4) buffer VB { float VOTES[]; };         // [n_kv, P]
layout(push_constant) uniform P_ {
    uint n_q_heads, n_kv, head_dim, page_size, n_rows, window, q_off, scale_bits;
} pc;
#include "common.glsl"
#define KV_READ_K
#define KQ(qo, i) Q[(qo) + (i)]
#include "kv.glsl"

float score(uint qo, uint kvh, uint r) {
    uint k = kv_row(uint(PT[r / pc.page_size]), kvh, r % pc.page_size, pc.n_kv, pc.page_size,
                    row_bytes(K_FMT, pc.head_dim));
    return k_dot(k, qo) * uintBitsToFloat(pc.scale_bits);
}

#if defined(PASS_STATS)
shared float rm[64];
shared float rl[64];
void main() {
    uint h = gl_WorkGroupID.x, w = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
    uint kvh = h / (pc.n_q_heads / pc.n_kv);
    uint n_vis = pc.n_rows - pc.window + w + 1u;
    uint qo = pc.q_off + (h * pc.window + w) * pc.head_dim;
    kv_tables_init(tid);
    barrier();
    float m = -1.0 / 0.0, l = 0.0;
    for (uint r = tid; r < n_vis; r += 64u) {
        float s = score(qo, kvh, r);
        float m2 = max(m, s);
        l = (is_neg_inf(m) ? 0.0 : l * exp(m - m2)) + exp(s - m2);     // (no exp(-inf): see common.glsl)
        m = m2;
    }
    rm[tid] = m;
    rl[tid] = l;
    barrier();
    for (uint k = 32u; k > 0u; k >>= 1) {
        if (tid < k) {
            float ma = rm[tid], mb = rm[tid + k];
            float mm = max(ma, mb);
            float la = is_neg_inf(ma) ? 0.0 : rl[tid] * exp(ma - mm);      // empty lanes weigh 0
            float lb = is_neg_inf(mb) ? 0.0 : rl[tid + k] * exp(mb - mm);
            rm[tid] = mm;
            rl[tid] = la + lb;
        }
        barrier();
    }
    if (tid == 0u) STATS[h * pc.window + w] = vec2(rm[0], rl[0]);
}
#elif defined(PASS_VOTES)
void main() {
    uint r = gl_GlobalInvocationID.x, g = gl_WorkGroupID.y;
    uint prefix = pc.n_rows - pc.window;
    kv_tables_init(gl_LocalInvocationID.x);
    barrier();
    if (r >= prefix) return;
    uint group = pc.n_q_heads / pc.n_kv;
    float v = 0.0;
    for (uint hh = 0u; hh < group; hh++) {
        uint h = g * group + hh;
        for (uint w = 0u; w < pc.window; w++) {
            vec2 st = STATS[h * pc.window + w];
            v += exp(score(pc.q_off + (h * pc.window + w) * pc.head_dim, g, r) - st.x) / st.y;
        }
    }
    VOTES[g * prefix + r] = v;
}
#else
#error "define PASS_STATS or PASS_VOTES"
#endif
