// Shared helpers for every compute shader (included with GL_GOOGLE_include_directive).
// Push constants are all uint; floats travel as their bits (uintBitsToFloat).
// Included by quant.glsl and kv.glsl too, so it is guarded.
#ifndef COMMON_GLSL
#define COMMON_GLSL

// -inf by its bits: without the SignedZeroInfNanPreserve execution mode a Vulkan driver may
// assume every float is finite and fold isinf / isnan, or a comparison with infinity, away.
bool is_neg_inf(float v) { return floatBitsToUint(v) == 0xFF800000u; }

// RoPE pair i (< half_ = rot_dim/2) of a head: its two places, (2i, 2i+1), or with neox
// (i, i + half_); and the pair (x0, x1) rotated by cs = (cos, sin) of its angle, products
// and sums rounded on their own (precise: no contraction), so rope.comp and kv_write.comp's
// ROPE variant give the same bits.
uvec2 rope_places(uint i, uint half_, uint neox) {
    return neox != 0u ? uvec2(i, i + half_) : uvec2(2u * i, 2u * i + 1u);
}
vec2 rope_rotate(float x0, float x1, vec2 cs) {
    precise vec2 r = vec2(x0 * cs.x - x1 * cs.y, x0 * cs.y + x1 * cs.x);
    return r;
}

// bf16 bits (low 16 bits of a uint) -> f32, exact.
float bf16_to_f32(uint h) { return uintBitsToFloat((h & 0xFFFFu) << 16); }

// f32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN (backends/bf16.py).
uint f32_to_bf16(float f) {
    uint bits = floatBitsToUint(f);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return ((bits >> 16) | 0x0040u) & 0xFFFFu;
    uint lsb = (bits >> 16) & 1u;
    return ((bits + 0x7FFFu + lsb) >> 16) & 0xFFFFu;
}

// A packed pair of bf16 (element 2i in the low half) -> vec2.
vec2 unpack_bf16x2(uint w) { return vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xFFFF0000u)); }

// f16 bits (low 16 bits of h) -> f32 with integer operations, exact: unpackHalf2x16
// may flush f16 subnormals to zero (Vulkan allows it), and f16 subnormals are f32
// normals, so here none is; inf and NaN stay inf and NaN.
float f16_to_f32(uint h) {
    uint sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0u) {
        float v = float(m) * 5.9604644775390625e-8;                 // m * 2^-24
        return sign != 0u ? -v : v;
    }
    return uintBitsToFloat(sign | (e == 31u ? 0x7F800000u | (m << 13) : ((e + 112u) << 23) | (m << 13)));
}

// The feed-forward gates (eltwise.comp, and matmul.comp's gated variants: the same values).
// gelu_tanh(a) = 0.5 a (1 + tanh(u)) == a / (1 + exp(-2u)), u = sqrt(2/pi) (a + 0.044715 a^3):
// no tanh, which some drivers compute as a quotient of exps (inf / inf = NaN for large |u|),
// and the exponent clamped so exp never overflows (a / (1 + e^80) < 1e-34 * |a|).
float silu(float a) { return a / (1.0 + exp(-a)); }
float gelu_tanh(float a) {
    float u = 0.7978845608028654 * a * (1.0 + 0.044715 * a * a);
    return a / (1.0 + exp(min(-2.0 * u, 80.0)));
}
#endif
