/* narrow.h: the scalar conversions of the narrow weight formats (mha.h: MHA_WEIGHTS_BF16,
 * MHA_WEIGHTS_F16, MHA_WEIGHTS_Q8_0), shared by every kernel unit (internal). The packing and the widening
 * that the GEMM does per panel are in gemm_impl.h; their NumPy twins are in
 * src/mha/reference/narrow.py, bit for bit. */
#ifndef MHA_NARROW_H
#define MHA_NARROW_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if (defined(__AVX512F__) || defined(__AVX2__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(MHA_PORTABLE)
#include <immintrin.h> /* gemm_impl.h: _mm512_cvtph_ps, pmovsxbd */
#endif

#define MHA_Q8_0_BLOCK 32 /* values of a Q8_0 block along the shared axis (ggml's QK8_0) */

/* What a narrow packing reads (gemm_impl.h: narrow_pack). */
enum { NARROW_SRC_REAL = 0, NARROW_SRC_BITS16 = 1, NARROW_SRC_Q8_0_BLOCKS = 2 }; /* BITS16: the
    format's own 16-bit values (bfloat16 or half bits), kept */

/* bfloat16 -> float: exact (the bits are float's top half). */
static inline float mha_bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float -> bfloat16, rounding to nearest even (torch's .to(torch.bfloat16): a NaN becomes the
 * quiet NaN 0x7FC0, overflow becomes infinity). */
static inline uint16_t mha_float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE half -> float: exact (subnormals, infinities and NaNs included). */
static inline float mha_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t u;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in float */
        const float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    u = e == 31 ? sign | 0x7F800000u | (m << 13) : sign | ((e + 112u) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float -> IEEE half, rounding to nearest even (as F16C's _cvtss_sh(x, 0), which ggml's
 * GGML_FP32_TO_FP16 uses on x86, and NumPy's astype(float16)): subnormal halves rounded in
 * units of 2^-24, |x| >= 65520 to infinity, a NaN to a quiet NaN of the same sign. */
static inline uint16_t mha_float_to_half(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
    if (a < 0x38800000u) {               /* below 2^-14: a subnormal half (or zero) */
        const uint32_t e = a >> 23;
        if (e < 102) return sign;        /* below 2^-25: rounds to zero */
        const uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - e; /* 14 .. 24 */
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - 0x38000000u; /* rebias 127 -> 15 */
    return (uint16_t)(sign | (r >> 13));
}

/* One Q8_0 block of n <= 32 values x[0], x[stride], ... (the rest of the 32 are zeros), as
 * ggml's quantize_row_q8_0_ref (ggml/src/ggml-quants.c: amax = max |x|, d = amax / 127 in
 * float, id = d ? 1 / d : 0, the scale stored as GGML_FP32_TO_FP16(d), q = roundf(x * id):
 * round half away from zero of the float product with the reciprocal, not of x / d). Writes
 * q[r * q_stride] for r < 32 and returns the half bits of d. */
static inline uint16_t mha_q8_0_block(int8_t *q, int64_t q_stride, const float *x, int64_t n) {
    float amax = 0;
    for (int64_t r = 0; r < n; r++) {
        const float v = fabsf(x[r]);
        amax = amax > v ? amax : v; /* ggml's MAX(amax, v) */
    }
    const float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
    for (int64_t r = 0; r < MHA_Q8_0_BLOCK; r++)
        q[r * q_stride] = r < n ? (int8_t)roundf(x[r] * id) : 0;
    return mha_float_to_half(d);
}

#endif /* MHA_NARROW_H */
