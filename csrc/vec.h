/* vec.h: the vector helpers of the softmax (max, exp-and-sum, scale) and of transposed
 * packing (square-block transposes), for float and double.
 *
 * Written with GCC/Clang vector extensions (32-byte vectors: AVX2 in the x86-64-v3 clone,
 * pairs of SSE registers in the baseline one) with a scalar tail. The float exp is a
 * polynomial in base 2 (absolute error < 2e-7 on a softmax weight, exactly 0 for -inf, NaN
 * propagated); the double path uses libm's exp so float64 results stay within 1e-15 of the
 * NumPy reference.
 * The exp is only for the softmax's non-positive arguments.
 */
#ifndef MHA_VEC_H
#define MHA_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float mha_v8f __attribute__((vector_size(32)));
typedef int32_t mha_v8i __attribute__((vector_size(32)));
typedef uint32_t mha_v8u __attribute__((vector_size(32))); /* shifts whose bits leave the top */

#define MHA_V8_LOAD(v, p) memcpy(&(v), (p), sizeof(mha_v8f))
#define MHA_V8_STORE(p, v) memcpy((p), &(v), sizeof(mha_v8f))

/* exp of 8 floats x <= 0 (softmax arguments s - max) as 2^t, t = x log2(e): 2^k * P(r),
 * k = round(t), r = t - k in [-1/2, 1/2], P a degree-5 fit of 2^r (relative error 1.6e-7
 * in float arithmetic; rounding t adds 6e-8 |x|, so a softmax weight e^x is off by at most
 * 1.9e-7 in absolute terms). t is first raised to -127 where below (-inf too; a NaN stays:
 * MHA_V8_MAX keeps its second operand when the compare is false). The scale 2^k is the bits of
 * t + 1.5 * 2^23 + 127 shifted left by 23: the low mantissa bits of that sum hold k + 127, in
 * [0, 127], and the rest shifts out; for k = -127 they are 0, so e^x is exactly 0 for
 * t < -126.5 (x < -87.68), a subnormal float for t in (-126.5, -126) (x up to -87.34), normal
 * above (a mask made everything below t = -125 exactly 0 before). In the AVX2 clone the
 * softmax loop is 20 instructions per 8 scores (23 with that mask, 31 with the Cody-Waite exp
 * before). */
#define MHA_V8_EXP_NONPOS(out, x_in)                                                            \
    do {                                                                                        \
        mha_v8f t_ = (x_in) * 1.44269504088896341f;                                             \
        t_ = MHA_V8_MAX((mha_v8f){0} - 127.0f, t_);     /* at least -127; a NaN t stays */      \
        mha_v8f kb_ = t_ + 12583039.0f;                 /* 1.5 * 2^23 + 127 + round(t) */       \
        mha_v8f r_ = t_ - (kb_ - 12583039.0f);                                                  \
        mha_v8f p_ = 1.330221e-3f * r_ + 9.672932e-3f;                                          \
        p_ = p_ * r_ + 5.550615e-2f;                                                            \
        p_ = p_ * r_ + 2.4022217e-1f;                                                           \
        p_ = p_ * r_ + 6.9314706e-1f;                                                           \
        p_ = p_ * r_ + 1.0f;                                                                    \
        (out) = p_ * (mha_v8f)((mha_v8u)kb_ << 23);     /* 2^k */                               \
    } while (0)

/* Lanes of v where v > acc, else of acc (x86's max instruction: a NaN in v gives acc). */
#define MHA_V8_MAX(v, acc)                                                                      \
    ((mha_v8f)(((mha_v8i)(v) & ((v) > (acc))) | ((mha_v8i)(acc) & ~((v) > (acc)))))

/* The largest number in x[0:n] (-inf if n == 0). NaN elements are skipped by the vector
 * loop (a compare and a blend per 8 scores, where tracking them took four more); the softmax
 * still propagates them, since exp(NaN - max) makes its row sum NaN. Only a row whose other
 * elements are all -inf would lose them (it would look fully masked): for a result of -inf
 * the row is scanned for NaN, and NaN is returned if it holds one. */
static inline __attribute__((always_inline)) float mha_max_f32(const float *x, int64_t n) {
    mha_v8f vmax[4], v;
    for (int a = 0; a < 4; a++) vmax[a] = (mha_v8f){0} - INFINITY;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        for (int a = 0; a < 4; a++) {
            MHA_V8_LOAD(v, x + j + 8 * a);
            vmax[a] = MHA_V8_MAX(v, vmax[a]);
        }
    for (; j + 8 <= n; j += 8) {
        MHA_V8_LOAD(v, x + j);
        vmax[0] = MHA_V8_MAX(v, vmax[0]);
    }
    for (int a = 1; a < 4; a++) vmax[0] = MHA_V8_MAX(vmax[a], vmax[0]);
    float m = -INFINITY;
    for (int i = 0; i < 8; i++) m = vmax[0][i] > m ? vmax[0][i] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    if (m == -INFINITY)
        for (j = 0; j < n; j++)
            if (x[j] != x[j]) return NAN;
    return m;
}

static inline __attribute__((always_inline)) double mha_max_f64(const double *x, int64_t n) {
    double m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = x[j] > m ? x[j] : m;
    if (m == -INFINITY)
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) return NAN;
    return m;
}

