// Shared helpers for every compute shader (included with GL_GOOGLE_include_directive).
// Push constants are all uint; floats travel as their bits (uintBitsToFloat).

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
