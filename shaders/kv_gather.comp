#version 450
// KV compaction on device: row keep[h, j] of KV head h moves to row j.
// Two passes so the in-place move never reads a row already overwritten:
//  PASS_GATHER:  pages -> TMP [2][n_kv][n_keep][head_dim/2]
//  PASS_SCATTER: TMP -> rows 0 .. n_keep-1 of the pages
// Grid: (n_keep, n_kv, 1); threads over head_dim/2 pairs.
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer KPB { uint KP[]; };
layout(set = 0, binding = 1) buffer VPB { uint VP[]; };
layout(set = 0, binding = 2) readonly buffer PTB { int PT[]; };
layout(set = 0, binding = 3) readonly buffer KEEPB { int KEEP[]; };   // [n_kv, n_keep]
layout(set = 0, binding = 4) buffer TB { uint TMP[]; };
layout(push_constant) uniform P { uint n_kv, n_keep, head_dim, page_size; } pc;
#include "kv.glsl"

void main() {
    uint j = gl_WorkGroupID.x, h = gl_WorkGroupID.y;
    uint hd2 = pc.head_dim / 2u;
    uint tk = (h * pc.n_keep + j) * hd2;
    uint tv = tk + pc.n_kv * pc.n_keep * hd2;
#if defined(PASS_GATHER)
    uint r = uint(KEEP[h * pc.n_keep + j]);
#else
    uint r = j;
#endif
    uint row = kv_word(uint(PT[r / pc.page_size]), h, r % pc.page_size, pc.n_kv, pc.page_size, hd2);
    for (uint p = gl_LocalInvocationID.x; p < hd2; p += 64u) {
#if defined(PASS_GATHER)
        TMP[tk + p] = KP[row + p];
        TMP[tv + p] = VP[row + p];
#else
        KP[row + p] = TMP[tk + p];
        VP[row + p] = TMP[tv + p];
#endif
    }
}
