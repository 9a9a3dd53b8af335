/* bench_paths.c: the packed GEMM (mha_linear_packed_f32, what a model's products run) of
 * every SIMD path this CPU runs, timed call by call in turns within one process:
 * `make -C csrc bench-paths SHAPES="128 1152 384 512 2304 768" THREADS=2`, or
 * `bench_paths THREADS TRIALS M N K [M N K ...]`.
 *
 * On a shared virtual machine the rate of one kernel moves by up to 2x over minutes (a busy
 * neighbour on the host core), so two paths timed one after the other in separate runs
 * compare the machine's moods, not the kernels. Here each trial times every path back to back
 * (the first path rotating), each path on its own weight packed for it (on a cache line, as
 * mha's binding allocates them), about 0.1 GFLOP per timed batch. Printed per shape and path:
 * GFLOP/s of the best trial and of the median trial, and the median against the first path's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "dispatch.h"

#define MAX_TRIALS 1000

static double wall_s(void) {
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 6 || (argc - 3) % 3) {
        fprintf(stderr, "usage: bench_paths THREADS TRIALS M N K [M N K ...]\n");
        return 2;
    }
    const mha_kernels *const *units[] = {&mha_unit_avx512, &mha_unit_avx2, &mha_unit_baseline};
    const char *names[] = {"avx512", "avx2", "baseline"};
    const char *runs = mha_simd_paths();   /* what this build and CPU run, best first */
    const mha_kernels *unit[3];
    const char *name[3];
    int n_units = 0;
    for (int i = 0; i < 3; i++)
        if (*units[i] && strstr(runs, names[i])) {
            unit[n_units] = *units[i];
            name[n_units++] = names[i];
        }
    mha_set_num_threads(atoi(argv[1]));
    int trials = atoi(argv[2]);
    if (trials < 1 || trials > MAX_TRIALS) trials = 40;
    printf("%d thread(s), %d trials; paths: %s\n", mha_get_num_threads(), trials, runs);
    static double t[3][MAX_TRIALS];
    for (int s = 3; s + 2 < argc; s += 3) {
        const int64_t M = atoll(argv[s]), N = atoll(argv[s + 1]), K = atoll(argv[s + 2]);
        if (M < 1 || N < 1 || K < 1) {
            fprintf(stderr, "bench_paths: M, N and K must be positive\n");
            return 2;
        }
        float *A = mha_alloc((size_t)(M * K) * sizeof(float)), *B = mha_alloc((size_t)(N * K) * sizeof(float));
        float *C = mha_alloc((size_t)(M * N) * sizeof(float)), *packed[3] = {NULL, NULL, NULL};
        int ok = A && B && C;
        for (int64_t i = 0; ok && i < M * K; i++) A[i] = (float)rand() / (float)RAND_MAX - 0.5f;
        for (int64_t i = 0; ok && i < N * K; i++) B[i] = (float)rand() / (float)RAND_MAX - 0.5f;
        for (int u = 0; ok && u < n_units; u++) {
            size_t bytes = 0;
            ok = unit[u]->mha_packed_bytes_f32(MHA_WEIGHTS_NATIVE, K, N, &bytes) == MHA_OK &&
                 (packed[u] = mha_alloc(bytes)) != NULL &&
                 unit[u]->mha_pack_weight_f32(packed[u], B, K, 1, K, N) == MHA_OK;
        }
        if (!ok) {
            fprintf(stderr, "bench_paths: out of memory at %lld x %lld x %lld\n", (long long)M,
                    (long long)N, (long long)K);
            return 1;
        }
        const double flops = 2.0 * (double)M * (double)N * (double)K;
        const int calls = (int)(1e8 / flops) + 1;
        for (int trial = 0; trial < trials; trial++)
            for (int i = 0; i < n_units; i++) {
                const int u = (i + trial) % n_units;
                unit[u]->mha_linear_packed_f32(M, N, K, A, K, packed[u], NULL, 0, 0, C, N); /* warm */
                const double t0 = wall_s();
                for (int c = 0; c < calls; c++)
                    unit[u]->mha_linear_packed_f32(M, N, K, A, K, packed[u], NULL, 0, 0, C, N);
                t[u][trial] = (wall_s() - t0) / calls;
            }
        printf("%lld x %lld x %lld:", (long long)M, (long long)N, (long long)K);
        for (int u = 0; u < n_units; u++) {
            qsort(t[u], (size_t)trials, sizeof(double), cmp);
            printf("  %s best %.1f median %.1f GFLOP/s", name[u], flops / t[u][0] * 1e-9,
                   flops / t[u][trials / 2] * 1e-9);
            if (u > 0) printf(" (%.2fx %s)", t[0][trials / 2] / t[u][trials / 2], name[0]);
        }
        printf("\n");
        mha_free(A);
        mha_free(B);
        mha_free(C);
        for (int u = 0; u < n_units; u++) mha_free(packed[u]);
    }
    return 0;
}