/* x[j] = exp(x[j] - shift) for j < n, where shift >= every x[j] (or NaN); returns the sum. */
static inline __attribute__((always_inline)) float mha_exp_sum_f32(float *x, int64_t n, float shift) {
    mha_v8f acc = {0}, acc1 = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) { /* two vectors a step: half the loop overhead */
        mha_v8f v, e, v1, e1;
        MHA_V8_LOAD(v, x + j);
        MHA_V8_LOAD(v1, x + j + 8);
        MHA_V8_EXP_NONPOS(e, v - shift);
        MHA_V8_EXP_NONPOS(e1, v1 - shift);
        MHA_V8_STORE(x + j, e);
        MHA_V8_STORE(x + j + 8, e1);
        acc += e;
        acc1 += e1;
    }
    acc += acc1;
    for (; j + 8 <= n; j += 8) {
        mha_v8f v, e;
        MHA_V8_LOAD(v, x + j);
        MHA_V8_EXP_NONPOS(e, v - shift);
        MHA_V8_STORE(x + j, e);
        acc += e;
    }
    if (j < n) { /* the tail through one padded vector */
        float tmp[8];
        int64_t rest = n - j;
        for (int i = 0; i < 8; i++) tmp[i] = i < rest ? x[j + i] : -INFINITY;
        mha_v8f v, e;
        MHA_V8_LOAD(v, tmp);
        MHA_V8_EXP_NONPOS(e, v - shift);
        acc += e;
        MHA_V8_STORE(tmp, e);
        memcpy(x + j, tmp, (size_t)rest * sizeof(float));
    }
    float s = 0;
    for (int i = 0; i < 8; i++) s += acc[i];
    return s;
}

static inline __attribute__((always_inline)) double mha_exp_sum_f64(double *x, int64_t n, double shift) {
    double s = 0;
    for (int64_t j = 0; j < n; j++) {
        x[j] = exp(x[j] - shift);
        s += x[j];
    }
    return s;
}

static inline __attribute__((always_inline)) void mha_scale_f32(float *x, int64_t n, float a) {
    for (int64_t j = 0; j < n; j++) x[j] *= a;
}

static inline __attribute__((always_inline)) void mha_scale_f64(double *x, int64_t n, double a) {
    for (int64_t j = 0; j < n; j++) x[j] *= a;
}

/* Transposes of square blocks, for packing a transposed operand (gemm_impl.h's pack_b) and
 * adding transposed tiles back (attention_impl.h's add_transposed):
 * dst[j * ld_dst + i] = src[i * ld_src + j] for an 8 x 8 float or 4 x 4 double block, in
 * registers: three rounds of two-input shuffles (AVX2 unpack, shuffle and lane permutes). */
typedef double mha_v4d __attribute__((vector_size(32)));
typedef int64_t mha_v4l __attribute__((vector_size(32)));
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define MHA_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define MHA_SHUFFLE4(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MHA_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (mha_v8i){__VA_ARGS__})
#define MHA_SHUFFLE4(a, b, ...) __builtin_shuffle(a, b, (mha_v4l){__VA_ARGS__})
#endif

static inline __attribute__((always_inline)) void
mha_transpose_vl_f32(float *dst, int64_t ld_dst, const float *src, int64_t ld_src) {
    mha_v8f r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) MHA_V8_LOAD(r[i], src + i * ld_src);
    for (int i = 0; i < 8; i += 2) { /* t: pairs of rows interleaved within 128-bit lanes */
        t[i] = MHA_SHUFFLE8(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = MHA_SHUFFLE8(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) { /* u: columns j and j + 4 of four rows */
        u[i] = MHA_SHUFFLE8(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = MHA_SHUFFLE8(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = MHA_SHUFFLE8(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = MHA_SHUFFLE8(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int j = 0; j < 4; j++) { /* column j from the low lanes, column j + 4 from the high */
        mha_v8f lo = MHA_SHUFFLE8(u[j], u[j + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        mha_v8f hi = MHA_SHUFFLE8(u[j], u[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        MHA_V8_STORE(dst + j * ld_dst, lo);
        MHA_V8_STORE(dst + (j + 4) * ld_dst, hi);
    }
}

static inline __attribute__((always_inline)) void
mha_transpose_vl_f64(double *dst, int64_t ld_dst, const double *src, int64_t ld_src) {
    mha_v4d r[4], t[4];
    for (int i = 0; i < 4; i++) memcpy(&r[i], src + i * ld_src, sizeof(mha_v4d));
    for (int i = 0; i < 4; i += 2) { /* t: columns j, j + 2 of rows i, i + 1 */
        t[i] = MHA_SHUFFLE4(r[i], r[i + 1], 0, 4, 2, 6);
        t[i + 1] = MHA_SHUFFLE4(r[i], r[i + 1], 1, 5, 3, 7);
    }
    for (int j = 0; j < 2; j++) {
        mha_v4d lo = MHA_SHUFFLE4(t[j], t[j + 2], 0, 1, 4, 5);
        mha_v4d hi = MHA_SHUFFLE4(t[j], t[j + 2], 2, 3, 6, 7);
        memcpy(dst + j * ld_dst, &lo, sizeof(mha_v4d));
        memcpy(dst + (j + 2) * ld_dst, &hi, sizeof(mha_v4d));
    }
}

#endif /* MHA_VEC_H */
