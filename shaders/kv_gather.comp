#version 450
// KV compaction on device: row keep[h, j] of KV head h moves to row j, whole rows of
// any format (k_rb / v_rb bytes: a quantized row moves with its scales).
// Two passes so the in-place move never reads a row already overwritten:
//  PASS_GATHER:  pages -> TMP: K rows [n_kv][n_keep][ceil(k_rb / 4)] words, then V rows
//  PASS_SCATTER: TMP -> rows 0 .. n_keep-1 of the pages; a word shared with a
//                neighbouring row changes only in the row's own bytes (KV_STORE)
// Grid: (min(n_keep, groups), n_kv, 1), each workgroup moving rows j, j + groups, ...
// (maxComputeWorkGroupCount[0] is 65535 on some devices; budgets may keep more rows);
// threads over the row's words.
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer KPB { uint KP[]; };
layout(set = 0, binding = 1) buffer VPB { uint VP[]; };
layout(set = 0, binding = 2) readonly buffer PTB { int PT[]; };
layout(set = 0, binding = 3) readonly buffer KEEPB { int KEEP[]; };   // [n_kv, n_keep]
layout(set = 0, binding = 4) buffer TB { uint TMP[]; };
layout(push_constant) uniform P { uint n_kv, n_keep, k_rb, v_rb, page_size; } pc;
#include "kv.glsl"

#if defined(PASS_GATHER)
#define MOVE(B, RB, T0) {                                                            \
    uint start = kv_row(page, h, off, pc.n_kv, pc.page_size, RB);                    \
    for (uint p = tid; 4u * p < RB; p += 64u) {                                      \
        uint nb = min(4u, RB - 4u * p), at = start + 4u * p;                         \
        TMP[T0 + p] = KV_RD(B, at, nb);                                              \
    } }
#else
#define MOVE(B, RB, T0) {                                                            \
    uint start = kv_row(page, h, off, pc.n_kv, pc.page_size, RB);                    \
    for (uint w = (start >> 2) + tid; w <= (start + RB - 1u) >> 2; w += 64u) {       \
        uint val = 0u, mask = 0u;                                                    \
        for (uint p = 0u; p < 4u; p++) {                                             \
            uint at = 4u * w + p;                                                    \
            if (at >= start && at < start + RB) {                                    \
                uint i = at - start;                                                 \
                val |= ((TMP[T0 + (i >> 2)] >> (8u * (i & 3u))) & 0xFFu) << (8u * p); \
                mask |= 0xFFu << (8u * p);                                           \
            }                                                                        \
        }                                                                            \
        KV_STORE(B, w, val, mask)                                                    \
    } }
#endif

void main() {
    uint h = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
    uint k_rw = (pc.k_rb + 3u) / 4u, v_rw = (pc.v_rb + 3u) / 4u;
    for (uint j = gl_WorkGroupID.x; j < pc.n_keep; j += gl_NumWorkGroups.x) {
        uint tk = (h * pc.n_keep + j) * k_rw;
        uint tv = pc.n_kv * pc.n_keep * k_rw + (h * pc.n_keep + j) * v_rw;
#if defined(PASS_GATHER)
        uint r = uint(KEEP[h * pc.n_keep + j]);
#elif defined(PASS_SCATTER)
        uint r = j;
#else
#error "define PASS_GATHER or PASS_SCATTER"
#endif
        uint page = uint(PT[r / pc.page_size]), off = r % pc.page_size;
        MOVE(KP, pc.k_rb, tk)
        MOVE(VP, pc.v_rb, tv)
    }
}
