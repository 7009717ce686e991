#version 450
// Decode attention (one query per head) for CPU Vulkan devices such as lavapipe, which
// run a workgroup's invocations as SIMD lanes of one CPU thread: there every barrier
// switches between the workgroup's lane groups, and attention.comp's tiles take about
// fifteen barriers per 64 rows. Here a workgroup of LANES invocations serves the GROUP
// query heads of KV head x (GROUP: specialization constant 0) over span y of the visible
// rows (spans: grid y), each lane taking every LANES-th row of the span with its own
// online softmax (running max, sum and value accumulators in registers), and writes its
// partial result in attention.comp's SPLIT layout, as split number y * LANES + lane of
// gl_NumWorkGroups.y * LANES; attention_combine.comp merges them. The group's queries sit
// in every lane's registers, not in shared memory: lavapipe loads shared memory lane by
// lane too, and a key row's dot products read each query element once per row (decode at
// 1,024 rows: 2x faster). One barrier (after kv_tables_init). Row formats, tq bases, the
// window and the row bias as in attention.comp, whose push constants it takes (n = 1;
// start_row = rows - 1).
#extension GL_GOOGLE_include_directive : require
#define LANES 8u
layout(local_size_x = 8) in;
layout(set = 0, binding = 0) readonly buffer QB { float Q[]; };
layout(set = 0, binding = 1) readonly buffer KPB { uint KP[]; };
layout(set = 0, binding = 2) readonly buffer VPB { uint VP[]; };
layout(set = 0, binding = 3) readonly buffer PTB { int PT[]; };
layout(set = 0, binding = 4) buffer OB { float O[]; };
layout(set = 0, binding = 5) readonly buffer RBB { float RB[]; };
layout(set = 0, binding = 6) readonly buffer STB { int STEP[]; };  // a recorded step's values
layout(push_constant) uniform P {
    uint n, n_q_heads, n_kv, head_dim, page_size, start_row;
    uint q_off, q_stride, o_off, o_stride, scale_bits, window;
    uint bias_off, bias_stride, n_bias;
    uint step_at;                        // > 0: start_row = STEP[step_at - 1] - 1 (rows attended - 1)
} pc;
#include "common.glsl"
#define KV_READ_K
#define KV_READ_V
layout(constant_id = 0) const uint GROUP = 1u;
layout(constant_id = 1) const uint HD = 64u;       // head_dim (= pc.head_dim): loops of known length
#define KV_HEAD_DIM HD
#define KQ(qo, i) qr[(qo) + (i)]
float qr[GROUP * HD];                    // the group's queries (scaled), in each lane's registers
#include "kv.glsl"

void main() {
    uint start_row = pc.step_at != 0u ? uint(STEP[pc.step_at - 1u]) - 1u : pc.start_row;
    uint lane = gl_LocalInvocationID.x;
    uint hd = HD;
    uint k_rb = row_bytes(K_FMT, hd), v_rb = row_bytes(V_FMT, hd);
    uint kvh = gl_WorkGroupID.x, h0 = kvh * GROUP;
    float scale = uintBitsToFloat(pc.scale_bits);
    for (uint i = 0u; i < GROUP * HD; i++) qr[i] = Q[pc.q_off + h0 * HD + i] * scale;
    kv_tables_init(lane);
    kv_tables_init(lane + LANES);                                    // tq4's 16 levels
    barrier();

    uint end = start_row + 1u;
    uint first = pc.window != 0u && end > pc.window ? end - pc.window : 0u;
    uint spans = gl_NumWorkGroups.y;
    uint span = (end - first + spans - 1u) / spans;
    uint lo = min(first + gl_WorkGroupID.y * span, end);
    uint hi = min(lo + span, end);                                   // rows lo .. hi-1
    float M[GROUP], L[GROUP];
    vec4 acc[GROUP * 64u];                                           // values 4j .. 4j+3 of head g at g * 64 + j
    uint nj = (hd + 3u) / 4u;
    for (uint g = 0u; g < GROUP; g++) {
        M[g] = -1.0 / 0.0;
        L[g] = 0.0;
        for (uint j = 0u; j < nj; j++) acc[g * 64u + j] = vec4(0.0);
    }
    for (uint r = lo + lane; r < hi; r += LANES) {
        uint page = uint(PT[r / pc.page_size]), off = r % pc.page_size;
        uint kr = kv_row(page, kvh, off, pc.n_kv, pc.page_size, k_rb);
        uint vr = kv_row(page, kvh, off, pc.n_kv, pc.page_size, v_rb);
        float rb = r < pc.n_bias ? RB[pc.bias_off + kvh * pc.bias_stride + r] : 0.0;
#ifdef V_ROW_SCALE
        float vs = v_row_scale(vr);
#else
        float vs = 1.0;
#endif
        float p[GROUP];
        for (uint g = 0u; g < GROUP; g++) {
            float s = k_dot(kr, g * HD) + rb;
            if (s > M[g]) {                                          // a new running max: rescale
                float alpha = is_neg_inf(M[g]) ? 0.0 : exp(M[g] - s);   // 0 while nothing is seen
                L[g] *= alpha;
                for (uint j = 0u; j < nj; j++) acc[g * 64u + j] *= alpha;
                M[g] = s;
            }
            p[g] = exp(s - M[g]);
            L[g] += p[g];
            p[g] *= vs;
        }
        for (uint j = 0u; j < nj; j++) {                             // the value row read once for the group
            vec4 vv = v_load4(vr, j);
            for (uint g = 0u; g < GROUP; g++) acc[g * 64u + j] += p[g] * vv;
        }
    }
    uint splits = spans * LANES, split = gl_WorkGroupID.y * LANES + lane;
    for (uint g = 0u; g < GROUP; g++) {
        uint po = ((h0 + g) * splits + split) * (hd + 2u);
        for (uint j = 0u; j < nj; j++)
            for (uint i = 0u; i < 4u; i++)
                if (4u * j + i < hd) O[po + 4u * j + i] = acc[g * 64u + j][i];
        O[po + hd] = M[g];                                           // -inf: no rows here
        O[po + hd + 1u] = L[g];
    }
}
