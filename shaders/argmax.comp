#version 450
// argmax_rows: O[o_off + t] = the index of row t's largest value, the first of equal ones,
// or -1 when the row holds a NaN or an infinity (the engine reports non-finite logits then),
// so greedy decoding reads back one int a token instead of the vocabulary's logits.
// Grid (n, 1, 1): a workgroup of 64 per row, a strided pass then a tree in shared memory.
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer XB { float X[]; };
layout(set = 0, binding = 1) buffer OB { int O[]; };
layout(push_constant) uniform P { uint d, x_off, x_stride, o_off; } pc;

shared float best_v[64];
shared uint best_i[64];
shared uint bad[64];

void main() {
    uint lid = gl_LocalInvocationID.x, t = gl_WorkGroupID.x;
    uint base = pc.x_off + t * pc.x_stride;
    float bv = uintBitsToFloat(0xFF800000u);            // -inf
    uint bi = pc.d, nonfinite = 0u;                      // bi = d: none yet
    for (uint i = lid; i < pc.d; i += 64u) {
        float v = X[base + i];
        if ((floatBitsToUint(v) & 0x7F800000u) == 0x7F800000u) nonfinite = 1u;   // NaN or inf, by its bits
                                                         // (a driver may fold isnan / isinf away)
        if (v > bv) { bv = v; bi = i; }                  // strictly greater: this lane's first
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    bad[lid] = nonfinite;
    barrier();
    for (uint h = 32u; h > 0u; h >>= 1) {
        if (lid < h) {                                   // larger value, then smaller index
            float ov = best_v[lid + h];
            uint oi = best_i[lid + h];
            if (ov > best_v[lid] || (ov == best_v[lid] && oi < best_i[lid])) {
                best_v[lid] = ov;
                best_i[lid] = oi;
            }
            bad[lid] |= bad[lid + h];
        }
        barrier();
    }
    if (lid == 0u) O[pc.o_off + t] = bad[0] != 0u || best_i[0] >= pc.d ? -1 : int(best_i[0]);
}
