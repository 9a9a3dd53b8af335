/* vec.h: the vector helpers of the kernels: the softmax's max, exp-and-sum and scale, and the
 * square-block transposes of transposed packing, for float and double.
 *
 * Each kernel unit (dispatch.h) is compiled for one instruction set, and its vectors are that
 * set's registers: MHA_VEC_BYTES = 64 with AVX-512, 32 with AVX, else 16 (SSE2, NEON). Wider
 * vectors would be split by the compiler into register pairs, which GCC keeps in memory
 * instead (a GEMM at a fifteenth of the speed, x86 SSE2 and aarch64 alike). MHA_VEC_REGS is
 * the number of vector registers: 32 on aarch64 and with AVX-512, 16 on other x86-64; the
 * GEMM's micro-tile is sized to fill them.
 * In GNU C the helpers are written with vector types, the float ones with a scalar or padded
 * tail; in portable C (MHA_GNU_C == 0) they are plain loops with the same contracts. */
#ifndef MHA_VEC_H
#define MHA_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "mha.h"

#if defined(__AVX512F__)
#define MHA_VEC_BYTES 64
#elif defined(__AVX__)
#define MHA_VEC_BYTES 32
#else
#define MHA_VEC_BYTES 16
#endif
#if defined(__aarch64__) || defined(_M_ARM64) || defined(__AVX512F__)
#define MHA_VEC_REGS 32
#else
#define MHA_VEC_REGS 16
#endif
#define MHA_VL_F32 (MHA_VEC_BYTES / 4) /* lanes of a float vector  */
#define MHA_VL_F64 (MHA_VEC_BYTES / 8) /* lanes of a double vector */

#if MHA_GNU_C
typedef float mha_vf32 __attribute__((vector_size(MHA_VEC_BYTES)));
typedef int32_t mha_vi32 __attribute__((vector_size(MHA_VEC_BYTES)));
typedef uint32_t mha_vu32 __attribute__((vector_size(MHA_VEC_BYTES))); /* shifts that drop bits */
typedef double mha_vf64 __attribute__((vector_size(MHA_VEC_BYTES)));
typedef int64_t mha_vi64 __attribute__((vector_size(MHA_VEC_BYTES)));

/* Unaligned vector load and store (macros: vectors passed to functions would change the ABI). */
#define MHA_VLOAD(v, p) memcpy(&(v), (p), sizeof(v))
#define MHA_VSTORE(p, v) memcpy((p), &(v), sizeof(v))

/* Lanes of v where v > acc, else of acc: a NaN in v gives acc (x86's max instruction). */
#define MHA_VMAX(v, acc) \
    ((mha_vf32)(((mha_vi32)(v) & ((v) > (acc))) | ((mha_vi32)(acc) & ~((v) > (acc)))))
