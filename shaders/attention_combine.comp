#version 450
// Second pass of split decode attention (attention.comp with SPLIT=S): per query head,
// merge the S partial results (accumulators a_s, running max M_s, sum L_s) into
//     O[h] = sum_s exp(M_s - M) a_s / sum_s exp(M_s - M) L_s,   M = max_s M_s
// (an empty span has M_s = -inf and weighs 0). Grid: (n_q_heads, 1, 1).
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer PB { float PART[]; };
layout(set = 0, binding = 1) buffer OB { float O[]; };
layout(push_constant) uniform P { uint head_dim, splits, o_off; } pc;

void main() {
    uint h = gl_WorkGroupID.x, tid = gl_LocalInvocationID.x, hd = pc.head_dim, w = hd + 2u;
    uint base = h * pc.splits * w;
    float M = -1.0 / 0.0;
    for (uint s = 0u; s < pc.splits; s++) M = max(M, PART[base + s * w + hd]);
    float L = 0.0;
    for (uint s = 0u; s < pc.splits; s++) {
        float m = PART[base + s * w + hd];
        if (floatBitsToUint(m) != 0xFF800000u) L += exp(m - M) * PART[base + s * w + hd + 1u];   // not -inf (bits:
                                                                    // a driver may fold float compares with inf)
    }
    for (uint i = tid; i < hd; i += 64u) {
        float a = 0.0;
        for (uint s = 0u; s < pc.splits; s++) {
            float m = PART[base + s * w + hd];
            if (floatBitsToUint(m) != 0xFF800000u) a += exp(m - M) * PART[base + s * w + i];
        }
        O[pc.o_off + h * hd + i] = a / L;
    }
}
