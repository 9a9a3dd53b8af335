/* common.h: small shared helpers of the C core (not part of the public API).
 *
 * The core is C11. GNU C (GCC, clang) adds vector types, always_inline and unroll pragmas,
 * which the kernels use where MHA_GNU_C is 1; elsewhere (MSVC), or when built with
 * -DMHA_PORTABLE, every file is plain C11 with no compiler extension, and the kernels take
 * their portable spelling (vec.h). */
#ifndef MHA_COMMON_H
#define MHA_COMMON_H

#include <stdint.h>
#include <stdlib.h>

#if (defined(__GNUC__) || defined(__clang__)) && !defined(MHA_PORTABLE)
#define MHA_GNU_C 1
#else
#define MHA_GNU_C 0
#endif

#define MHA_CAT_(a, b) a##_##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define MHA_STR_(x) #x
#define MHA_STR(x) MHA_STR_(x)

/* Helpers that must be inlined so that vector values stay in registers across the call (GNU
 * C; elsewhere a hint), and a loop unrolled n times (GNU C; elsewhere the compiler's choice). */
#if MHA_GNU_C
#define MHA_INLINE static inline __attribute__((always_inline))
#define MHA_UNROLL(n) _Pragma(MHA_STR(GCC unroll n))
#else
#define MHA_INLINE static inline
#define MHA_UNROLL(n)
#endif

#define MHA_MIN(a, b) ((a) < (b) ? (a) : (b))
#define MHA_MAX(a, b) ((a) > (b) ? (a) : (b))
#define MHA_CACHE_LINE 64

static inline size_t mha_round_up(size_t n, size_t multiple) {
    return (n + multiple - 1) / multiple * multiple;
}

/* a * b and a + b with overflow detection: on overflow they return 0 and set *ok = 0
 * (*ok is never set to 1, so one flag collects a chain of them). */
static inline size_t mha_mul_size(size_t a, size_t b, int *ok) {
    if (a != 0 && b > SIZE_MAX / a) { *ok = 0; return 0; }
    return a * b;
}

static inline size_t mha_add_size(size_t a, size_t b, int *ok) {
    if (b > SIZE_MAX - a) { *ok = 0; return 0; }
    return a + b;
}

/* Scratch (threads.c): 64-byte aligned (so per-thread slices can start on cache lines),
 * released with mha_free, NULL when out of memory. malloc'd with room to align (C11's
 * aligned_alloc is missing on MSVC and MinGW). On POSIX builds a freed block of 256 KiB or
 * more is kept (up to 64 MiB in all) for the next mha_alloc it can hold: glibc maps each
 * large malloc anew and returns it on free, so a layer's scratch, asked for again and again
 * at one size, was faulted in and zeroed by the kernel on every call. */
#define MHA_SCRATCH_KEEP_MIN ((size_t)256 << 10)
/* 1 when built with AddressSanitizer (GCC's macro, clang's feature test): no blocks kept. */
#if defined(__SANITIZE_ADDRESS__)
#define MHA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MHA_ASAN 1
#endif
#endif
#ifndef MHA_ASAN
#define MHA_ASAN 0
#endif
void *mha_alloc(size_t bytes);
void mha_free(void *p);

/* Named scratch, llm.c's way: a kernel's scratch is a struct of pointers with a shape comment
 * per field, and one layout function that carves every field, in order, out of one block with
 * mha_carve. Run on a carver with base NULL it only measures (bytes: the block's size, ok = 0
 * when a size overflows); run on one whose base is an mha_alloc'd block (or a slice of it that
 * starts on a cache line) it points the fields into it. Every field starts on a cache line. */
typedef struct {
    char *base;   /* the block, or NULL to measure */
    size_t bytes; /* carved so far */
    int ok;       /* 0 once a size overflowed */
} mha_carver;

static inline void *mha_carve(mha_carver *c, size_t count, size_t size) {
    size_t bytes = mha_mul_size(count, size, &c->ok);
    if (bytes > SIZE_MAX - MHA_CACHE_LINE) c->ok = 0;
    void *at = c->base && c->ok ? c->base + c->bytes : NULL;
    c->bytes = mha_add_size(c->bytes, mha_round_up(c->ok ? bytes : 0, MHA_CACHE_LINE), &c->ok);
    return at;
}

/* One block of `slices` slices of `bytes` each (as measured by a carver: a multiple of the
 * cache line), for per-thread scratch; NULL when the size overflows or memory runs out. */
static inline char *mha_alloc_slices(size_t bytes, int slices) {
    if (slices < 1 || (bytes > 0 && (size_t)slices > SIZE_MAX / bytes)) return NULL;
    return mha_alloc(bytes * (size_t)slices);
}

/* Threads (threads.c): mha's own pool on POSIX systems, OpenMP or serial elsewhere.
 * mha_parallel_for runs fn(ctx, i, thread) for every i in [0, n) on up to `threads` threads
 * and returns when all are done; tasks are handed out in order, `chunk` at a time, to
 * whichever thread is free; `thread` < threads numbers the thread running the task (the
 * caller is 0), for per-thread scratch. Called from inside a task it runs serially. */
typedef void (*mha_task_fn)(void *ctx, int64_t task, int thread);
void mha_parallel_for(int threads, int64_t n, int64_t chunk, mha_task_fn fn, void *ctx);
/* What runs the threads, for mha_build_info: "mha pool (...)", "OpenMP <version>", "serial". */
const char *mha_thread_runtime(void);

/* Threads for a parallel job doing about `flops` of work started here: 1 inside another
 * job, and no more than one per MHA_FLOPS_PER_THREAD so that small calls do not pay for
 * waking threads (tens of microseconds, far more on a busy machine). */
#define MHA_FLOPS_PER_THREAD 4e6
int mha_threads_for(double flops);

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

/* Internal entry points of the kernels, dispatched like the public ones (dispatch.h). */

/* C = op(A) @ op(B) + bias on every row (bias may be NULL), threads as mha_gemm. */
int mha_gemm_bias_f32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const float *A,
                      int64_t lda, const float *B, int64_t ldb, const float *bias, float *C,
                      int64_t ldc);
int mha_gemm_bias_f64(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const double *A,
                      int64_t lda, const double *B, int64_t ldb, const double *bias, double *C,
                      int64_t ldc);

/* Products that share their left operand: C = A @ B + bias (bias may be NULL) for each of up
 * to 3 outputs, A (M x K) row-major with row stride lda, B (K x N) with row stride ldb, A
 * packed once per block of rows (the layer's Q, K and V projections of one input). Each
 * output is bitwise what mha_gemm_bias gives it alone. Bp, when not NULL, is B packed whole
 * by mha_pack_weight (B and ldb are then not read); the result is bitwise the same. */
#define MHA_GEMM_OUT(T)                                                                        \
    struct {                                                                                   \
        const T *B;                                                                            \
        int64_t ldb;                                                                           \
        const T *bias;                                                                         \
        T *C;                                                                                  \
        int64_t ldc, N;                                                                        \
        const T *Bp;                                                                           \
    }
typedef MHA_GEMM_OUT(float) mha_gemm_out_f32;
typedef MHA_GEMM_OUT(double) mha_gemm_out_f64;
#undef MHA_GEMM_OUT
int mha_gemm_shared_a_f32(int64_t M, int64_t K, const float *A, int64_t lda,
                          const mha_gemm_out_f32 *outs, int n_out);
int mha_gemm_shared_a_f64(int64_t M, int64_t K, const double *A, int64_t lda,
                          const mha_gemm_out_f64 *outs, int n_out);

#endif /* MHA_COMMON_H */