/* The float whose bits are those of kb shifted left by 23 (see the exp below). */
#define MHA_VPOW2_BITS(kb) ((mha_vf32)((mha_vu32)(kb) << 23))

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define MHA_SHUFFLE_F32(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define MHA_SHUFFLE_F64(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MHA_SHUFFLE_F32(a, b, ...) __builtin_shuffle(a, b, (mha_vi32){__VA_ARGS__})
#define MHA_SHUFFLE_F64(a, b, ...) __builtin_shuffle(a, b, (mha_vi64){__VA_ARGS__})
#endif
#endif /* MHA_GNU_C */

#define MHA_SMAX(v, acc) ((v) > (acc) ? (v) : (acc)) /* the same rule on one float */

static inline float mha_pow2_bits_f32(float kb) {
    uint32_t u;
    memcpy(&u, &kb, sizeof u);
    u <<= 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* e^x for softmax arguments x = s - max <= 0, on a float or a float vector T (MAX and POW2
 * the matching spellings above), as 2^t, t = x log2(e): 2^k * P(r), k = round(t),
 * r = t - k in [-1/2, 1/2], P a degree-5 fit of 2^r.
 * Error: P is within 1.6e-7 relative of 2^r in float arithmetic (with or without fused
 * multiply-adds); rounding t adds 6e-8 |x|, so a softmax weight e^x is within 1.9e-7 of its
 * value in absolute terms.
 * Range: t is first raised to -127 where below (-inf included); a NaN stays NaN (MAX keeps
 * its second operand when the compare is false). The scale 2^k is the bits of
 * t + 1.5 * 2^23 + 127 shifted left by 23: that sum's low mantissa bits hold k + 127, in
 * [0, 127], and the rest shifts out; for k = -127 they are 0, so e^x is exactly 0 for
 * x < -87.68 (t < -126.5) and for x = -inf, a subnormal float for x in (-87.68, -87.34), a
 * normal float above. Arguments x > 88 would wrap the exponent: callers never pass x > 0. */
#define MHA_EXP_NONPOS(out, x_in, T, MAX, POW2)                                                 \
    do {                                                                                        \
        T t_ = (x_in) * 1.44269504088896341f;                                                   \
        t_ = MAX((T){0} - 127.0f, t_);                 /* at least -127; a NaN t stays */       \
        T kb_ = t_ + 12583039.0f;                      /* 1.5 * 2^23 + 127 + round(t) */        \
        T r_ = t_ - (kb_ - 12583039.0f);                                                        \
        T p_ = 1.330221e-3f * r_ + 9.672932e-3f;                                                \
        p_ = p_ * r_ + 5.550615e-2f;                                                            \
        p_ = p_ * r_ + 2.4022217e-1f;                                                           \
        p_ = p_ * r_ + 6.9314706e-1f;                                                           \
        p_ = p_ * r_ + 1.0f;                                                                    \
        (out) = p_ * POW2(kb_);                        /* 2^k */                                \
    } while (0)

/* The largest number in x[0:n] (-inf if n == 0). NaN elements are skipped while scanning (one
 * compare and one select per element); the softmax still propagates them, since
 * exp(NaN - max) makes its row sum NaN. Only a row whose other elements are all -inf would
 * lose them (it would look fully masked): for a result of -inf the row is scanned for NaN,
 * and NaN is returned if it holds one. */
MHA_INLINE float mha_max_f32(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t j = 0;
#if MHA_GNU_C
    enum { VL = MHA_VL_F32 };
    mha_vf32 vmax[4], v;
    for (int a = 0; a < 4; a++) vmax[a] = (mha_vf32){0} - INFINITY;
    for (; j + 4 * VL <= n; j += 4 * VL)
        for (int a = 0; a < 4; a++) {
            MHA_VLOAD(v, x + j + VL * a);
            vmax[a] = MHA_VMAX(v, vmax[a]);
        }
    for (; j + VL <= n; j += VL) {
        MHA_VLOAD(v, x + j);
        vmax[0] = MHA_VMAX(v, vmax[0]);
    }
    for (int a = 1; a < 4; a++) vmax[0] = MHA_VMAX(vmax[a], vmax[0]);
    for (int i = 0; i < VL; i++) m = MHA_SMAX(vmax[0][i], m);
#endif
    for (; j < n; j++) m = MHA_SMAX(x[j], m);
    if (m == -INFINITY)
        for (j = 0; j < n; j++)
            if (x[j] != x[j]) return NAN;
    return m;
}

MHA_INLINE double mha_max_f64(const double *x, int64_t n) {
    double m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = MHA_SMAX(x[j], m);
    if (m == -INFINITY)
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) return NAN;
    return m;
}

/* x[j] = exp(x[j] - shift) for j < n, where shift >= every x[j] (or NaN); returns the sum. */
MHA_INLINE float mha_exp_sum_f32(float *x, int64_t n, float shift) {
#if MHA_GNU_C
    enum { VL = MHA_VL_F32 };
    mha_vf32 acc = {0}, acc1 = {0};
    int64_t j = 0;
    for (; j + 2 * VL <= n; j += 2 * VL) { /* two vectors a step: half the loop overhead */
        mha_vf32 v, e, v1, e1;
        MHA_VLOAD(v, x + j);
        MHA_VLOAD(v1, x + j + VL);
        MHA_EXP_NONPOS(e, v - shift, mha_vf32, MHA_VMAX, MHA_VPOW2_BITS);
        MHA_EXP_NONPOS(e1, v1 - shift, mha_vf32, MHA_VMAX, MHA_VPOW2_BITS);
        MHA_VSTORE(x + j, e);
        MHA_VSTORE(x + j + VL, e1);
        acc += e;
        acc1 += e1;
    }
    acc += acc1;
    for (; j + VL <= n; j += VL) {
        mha_vf32 v, e;
        MHA_VLOAD(v, x + j);
        MHA_EXP_NONPOS(e, v - shift, mha_vf32, MHA_VMAX, MHA_VPOW2_BITS);
        MHA_VSTORE(x + j, e);
        acc += e;
    }
    if (j < n) { /* the tail through one vector padded with -inf (e^-inf = 0 adds nothing) */
        float tmp[VL];
        int64_t rest = n - j;
        for (int i = 0; i < VL; i++) tmp[i] = i < rest ? x[j + i] : -INFINITY;
        mha_vf32 v, e;
        MHA_VLOAD(v, tmp);
        MHA_EXP_NONPOS(e, v - shift, mha_vf32, MHA_VMAX, MHA_VPOW2_BITS);
        acc += e;
        MHA_VSTORE(tmp, e);
        memcpy(x + j, tmp, (size_t)rest * sizeof(float));
    }
    float s = 0;
    for (int i = 0; i < VL; i++) s += acc[i];
    return s;
#else
    float s = 0;
    for (int64_t j = 0; j < n; j++) {
        MHA_EXP_NONPOS(x[j], x[j] - shift, float, MHA_SMAX, mha_pow2_bits_f32);
        s += x[j];
    }
    return s;
#endif
}

/* The double softmax uses libm's exp, so float64 results stay within 1e-15 of the NumPy
 * reference. */
MHA_INLINE double mha_exp_sum_f64(double *x, int64_t n, double shift) {
    double s = 0;
    for (int64_t j = 0; j < n; j++) {
        x[j] = exp(x[j] - shift);
        s += x[j];
    }
    return s;
}

/* ---- activations, elementwise in place (block_impl.h applies them after a product) ---- */

/* Lanes of a where m is set, else of b (m: a compare's result, all bits set or clear). */
#define MHA_VSEL(m, a, b) ((mha_vf32)(((mha_vi32)(a) & (m)) | ((mha_vi32)(b) & ~(m))))
#define MHA_SSEL(m, a, b) ((m) ? (a) : (b))

/* float32 formulas on a float or a float vector T (SEL, MAX, POW2 the matching spellings).
 *
 * sigmoid(t) from e = exp(-|t|) (MHA_EXP_NONPOS, never overflows): 1 / (1 + e) for t >= 0,
 * e / (1 + e) below; relative error about 3e-7; a NaN t gives NaN.
 * erf(u), |u| clamped to 4 (erf(4) rounds to 1 in float): u P(u^2) / Q(u^2), the rational
 * fit of degree 13/8 that Eigen and XLA use for float erf, max abs error 6.5e-8 in exact
 * arithmetic, about 4e-7 in float. */
#define MHA_SIGMOID_F32(out, t_in, T, SEL, MAX, POW2)                                           \
    do {                                                                                        \
        T st_ = (t_in);                                                                         \
        T sneg_ = SEL(st_ > (T){0}, (T){0} - st_, st_);        /* -|t| (NaN stays NaN) */            \
        T se_;                                                                                  \
        MHA_EXP_NONPOS(se_, sneg_, T, MAX, POW2);                                               \
        T sden_ = 1.0f / (1.0f + se_);                                                          \
        (out) = SEL(st_ >= (T){0}, sden_, se_ * sden_);                                              \
    } while (0)

#define MHA_ERF_F32(out, u_in, T, SEL)                                                          \
    do {                                                                                        \
        T eu_ = (u_in);                                                                         \
        eu_ = SEL(eu_ > (T){0} + 4.0f, (T){0} + 4.0f, eu_);                                              \
        eu_ = SEL(eu_ < (T){0} - 4.0f, (T){0} - 4.0f, eu_);                                             \
        T eu2_ = eu_ * eu_;                                                                     \
        T ep_ = -2.72614225801306e-10f * eu2_ + 2.77068142495902e-08f;                          \
        ep_ = ep_ * eu2_ - 2.10102402082508e-06f;                                               \
        ep_ = ep_ * eu2_ - 5.69250639462346e-05f;                                               \
        ep_ = ep_ * eu2_ - 7.34990630326855e-04f;                                               \
        ep_ = ep_ * eu2_ - 2.95459980854025e-03f;                                               \
        ep_ = ep_ * eu2_ - 1.60960333262415e-02f;                                               \
        T eq_ = -1.45660718464996e-05f * eu2_ - 2.13374055278905e-04f;                          \
        eq_ = eq_ * eu2_ - 1.68282697438203e-03f;                                               \
        eq_ = eq_ * eu2_ - 7.37332916720468e-03f;                                               \
        eq_ = eq_ * eu2_ - 1.42647390514189e-02f;                                               \
        (out) = eu_ * ep_ / eq_;                                                                \
    } while (0)

/* One activation (enum mha_activation) of x, float32: the same formulas for a vector or a
 * float. relu keeps a NaN (x < 0 is false for it). */
#define MHA_ACT_F32(out, x_in, act, T, SEL, MAX, POW2)                                          \
    do {                                                                                        \
        T ax_ = (x_in), ay_;                                                                    \
        switch (act) {                                                                          \
        case MHA_ACT_GELU:                                                                      \
            MHA_ERF_F32(ay_, ax_ * 0.70710678118654752f, T, SEL);                               \
            ay_ = ax_ * (0.5f + 0.5f * ay_);                                                    \
            break;                                                                              \
        case MHA_ACT_GELU_TANH: /* 0.5 (1 + tanh(u)) = sigmoid(2 u) */                          \
            MHA_SIGMOID_F32(ay_, (1.5957691216057308f * ax_) * (1.0f + 0.044715f * ax_ * ax_),  \
                            T, SEL, MAX, POW2);                                                 \
            ay_ = ax_ * ay_;                                                                    \
            break;                                                                              \
        case MHA_ACT_SILU:                                                                      \
            MHA_SIGMOID_F32(ay_, ax_, T, SEL, MAX, POW2);                                       \
            ay_ = ax_ * ay_;                                                                    \
            break;                                                                              \
        case MHA_ACT_QUICK_GELU:                                                                \
            MHA_SIGMOID_F32(ay_, 1.702f * ax_, T, SEL, MAX, POW2);                              \
            ay_ = ax_ * ay_;                                                                    \
            break;                                                                              \
        case MHA_ACT_RELU:                                                                      \
            ay_ = SEL(ax_ < (T){0}, (T){0}, ax_);                                                    \
            break;                                                                              \
        default:                                                                                \
            ay_ = ax_;                                                                          \
        }                                                                                       \
        (out) = ay_;                                                                            \
    } while (0)

/* x[j] = act(x[j]) for j < n, float32 (formulas above); one loop per activation, so that
 * the switch inside MHA_ACT_F32 folds away. */
#if MHA_GNU_C
#define MHA_ACT_LOOP_F32(x, n, act)                                                             \
    do {                                                                                        \
        int64_t j_ = 0;                                                                         \
        for (; j_ + MHA_VL_F32 <= (n); j_ += MHA_VL_F32) {                                      \
            mha_vf32 v_, y_;                                                                    \
            MHA_VLOAD(v_, (x) + j_);                                                            \
            MHA_ACT_F32(y_, v_, act, mha_vf32, MHA_VSEL, MHA_VMAX, MHA_VPOW2_BITS);             \
            MHA_VSTORE((x) + j_, y_);                                                           \
        }                                                                                       \
        for (; j_ < (n); j_++)                                                                  \
            MHA_ACT_F32((x)[j_], (x)[j_], act, float, MHA_SSEL, MHA_SMAX, mha_pow2_bits_f32);   \
    } while (0)
#else
#define MHA_ACT_LOOP_F32(x, n, act)                                                             \
    do {                                                                                        \
        for (int64_t j_ = 0; j_ < (n); j_++)                                                    \
            MHA_ACT_F32((x)[j_], (x)[j_], act, float, MHA_SSEL, MHA_SMAX, mha_pow2_bits_f32);   \
    } while (0)
#endif

MHA_INLINE void mha_act_row_f32(float *x, int64_t n, int act) {
    switch (act) {
    case MHA_ACT_GELU: MHA_ACT_LOOP_F32(x, n, MHA_ACT_GELU); break;
    case MHA_ACT_GELU_TANH: MHA_ACT_LOOP_F32(x, n, MHA_ACT_GELU_TANH); break;
    case MHA_ACT_SILU: MHA_ACT_LOOP_F32(x, n, MHA_ACT_SILU); break;
    case MHA_ACT_QUICK_GELU: MHA_ACT_LOOP_F32(x, n, MHA_ACT_QUICK_GELU); break;
    case MHA_ACT_RELU: MHA_ACT_LOOP_F32(x, n, MHA_ACT_RELU); break;
    default: break;
    }
}

/* x[j] = act(x[j]) for j < n, float64, on libm's erf, exp and tanh (within a few ulp of the
 * formulas: what torch computes in float64). */
MHA_INLINE void mha_act_row_f64(double *x, int64_t n, int act) {
    switch (act) {
    case MHA_ACT_GELU:
        for (int64_t j = 0; j < n; j++) x[j] = 0.5 * x[j] * (1.0 + erf(x[j] * 0.70710678118654752));
        break;
    case MHA_ACT_GELU_TANH:
        for (int64_t j = 0; j < n; j++)
            x[j] = 0.5 * x[j] * (1.0 + tanh(0.79788456080286536 * (x[j] + 0.044715 * x[j] * x[j] * x[j])));
        break;
    case MHA_ACT_SILU:
        for (int64_t j = 0; j < n; j++) x[j] = x[j] / (1.0 + exp(-x[j]));
        break;
    case MHA_ACT_QUICK_GELU:
        for (int64_t j = 0; j < n; j++) x[j] = x[j] / (1.0 + exp(-1.702 * x[j]));
        break;
    case MHA_ACT_RELU:
        for (int64_t j = 0; j < n; j++) x[j] = x[j] < 0 ? 0.0 : x[j];
        break;
    default:
        break;
    }
}

/* ---- logit soft-capping (Gemma 2's attn_logit_softcapping) -----------------------------------
 * x[j] = c tanh(x[j] / c) for j < n, c > 0; dt (NULL: not wanted) receives tanh's derivative
 * at each x[j] / c, 1 - tanh^2, for the backward.
 * float32: tanh(u) = u P(u^2) / Q(u^2), the rational fit of degree 13/6 that Eigen uses for
 * float tanh, with u clamped to +-7.90531 (where tanh rounds to 1 - 2.7e-7 in float; an infinite
 * u gives that too); within 4e-7 of tanh relative to |tanh| over the whole range (small u
 * included: no cancellation, unlike 1 - 2 / (e^2u + 1), whose error near 0 is absolute); one
 * division a lane, no exp. A NaN stays NaN. float64: libm's tanh (within an ulp or two). */
#define MHA_TANH_F32(out, u_in, T, SEL)                                                         \
    do {                                                                                        \
        T tu_ = (u_in);                                                                         \
        tu_ = SEL(tu_ > (T){0} + 7.90531110763549805f, (T){0} + 7.90531110763549805f, tu_);     \
        tu_ = SEL(tu_ < (T){0} - 7.90531110763549805f, (T){0} - 7.90531110763549805f, tu_);     \
        T tu2_ = tu_ * tu_;                                                                     \
        T tp_ = -2.76076847742355e-16f * tu2_ + 2.00018790482477e-13f;                          \
        tp_ = tp_ * tu2_ - 8.60467152213735e-11f;                                               \
        tp_ = tp_ * tu2_ + 5.12229709037114e-08f;                                               \
        tp_ = tp_ * tu2_ + 1.48572235717979e-05f;                                               \
        tp_ = tp_ * tu2_ + 6.37261928875436e-04f;                                               \
        tp_ = tp_ * tu2_ + 4.89352455891786e-03f;                                               \
        T tq_ = 1.19825839466702e-06f * tu2_ + 1.18534705686654e-04f;                           \
        tq_ = tq_ * tu2_ + 2.26843463243900e-03f;                                               \
        tq_ = tq_ * tu2_ + 4.89352518554385e-03f;                                               \
        (out) = tu_ * tp_ / tq_;                                                                \
    } while (0)

MHA_INLINE float mha_tanh_f32(float u) {
    float t;
    MHA_TANH_F32(t, u, float, MHA_SSEL);
    return t;
}

MHA_INLINE void mha_softcap_f32(float *x, int64_t n, float c, float *dt) {
    const float inv = 1.0f / c;
    int64_t j = 0;
#if MHA_GNU_C
    enum { VL = MHA_VL_F32 };
    for (; j + VL <= n; j += VL) {
        mha_vf32 v, t;
        MHA_VLOAD(v, x + j);
        MHA_TANH_F32(t, v * inv, mha_vf32, MHA_VSEL);
        v = t * c;
        MHA_VSTORE(x + j, v);
        if (dt) {
            mha_vf32 g = (1.0f - t) * (1.0f + t);
            MHA_VSTORE(dt + j, g);
        }
    }
#endif
    for (; j < n; j++) {
        const float t = mha_tanh_f32(x[j] * inv);
        x[j] = t * c;
        if (dt) dt[j] = (1.0f - t) * (1.0f + t);
    }
}

MHA_INLINE void mha_softcap_f64(double *x, int64_t n, double c, double *dt) {
    for (int64_t j = 0; j < n; j++) {
        const double t = tanh(x[j] / c);
        x[j] = t * c;
        if (dt) dt[j] = (1.0 - t) * (1.0 + t);
    }
}

MHA_INLINE void mha_scale_f32(float *x, int64_t n, float a) {
    for (int64_t j = 0; j < n; j++) x[j] *= a;
}

MHA_INLINE void mha_scale_f64(double *x, int64_t n, double a) {
    for (int64_t j = 0; j < n; j++) x[j] *= a;
}

/* Transposes of square blocks of one vector's lanes (VL x VL: 16, 8 or 4 floats, 8, 4 or 2
 * doubles), for packing a transposed operand (gemm_impl.h's pack_b) and adding transposed
 * tiles back (attention_impl.h's add_transposed):
 * dst[j * ld_dst + i] = src[i * ld_src + j] for i, j < VL. In GNU C the block stays in
 * registers: rounds of two-input shuffles (unpack, shuffle and lane permutes on x86).
 * 64-byte vectors: one round per bit w of the lane index (w = 1, 2, 4, 8), each swapping the
 * off-diagonal w x w blocks of every 2w x 2w block, so that bit w of the row and of the column
 * index trade places; after every round, element (i, j) is at (j, i). Rows i and i + w (bit w
 * of i clear) become lo[c] = c & w ? row(i + w)[c - w] : row(i)[c] and
 * hi[c] = c & w ? row(i + w)[c] : row(i)[c + w] (shuffle indices: row i + w's lanes count from
 * VL); one two-source permute each on AVX-512. */
#define MHA_ARGS(...) __VA_ARGS__ /* a list passed as one macro argument */
#define MHA_TRANSPOSE_ROUND(r, n, w, T, SHUFFLE, LO, HI)                                        \
    do {                                                                                        \
        for (int i_ = 0; i_ < (n); i_++) {                                                      \
            if (i_ & (w)) continue;                                                             \
            T a_ = (r)[i_], b_ = (r)[i_ + (w)];                                                 \
            (r)[i_] = SHUFFLE(a_, b_, LO);                                                      \
            (r)[i_ + (w)] = SHUFFLE(a_, b_, HI);                                                \
        }                                                                                       \
    } while (0)

MHA_INLINE void mha_transpose_vl_f32(float *dst, int64_t ld_dst, const float *src, int64_t ld_src) {
#if MHA_GNU_C && MHA_VL_F32 == 16
    mha_vf32 r[16];
    for (int i = 0; i < 16; i++) MHA_VLOAD(r[i], src + i * ld_src);
    MHA_TRANSPOSE_ROUND(r, 16, 1, mha_vf32, MHA_SHUFFLE_F32,
                        MHA_ARGS(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                        MHA_ARGS(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31));
    MHA_TRANSPOSE_ROUND(r, 16, 2, mha_vf32, MHA_SHUFFLE_F32,
                        MHA_ARGS(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                        MHA_ARGS(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31));
    MHA_TRANSPOSE_ROUND(r, 16, 4, mha_vf32, MHA_SHUFFLE_F32,
                        MHA_ARGS(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                        MHA_ARGS(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31));
    MHA_TRANSPOSE_ROUND(r, 16, 8, mha_vf32, MHA_SHUFFLE_F32,
                        MHA_ARGS(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                        MHA_ARGS(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
    for (int j = 0; j < 16; j++) MHA_VSTORE(dst + j * ld_dst, r[j]);
#elif MHA_GNU_C && MHA_VL_F32 == 8
    mha_vf32 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) MHA_VLOAD(r[i], src + i * ld_src);
    for (int i = 0; i < 8; i += 2) { /* t: pairs of rows interleaved within 128-bit lanes */
        t[i] = MHA_SHUFFLE_F32(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = MHA_SHUFFLE_F32(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) { /* u: columns j and j + 4 of four rows */
        u[i] = MHA_SHUFFLE_F32(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = MHA_SHUFFLE_F32(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = MHA_SHUFFLE_F32(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = MHA_SHUFFLE_F32(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int j = 0; j < 4; j++) { /* column j from the low lanes, column j + 4 from the high */
        mha_vf32 lo = MHA_SHUFFLE_F32(u[j], u[j + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        mha_vf32 hi = MHA_SHUFFLE_F32(u[j], u[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        MHA_VSTORE(dst + j * ld_dst, lo);
        MHA_VSTORE(dst + (j + 4) * ld_dst, hi);
    }
#elif MHA_GNU_C && MHA_VL_F32 == 4
    mha_vf32 r[4], t[4];
    for (int i = 0; i < 4; i++) MHA_VLOAD(r[i], src + i * ld_src);
    for (int i = 0; i < 4; i += 2) { /* t: columns (0, 1), then (2, 3), of rows i, i + 1 */
        t[i] = MHA_SHUFFLE_F32(r[i], r[i + 1], 0, 4, 1, 5);
        t[i + 1] = MHA_SHUFFLE_F32(r[i], r[i + 1], 2, 6, 3, 7);
    }
    for (int j = 0; j < 4; j += 2) {
        mha_vf32 c0 = MHA_SHUFFLE_F32(t[j / 2], t[j / 2 + 2], 0, 1, 4, 5);
        mha_vf32 c1 = MHA_SHUFFLE_F32(t[j / 2], t[j / 2 + 2], 2, 3, 6, 7);
        MHA_VSTORE(dst + j * ld_dst, c0);
        MHA_VSTORE(dst + (j + 1) * ld_dst, c1);
    }
#else
    for (int i = 0; i < MHA_VL_F32; i++)
        for (int j = 0; j < MHA_VL_F32; j++) dst[j * ld_dst + i] = src[i * ld_src + j];
#endif
}

MHA_INLINE void mha_transpose_vl_f64(double *dst, int64_t ld_dst, const double *src, int64_t ld_src) {
#if MHA_GNU_C && MHA_VL_F64 == 8
    mha_vf64 r[8];
    for (int i = 0; i < 8; i++) MHA_VLOAD(r[i], src + i * ld_src);
    MHA_TRANSPOSE_ROUND(r, 8, 1, mha_vf64, MHA_SHUFFLE_F64, MHA_ARGS(0, 8, 2, 10, 4, 12, 6, 14),
                        MHA_ARGS(1, 9, 3, 11, 5, 13, 7, 15));
    MHA_TRANSPOSE_ROUND(r, 8, 2, mha_vf64, MHA_SHUFFLE_F64, MHA_ARGS(0, 1, 8, 9, 4, 5, 12, 13),
                        MHA_ARGS(2, 3, 10, 11, 6, 7, 14, 15));
    MHA_TRANSPOSE_ROUND(r, 8, 4, mha_vf64, MHA_SHUFFLE_F64, MHA_ARGS(0, 1, 2, 3, 8, 9, 10, 11),
                        MHA_ARGS(4, 5, 6, 7, 12, 13, 14, 15));
    for (int j = 0; j < 8; j++) MHA_VSTORE(dst + j * ld_dst, r[j]);
#elif MHA_GNU_C && MHA_VL_F64 == 4
    mha_vf64 r[4], t[4];
    for (int i = 0; i < 4; i++) MHA_VLOAD(r[i], src + i * ld_src);
    for (int i = 0; i < 4; i += 2) { /* t: columns j, j + 2 of rows i, i + 1 */
        t[i] = MHA_SHUFFLE_F64(r[i], r[i + 1], 0, 4, 2, 6);
        t[i + 1] = MHA_SHUFFLE_F64(r[i], r[i + 1], 1, 5, 3, 7);
    }
    for (int j = 0; j < 2; j++) {
        mha_vf64 lo = MHA_SHUFFLE_F64(t[j], t[j + 2], 0, 1, 4, 5);
        mha_vf64 hi = MHA_SHUFFLE_F64(t[j], t[j + 2], 2, 3, 6, 7);
        MHA_VSTORE(dst + j * ld_dst, lo);
        MHA_VSTORE(dst + (j + 2) * ld_dst, hi);
    }
#elif MHA_GNU_C && MHA_VL_F64 == 2
    mha_vf64 r0, r1;
    MHA_VLOAD(r0, src);
    MHA_VLOAD(r1, src + ld_src);
    mha_vf64 c0 = MHA_SHUFFLE_F64(r0, r1, 0, 2), c1 = MHA_SHUFFLE_F64(r0, r1, 1, 3);
    MHA_VSTORE(dst, c0);
    MHA_VSTORE(dst + ld_dst, c1);
#else
    for (int i = 0; i < MHA_VL_F64; i++)
        for (int j = 0; j < MHA_VL_F64; j++) dst[j * ld_dst + i] = src[i * ld_src + j];
#endif
}

#endif /* MHA_VEC_H */
