/* bench_core.c: time the core's pieces without Python: `make -C csrc bench THREADS=2`, or
 * `bench_core THREADS [NAME [REPEATS]]` to time only the pieces whose name contains NAME (or,
 * written "=NAME", equals it).
 *
 * The layer of the benchmark table's case a (docs/benchmarks.md: B=16, n=128, d_model=256,
 * 8 heads, float32): the projection GEMM, the attention forward with and without weights (and
 * with every row statistic), its backward, the layer forward and backward; the attention
 * forward over one causal sequence of 1024 tokens (8 heads of 64), with and without the row
 * statistics; and a product small enough that it runs on two
 * threads whatever THREADS says (64 rows: a short sequence's projection), which times what a
 * parallel job costs beyond its work. Each piece runs once untimed, then REPEATS times
 * (default 15); printed: the process CPU time (all threads) and the wall time, each as median
 * [min, max], and GFLOP/s from the median CPU time. MHA_SIMD picks the SIMD path (mha.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mha.h"

static double wall_s(void) {
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double cpu_s(void) { return (double)clock() / CLOCKS_PER_SEC; }

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static const char *only = ""; /* time the pieces whose name contains this */
static int repeats = 15;

#define MAX_REPEATS 1000
#define TIME(name, flops, stmt)                                                               \
    do {                                                                                      \
        if (only[0] == '=' ? strcmp(name, only + 1) != 0 : !strstr(name, only)) break;        \
        static double cpu[MAX_REPEATS], wall[MAX_REPEATS];                                    \
        stmt;                                                                                 \
        for (int r_ = 0; r_ < repeats; r_++) {                                                \
            double c0 = cpu_s(), w0 = wall_s();                                               \
            stmt;                                                                             \
            cpu[r_] = cpu_s() - c0;                                                           \
            wall[r_] = wall_s() - w0;                                                         \
        }                                                                                     \
        qsort(cpu, (size_t)repeats, sizeof(double), cmp);                                     \
        qsort(wall, (size_t)repeats, sizeof(double), cmp);                                    \
        printf("%-28s cpu %8.3f [%8.3f, %8.3f] ms  wall %8.3f [%8.3f, %8.3f] ms  %6.1f GFLOP/s\n", \
               name, cpu[repeats / 2] * 1e3, cpu[0] * 1e3, cpu[repeats - 1] * 1e3,            \
               wall[repeats / 2] * 1e3, wall[0] * 1e3, wall[repeats - 1] * 1e3,               \
               (flops) / cpu[repeats / 2] * 1e-9);                                            \
    } while (0)

