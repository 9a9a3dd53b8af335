/* vec.h: the vector helpers of the softmax (max, exp-and-sum, scale), for float and double.
 *
 * Written with GCC/Clang vector extensions (32-byte vectors: AVX2 in the x86-64-v3 clone,
 * pairs of SSE registers in the baseline one) with a scalar tail. The float exp is a
 * Cephes-style polynomial (relative error < 2e-7, exactly 0 for -inf, NaN propagated); the double
 * path uses libm's exp so float64 results stay within 1e-15 of the NumPy reference.
 * The exp is only for the softmax's non-positive arguments.
 */
#ifndef MHA_VEC_H
#define MHA_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float mha_v8f __attribute__((vector_size(32)));
typedef int32_t mha_v8i __attribute__((vector_size(32)));

#define MHA_V8_LOAD(v, p) memcpy(&(v), (p), sizeof(mha_v8f))
#define MHA_V8_STORE(p, v) memcpy((p), &(v), sizeof(mha_v8f))

/* exp of 8 floats x <= 0 (softmax arguments s - max): 2^k * P(r), k = round(x / ln 2),
 * r = x - k ln 2 (Cody-Waite split); exactly 0 below -87 (and for -inf), NaN kept. */
#define MHA_V8_EXP_NONPOS(out, x_in)                                                            \
    do {                                                                                        \
        mha_v8f x_ = (x_in);                                                                    \
        mha_v8i keep_ = x_ >= -87.0f;                   /* false below -87, for -inf and NaN */ \
        mha_v8i nan_ = x_ != x_;                                                                \
        mha_v8f xc_ = (mha_v8f)((mha_v8i)x_ & keep_);   /* 0 where not kept: finite math */     \
        mha_v8f kf_ = xc_ * 1.44269504088896341f + 12582912.0f;                                 \
        kf_ = kf_ - 12582912.0f;                        /* round to nearest */                  \
        mha_v8f r_ = xc_ - kf_ * 0.693359375f;                                                  \
        r_ = r_ - kf_ * -2.12194440e-4f;                                                        \
        mha_v8f p_ = 1.9875691500e-4f * r_ + 1.3981999507e-3f;                                  \
        p_ = p_ * r_ + 8.3334519073e-3f;                                                        \
        p_ = p_ * r_ + 4.1665795894e-2f;                                                        \
        p_ = p_ * r_ + 1.6666665459e-1f;                                                        \
        p_ = p_ * r_ + 5.0000001201e-1f;                                                        \
        p_ = p_ * (r_ * r_) + r_ + 1.0f;                                                        \
        mha_v8i k_ = __builtin_convertvector(kf_, mha_v8i);                                     \
        mha_v8f y_ = p_ * (mha_v8f)((k_ + 127) << 23);                                          \
        (out) = (mha_v8f)(((mha_v8i)y_ & keep_) | ((mha_v8i)x_ & nan_));                       \
    } while (0)

/* The maximum of x[0:n], NaN if any element is NaN, -inf if n == 0. */
static inline __attribute__((always_inline)) float mha_max_f32(const float *x, int64_t n) {
    mha_v8f vmax = (mha_v8f){0} - INFINITY;
    mha_v8i vnan = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        mha_v8f v;
        MHA_V8_LOAD(v, x + j);
        mha_v8i greater = v > vmax;
        vnan |= v != v;
        vmax = (mha_v8f)(((mha_v8i)v & greater) | ((mha_v8i)vmax & ~greater));
    }
    float m = -INFINITY;
    int nan = 0;
    for (int i = 0; i < 8; i++) {
        m = vmax[i] > m ? vmax[i] : m;
        nan |= vnan[i] != 0;
    }
    for (; j < n; j++) {
        m = x[j] > m ? x[j] : m;
        nan |= x[j] != x[j];
    }
    return nan ? NAN : m;
}

static inline __attribute__((always_inline)) double mha_max_f64(const double *x, int64_t n) {
    double m = -INFINITY;
    int nan = 0;
    for (int64_t j = 0; j < n; j++) {
        m = x[j] > m ? x[j] : m;
        nan |= x[j] != x[j];
    }
    return nan ? NAN : m;
}

/* x[j] = exp(x[j] - shift) for j < n, where shift >= every x[j] (or NaN); returns the sum. */
static inline __attribute__((always_inline)) float mha_exp_sum_f32(float *x, int64_t n, float shift) {
    mha_v8f acc = {0};
    int64_t j = 0;
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

#endif /* MHA_VEC_H */
