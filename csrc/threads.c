/* threads.c: thread count, build information, and the dropout RNG's public entry point. */
#include "common.h"
#include "mha.h"

static int g_num_threads = 0; /* 0: OpenMP's default (OMP_NUM_THREADS or the core count) */

void mha_set_num_threads(int n) { g_num_threads = n > 0 ? n : 0; }

int mha_get_num_threads(void) {
#ifdef _OPENMP
    return g_num_threads > 0 ? g_num_threads : omp_get_max_threads();
#else
    return 1;
#endif
}

int mha_threads_for(double flops) {
#ifdef _OPENMP
    if (omp_in_parallel()) return 1;
#endif
    double useful = flops / MHA_FLOPS_PER_THREAD;
    int n = mha_get_num_threads();
    return useful < n ? (int)MHA_MAX(1.0, useful) : n;
}

double mha_dropout_uniform(uint64_t seed, uint64_t b, uint64_t h, uint64_t i, uint64_t j) {
    return mha_uniform_from_state(mha_dropout_row_state(seed, b, h, i), j);
}

#define MHA_STR_(x) #x
#define MHA_STR(x) MHA_STR_(x)

#if defined(__clang__)
#define MHA_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define MHA_COMPILER "gcc " MHA_STR(__GNUC__) "." MHA_STR(__GNUC_MINOR__) "." MHA_STR(__GNUC_PATCHLEVEL__)
#else
#define MHA_COMPILER "unknown compiler"
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && !defined(MHA_NO_CLONES)
#define MHA_SIMD "x86-64 runtime dispatch: AVX2+FMA (x86-64-v3) or baseline SSE2"
#elif defined(__AVX2__)
#define MHA_SIMD "AVX2"
#elif defined(__SSE2__)
#define MHA_SIMD "SSE2"
#elif defined(__ARM_NEON)
#define MHA_SIMD "NEON"
#else
#define MHA_SIMD "portable (compiler vector extensions)"
#endif

#ifdef _OPENMP
#define MHA_OPENMP "OpenMP " MHA_STR(_OPENMP)
#else
#define MHA_OPENMP "no OpenMP (serial)"
#endif

const char *mha_build_info(void) {
    return "compiler=" MHA_COMPILER "; simd=" MHA_SIMD "; threads=" MHA_OPENMP;
}
