/* common.h: small shared helpers of the C core (not part of the public API). */
#ifndef MHA_COMMON_H
#define MHA_COMMON_H

#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* Type-generic sources (*_impl.h) are included once per type with `real` and SFX defined;
 * FN(name) gives the type's name, e.g. FN(mha_gemm) -> mha_gemm_f32. */
#define MHA_CAT_(a, b) a##_##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define FN(name) MHA_CAT(name, SFX)

#define MHA_MIN(a, b) ((a) < (b) ? (a) : (b))
#define MHA_MAX(a, b) ((a) > (b) ? (a) : (b))
#define MHA_CACHE_LINE 64

/* Runtime dispatch: hot loops are compiled twice on x86-64 (AVX2+FMA and baseline) and the
 * loader picks the clone the CPU supports. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && !defined(MHA_NO_CLONES)
#define MHA_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MHA_HOT
#endif

/* Scratch: 64-byte aligned, sizes rounded up so that per-thread slices start on a cache line. */
static inline size_t mha_round_up(size_t n, size_t multiple) {
    return (n + multiple - 1) / multiple * multiple;
}

static inline void *mha_alloc(size_t bytes) {
    if (bytes == 0) bytes = MHA_CACHE_LINE;
    return aligned_alloc(MHA_CACHE_LINE, mha_round_up(bytes, MHA_CACHE_LINE));
}

/* a * b with overflow detection: returns 0 and sets *ok = 0 on overflow. */
static inline size_t mha_mul_size(size_t a, size_t b, int *ok) {
    size_t r;
    if (__builtin_mul_overflow(a, b, &r)) { *ok = 0; return 0; }
    return r;
}

/* Threads for a parallel region doing about `flops` of work started here: 1 inside another
 * region, and no more than one per MHA_FLOPS_PER_THREAD so that small calls do not pay for
 * waking threads (tens of microseconds, far more on a busy machine). */
#define MHA_FLOPS_PER_THREAD 4e6
int mha_threads_for(double flops);

/* The calling thread's number in the innermost parallel region (0 outside one, or serial). */
static inline int mha_thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* The counter-based RNG of the dropout mask (docs/semantics.md). */
static inline uint64_t mha_splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* State after (seed, b, h, i): one more mix with j gives the (i, j) draw. */
static inline uint64_t mha_dropout_row_state(uint64_t seed, uint64_t b, uint64_t h, uint64_t i) {
    uint64_t z = mha_splitmix64(seed);
    z = mha_splitmix64(z ^ b);
    z = mha_splitmix64(z ^ h);
    return mha_splitmix64(z ^ i);
}

static inline double mha_uniform_from_state(uint64_t row_state, uint64_t j) {
    return (double)(mha_splitmix64(row_state ^ j) >> 11) * 0x1.0p-53;
}

/* Internal GEMM with a bias row added to C (NULL: none), caller-provided workspace (NULL:
 * allocate), and a thread count. */
size_t mha_gemm_workspace_f32(int64_t M, int64_t N, int64_t K, int threads);
size_t mha_gemm_workspace_f64(int64_t M, int64_t N, int64_t K, int threads);
int mha_gemm_ws_f32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                    const float *bias, float *C, int64_t ldc, float *workspace, int threads);
int mha_gemm_ws_f64(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, double alpha,
                    const double *A, int64_t lda, const double *B, int64_t ldb, double beta,
                    const double *bias, double *C, int64_t ldc, double *workspace, int threads);
/* C = op(A) @ op(B) + bias on every row (bias may be NULL), threads as mha_gemm. */
int mha_gemm_bias_f32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const float *A,
                      int64_t lda, const float *B, int64_t ldb, const float *bias, float *C,
                      int64_t ldc);
int mha_gemm_bias_f64(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const double *A,
                      int64_t lda, const double *B, int64_t ldb, const double *bias, double *C,
                      int64_t ldc);

/* Products that share their left operand: C = op(A) @ B + bias (bias may be NULL) for each
 * of up to 3 outputs, B (K x N) row-major with row stride ldb, A packed once per block of rows
 * (gemm_impl.h; the layer's Q, K and V projections of one input). Each output is bitwise what
 * mha_gemm_bias gives it alone. */
typedef struct { const float *B; int64_t ldb; const float *bias; float *C; int64_t ldc, N; } mha_gemm_out_f32;
typedef struct { const double *B; int64_t ldb; const double *bias; double *C; int64_t ldc, N; } mha_gemm_out_f64;
int mha_gemm_shared_a_f32(int64_t M, int64_t K, const float *A, int64_t lda,
                          const mha_gemm_out_f32 *outs, int n_out);
int mha_gemm_shared_a_f64(int64_t M, int64_t K, const double *A, int64_t lda,
                          const mha_gemm_out_f64 *outs, int n_out);

/* Pre-packed right operand for many small products on one thread (gemm_impl.h). */
size_t mha_packed_b_size_f32(int64_t K, int64_t N);
size_t mha_packed_b_size_f64(int64_t K, int64_t N);
void mha_pack_b_full_f32(float *packed, const float *B, int64_t ldb, int trans_b, int64_t K, int64_t N);
void mha_pack_b_full_f64(double *packed, const double *B, int64_t ldb, int trans_b, int64_t K, int64_t N);
void mha_gemm_packed_f32(int trans_a, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                         const float *packed, float beta, float *C, int64_t ldc);
void mha_gemm_packed_f64(int trans_a, int64_t M, int64_t N, int64_t K, double alpha, const double *A, int64_t lda,
                         const double *packed, double beta, double *C, int64_t ldc);

#endif /* MHA_COMMON_H */