static float *rand_f32(size_t n) {
    float *a = malloc(n * sizeof *a);
    for (size_t i = 0; i < n; i++) a[i] = (float)((double)rand() / RAND_MAX - 0.5);
    return a;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (argc > 2) only = argv[2];
    if (argc > 3) repeats = atoi(argv[3]);
    if (repeats < 1 || repeats > MAX_REPEATS) repeats = 15;
    mha_set_num_threads(threads);
    printf("%s; %d thread(s)\n", mha_build_info(), mha_get_num_threads());
    const int64_t B = 16, n = 128, D = 256, H = 8, dh = D / H;
    float *x = rand_f32(B * n * D), *W = rand_f32(D * D), *y = rand_f32(B * n * D);
    TIME("gemm 2048x256x256 NN", 2.0 * B * n * D * D, mha_gemm_f32(0, 0, B * n, D, D, 1, x, D, W, D, 0, y, D));
    TIME("gemm 256x256x2048 TN (dW)", 2.0 * B * n * D * D, mha_gemm_f32(1, 0, D, D, B * n, 1, x, D, y, D, 0, W, D));
    TIME("gemm 2048x256x256 NT (dX)", 2.0 * B * n * D * D, mha_gemm_f32(0, 1, B * n, D, D, 1, y, D, W, D, 0, x, D));
    TIME("gemm 64x256x256 NN (small)", 2.0 * 64 * D * D, mha_gemm_f32(0, 0, 64, D, D, 1, x, D, W, D, 0, y, D));

    float *q = rand_f32(B * H * n * dh), *k = rand_f32(B * H * n * dh), *v = rand_f32(B * H * n * dh);
    float *o = rand_f32(B * H * n * dh), *w = rand_f32(B * H * n * n);
    float *dq = rand_f32(B * H * n * dh), *dk = rand_f32(B * H * n * dh), *dv = rand_f32(B * H * n * dh);
    mha_attention_desc d;
    mha_attention_desc_init(&d, B, H, H, n, n, dh, dh);
    double attn_flops = 4.0 * B * H * n * n * dh;
    TIME("attention fwd +weights", attn_flops, mha_attention_forward_f32(o, w, q, k, v, &d));
    TIME("attention fwd", attn_flops, mha_attention_forward_f32(o, NULL, q, k, v, &d));
    TIME("attention bwd", 2.5 * attn_flops, mha_attention_backward_f32(dq, dk, dv, o, q, k, v, &d));
    d.causal = 1;
    TIME("attention fwd causal", attn_flops / 2, mha_attention_forward_f32(o, NULL, q, k, v, &d));
    d.causal = 0;
    /* every row statistic beside the fused forward (the key set: the first key) */
    uint8_t *key_set = calloc((size_t)n, 1);
    key_set[0] = 1;
    float *st = rand_f32(7 * B * H * n);
    int64_t *argmax = malloc(sizeof(int64_t) * B * H * n);
    mha_row_stats_f32 all = {st, st + B * H * n, argmax, st + 2 * B * H * n, st + 3 * B * H * n,
                             st + 4 * B * H * n, st + 5 * B * H * n, st + 6 * B * H * n, key_set, 0};
    TIME("attention fwd +stats", attn_flops, mha_attention_forward_stats_f32(o, NULL, NULL, &all, q, k, v, &d));

    /* one long sequence: 8 heads of 64 over 1024 tokens, causal, without and with statistics */
    const int64_t L = 1024, HL = 8, dL = 64;
    float *qL = rand_f32(HL * L * dL), *kL = rand_f32(HL * L * dL), *vL = rand_f32(HL * L * dL);
    float *oL = rand_f32(HL * L * dL), *stL = rand_f32(7 * HL * L);
    int64_t *argmaxL = malloc(sizeof(int64_t) * HL * L);
    uint8_t *key_setL = calloc((size_t)L, 1);
    key_setL[0] = 1;
    mha_row_stats_f32 allL = {stL, stL + HL * L, argmaxL, stL + 2 * HL * L, stL + 3 * HL * L,
                              stL + 4 * HL * L, stL + 5 * HL * L, stL + 6 * HL * L, key_setL, 0};
    mha_attention_desc dL_desc;
    mha_attention_desc_init(&dL_desc, 1, HL, HL, L, L, dL, dL);
    dL_desc.causal = 1;
    const double long_flops = 4.0 * HL * L * L * dL / 2;
    TIME("attention fwd 1024 causal", long_flops, mha_attention_forward_f32(oL, NULL, qL, kL, vL, &dL_desc));
    TIME("attention fwd 1024 causal +stats", long_flops,
         mha_attention_forward_stats_f32(oL, NULL, NULL, &allL, qL, kL, vL, &dL_desc));

    float *W_q = rand_f32(D * D), *W_k = rand_f32(D * D), *W_v = rand_f32(D * D), *W_o = rand_f32(D * D);
    float *b_q = rand_f32(D), *b_k = rand_f32(D), *b_v = rand_f32(D), *b_o = rand_f32(D);
    mha_layer_params_f32 p = {.W_q = W_q, .W_k = W_k, .W_v = W_v, .W_o = W_o,
                              .b_q = b_q, .b_k = b_k, .b_v = b_v, .b_o = b_o};
    mha_layer_dims m = {.batch = B, .n_q = n, .n_k = n, .n_new = n, .d_model = D, .kdim = D, .vdim = D,
                        .heads = H, .kv_heads = H, .d_head = dh, .kv_batch_stride = n};
    float *out = rand_f32(B * n * D), *qp = rand_f32(B * n * D), *kp = rand_f32(B * n * D);
    float *vp = rand_f32(B * n * D), *attn = rand_f32(B * n * D), *lse = rand_f32(B * H * n);
    float *dx = rand_f32(B * n * D), *dxk = rand_f32(B * n * D), *dxv = rand_f32(B * n * D);
    float *g[9];
    for (int i = 0; i < 9; i++) g[i] = rand_f32(D * D);
    mha_layer_grads_f32 gr = {.W_q = g[0], .W_k = g[1], .W_v = g[2], .W_o = g[3], .b_q = g[4],
                              .b_k = g[5], .b_v = g[6], .b_o = g[7], .head_mask = g[8]};
    mha_layer_saved_f32 saved = {.q_proj = qp, .k_proj = kp, .v_proj = vp, .attn = attn, .lse = lse};
    double layer_flops = 8.0 * B * n * D * D + attn_flops;
    TIME("layer fwd +weights", layer_flops, mha_layer_forward_f32(out, w, &saved, x, x, x, &p, &m, &d));
    TIME("layer fwd", layer_flops, mha_layer_forward_f32(out, NULL, &saved, x, x, x, &p, &m, &d));
    TIME("layer bwd", 2 * layer_flops, mha_layer_backward_f32(dx, dxk, dxv, &gr, y, &saved, x, x, x, &p, &m, &d));
    return 0;
}
