/* test_core.c: the C core on its own, no Python. `make -C csrc test` (and asan, valgrind,
 * portable): once per SIMD path.
 *
 * Each fast kernel is held to a naive twin written here in the plainest loops: the GEMM in all
 * four transpose combinations (and products sharing A, bitwise against single products),
 * attention forward with every mask kind, causal, GQA and dropout, its backward against
 * central finite differences (float64), its row statistics against loops over the weights, the layer against projections + attention composed by
 * hand, and fully masked rows giving 0; the rest of the block (dense with its activation,
 * norms, RoPE, embedding) and its backward against loops in double (accumulated into
 * strided outputs, the cross-entropy in chunks); the Adam step against its formula; the thread layer runs every task of a job
 * once.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "mha.h"
#include "narrow.h"

static int failures = 0, checks = 0;
/* Elements per array checked against finite differences: about 23 (the whole run), or 4
 * with --quick (for emulators: every kernel still runs on every case, and every forward
 * result is still held to its twin). */
static size_t fd_samples = 23;

static void expect(int ok, const char *what, double err, double tol) {
    checks++;
    if (!ok) {
        failures++;
        printf("FAIL %s: error %.3e > tolerance %.1e\n", what, err, tol);
    }
}

static double max_abs_diff(const double *a, const double *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        if (d > m || d != d) m = d;
    }
    return m;
}

static unsigned long long rng_state = 42;
static double randn(void) { /* Box-Muller on a small LCG: enough for test data */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    double u1 = ((rng_state >> 11) + 1.0) * 0x1.0p-53;
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    double u2 = (rng_state >> 11) * 0x1.0p-53;
    return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

static double *random_array(size_t n) {
    double *a = malloc(n * sizeof *a);
    for (size_t i = 0; i < n; i++) a[i] = randn();
    return a;
}

/* ---- GEMM ---------------------------------------------------------------------------------- */

static void test_gemm(void) {
    /* the last two are big enough for two threads: split by rows, and by columns */
    const int64_t sizes[][3] = {{1, 1, 1}, {7, 5, 3}, {37, 53, 301}, {130, 20, 4100}, {300, 40, 300}, {12, 700, 400}, {12, 12, 8}, {5, 9, 40}};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                int64_t M = sizes[s][0], N = sizes[s][1], K = sizes[s][2];
                double *A = random_array(M * K), *B = random_array(K * N), *C = random_array(M * N);
                double *R = malloc(M * N * sizeof *R);
                float *Af = malloc(M * K * 4), *Bf = malloc(K * N * 4), *Cf = malloc(M * N * 4);
                int64_t lda = ta ? M : K, ldb = tb ? K : N;
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) {
                        double acc = 0;
                        for (int64_t p = 0; p < K; p++)
                            acc += (ta ? A[p * lda + i] : A[i * lda + p]) * (tb ? B[j * ldb + p] : B[p * ldb + j]);
                        R[i * N + j] = 2 * acc + 0.5 * C[i * N + j];
                    }
                for (int64_t i = 0; i < M * K; i++) Af[i] = (float)A[i];
                for (int64_t i = 0; i < K * N; i++) Bf[i] = (float)B[i];
                for (int64_t i = 0; i < M * N; i++) Cf[i] = (float)C[i];
                mha_gemm_f64(ta, tb, M, N, K, 2, A, lda, B, ldb, 0.5, C, N);
                mha_gemm_f32(ta, tb, M, N, K, 2, Af, lda, Bf, ldb, 0.5f, Cf, N);
                double err = max_abs_diff(C, R, M * N), err32 = 0;
                for (int64_t i = 0; i < M * N; i++) err32 = fmax(err32, fabs(Cf[i] - R[i]));
                char what[96];
                snprintf(what, sizeof what, "gemm f64 %lldx%lldx%lld ta=%d tb=%d", (long long)M, (long long)N, (long long)K, ta, tb);
                expect(err <= 1e-12 * K, what, err, 1e-12 * K);
                snprintf(what, sizeof what, "gemm f32 %lldx%lldx%lld ta=%d tb=%d", (long long)M, (long long)N, (long long)K, ta, tb);
                expect(err32 <= 1e-5 * K, what, err32, 1e-5 * K);
                free(A), free(B), free(C), free(R), free(Af), free(Bf), free(Cf);
            }
}

/* Products sharing their left operand (the layer's fused Q, K, V projections): each output
 * bitwise equal to its own mha_gemm_bias call, its row padding (ldc > N) untouched. Shapes
 * cover whole and ragged panels, A packed and read in place, a shared axis in slices (4100),
 * one row block whose panels two threads split inside an output, an empty output, and
 * outputs small enough for the unpacked path. */
static void test_gemm_shared_a(void) {
    const int64_t shapes[][5] = {/* M, K, N0, N1, N2 */
                                 {300, 40, 256, 64, 64}, {130, 4100, 21, 0, 48}, {6, 300, 24, 70, 50},
                                 {2000, 64, 16, 16, 40}, {12, 8, 5, 300, 16}, {7, 3, 2, 2, 2}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t M = shapes[s][0], K = shapes[s][1], pad = 3;
        float *A = malloc(M * K * sizeof *A);
        for (int64_t i = 0; i < M * K; i++) A[i] = (float)randn();
        mha_gemm_out_f32 outs[3];
        float *want[3], *biases[3];
        for (int o = 0; o < 3; o++) {
            const int64_t N = shapes[s][2 + o], ldc = N + pad;
            float *B = malloc((K * N + 1) * sizeof *B), *bias = biases[o] = malloc((N + 1) * sizeof *bias);
            float *C = malloc((M * ldc + 1) * sizeof *C);
            want[o] = malloc((M * ldc + 1) * sizeof *C);
            for (int64_t i = 0; i < K * N; i++) B[i] = (float)randn();
            for (int64_t i = 0; i < N; i++) bias[i] = (float)randn();
            for (int64_t i = 0; i < M * ldc; i++) C[i] = want[o][i] = (float)randn(); /* the padding */
            outs[o] = (mha_gemm_out_f32){B, N, o == 1 ? NULL : bias, C, ldc, N, NULL};
            mha_gemm_bias_f32(0, 0, M, N, K, A, K, B, N, o == 1 ? NULL : bias, want[o], ldc);
        }
        int err = mha_gemm_shared_a_f32(M, K, A, K, outs, 3);
        for (int o = 0; o < 3; o++) {
            char what[96];
            const size_t n = (size_t)(M * outs[o].ldc);
            size_t differ = 0; /* elements not bitwise equal */
            for (size_t i = 0; i < n; i++) differ += memcmp(outs[o].C + i, want[o] + i, sizeof(float)) != 0;
            snprintf(what, sizeof what, "gemm shared A %lldx%lld, output %d of width %lld (core error %d; elements differing)",
                     (long long)M, (long long)K, o, (long long)outs[o].N, err);
            expect(!err && differ == 0, what, (double)differ, 0);
            free((void *)outs[o].B), free(biases[o]), free(outs[o].C), free(want[o]);
        }
        free(A);
    }
}

/* ---- attention: the naive twin --------------------------------------------------------------- */

/* Contiguous (B, H, n_q, d) arrays; mask (B, H, n_q, n_k) bytes or NULL. */
static void naive_attention(double *out, double *weights, const double *q, const double *k,
                            const double *v, const uint8_t *mask, const mha_attention_desc *d) {
    int64_t group = d->heads / d->kv_heads;
    double *s = malloc((d->n_k + 1) * sizeof *s);
    for (int64_t b = 0; b < d->batch; b++)
        for (int64_t h = 0; h < d->heads; h++)
            for (int64_t i = 0; i < d->n_q; i++) {
                const double *q_i = q + ((b * d->heads + h) * d->n_q + i) * d->d_k;
                const double *k_bh = k + (b * d->kv_heads + h / group) * d->n_k * d->d_k;
                const double *v_bh = v + (b * d->kv_heads + h / group) * d->n_k * d->d_v;
                double m = -INFINITY, sum = 0;
                for (int64_t j = 0; j < d->n_k; j++) {
                    double dot = 0;
                    for (int64_t c = 0; c < d->d_k; c++) dot += q_i[c] * k_bh[j * d->d_k + c];
                    s[j] = d->scale * dot;
                    if (d->softcap > 0) s[j] = d->softcap * tanh(s[j] / d->softcap);
                    int allowed = !mask || mask[((b * d->heads + h) * d->n_q + i) * d->n_k + j];
                    if (d->causal && j > i + d->n_k - d->n_q) allowed = 0;
                    if (d->key_padding && !d->key_padding[b * d->key_padding_stride + j]) allowed = 0;
                    if (!allowed) s[j] = -INFINITY;
                    if (s[j] > m) m = s[j];
                }
                for (int64_t j = 0; j < d->n_k; j++) {
                    s[j] = m == -INFINITY ? 0 : exp(s[j] - m);
                    sum += s[j];
                }
                double *o_i = out + ((b * d->heads + h) * d->n_q + i) * d->d_v;
                memset(o_i, 0, d->d_v * sizeof *o_i);
                for (int64_t j = 0; j < d->n_k; j++) {
                    double p = sum > 0 ? s[j] / sum : 0;
                    if (weights) weights[((b * d->heads + h) * d->n_q + i) * d->n_k + j] = p;
                    double keep = 1;
                    if (d->dropout > 0)
                        keep = mha_dropout_uniform(d->seed, b, h, i, j) >= d->dropout ? 1 / (1 - d->dropout) : 0;
                    for (int64_t c = 0; c < d->d_v; c++) o_i[c] += p * keep * v_bh[j * d->d_v + c];
                }
            }
    free(s);
}

typedef struct {
    int64_t B, H, H_kv, n_q, n_k, d_k, d_v;
    int causal, use_mask;
    double dropout;
    double softcap; /* 0: off */
    int padding;    /* key padding: the last key of batch 0, the first two of the others */
} attention_case;

/* The worst difference between the scores a forward wrote (float or double, by `single`) and
 * the naive twin's: scale * q k^T, -inf where the mask or causality hides the key. A key
 * hidden in one and not in the other counts as an infinite difference. */
static double scores_error(const void *got, int single, const double *q, const double *k,
                           const uint8_t *mask, const mha_attention_desc *d) {
    const int64_t group = d->heads / d->kv_heads;
    double worst = 0;
    for (int64_t b = 0; b < d->batch; b++)
        for (int64_t h = 0; h < d->heads; h++)
            for (int64_t i = 0; i < d->n_q; i++)
                for (int64_t j = 0; j < d->n_k; j++) {
                    const int64_t at = ((b * d->heads + h) * d->n_q + i) * d->n_k + j;
                    const double *q_i = q + ((b * d->heads + h) * d->n_q + i) * d->d_k;
                    const double *k_j = k + ((b * d->kv_heads + h / group) * d->n_k + j) * d->d_k;
                    double want = 0;
                    for (int64_t c = 0; c < d->d_k; c++) want += q_i[c] * k_j[c];
                    want *= d->scale;
                    if (d->softcap > 0) want = d->softcap * tanh(want / d->softcap);
                    if ((mask && !mask[at]) || (d->causal && j > i + d->n_k - d->n_q)) want = -INFINITY;
                    if (d->key_padding && !d->key_padding[b * d->key_padding_stride + j]) want = -INFINITY;
                    const double s = single ? ((const float *)got)[at] : ((const double *)got)[at];
                    if (isinf(want) || isinf(s)) worst = s == want ? worst : INFINITY;
                    else worst = fmax(worst, fabs(s - want) / fmax(1, fabs(want)));
                }
    return worst;
}

/* scores_out: the softmax's input, beside the weights, in both types; it needs the weights. */
static void test_attention_scores(const attention_case *c, const mha_attention_desc *desc,
                                  const double *q, const double *k, const double *v,
                                  const uint8_t *mask) {
    mha_attention_desc d = *desc;
    const size_t nq = c->B * c->H * c->n_q * c->d_k, nk = c->B * c->H_kv * c->n_k * c->d_k;
    const size_t nv = c->B * c->H_kv * c->n_k * c->d_v, no = c->B * c->H * c->n_q * c->d_v;
    const size_t nw = c->B * c->H * c->n_q * c->n_k;
    double *out = malloc(no * 8), *w = malloc(nw * 8), *scores = malloc(nw * 8 + 8);
    d.scores = scores;
    expect(mha_attention_forward_f64(out, NULL, q, k, v, &d) == MHA_EINVAL,
           "scores without weights is refused", 0, 0);
    int err = mha_attention_forward_f64(out, w, q, k, v, &d);
    double e = scores_error(scores, 0, q, k, mask, &d);
    expect(!err && e <= 1e-12, "attention scores_out (float64) against the naive scores", e, 1e-12);
    float *qf = malloc(nq * 4), *kf = malloc(nk * 4), *vf = malloc(nv * 4);
    float *of = malloc(no * 4), *wf = malloc(nw * 4), *sf = malloc(nw * 4 + 4);
    double *qr = malloc(nq * 8), *kr = malloc(nk * 8); /* the float inputs, widened */
    for (size_t i = 0; i < nq; i++) qr[i] = qf[i] = (float)q[i];
    for (size_t i = 0; i < nk; i++) kr[i] = kf[i] = (float)k[i];
    for (size_t i = 0; i < nv; i++) vf[i] = (float)v[i];
    d.scores = sf;
    err = mha_attention_forward_f32(of, wf, qf, kf, vf, &d);
    e = scores_error(sf, 1, qr, kr, mask, &d);
    expect(!err && e <= 1e-5, "attention scores_out (float32) against the naive scores", e, 1e-5);
    free(out), free(w), free(scores), free(qf), free(kf), free(vf), free(of), free(wf), free(sf);
    free(qr), free(kr);
}

/* With soft-capping, beyond what every case checks (the weights and output against the naive
 * twin with c tanh(s / c), both paths, the scores, the backward against finite differences):
 * lse (float64) against the capped scores' log-sum-exp; the float32 weights; the backward
 * from the saved out and lse equal to the stateless one; the float32 backward near the
 * float64 one; a negative, NaN or infinite softcap refused (MHA_EINVAL, nothing written). */
static void test_softcap_extra(const attention_case *c, const mha_attention_desc *desc, const double *q,
                               const double *k, const double *v, const double *out_ref,
                               const double *w_ref) {
    mha_attention_desc d = *desc;
    const size_t nq = c->B * c->H * c->n_q * c->d_k, nk = c->B * c->H_kv * c->n_k * c->d_k;
    const size_t nv = c->B * c->H_kv * c->n_k * c->d_v, no = c->B * c->H * c->n_q * c->d_v;
    const size_t nw = c->B * c->H * c->n_q * c->n_k, nr = c->B * c->H * c->n_q;
    double *out = malloc(no * 8 + 8), *lse = malloc(nr * 8 + 8), *scores = malloc(nw * 8 + 8);
    double *w = malloc(nw * 8 + 8);
    /* lse: log sum_j exp(s_j) of the capped, masked scores */
    d.scores = scores;
    int err = mha_attention_forward_f64(out, w, q, k, v, &d);
    d.scores = NULL;
    err |= mha_attention_forward_lse_f64(out, NULL, lse, q, k, v, &d);
    double e = 0;
    for (size_t r = 0; r < nr; r++) {
        double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < c->n_k; j++) m = fmax(m, scores[r * c->n_k + j]);
        for (int64_t j = 0; j < c->n_k && m > -INFINITY; j++) sum += exp(scores[r * c->n_k + j] - m);
        const double want = m == -INFINITY ? -INFINITY : m + log(sum);
        e = fmax(e, want == lse[r] ? 0 : fabs(lse[r] - want) / fmax(1, fabs(want)));
    }
    expect(!err && e <= 1e-13, "softcap lse (float64) of the capped scores", e, 1e-13);
    /* float32: the weights path against the twin */
    float *qf = malloc(nq * 4), *kf = malloc(nk * 4), *vf = malloc(nv * 4), *of = malloc(no * 4);
    float *wf = malloc(nw * 4 + 4), *lf = malloc(nr * 4 + 4), *gf = malloc(no * 4);
    float *dqf = malloc(nq * 4), *dkf = malloc(nk * 4), *dvf = malloc(nv * 4);
    for (size_t i = 0; i < nq; i++) qf[i] = (float)q[i];
    for (size_t i = 0; i < nk; i++) kf[i] = (float)k[i];
    for (size_t i = 0; i < nv; i++) vf[i] = (float)v[i];
    err = mha_attention_forward_f32(of, wf, qf, kf, vf, &d);
    double e_w = 0, e_o = 0;
    for (size_t i = 0; i < nw; i++) e_w = fmax(e_w, fabs(wf[i] - w_ref[i]));
    for (size_t i = 0; i < no; i++) e_o = fmax(e_o, fabs(of[i] - out_ref[i]));
    expect(!err && e_w <= 1e-5, "softcap float32 weights against the naive twin", e_w, 1e-5);
    expect(!err && e_o <= 1e-4 * (1 + c->dropout * 4), "softcap float32 output (weights path)", e_o, 1e-4);
    /* the backward from the saved forward equals the stateless one (float64); float32 near it */
    double *g = random_array(no), *dq = malloc(nq * 8), *dk = malloc(nk * 8), *dv = malloc(nv * 8);
    double *dq2 = malloc(nq * 8), *dk2 = malloc(nk * 8), *dv2 = malloc(nv * 8);
    err = mha_attention_forward_lse_f64(out, NULL, lse, q, k, v, &d);
    err |= mha_attention_backward_saved_f64(dq, dk, dv, g, q, k, v, out, lse, &d);
    err |= mha_attention_backward_f64(dq2, dk2, dv2, g, q, k, v, &d);
    e = fmax(max_abs_diff(dq, dq2, nq), fmax(max_abs_diff(dk, dk2, nk), max_abs_diff(dv, dv2, nv)));
    expect(!err && e <= 1e-13, "softcap backward from the saved out and lse = the stateless one", e, 1e-13);
    for (size_t i = 0; i < no; i++) gf[i] = (float)g[i];
    err = mha_attention_forward_lse_f32(of, NULL, lf, qf, kf, vf, &d);
    err |= mha_attention_backward_saved_f32(dqf, dkf, dvf, gf, qf, kf, vf, of, lf, &d);
    double e32 = 0, big = 1;
    for (size_t i = 0; i < nq; i++) e32 = fmax(e32, fabs(dqf[i] - dq[i])), big = fmax(big, fabs(dq[i]));
    for (size_t i = 0; i < nk; i++) e32 = fmax(e32, fabs(dkf[i] - dk[i])), big = fmax(big, fabs(dk[i]));
    for (size_t i = 0; i < nv; i++) e32 = fmax(e32, fabs(dvf[i] - dv[i])), big = fmax(big, fabs(dv[i]));
    expect(!err && e32 <= 1e-4 * big, "softcap float32 backward near the float64 one", e32 / big, 1e-4);
    /* bad values: refused before anything is written */
    const double bad[3] = {-1.0, NAN, INFINITY};
    for (int t = 0; t < 3; t++) {
        mha_attention_desc b = d;
        b.softcap = bad[t];
        for (size_t i = 0; i < no; i++) out[i] = 7;
        int status = mha_attention_forward_f64(out, NULL, q, k, v, &b);
        status &= mha_attention_forward_f64(out, w, q, k, v, &b);
        status &= mha_attention_backward_f64(dq, dk, dv, g, q, k, v, &b);
        status &= mha_attention_forward_f32(of, NULL, qf, kf, vf, &b);
        int untouched = 1;
        for (size_t i = 0; i < no; i++) untouched &= out[i] == 7;
        expect(status == MHA_EINVAL && untouched, "a negative, NaN or infinite softcap is MHA_EINVAL", bad[t], 0);
    }
    free(out), free(lse), free(scores), free(w), free(qf), free(kf), free(vf), free(of), free(wf), free(lf);
    free(gf), free(dqf), free(dkf), free(dvf), free(g), free(dq), free(dk), free(dv), free(dq2), free(dk2), free(dv2);
}

static void test_attention_case(attention_case c) {
    mha_attention_desc d;
    mha_attention_desc_init(&d, c.B, c.H, c.H_kv, c.n_q, c.n_k, c.d_k, c.d_v);
    d.causal = c.causal;
    d.dropout = c.dropout;
    d.seed = 1234;
    d.softcap = c.softcap;
    uint8_t *padding = NULL;
    if (c.padding) {
        padding = malloc(c.B * c.n_k + 1);
        for (int64_t b = 0; b < c.B; b++)
            for (int64_t j = 0; j < c.n_k; j++) padding[b * c.n_k + j] = b == 0 ? j != c.n_k - 1 : j >= 2;
        d.key_padding = padding;
        d.key_padding_stride = c.n_k;
    }
    size_t nq = c.B * c.H * c.n_q * c.d_k, nk = c.B * c.H_kv * c.n_k * c.d_k, nv = c.B * c.H_kv * c.n_k * c.d_v;
    size_t no = c.B * c.H * c.n_q * c.d_v, nw = c.B * c.H * c.n_q * c.n_k;
    double *q = random_array(nq), *k = random_array(nk), *v = random_array(nv);
    uint8_t *mask = NULL;
    if (c.use_mask) {
        mask = malloc(nw);
        for (size_t i = 0; i < nw; i++) mask[i] = randn() > -0.5;
        for (int64_t j = 0; j < c.n_k; j++) mask[j] = 0; /* row 0 of head 0: fully masked */
        d.mask_kind = MHA_MASK_BOOL;
        d.mask = mask;
        d.mask_strides[0] = c.H * c.n_q * c.n_k;
        d.mask_strides[1] = c.n_q * c.n_k;
        d.mask_strides[2] = c.n_k;
        d.mask_strides[3] = 1;
    }
    double *out = malloc(no * 8), *w = malloc(nw * 8), *out_ref = malloc(no * 8), *w_ref = malloc(nw * 8);
    char what[160];
    snprintf(what, sizeof what, "attention B=%lld H=%lld/%lld n_q=%lld n_k=%lld d=%lld/%lld causal=%d mask=%d "
             "dropout=%g softcap=%g padding=%d", (long long)c.B, (long long)c.H, (long long)c.H_kv,
             (long long)c.n_q, (long long)c.n_k, (long long)c.d_k, (long long)c.d_v, c.causal, c.use_mask,
             c.dropout, c.softcap, c.padding);
    naive_attention(out_ref, w_ref, q, k, v, mask, &d);
    expect(mha_attention_forward_f64(out, w, q, k, v, &d) == MHA_OK, what, 0, 0);
    double err = fmax(max_abs_diff(out, out_ref, no), max_abs_diff(w, w_ref, nw));
    expect(err <= 1e-12, what, err, 1e-12);
    /* without weights (the fused online-softmax path): the same output up to rounding */
    double *out2 = malloc(no * 8);
    mha_attention_forward_f64(out2, NULL, q, k, v, &d);
    err = max_abs_diff(out2, out_ref, no);
    expect(err <= 1e-12, "need_weights=false (fused path) matches the naive twin", err, 1e-12);
    test_attention_scores(&c, &d, q, k, v, mask);

    /* float32 from the same source */
    float *qf = malloc(nq * 4), *kf = malloc(nk * 4), *vf = malloc(nv * 4), *of = malloc(no * 4);
    for (size_t i = 0; i < nq; i++) qf[i] = (float)q[i];
    for (size_t i = 0; i < nk; i++) kf[i] = (float)k[i];
    for (size_t i = 0; i < nv; i++) vf[i] = (float)v[i];
    mha_attention_forward_f32(of, NULL, qf, kf, vf, &d);
    double err32 = 0;
    for (size_t i = 0; i < no; i++) err32 = fmax(err32, fabs(of[i] - out_ref[i]));
    expect(err32 <= 1e-4 * (1 + c.dropout * 4), "float32 forward", err32, 1e-4);
    if (c.softcap > 0) test_softcap_extra(&c, &d, q, k, v, out_ref, w_ref);

    /* backward against central finite differences of L = sum(out * g) */
    double *g = random_array(no), *dq = malloc(nq * 8), *dk = malloc(nk * 8), *dv = malloc(nv * 8);
    expect(mha_attention_backward_f64(dq, dk, dv, g, q, k, v, &d) == MHA_OK, "backward status", 0, 0);
    double *arrays[3] = {q, k, v}, *grads[3] = {dq, dk, dv};
    size_t sizes[3] = {nq, nk, nv};
    const double eps = 1e-6;
    double worst = 0;
    for (int a = 0; a < 3; a++)
        for (size_t i = 0; i < sizes[a]; i += 1 + sizes[a] / fd_samples) {
            double saved = arrays[a][i], lp = 0, lm = 0;
            arrays[a][i] = saved + eps;
            naive_attention(out2, NULL, q, k, v, mask, &d);
            for (size_t t = 0; t < no; t++) lp += out2[t] * g[t];
            arrays[a][i] = saved - eps;
            naive_attention(out2, NULL, q, k, v, mask, &d);
            for (size_t t = 0; t < no; t++) lm += out2[t] * g[t];
            arrays[a][i] = saved;
            double fd = (lp - lm) / (2 * eps);
            worst = fmax(worst, fabs(fd - grads[a][i]) / fmax(1, fabs(fd)));
        }
    snprintf(what + strlen(what), sizeof what - strlen(what), " backward vs finite differences");
    expect(worst <= 1e-6, what, worst, 1e-6);
    if (c.use_mask) { /* the fully masked row: output 0 and gradient 0 */
        double z = 0;
        for (int64_t t = 0; t < c.d_v; t++) z = fmax(z, fabs(out[t]));
        for (int64_t t = 0; t < c.d_k; t++) z = fmax(z, fabs(dq[t]));
        expect(z == 0, "a fully masked row gives output 0 and dq 0", z, 0);
    }
    free(q), free(k), free(v), free(mask), free(out), free(w), free(out_ref), free(w_ref), free(out2);
    free(qf), free(kf), free(vf), free(of), free(g), free(dq), free(dk), free(dv), free(padding);
}

/* ---- the layer: projections + attention + output projection by hand ------------------------ */

static void test_layer(void) {
    const int64_t B = 2, n = 7, d_model = 8, H = 4, H_kv = 2, dh = 3, E_q = H * dh, E_kv = H_kv * dh;
    double *x = random_array(B * n * d_model);
    double *W_q = random_array(d_model * E_q), *W_k = random_array(d_model * E_kv);
    double *W_v = random_array(d_model * E_kv), *W_o = random_array(E_q * d_model);
    double *b_q = random_array(E_q), *b_k = random_array(E_kv), *b_v = random_array(E_kv), *b_o = random_array(d_model);
    double head_mask[4] = {1, 0.5, 0, 2};
    mha_layer_params_f64 p = {.W_q = W_q, .W_k = W_k, .W_v = W_v, .W_o = W_o, .b_q = b_q, .b_k = b_k,
                              .b_v = b_v, .b_o = b_o, .head_mask = head_mask};
    mha_layer_dims m = {.batch = B, .n_q = n, .n_k = n, .n_new = n, .d_model = d_model, .kdim = d_model,
                        .vdim = d_model, .heads = H, .kv_heads = H_kv, .d_head = dh, .kv_batch_stride = n};
    mha_attention_desc opts;
    mha_attention_desc_init(&opts, B, H, H_kv, n, n, dh, dh);
    opts.causal = 1;
    double *out = malloc(B * n * d_model * 8), *qp = malloc(B * n * E_q * 8), *kp = malloc(B * n * E_kv * 8);
    double *vp = malloc(B * n * E_kv * 8), *attn = malloc(B * n * E_q * 8), *lse = malloc(B * H * n * 8);
    mha_layer_saved_f64 saved = {.q_proj = qp, .k_proj = kp, .v_proj = vp, .attn = attn, .lse = lse};
    mha_layer_saved_f64 no_lse = saved;
    no_lse.lse = NULL;
    expect(mha_layer_forward_f64(out, NULL, &saved, x, x, x, &p, &m, &opts) == MHA_OK, "layer forward status", 0, 0);

    /* by hand: Q = x W_q + b_q as (B, H, n, dh) contiguous, then naive attention */
    double *Q = malloc(B * H * n * dh * 8), *K = malloc(B * H_kv * n * dh * 8), *V = malloc(B * H_kv * n * dh * 8);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++) {
            const double *x_i = x + (b * n + i) * d_model;
            for (int64_t f = 0; f < E_q; f++) {
                double s = b_q[f];
                for (int64_t c = 0; c < d_model; c++) s += x_i[c] * W_q[c * E_q + f];
                Q[((b * H + f / dh) * n + i) * dh + f % dh] = s;
            }
            for (int64_t f = 0; f < E_kv; f++) {
                double sk = b_k[f], sv = b_v[f];
                for (int64_t c = 0; c < d_model; c++) sk += x_i[c] * W_k[c * E_kv + f], sv += x_i[c] * W_v[c * E_kv + f];
                K[((b * H_kv + f / dh) * n + i) * dh + f % dh] = sk;
                V[((b * H_kv + f / dh) * n + i) * dh + f % dh] = sv;
            }
        }
    double *O = malloc(B * H * n * dh * 8), *ref = malloc(B * n * d_model * 8);
    naive_attention(O, NULL, Q, K, V, NULL, &opts);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = 0; c < d_model; c++) {
                double s = b_o[c];
                for (int64_t f = 0; f < E_q; f++)
                    s += head_mask[f / dh] * O[((b * H + f / dh) * n + i) * dh + f % dh] * W_o[f * d_model + c];
                ref[(b * n + i) * d_model + c] = s;
            }
    double err = max_abs_diff(out, ref, B * n * d_model);
    expect(err <= 1e-12, "layer forward vs projections + naive attention by hand", err, 1e-12);

    /* backward: d_head_mask and dW_o against finite differences of L = sum(out * g) */
    double *g = random_array(B * n * d_model), *dx = malloc(B * n * d_model * 8);
    double *dx_k = malloc(B * n * d_model * 8), *dx_v = malloc(B * n * d_model * 8);
    double *gW_q = malloc(d_model * E_q * 8), *gW_k = malloc(d_model * E_kv * 8), *gW_v = malloc(d_model * E_kv * 8);
    double *gW_o = malloc(E_q * d_model * 8), *gb_q = malloc(E_q * 8), *gb_k = malloc(E_kv * 8), *gb_v = malloc(E_kv * 8);
    double *gb_o = malloc(d_model * 8), ghm[4];
    mha_layer_grads_f64 gr = {.W_q = gW_q, .W_k = gW_k, .W_v = gW_v, .W_o = gW_o, .b_q = gb_q, .b_k = gb_k,
                              .b_v = gb_v, .b_o = gb_o, .head_mask = ghm};
    expect(mha_layer_backward_f64(dx, dx_k, dx_v, &gr, g, &saved, x, x, x, &p, &m, &opts) == MHA_OK,
           "layer backward status", 0, 0);
    /* without the saved lse the attention's forward runs again: the same gradients */
    double *dx2 = malloc(B * n * d_model * 8);
    mha_layer_backward_f64(dx2, dx_k, dx_v, &gr, g, &no_lse, x, x, x, &p, &m, &opts);
    expect(max_abs_diff(dx, dx2, B * n * d_model) <= 1e-13, "layer backward: saved lse == recomputed",
           max_abs_diff(dx, dx2, B * n * d_model), 1e-13);
    free(dx2);
    double *targets[4] = {head_mask, W_o, W_q, x}, *grads[4] = {ghm, gW_o, gW_q, NULL};
    size_t counts[4] = {4, E_q * d_model, d_model * E_q, B * n * d_model};
    double worst = 0;
    for (int t = 0; t < 4; t++)
        for (size_t i = 0; i < counts[t]; i += 1 + counts[t] / (fd_samples / 2)) {
            double saved = targets[t][i], lp = 0, lm = 0;
            targets[t][i] = saved + 1e-6;
            mha_layer_forward_f64(out, NULL, &no_lse, x, x, x, &p, &m, &opts);
            for (int64_t s = 0; s < B * n * d_model; s++) lp += out[s] * g[s];
            targets[t][i] = saved - 1e-6;
            mha_layer_forward_f64(out, NULL, &no_lse, x, x, x, &p, &m, &opts);
            for (int64_t s = 0; s < B * n * d_model; s++) lm += out[s] * g[s];
            targets[t][i] = saved;
            double fd = (lp - lm) / 2e-6;
            /* x feeds q, k and v: its gradient is the sum of the three */
            double analytic = grads[t] ? grads[t][i] : dx[i] + dx_k[i] + dx_v[i];
            worst = fmax(worst, fabs(fd - analytic) / fmax(1, fabs(fd)));
        }
    expect(worst <= 1e-6, "layer backward (head_mask, W_o, W_q, x) vs finite differences", worst, 1e-6);
    free(x), free(W_q), free(W_k), free(W_v), free(W_o), free(b_q), free(b_k), free(b_v), free(b_o);
    free(out), free(qp), free(kp), free(vp), free(attn), free(lse), free(Q), free(K), free(V), free(O), free(ref);
    free(g), free(dx), free(dx_k), free(dx_v), free(gW_q), free(gW_k), free(gW_v), free(gW_o);
    free(gb_q), free(gb_k), free(gb_v), free(gb_o);
}

/* The float32 softmax's exp, through the public forward: one query, d_k = 1, q = 1 and scale 1,
 * so the scores are the keys x_j = -100 j / (N - 1) (the row max is x_0 = 0). Each weight
 * e^x_j / sum is held to the float64 value with relative error 5e-7 + 7e-8 |x_j| (the exp's
 * 1.6e-7 and rounding t = x log2 e, plus the sum and the division) where it is a normal float;
 * below -87.7 it is 0 (a subnormal float between -87.68 and -87.34). Both paths: the weights
 * path gives the whole row at once; the fused path (no weights) gives weight j as the output
 * when v is the indicator of key j. */
static void test_exp_f32(void) {
    enum { N = 1000 };
    float q = 1, out, *k = malloc(N * sizeof *k), *v = malloc(N * sizeof *v), *w = malloc(N * sizeof *w);
    double sum = 0, worst[2] = {0, 0};
    int status = MHA_OK, zeros = 1;
    for (int j = 0; j < N; j++) {
        k[j] = (float)(-100.0 * j / (N - 1));
        sum += exp((double)k[j]);
    }
    mha_attention_desc d;
    mha_attention_desc_init(&d, 1, 1, 1, 1, N, 1, 1);
    d.scale = 1;
    for (int j = 0; j < N; j++) v[j] = 1;
    status |= mha_attention_forward_f32(&out, w, &q, k, v, &d);
    for (int fused = 0; fused < 2; fused++)
        /* fused: every key near either end, and every 38th in between */
        for (int j = 0; j < N; j += fused && j >= 20 && j < N - 58 ? 38 : 1) {
            if (fused) {
                for (int i = 0; i < N; i++) v[i] = i == j;
                status |= mha_attention_forward_f32(&out, NULL, &q, k, v, &d);
            }
            double x = k[j], want = exp(x) / sum, got = fused ? out : w[j];
            if (x < -87.7) zeros &= got == 0;
            else if (want >= 1e-36) /* a subnormal float weight has no relative accuracy */
                worst[fused] = fmax(worst[fused], fabs(got / want - 1) / (5e-7 + 7e-8 * fabs(x)));
        }
    expect(status == MHA_OK, "exp test status", 0, 0);
    expect(zeros, "float32 softmax weight exactly 0 below -87.7", 1, 0);
    expect(worst[0] <= 1, "float32 softmax weights within 5e-7 + 7e-8|x| of float64", worst[0], 1);
    expect(worst[1] <= 1, "float32 fused softmax within 5e-7 + 7e-8|x| of float64", worst[1], 1);
    free(k), free(v), free(w);
}

/* The soft-cap's tanh through the scores (q = 1, d_k = 1, scale = 1, c = 1: score j is
 * tanh(k_j)): float32 within 5e-7 of tanh relative to |tanh| (the vectorised rational fit,
 * its vector body and its tail), from 1e-30 to past the clamp, both signs, and +-inf giving
 * +-1 within that; float64 within 4e-16 relative (libm). */
static void test_softcap_tanh(void) {
    enum { N = 4003 };
    double *k = malloc(N * sizeof *k), *v = malloc(N * sizeof *v), *w = malloc(N * sizeof *w);
    double *s = malloc(N * sizeof *s), q = 1, out;
    float *kf = malloc(N * sizeof *kf), *vf = malloc(N * sizeof *vf), *wf = malloc(N * sizeof *wf);
    float *sf = malloc(N * sizeof *sf), qf = 1, outf;
    for (int j = 0; j < N - 3; j++) { /* a geometric half from 1e-30 to 12, then linear steps to 12 */
        double x = j % 2 ? pow(10, -30 + 31.08 * j / (N - 3)) : 12.0 * j / (N - 3);
        k[j] = (float)(j % 4 < 2 ? x : -x);
    }
    k[N - 3] = INFINITY, k[N - 2] = -INFINITY, k[N - 1] = 0;
    for (int j = 0; j < N; j++) kf[j] = (float)k[j], v[j] = vf[j] = 1;
    mha_attention_desc d;
    mha_attention_desc_init(&d, 1, 1, 1, 1, N, 1, 1);
    d.scale = 1;
    d.softcap = 1;
    d.scores = s;
    int err = mha_attention_forward_f64(&out, w, &q, k, v, &d);
    d.scores = sf;
    err |= mha_attention_forward_f32(&outf, wf, &qf, kf, vf, &d);
    double e32 = 0, e64 = 0;
    for (int j = 0; j < N; j++) {
        const double want = tanh(k[j]), den = fmax(fabs(want), 1e-300);
        e32 = fmax(e32, fabs(sf[j] - want) / den);
        e64 = fmax(e64, fabs(s[j] - want) / den);
    }
    expect(!err && e32 <= 5e-7, "float32 soft-cap tanh relative to |tanh|", e32, 5e-7);
    expect(!err && e64 <= 4e-16, "float64 soft-cap tanh relative to |tanh|", e64, 4e-16);
    free(k), free(v), free(w), free(s), free(kf), free(vf), free(wf), free(sf);
}

static void test_dropout_rng(void) {
    /* the uniform is in [0, 1) and about 1/2 on average; mha.reference holds the same values */
    double mean = 0, lo = 1, hi = 0;
    for (int j = 0; j < 10000; j++) {
        double u = mha_dropout_uniform(7, 1, 2, 3, (uint64_t)j);
        lo = fmin(lo, u), hi = fmax(hi, u);
        mean += u / 10000;
    }
    expect(lo >= 0 && hi < 1, "dropout uniform in [0, 1)", hi, 1);
    expect(fabs(mean - 0.5) < 0.01, "dropout uniform mean", fabs(mean - 0.5), 0.01);
}

/* NaN in the scores reaches every row that sees it, through both softmax paths, in the vector
 * body, the tail and the second key tile (keys 150 and 297 of 300 are NaN): a row seeing a NaN
 * gives NaN, also when every other key it sees is masked (its max is then -inf, yet the row is
 * not fully masked); a row seeing neither is exact, a fully masked row is 0. */
static void test_nan_scores(void) {
    enum { NQ = 5, NK = 300, D = 4 };
    const int64_t nan_keys[2] = {150, 297};
    double *q = random_array(NQ * D), *k = random_array(NK * D), *v = random_array(NK * D);
    for (int t = 0; t < 2; t++) k[nan_keys[t] * D + 1] = NAN;
    uint8_t *mask = malloc(NQ * NK);
    for (int64_t j = 0; j < NK; j++) {
        mask[0 * NK + j] = 1;                 /* sees both NaN keys among finite ones  */
        mask[1 * NK + j] = j == 150;          /* sees one NaN key, all else masked      */
        mask[2 * NK + j] = j <= 100;          /* sees no NaN                            */
        mask[3 * NK + j] = 0;                 /* fully masked                           */
        mask[4 * NK + j] = j == 297 || j < 3; /* a NaN in the second tile's tail        */
    }
    mha_attention_desc d;
    mha_attention_desc_init(&d, 1, 1, 1, NQ, NK, D, D);
    d.mask_kind = MHA_MASK_BOOL;
    d.mask = mask;
    d.mask_strides[2] = NK;
    d.mask_strides[3] = 1;
    double *ref = malloc(NQ * D * sizeof *ref), *out = malloc(NQ * D * sizeof *out), *w = malloc(NQ * NK * sizeof *w);
    float *qf = malloc(NQ * D * 4), *kf = malloc(NK * D * 4), *vf = malloc(NK * D * 4), *of = malloc(NQ * D * 4), *wf = malloc(NQ * NK * 4);
    for (int i = 0; i < NQ * D; i++) qf[i] = (float)q[i];
    for (int i = 0; i < NK * D; i++) kf[i] = (float)k[i], vf[i] = (float)v[i];
    naive_attention(ref, NULL, q, k, v, mask, &d); /* right for rows 2 and 3 only */
    for (int f32 = 0; f32 < 2; f32++)
        for (int weights = 0; weights < 2; weights++) {
            int status = f32 ? mha_attention_forward_f32(of, weights ? wf : NULL, qf, kf, vf, &d)
                             : mha_attention_forward_f64(out, weights ? w : NULL, q, k, v, &d);
            if (f32)
                for (int i = 0; i < NQ * D; i++) out[i] = of[i];
            int nan_rows = 1;
            double zero = 0;
            for (int c = 0; c < D; c++) {
                nan_rows &= isnan(out[0 * D + c]) && isnan(out[1 * D + c]) && isnan(out[4 * D + c]);
                zero = fmax(zero, fabs(out[3 * D + c]));
            }
            double err = 0;
            for (int c = 0; c < D; c++) err = fmax(err, fabs(out[2 * D + c] - ref[2 * D + c]));
            char what[120];
            const char *kind = f32 ? "float32" : "float64", *path = weights ? "weights" : "fused";
            snprintf(what, sizeof what, "NaN scores (%s, %s path): status", kind, path);
            expect(status == MHA_OK, what, status, 0);
            snprintf(what, sizeof what, "NaN scores (%s, %s path): rows seeing NaN are NaN", kind, path);
            expect(nan_rows, what, 1, 0);
            snprintf(what, sizeof what, "NaN scores (%s, %s path): fully masked row is 0", kind, path);
            expect(zero == 0, what, zero, 0);
            snprintf(what, sizeof what, "NaN scores (%s, %s path): row without NaN", kind, path);
            expect(err <= (f32 ? 1e-5 : 1e-12), what, err, f32 ? 1e-5 : 1e-12);
        }
    free(q), free(k), free(v), free(mask), free(ref), free(out), free(w);
    free(qf), free(kf), free(vf), free(of), free(wf);
}

/* ---- row statistics ------------------------------------------------------------------------ */

enum { N_STATS = 8 }; /* entropy, max, argmax, key set, self, prev, next, distance */
static const char *const STAT_NAMES[N_STATS] = {"entropy", "max", "argmax", "key_set_mass",
                                                "self", "prev", "next", "distance"};

/* The statistics of each row of materialised weights w (B, H, n_q, n_k), the plainest loops:
 * st (rows, N_STATS), the argmax as a double; a = i + n_k - n_q. key_set (B, n_k) with row
 * stride ks_stride. A row of zeros (fully masked) gives 0 and argmax -1. */
static void naive_row_stats(double *st, const double *w, const uint8_t *key_set, int64_t ks_stride,
                            const mha_attention_desc *d) {
    for (int64_t b = 0; b < d->batch; b++)
        for (int64_t h = 0; h < d->heads; h++)
            for (int64_t i = 0; i < d->n_q; i++) {
                const int64_t row = (b * d->heads + h) * d->n_q + i, a = i + d->n_k - d->n_q;
                const double *p = w + row * d->n_k;
                double *o = st + row * N_STATS, total = 0;
                memset(o, 0, N_STATS * sizeof *o);
                o[2] = -1;
                for (int64_t j = 0; j < d->n_k; j++) {
                    total += p[j];
                    if (p[j] > 0) o[0] -= p[j] * log(p[j]);
                    if (p[j] > o[1]) o[1] = p[j], o[2] = (double)j;
                    if (key_set[b * ks_stride + j]) o[3] += p[j];
                    o[4] += j == a ? p[j] : 0;
                    o[5] += j == a - 1 ? p[j] : 0;
                    o[6] += j == a + 1 ? p[j] : 0;
                    o[7] += p[j] * fabs((double)(a - j));
                }
                if (total == 0) o[2] = -1;
            }
}

typedef struct {
    int64_t B, H, H_kv, n_q, n_k, d;
    int causal, use_mask, padding, shared_set; /* shared_set: one key set for every batch */
    double dropout;
} stats_case;

/* The core's row statistics against naive_row_stats of the naive twin's weights, float64
 * and float32, on the weights path and the fused path, every statistic asked but one
 * (leaving a field NULL writes nothing there). Tolerances, absolute: 1e-12 (float64) and
 * 1e-6 (float32) on the probabilities (max, key-set mass, self, prev, next); the entropy
 * relative to its scale log(n_k), the distance to its scale n_k (float32: 3e-6). The argmax must name a key
 * whose weight is the row's max within that tolerance (a near tie may go either way). */
static void test_row_stats_case(stats_case c) {
    mha_attention_desc d;
    mha_attention_desc_init(&d, c.B, c.H, c.H_kv, c.n_q, c.n_k, c.d, c.d);
    d.causal = c.causal;
    d.dropout = c.dropout;
    d.seed = 99;
    const size_t nq = c.B * c.H * c.n_q * c.d, nk = c.B * c.H_kv * c.n_k * c.d, nw = c.B * c.H * c.n_q * c.n_k;
    const size_t rows = c.B * c.H * c.n_q;
    double *q = random_array(nq), *k = random_array(nk), *v = random_array(nk);
    for (size_t i = 0; i < nq; i++) q[i] = (float)q[i]; /* float32 sees the same numbers */
    for (size_t i = 0; i < nk; i++) k[i] = (float)k[i], v[i] = (float)v[i];
    uint8_t *mask = malloc(nw + 1), *padding = malloc(c.B * c.n_k + 1), *key_set = malloc(c.B * c.n_k + 1);
    uint8_t *naive_mask = malloc(nw + 1);
    for (size_t i = 0; i < nw; i++) mask[i] = !c.use_mask || randn() > -0.8;
    if (c.use_mask && c.n_q > 0)
        for (int64_t j = 0; j < c.n_k; j++) mask[j] = 0; /* row 0 of head 0: fully masked */
    for (int64_t i = 0; i < c.B * c.n_k; i++) padding[i] = !c.padding || i % c.n_k < c.n_k - 1 - (i / c.n_k) * 3;
    for (int64_t i = 0; i < c.B * c.n_k; i++) key_set[i] = i % c.n_k == 0 || randn() > 1;
    for (size_t i = 0; i < nw; i++) naive_mask[i] = mask[i] && padding[i / (c.n_q * c.H) / c.n_k * c.n_k + i % c.n_k];
    if (c.use_mask) {
        d.mask_kind = MHA_MASK_BOOL;
        d.mask = mask;
        d.mask_strides[0] = c.H * c.n_q * c.n_k;
        d.mask_strides[1] = c.n_q * c.n_k;
        d.mask_strides[2] = c.n_k;
        d.mask_strides[3] = 1;
    }
    if (c.padding) d.key_padding = padding, d.key_padding_stride = c.n_k;
    const int64_t ks_stride = c.shared_set ? 0 : c.n_k;
    double *w = malloc((nw + 1) * 8), *out = malloc((c.B * c.H * c.n_q * c.d + 1) * 8);
    double *want = malloc((rows * N_STATS + 1) * 8);
    naive_attention(out, w, q, k, v, naive_mask, &d);
    naive_row_stats(want, w, key_set, ks_stride, &d);

    double *got64[N_STATS], *wf64 = malloc((nw + 1) * 8), *of64 = malloc((c.B * c.H * c.n_q * c.d + 1) * 8);
    float *got32[N_STATS], *qf = malloc((nq + 1) * 4), *kf = malloc((nk + 1) * 4), *vf = malloc((nk + 1) * 4);
    float *wf32 = malloc((nw + 1) * 4), *of32 = malloc((c.B * c.H * c.n_q * c.d + 1) * 4);
    int64_t *argmax = malloc((rows + 1) * 8);
    for (int s = 0; s < N_STATS; s++) got64[s] = malloc((rows + 1) * 8), got32[s] = malloc((rows + 1) * 4);
    for (size_t i = 0; i < nq; i++) qf[i] = (float)q[i];
    for (size_t i = 0; i < nk; i++) kf[i] = (float)k[i], vf[i] = (float)v[i];
    const int skip = (int)((c.n_q + c.n_k) % N_STATS); /* the statistic not asked */
    const double scale_of[N_STATS] = {fmax(1, log((double)c.n_k)), 1, 1, 1, 1, 1, 1, fmax(1, (double)c.n_k)};
    for (int f32 = 0; f32 < 2; f32++)
        for (int fused = 0; fused < 2; fused++) {
            const double sentinel = -12345;
            for (int s = 0; s < N_STATS; s++)
                for (size_t r = 0; r < rows; r++) got64[s][r] = sentinel, got32[s][r] = (float)sentinel;
            for (size_t r = 0; r < rows; r++) argmax[r] = -12345;
#define STAT(T, i) (skip == (i) ? NULL : T[i])
            mha_row_stats_f64 s64 = {STAT(got64, 0), STAT(got64, 1), skip == 2 ? NULL : argmax, STAT(got64, 3),
                                     STAT(got64, 4), STAT(got64, 5), STAT(got64, 6), STAT(got64, 7), key_set, ks_stride};
            mha_row_stats_f32 s32 = {STAT(got32, 0), STAT(got32, 1), skip == 2 ? NULL : argmax, STAT(got32, 3),
                                     STAT(got32, 4), STAT(got32, 5), STAT(got32, 6), STAT(got32, 7), key_set, ks_stride};
#undef STAT
            int status = f32 ? mha_attention_forward_stats_f32(of32, fused ? NULL : wf32, NULL, &s32, qf, kf, vf, &d)
                             : mha_attention_forward_stats_f64(of64, fused ? NULL : wf64, NULL, &s64, q, k, v, &d);
            const double tol = f32 ? 1e-6 : 1e-12;
            double err[N_STATS] = {0};
            int untouched = 1; /* the statistic not asked keeps its sentinel */
            for (size_t r = 0; r < rows; r++) {
                const double *ref = want + r * N_STATS;
                for (int s = 0; s < N_STATS; s++) {
                    double g = s == 2 ? (double)argmax[r] : f32 ? (double)got32[s][r] : got64[s][r];
                    if (s == skip) {
                        untouched &= g == sentinel;
                        continue;
                    }
                    double e = fabs(g - ref[s]) / scale_of[s];
                    if (s == 2) { /* the argmax: a key of the row's max weight, -1 for a dead row */
                        const int64_t j = argmax[r];
                        e = ref[2] < 0 ? (j == -1 ? 0 : 1)
                            : j < 0 || j >= c.n_k ? 1 : ref[1] - w[r * c.n_k + j];
                    }
                    if (!(e <= err[s])) err[s] = e; /* keeps a NaN */
                }
            }
            char what[200];
            const char *kind = f32 ? "float32" : "float64", *path = fused ? "fused" : "weights";
            snprintf(what, sizeof what, "row stats %s %s path B=%lld H=%lld/%lld n_q=%lld n_k=%lld causal=%d mask=%d padding=%d: status",
                     kind, path, (long long)c.B, (long long)c.H, (long long)c.H_kv, (long long)c.n_q,
                     (long long)c.n_k, c.causal, c.use_mask, c.padding);
            expect(status == MHA_OK, what, status, 0);
            for (int s = 0; s < N_STATS; s++) {
                if (s == skip) continue;
                char *tail = strstr(what, ": ") + 2;
                snprintf(tail, sizeof what - (size_t)(tail - what), "%s", STAT_NAMES[s]);
                /* float32's distance is a product over all n_k keys, summed in one slice of the
                 * GEMM up to 4096 keys: 1.1e-6 measured at n_k = 1030 (portable build) */
                const double tol_s = f32 && s == 7 ? 3e-6 : tol;
                expect(err[s] <= tol_s, what, err[s], tol_s);
            }
            snprintf(strstr(what, ": ") + 2, 60, "%s not asked, not written", STAT_NAMES[skip]);
            expect(untouched, what, 1, 0);
        }
    for (int s = 0; s < N_STATS; s++) free(got64[s]), free(got32[s]);
    free(q), free(k), free(v), free(mask), free(padding), free(key_set), free(naive_mask), free(w), free(out);
    free(want), free(wf64), free(of64), free(qf), free(kf), free(vf), free(wf32), free(of32), free(argmax);
}

/* The output is bitwise the same with and without statistics (both paths), and a key-set
 * mass asked without a key set is refused. */
static void test_row_stats_output(void) {
    enum { NQ = 100, NK = 300, D = 8 };
    float *q = malloc(NQ * D * 4), *k = malloc(NK * D * 4), *v = malloc(NK * D * 4);
    float *o1 = malloc(NQ * D * 4), *o2 = malloc(NQ * D * 4), *w = malloc(NQ * NK * 4), ent[NQ];
    for (int i = 0; i < NQ * D; i++) q[i] = (float)randn();
    for (int i = 0; i < NK * D; i++) k[i] = (float)randn(), v[i] = (float)randn();
    mha_attention_desc d;
    mha_attention_desc_init(&d, 1, 1, 1, NQ, NK, D, D);
    d.causal = 1;
    mha_row_stats_f32 st = {.entropy = ent};
    for (int fused = 0; fused < 2; fused++) {
        int status = mha_attention_forward_f32(o1, fused ? NULL : w, q, k, v, &d);
        status |= mha_attention_forward_stats_f32(o2, fused ? NULL : w, NULL, &st, q, k, v, &d);
        expect(status == MHA_OK && memcmp(o1, o2, sizeof(float) * NQ * D) == 0,
               fused ? "row stats leave the fused output bitwise unchanged"
                     : "row stats leave the weights path's output bitwise unchanged", 1, 0);
    }
    mha_row_stats_f32 no_set = {.key_set_mass = ent};
    expect(mha_attention_forward_stats_f32(o2, NULL, NULL, &no_set, q, k, v, &d) == MHA_EINVAL,
           "key_set_mass without a key_set: MHA_EINVAL", 0, 0);
    free(q), free(k), free(v), free(o1), free(o2), free(w);
}

/* ---- attention flow --------------------------------------------------------------------- */

/* Edmonds-Karp on a dense capacity matrix (V x V, modified): the plainest maximum flow. */
static double naive_max_flow(double *cap, int V, int s, int t) {
    double total = 0;
    int *parent = malloc(V * sizeof *parent), *queue = malloc(V * sizeof *queue);
    for (;;) {
        for (int v = 0; v < V; v++) parent[v] = -1;
        parent[s] = s;
        int head = 0, tail = 0;
        queue[tail++] = s;
        while (head < tail && parent[t] < 0) {
            int u = queue[head++];
            for (int v = 0; v < V; v++)
                if (parent[v] < 0 && cap[u * V + v] > 1e-15) parent[v] = u, queue[tail++] = v;
        }
        if (parent[t] < 0) break;
        double push = INFINITY;
        for (int v = t; v != s; v = parent[v]) push = fmin(push, cap[parent[v] * V + v]);
        for (int v = t; v != s; v = parent[v]) cap[parent[v] * V + v] -= push, cap[v * V + parent[v]] += push;
        total += push;
    }
    free(parent), free(queue);
    return total;
}

static void test_attention_flow(void) {
    /* layers, tokens, kind: 0 softmax rows with the residual, 1 sparse rows (not normalised) */
    const int cases[][3] = {{1, 4, 0}, {2, 5, 0}, {3, 6, 0}, {4, 7, 1}, {5, 4, 0}, {3, 9, 1}, {2, 1, 0}, {6, 8, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int L = cases[c][0], n = cases[c][1], V = (L + 1) * n;
        double *w = malloc((size_t)L * n * n * sizeof *w), *out = malloc((size_t)n * n * sizeof *out);
        double *cap = malloc((size_t)V * V * sizeof *cap);
        for (int r = 0; r < L * n; r++) {
            double sum = 0;
            for (int b = 0; b < n; b++) sum += w[r * n + b] = exp(2 * randn());
            for (int b = 0; b < n; b++) {
                double x = w[r * n + b] / sum;
                w[r * n + b] = cases[c][2] ? (randn() > 0 ? x : 0) : 0.5 * x + (b == r % n ? 0.5 : 0);
            }
        }
        int err = mha_attention_flow_f64(out, w, L, n, NULL, 0);
        double worst = err ? INFINITY : 0;
        for (int i = 0; i < n && !err; i++)
            for (int j = 0; j < n; j++) {
                /* node (l, a) is l * n + a; edge (l + 1, a) -> (l, b) */
                memset(cap, 0, (size_t)V * V * sizeof *cap);
                for (int l = 0; l < L; l++)
                    for (int a = 0; a < n; a++)
                        for (int b = 0; b < n; b++) cap[((l + 1) * n + a) * V + l * n + b] = w[(l * n + a) * n + b];
                worst = fmax(worst, fabs(out[i * n + j] - naive_max_flow(cap, V, L * n + i, j)));
            }
        char what[64];
        snprintf(what, sizeof what, "attention flow L=%d n=%d", L, n);
        expect(worst <= 1e-12, what, worst, 1e-12);
        /* a subset of sources, in any order: the same rows */
        int64_t sources[2] = {n - 1, 0};
        double *some = malloc(2 * (size_t)n * sizeof *some);
        err = mha_attention_flow_f64(some, w, L, n, sources, 2);
        double diff = err ? INFINITY : 0;
        for (int j = 0; j < n && !err; j++)
            diff = fmax(diff, fmax(fabs(some[j] - out[(n - 1) * n + j]), fabs(some[n + j] - out[j])));
        expect(diff == 0, "attention flow from chosen sources", diff, 0);
        free(some);
        free(w), free(out), free(cap);
    }
    double bad[4] = {0.5, -0.1, 0.3, 0.2}, out[4];
    expect(mha_attention_flow_f64(out, bad, 1, 2, NULL, 0) == MHA_EINVAL, "attention flow rejects a negative weight", 1, 0);
    bad[1] = NAN;
    expect(mha_attention_flow_f64(out, bad, 1, 2, NULL, 0) == MHA_EINVAL, "attention flow rejects NaN", 1, 0);
    bad[1] = 0.1;
    int64_t outside = 2;
    expect(mha_attention_flow_f64(out, bad, 1, 2, &outside, 1) == MHA_EINVAL, "attention flow rejects a source out of range", 1, 0);
}

/* `test_core --paths` prints the SIMD paths this build runs here (the Makefile runs the tests
 * once per path, with MHA_SIMD set); a run with MHA_SIMD set fails unless that path is used.
 * `test_core --quick` samples fewer finite differences (fd_samples). */
/* ---- the rest of the block (block_impl.h) ------------------------------------------------- */

/* Naive twins in double: the activations by their definitions (libm). */
static double act_naive(int act, double x) {
    switch (act) {
    case MHA_ACT_GELU: return 0.5 * x * (1 + erf(x / sqrt(2.0)));
    case MHA_ACT_GELU_TANH: return 0.5 * x * (1 + tanh(sqrt(2 / 3.141592653589793) * (x + 0.044715 * x * x * x)));
    case MHA_ACT_SILU: return x / (1 + exp(-x));
    case MHA_ACT_QUICK_GELU: return x / (1 + exp(-1.702 * x));
    case MHA_ACT_RELU: return x < 0 ? 0 : x;
    default: return x;
    }
}

/* mha_linear: every activation, plain and gated, float and double, against
 * act(A @ B + bias) in double; M spans the small path, one block and several blocks */
static void test_linear(void) {
    char what[96];
    const int64_t Ms[] = {2, 37, 300}, K = 70, N = 45;
    for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++)
        for (int act = MHA_ACT_NONE; act <= MHA_ACT_RELU; act++)
            for (int gated = 0; gated <= 1; gated++) {
                const int64_t M = Ms[mi], NB = gated ? 2 * N : N;
                const int code = act | (gated ? MHA_ACT_GATED : 0);
                double *A = random_array((size_t)(M * K)), *B = random_array((size_t)(K * NB));
                double *bias = random_array((size_t)NB), *want = malloc(sizeof(double) * (size_t)(M * N));
                double *C = malloc(sizeof(double) * (size_t)(M * N));
                float *Af = malloc(sizeof(float) * (size_t)(M * K)), *Bf = malloc(sizeof(float) * (size_t)(K * NB));
                float *biasf = malloc(sizeof(float) * (size_t)NB), *Cf = malloc(sizeof(float) * (size_t)(M * N));
                for (int64_t i = 0; i < M * K; i++) Af[i] = (float)A[i];
                for (int64_t i = 0; i < K * NB; i++) Bf[i] = (float)(B[i] /= sqrt((double)K));
                for (int64_t i = 0; i < NB; i++) biasf[i] = (float)bias[i];
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) {
                        double g = bias[j], u = gated ? bias[N + j] : 0;
                        for (int64_t p = 0; p < K; p++) {
                            g += (double)Af[i * K + p] * (double)Bf[p * NB + j];
                            if (gated) u += (double)Af[i * K + p] * (double)Bf[p * NB + N + j];
                        }
                        want[i * N + j] = gated ? act_naive(act, g) * u : act_naive(act, g);
                    }
                double scale = 1;
                for (int64_t i = 0; i < M * N; i++) scale = MHA_MAX(scale, fabs(want[i]));
                for (int64_t i = 0; i < M * K; i++) A[i] = Af[i];
                for (int64_t i = 0; i < K * NB; i++) B[i] = Bf[i];
                int err = mha_linear_f64(M, N, K, A, K, B, NB, 0, bias, code, 0, C, N);
                snprintf(what, sizeof what, "linear f64 M=%lld act=%d gated=%d", (long long)M, act, gated);
                double e = err ? INFINITY : max_abs_diff(C, want, (size_t)(M * N)) / scale;
                expect(e <= 1e-12, what, e, 1e-12);
                err = mha_linear_f32(M, N, K, Af, K, Bf, NB, 0, biasf, code, 0, Cf, N);
                for (int64_t i = 0; i < M * N; i++) C[i] = Cf[i];
                snprintf(what, sizeof what, "linear f32 M=%lld act=%d gated=%d", (long long)M, act, gated);
                e = err ? INFINITY : max_abs_diff(C, want, (size_t)(M * N)) / scale;
                expect(e <= 2e-5, what, e, 2e-5);
                free(A), free(B), free(bias), free(want), free(C), free(Af), free(Bf), free(biasf), free(Cf);
            }
}

/* weights packed once (mha_pack_weight): mha_linear_packed bitwise equal to mha_linear
 * (to rounding where mha_linear runs a small product unpacked), for B as it is and
 * transposed, plain, gated and residual, one row to several blocks, a shared axis in one
 * slice and in slices (K = 4100: longer than the GEMM's one-slice limit of 4096) */
static void test_linear_packed(void) {
    char what[96];
    const int64_t Ms[] = {1, 3, 37, 300}, Ks[] = {70, 4100}, N = 45;
    int64_t width = 0;
    mha_pack_width_f32(&width);
    expect(width > 0 && width % 4 == 0, "pack width f32 a multiple of 4", (double)width, 0);
    for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++)
        for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++)
            for (int mode = 0; mode < 4; mode++) { /* B, B transposed, gated, residual */
                const int64_t M = Ms[mi], K = Ks[ki], NB = mode == 2 ? 2 * N : N;
                const int tb = mode == 1, act = mode == 2 ? (MHA_ACT_SILU | MHA_ACT_GATED) : 0;
                const float beta = mode == 3 ? 1.0f : 0.0f;
                const int64_t panels = (NB + width - 1) / width;
                float *A = malloc(sizeof(float) * (size_t)(M * K)), *B = malloc(sizeof(float) * (size_t)(K * NB));
                float *bias = malloc(sizeof(float) * (size_t)NB);
                float *Bp = malloc(sizeof(float) * (size_t)(K * width * panels));
                float *want = malloc(sizeof(float) * (size_t)(M * N)), *C = malloc(sizeof(float) * (size_t)(M * N));
                for (int64_t i = 0; i < M * K; i++) A[i] = (float)randn();
                for (int64_t i = 0; i < K * NB; i++) B[i] = (float)(randn() / sqrt((double)K));
                for (int64_t i = 0; i < NB; i++) bias[i] = (float)randn();
                for (int64_t i = 0; i < M * N; i++) want[i] = C[i] = (float)randn();
                const int64_t ldb = tb ? K : NB;
                int err = mha_pack_weight_f32(Bp, B, ldb, tb, K, NB);
                err |= mha_linear_f32(M, N, K, A, K, B, ldb, tb, bias, act, beta, want, N);
                err |= mha_linear_packed_f32(M, N, K, A, K, Bp, bias, act, beta, C, N);
                size_t differ = 0; /* not bitwise equal, or (small products) beyond rounding */
                const int small = M * NB * K <= 16384; /* mha_linear's unpacked loops: other order */
                for (int64_t i = 0; i < M * N; i++)
                    differ += small ? fabsf(C[i] - want[i]) > 1e-5f * (1 + fabsf(want[i]))
                                    : memcmp(C + i, want + i, sizeof(float)) != 0;
                snprintf(what, sizeof what, "linear packed f32 M=%lld K=%lld mode=%d (elements differing)",
                         (long long)M, (long long)K, mode);
                expect(!err && differ == 0, what, (double)differ, 0);
                free(A), free(B), free(bias), free(Bp), free(want), free(C);
            }
    /* double, one case (M * Nd * K above 16384: mha_linear packs too, so bitwise equal) */
    const int64_t M = 40, K = 33, Nd = 19;
    mha_pack_width_f64(&width);
    const int64_t panels = (Nd + width - 1) / width;
    double *A = random_array((size_t)(M * K)), *B = random_array((size_t)(K * Nd));
    double *Bp = malloc(sizeof(double) * (size_t)(K * width * panels));
    double *want = malloc(sizeof(double) * (size_t)(M * Nd)), *C = malloc(sizeof(double) * (size_t)(M * Nd));
    int err = mha_pack_weight_f64(Bp, B, Nd, 0, K, Nd);
    err |= mha_linear_f64(M, Nd, K, A, K, B, Nd, 0, NULL, MHA_ACT_GELU, 0, want, Nd);
    err |= mha_linear_packed_f64(M, Nd, K, A, K, Bp, NULL, MHA_ACT_GELU, 0, C, Nd);
    double e = err ? INFINITY : max_abs_diff(C, want, (size_t)(M * Nd));
    expect(e == 0, "linear packed f64, GELU", e, 0);
    expect(mha_pack_weight_f64(Bp, B, Nd, 0, -1, Nd) == MHA_EINVAL, "pack_weight: negative K refused", 0, 0);
    free(A), free(B), free(Bp), free(want), free(C);
}

/* mha_pack_weight_transposed: op(B)^T's packing made from op(B)'s alone, bitwise what
 * mha_pack_weight makes of op(B)^T, for shapes with ragged panels on either axis (float and
 * double); a negative size refused. */
static void test_pack_weight_transposed(void) {
    char what[96];
    const int64_t shapes[][2] = {{1, 1}, {5, 7}, {64, 64}, {65, 130}, {100, 33}, {3, 200}, {768, 300}};
    for (int dbl = 0; dbl < 2; dbl++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const int64_t K = shapes[si][0], N = shapes[si][1];
            int64_t W = 0;
            if (dbl) mha_pack_width_f64(&W);
            else mha_pack_width_f32(&W);
            const size_t size = dbl ? sizeof(double) : sizeof(float);
            const size_t src_n = (size_t)(K * N), p_n = (size_t)(K * W * ((N + W - 1) / W)),
                         t_n = (size_t)(N * W * ((K + W - 1) / W));
            double *B = random_array(src_n);
            void *Bs = malloc(size * src_n), *P = malloc(size * p_n), *T = malloc(size * t_n),
                 *want = malloc(size * t_n);
            int err;
            memset(T, 0xff, size * t_n); /* NaNs: every element must be written */
            if (dbl) {
                memcpy(Bs, B, size * src_n);
                err = mha_pack_weight_f64(P, Bs, N, 0, K, N) | mha_pack_weight_f64(want, Bs, N, 1, N, K) |
                      mha_pack_weight_transposed_f64(T, P, K, N);
            } else {
                for (size_t i = 0; i < src_n; i++) ((float *)Bs)[i] = (float)B[i];
                err = mha_pack_weight_f32(P, Bs, N, 0, K, N) | mha_pack_weight_f32(want, Bs, N, 1, N, K) |
                      mha_pack_weight_transposed_f32(T, P, K, N);
            }
            snprintf(what, sizeof what, "pack_weight_transposed %s K=%lld N=%lld bitwise",
                     dbl ? "f64" : "f32", (long long)K, (long long)N);
            expect(!err && memcmp(T, want, size * t_n) == 0, what, (double)err, 0);
            free(B), free(Bs), free(P), free(T), free(want);
        }
    float one = 0;
    expect(mha_pack_weight_transposed_f32(&one, &one, -1, 1) == MHA_EINVAL, "pack_weight_transposed: negative K refused", 0, 0);
}

/* ---- narrow packed weights (mha.h: mha_weight_format) -------------------------------------- */

/* The scalar conversions (narrow.h): every finite half round-trips through float; float ->
 * half and float -> bfloat16 round to nearest even (ties, subnormals, overflow). */
static void test_narrow_conversions(void) {
    size_t bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu)) continue; /* NaNs */
        bad += mha_float_to_half(mha_half_to_float((uint16_t)h)) != h;
        bad += mha_float_to_bf16(mha_bf16_to_float((uint16_t)h)) != h && !((h & 0x7F80u) == 0x7F80u && (h & 0x7Fu));
    }
    expect(bad == 0, "half and bfloat16 round trips (mismatches)", (double)bad, 0);
    const struct { float x; uint16_t half, bf16; } cases[] = {
        {1.0f, 0x3C00, 0x3F80}, {-2.0f, 0xC000, 0xC000}, {65504.0f, 0x7BFF, 0x4780},
        {65519.99f, 0x7BFF, 0x4780}, {65520.0f, 0x7C00, 0x4780}, {0x1.0p-24f, 0x0001, 0x3380},
        {0x1.0p-25f, 0x0000, 0x3300}, {0x1.8p-25f, 0x0001, 0x3340}, {0x1.8p-24f, 0x0002, 0x33C0},
        {1.0f + 0x1.0p-11f, 0x3C00, 0x3F80}, {1.0f + 0x1.8p-10f, 0x3C02, 0x3F80}, /* ties: even */
        {1.0f + 0x1.8p-11f, 0x3C01, 0x3F80}, {1.0f + 0x1.0p-8f, 0x3C04, 0x3F80},
        {1.0f + 0x1.0p-8f + 0x1.0p-9f, 0x3C06, 0x3F81}, {1.0f + 0x1.8p-7f, 0x3C0C, 0x3F82},
        {1.0f + 0x1.0p-7f, 0x3C08, 0x3F81}, {1.0f + 0x1.0p-8f + 0x1.0p-20f, 0x3C04, 0x3F81},
    };
    bad = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bad += mha_float_to_half(cases[i].x) != cases[i].half;
        bad += mha_float_to_bf16(cases[i].x) != cases[i].bf16;
    }
    expect(bad == 0, "half and bfloat16 rounding cases (mismatches)", (double)bad, 0);
    expect(mha_float_to_bf16(NAN) == 0x7FC0, "bfloat16 of NaN is 0x7FC0", 0, 0);
}

/* op(B) (K, NB) as the packing holds it, decoded from mha.h's layout in plain loops. */
static void decode_packed(float *W, int fmt, const unsigned char *packed, int64_t K, int64_t NB,
                          int64_t width) {
    const size_t ps = fmt != MHA_WEIGHTS_Q8_0 ? (size_t)(K * width * 2)
                                              : (size_t)((K + 31) / 32 * 34 * width);
    for (int64_t j = 0; j < NB; j++) {
        const unsigned char *panel = packed + (size_t)(j / width) * ps;
        const int64_t c = j % width;
        for (int64_t p = 0; p < K; p++) {
            uint16_t h;
            if (fmt != MHA_WEIGHTS_Q8_0) {
                memcpy(&h, panel + 2 * (size_t)(p * width + c), 2);
                W[p * NB + j] = fmt == MHA_WEIGHTS_BF16 ? mha_bf16_to_float(h) : mha_half_to_float(h);
            } else {
                const unsigned char *blk = panel + (size_t)(p / 32 * 34 * width);
                memcpy(&h, blk + 2 * c, 2);
                W[p * NB + j] = mha_half_to_float(h) * (float)(int8_t)blk[2 * width + (p % 32) * width + c];
            }
        }
    }
}

static const char *format_name(int fmt) {
    return fmt == MHA_WEIGHTS_BF16 ? "bf16" : fmt == MHA_WEIGHTS_F16 ? "f16" : "q8_0";
}

/* mha_linear_packed_fmt: bfloat16, half and Q8_0 packings of op(B) as it is and transposed, plain,
 * gated, residual, with bias; M = 1 (decode) to several blocks; K not a multiple of 32, one
 * slice and several (K = 4100, with fewer row counts: 1, 17 and 70 rows cover the micro-kernel
 * widening in registers and the buffer on both SIMD widths). Each product bitwise equal to mha_linear_packed on the weights
 * decoded from the packing, and within float rounding of a double loop on them; the packing
 * itself: bfloat16 the rounding of B (and raw bits kept), Q8_0 within d / 2 of B, every
 * block's d = half(max |x| / 127), its padding zero. */
static void test_linear_packed_narrow(void) {
    char what[128];
    const int64_t Ms[] = {1, 2, 4, 7, 16, 17, 300}, Ms_long[] = {1, 17, 70}, Ks[] = {70, 64, 4100}, N = 45;
    int64_t width = 0;
    mha_pack_width_f32(&width);
    for (int fmt = MHA_WEIGHTS_BF16; fmt <= MHA_WEIGHTS_F16; fmt++)
        for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++)
            for (int mode = 0; mode < 4; mode++) { /* B, B transposed, gated, residual */
                const int64_t K = Ks[ki], NB = mode == 2 ? 2 * N : N;
                const int tb = mode == 1, act = mode == 2 ? (MHA_ACT_SILU | MHA_ACT_GATED) : 0;
                const int64_t ldb = tb ? K : NB, panels = (NB + width - 1) / width;
                float *B = malloc(sizeof(float) * (size_t)(K * NB)), *bias = malloc(sizeof(float) * (size_t)NB);
                float *W = malloc(sizeof(float) * (size_t)(K * NB));
                float *Wp = malloc(sizeof(float) * (size_t)(K * width * panels));
                for (int64_t i = 0; i < K * NB; i++) B[i] = (float)(randn() / sqrt((double)K));
                if (fmt == MHA_WEIGHTS_Q8_0) B[3] = 0; /* a zero, and a column of zeros */
                for (int64_t p = 0; p < K; p++) B[tb ? 5 * ldb + p : p * ldb + 5] = 0;
                for (int64_t i = 0; i < NB; i++) bias[i] = (float)randn();
                size_t bytes = 0;
                int err = mha_packed_bytes_f32(fmt, K, NB, &bytes);
                unsigned char *packed = malloc(bytes), *again = malloc(bytes);
                err |= mha_pack_weight_fmt_f32(packed, fmt, B, ldb, tb, K, NB);
                decode_packed(W, fmt, packed, K, NB, width);
                /* the packing against B */
                size_t bad = 0;
                for (int64_t p = 0; p < K; p++)
                    for (int64_t j = 0; j < NB; j++) {
                        const float b = B[tb ? j * ldb + p : p * ldb + j], w = W[p * NB + j];
                        if (fmt == MHA_WEIGHTS_BF16) {
                            bad += w != mha_bf16_to_float(mha_float_to_bf16(b));
                            bad += fabsf(w - b) > fabsf(b) * 0x1.0p-8f;
                        } else if (fmt == MHA_WEIGHTS_F16) {
                            bad += w != mha_half_to_float(mha_float_to_half(b));
                            bad += fabsf(w - b) > fabsf(b) * 0x1.0p-11f + 0x1.0p-25f;
                        } else {
                            float amax = 0;
                            for (int64_t r = p / 32 * 32; r < MHA_MIN(K, p / 32 * 32 + 32); r++)
                                amax = fmaxf(amax, fabsf(B[tb ? j * ldb + r : r * ldb + j]));
                            /* ggml: q = roundf(x * (1 / d)) with d = amax / 127 in float, stored
                             * as half(d) (so |w - b| <= d / 2 + 127 |half(d) - d|) */
                            const float d = amax / 127, q = roundf(b * (d != 0 ? 1.0f / d : 0.0f));
                            bad += w != mha_half_to_float(mha_float_to_half(d)) * q;
                            bad += fabsf(w - b) > (0.5f + 127 * 0x1.0p-11f) * d * (1 + 1e-3f);
                        }
                    }
                const size_t ps = fmt != MHA_WEIGHTS_Q8_0 ? (size_t)(K * width * 2) : (size_t)((K + 31) / 32 * 34 * width);
                if (fmt == MHA_WEIGHTS_Q8_0 && K % 32) /* the last block's padded rows */
                    for (int64_t pn = 0; pn < panels; pn++)
                        for (int64_t r = K % 32; r < 32; r++)
                            for (int64_t c = 0; c < width; c++)
                                bad += packed[(size_t)pn * ps + (size_t)(K / 32 * 34 * width) + (size_t)(2 * width + r * width + c)] != 0;
                snprintf(what, sizeof what, "pack %s K=%lld mode=%d (values off)", format_name(fmt), (long long)K, mode);
                expect(!err && bad == 0 && bytes == ps * (size_t)panels, what, (double)bad, 0);
                /* raw bits / ggml blocks give the same bytes */
                if (fmt != MHA_WEIGHTS_Q8_0) {
                    uint16_t *bits = malloc(sizeof(uint16_t) * (size_t)(K * NB));
                    for (int64_t i = 0; i < K * NB; i++)
                        bits[i] = fmt == MHA_WEIGHTS_BF16 ? mha_float_to_bf16(B[i]) : mha_float_to_half(B[i]);
                    memset(again, 0xAB, bytes);
                    err = fmt == MHA_WEIGHTS_BF16 ? mha_pack_weight_bf16_bits_f32(again, bits, ldb, tb, K, NB)
                                                  : mha_pack_weight_f16_bits_f32(again, bits, ldb, tb, K, NB);
                    free(bits);
                } else {
                    const int64_t nblk = (K + 31) / 32;
                    unsigned char *blocks = calloc((size_t)(NB * nblk * 34), 1);
                    for (int64_t j = 0; j < NB; j++)
                        for (int64_t b = 0; b < nblk; b++) { /* ggml's block_q8_0: d, then qs[32] */
                            const unsigned char *src = packed + (size_t)(j / width) * ps + (size_t)(b * 34 * width);
                            unsigned char *dst = blocks + (size_t)((j * nblk + b) * 34);
                            memcpy(dst, src + 2 * (j % width), 2);
                            for (int r = 0; r < 32; r++) dst[2 + r] = src[2 * width + r * width + j % width];
                        }
                    memset(again, 0xAB, bytes);
                    err = mha_pack_weight_q8_0_blocks_f32(again, blocks, K, NB);
                    free(blocks);
                }
                snprintf(what, sizeof what, "pack %s from %s K=%lld mode=%d: same bytes", format_name(fmt),
                         fmt != MHA_WEIGHTS_Q8_0 ? "raw bits" : "ggml blocks", (long long)K, mode);
                expect(!err && memcmp(again, packed, bytes) == 0, what, 1, 0);
                err = mha_pack_weight_f32(Wp, W, NB, 0, K, NB);
                const int long_k = K > 1000;
                const size_t n_ms = long_k ? sizeof Ms_long / sizeof Ms_long[0] : sizeof Ms / sizeof Ms[0];
                for (size_t mi = 0; mi < n_ms; mi++) {
                    const int64_t M = long_k ? Ms_long[mi] : Ms[mi];
                    const float beta = mode == 3 ? 1.0f : 0.0f;
                    float *A = malloc(sizeof(float) * (size_t)(M * K));
                    float *want = malloc(sizeof(float) * (size_t)(M * N)), *C = malloc(sizeof(float) * (size_t)(M * N));
                    double *naive = malloc(sizeof(double) * (size_t)(M * N));
                    for (int64_t i = 0; i < M * K; i++) A[i] = (float)randn();
                    for (int64_t i = 0; i < M * N; i++) want[i] = C[i] = (float)randn();
                    double scale = 1;
                    for (int64_t i = 0; i < M; i++)
                        for (int64_t j = 0; j < N; j++) {
                            double g = bias[j], u = mode == 2 ? bias[N + j] : 0;
                            for (int64_t p = 0; p < K; p++) {
                                g += (double)A[i * K + p] * W[p * NB + j];
                                if (mode == 2) u += (double)A[i * K + p] * W[p * NB + N + j];
                            }
                            naive[i * N + j] = mode == 2 ? act_naive(MHA_ACT_SILU, g) * u : g + beta * (double)C[i * N + j];
                            scale = MHA_MAX(scale, fabs(naive[i * N + j]));
                        }
                    err |= mha_linear_packed_f32(M, N, K, A, K, Wp, bias, act, beta, want, N);
                    err |= mha_linear_packed_fmt_f32(M, N, K, A, K, fmt, packed, bias, act, beta, C, N);
                    size_t differ = 0;
                    double e = 0;
                    for (int64_t i = 0; i < M * N; i++) {
                        differ += memcmp(C + i, want + i, sizeof(float)) != 0;
                        e = MHA_MAX(e, fabs(C[i] - naive[i]) / scale);
                    }
                    /* Q8_0 on few rows (in registers: up to 16, or 64) sums each block's a * q
                     * before its scale (mha.h): within float rounding of the float32 product */
                    if (fmt == MHA_WEIGHTS_Q8_0 && M <= 64) {
                        double ef = 0;
                        for (int64_t i = 0; i < M * N; i++) ef = MHA_MAX(ef, fabs((double)C[i] - want[i]) / scale);
                        snprintf(what, sizeof what, "linear packed %s M=%lld K=%lld mode=%d vs f32 packed",
                                 format_name(fmt), (long long)M, (long long)K, mode);
                        expect(!err && ef <= 4e-6, what, ef, 4e-6);
                    } else {
                        snprintf(what, sizeof what, "linear packed %s M=%lld K=%lld mode=%d (elements differing from f32 packed)",
                                 format_name(fmt), (long long)M, (long long)K, mode);
                        expect(!err && differ == 0, what, (double)differ, 0);
                    }
                    snprintf(what, sizeof what, "linear packed %s M=%lld K=%lld mode=%d vs double loop",
                             format_name(fmt), (long long)M, (long long)K, mode);
                    expect(!err && e <= 5e-6, what, e, 5e-6);
                    free(A), free(want), free(C), free(naive);
                }
                free(B), free(bias), free(W), free(Wp), free(packed), free(again);
            }
    /* every half (K = 1, N = 65536, A = 1: C = 0 + 1 * w) through both widenings, float and
     * double: each exactly mha_half_to_float, infinities and subnormals included, NaN a NaN */
    {
        const int64_t Nh = 65536;
        uint16_t *bits = malloc(sizeof(uint16_t) * (size_t)Nh);
        for (int64_t j = 0; j < Nh; j++) bits[j] = (uint16_t)j;
        for (int mi = 0; mi < 2; mi++) {
            const int64_t Mh = mi ? 20 : 1; /* registers, then the buffer */
            size_t hb = 0, bad = 0;
            int herr = mha_packed_bytes_f32(MHA_WEIGHTS_F16, 1, Nh, &hb);
            unsigned char *hp = malloc(hb);
            float *ones = malloc(sizeof(float) * (size_t)Mh), *Ch = malloc(sizeof(float) * (size_t)(Mh * Nh));
            double *ones_d = malloc(sizeof(double) * (size_t)Mh), *Cd = malloc(sizeof(double) * (size_t)(Mh * Nh));
            for (int64_t i = 0; i < Mh; i++) ones[i] = 1, ones_d[i] = 1;
            herr |= mha_pack_weight_f16_bits_f32(hp, bits, Nh, 0, 1, Nh);
            herr |= mha_linear_packed_fmt_f32(Mh, Nh, 1, ones, 1, MHA_WEIGHTS_F16, hp, NULL, 0, 0, Ch, Nh);
            free(hp);
            herr |= mha_packed_bytes_f64(MHA_WEIGHTS_F16, 1, Nh, &hb);
            hp = malloc(hb);
            herr |= mha_pack_weight_f16_bits_f64(hp, bits, Nh, 0, 1, Nh);
            herr |= mha_linear_packed_fmt_f64(Mh, Nh, 1, ones_d, 1, MHA_WEIGHTS_F16, hp, NULL, 0, 0, Cd, Nh);
            for (int64_t i = 0; i < Mh; i++)
                for (int64_t j = 0; j < Nh; j++) {
                    const float w = mha_half_to_float((uint16_t)j) + 0.0f;
                    const float got = Ch[i * Nh + j];
                    const double got_d = Cd[i * Nh + j];
                    if (isnan(w)) bad += !isnan(got) + !isnan(got_d);
                    else bad += memcmp(&got, &w, sizeof w) != 0 || got_d != (double)w;
                }
            snprintf(what, sizeof what, "every half widened exactly, M=%lld (float and double)", (long long)Mh);
            expect(!herr && bad == 0, what, (double)bad, 0);
            free(hp), free(ones), free(Ch), free(ones_d), free(Cd);
        }
        free(bits);
    }
    /* double compute from every narrow packing of the f64 path, against a double loop; M = 5
     * in registers, M = 40 through the buffer */
    const int64_t K = 97, Nd = 21;
    double *A = random_array((size_t)(40 * K)), *B = random_array((size_t)(K * Nd));
    double *C = malloc(sizeof(double) * (size_t)(40 * Nd));
    float *W = malloc(sizeof(float) * (size_t)(K * Nd));
    size_t bytes = 0;
    int64_t wd = 0;
    mha_pack_width_f64(&wd);
    int err = 0;
    for (int fmt = MHA_WEIGHTS_BF16; fmt <= MHA_WEIGHTS_F16; fmt++) { /* room for the largest */
        size_t b = 0;
        err |= mha_packed_bytes_f64(fmt, K, Nd, &b);
        bytes = MHA_MAX(bytes, b);
    }
    unsigned char *packed = malloc(bytes);
    for (int fmt = MHA_WEIGHTS_BF16; fmt <= MHA_WEIGHTS_F16; fmt++)
        for (int64_t M = 5; M <= 40; M += 35) {
            err |= mha_pack_weight_fmt_f64(packed, fmt, B, Nd, 0, K, Nd);
            decode_packed(W, fmt, packed, K, Nd, wd);
            err |= mha_linear_packed_fmt_f64(M, Nd, K, A, K, fmt, packed, NULL, MHA_ACT_GELU, 0, C, Nd);
            double e = 0;
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < Nd; j++) {
                    double g = 0;
                    for (int64_t p = 0; p < K; p++) g += A[i * K + p] * W[p * Nd + j];
                    e = MHA_MAX(e, fabs(C[i * Nd + j] - act_naive(MHA_ACT_GELU, g)));
                }
            snprintf(what, sizeof what, "linear packed %s f64, GELU, M=%lld", format_name(fmt), (long long)M);
            expect(!err && e <= 1e-12, what, e, 1e-12);
        }
    const int64_t M = 5;
    /* refusals */
    expect(mha_packed_bytes_f32(7, K, Nd, &bytes) == MHA_EINVAL, "packed_bytes: unknown format refused", 0, 0);
    expect(mha_pack_weight_fmt_f64(packed, 7, B, Nd, 0, K, Nd) == MHA_EINVAL, "pack_weight_fmt: unknown format refused", 0, 0);
    expect(mha_pack_weight_fmt_f64(packed, MHA_WEIGHTS_Q8_0, B, Nd, 0, -1, Nd) == MHA_EINVAL, "pack_weight_fmt: negative K refused", 0, 0);
    expect(mha_pack_weight_fmt_f64(packed, MHA_WEIGHTS_Q8_0, B, Nd - 1, 0, K, Nd) == MHA_EINVAL, "pack_weight_fmt: short ldb refused", 0, 0);
    expect(mha_linear_packed_fmt_f64(M, Nd, K, A, K, 7, packed, NULL, 0, 0, C, Nd) == MHA_EINVAL, "linear_packed_fmt: unknown format refused", 0, 0);
    free(A), free(B), free(C), free(W), free(packed);
}

/* mha_linear_transposed_fmt: C (M, K) = A (M, N) @ op(B)^T + beta C from every packing, float
 * and double, against a double loop on the weights decoded from the packing (op(B) itself for
 * the native packing); K across several chunks (K = 3000 at N = 130: chunks of 2016 floats).
 * Measured: float 5.4e-7, double 1.3e-15 of the largest output. */
static void test_linear_transposed(void) {
    char what[128];
    const int64_t Ms[] = {1, 5, 40}, Ks[] = {70, 3000}, Ns[] = {45, 130};
    int64_t width = 0, wd = 0;
    mha_pack_width_f32(&width);
    mha_pack_width_f64(&wd);
    for (int fmt = MHA_WEIGHTS_NATIVE; fmt <= MHA_WEIGHTS_F16; fmt++)
        for (size_t ki = 0; ki < 2; ki++)
            for (size_t ni = 0; ni < 2; ni++)
                for (size_t mi = 0; mi < 3; mi++) {
                    const int64_t K = Ks[ki], N = Ns[ni], M = Ms[mi];
                    float *B = malloc(sizeof(float) * (size_t)(K * N)), *W = malloc(sizeof(float) * (size_t)(K * N));
                    float *A = malloc(sizeof(float) * (size_t)(M * N)), *C = malloc(sizeof(float) * (size_t)(M * K));
                    double *Bd = malloc(sizeof(double) * (size_t)(K * N)), *Ad = malloc(sizeof(double) * (size_t)(M * N));
                    double *Cd = malloc(sizeof(double) * (size_t)(M * K)), *C0 = malloc(sizeof(double) * (size_t)(M * K));
                    float *Wd = malloc(sizeof(float) * (size_t)(K * N));
                    for (int64_t i = 0; i < K * N; i++) Bd[i] = randn() / sqrt((double)N), B[i] = (float)Bd[i];
                    for (int64_t i = 0; i < M * N; i++) Ad[i] = randn(), A[i] = (float)Ad[i];
                    for (int64_t i = 0; i < M * K; i++) C0[i] = randn(), C[i] = (float)C0[i], Cd[i] = C0[i];
                    size_t bytes = 0, bytes_d = 0;
                    int err = mha_packed_bytes_f32(fmt, K, N, &bytes) | mha_packed_bytes_f64(fmt, K, N, &bytes_d);
                    unsigned char *packed = malloc(bytes), *packed_d = malloc(bytes_d);
                    err |= mha_pack_weight_fmt_f32(packed, fmt, B, N, 0, K, N);
                    err |= mha_pack_weight_fmt_f64(packed_d, fmt, Bd, N, 0, K, N);
                    if (fmt == MHA_WEIGHTS_NATIVE) {
                        memcpy(W, B, sizeof(float) * (size_t)(K * N));
                    } else {
                        decode_packed(W, fmt, packed, K, N, width);
                        decode_packed(Wd, fmt, packed_d, K, N, wd);
                    }
                    const float beta = mi == 1 ? 1.0f : 0.0f;
                    err |= mha_linear_transposed_fmt_f32(M, N, K, A, N, fmt, packed, beta, C, K);
                    err |= mha_linear_transposed_fmt_f64(M, N, K, Ad, N, fmt, packed_d, beta, Cd, K);
                    double e = 0, ed = 0, scale = 1;
                    for (int64_t i = 0; i < M; i++)
                        for (int64_t p = 0; p < K; p++) {
                            double want = beta * C0[i * K + p], want_d = want;
                            for (int64_t j = 0; j < N; j++) {
                                want += (double)A[i * N + j] * W[p * N + j];
                                want_d += Ad[i * N + j] * (fmt == MHA_WEIGHTS_NATIVE ? Bd[p * N + j] : (double)Wd[p * N + j]);
                            }
                            scale = MHA_MAX(scale, fabs(want));
                            e = MHA_MAX(e, fabs(C[i * K + p] - want));
                            ed = MHA_MAX(ed, fabs(Cd[i * K + p] - want_d));
                        }
                    snprintf(what, sizeof what, "linear_transposed %s M=%lld N=%lld K=%lld (float, double)",
                             fmt == MHA_WEIGHTS_NATIVE ? "native" : format_name(fmt), (long long)M, (long long)N, (long long)K);
                    expect(!err && e <= 5e-6 * scale && ed <= 1e-14 * scale, what, MHA_MAX(e, ed) / scale, 5e-6);
                    free(B), free(W), free(A), free(C), free(Bd), free(Ad), free(Cd), free(C0), free(Wd);
                    free(packed), free(packed_d);
                }
    float a = 1, c = 0;
    expect(mha_linear_transposed_fmt_f32(1, 1, 1, &a, 1, 7, &a, 0, &c, 1) == MHA_EINVAL,
           "linear_transposed: unknown format refused", 0, 0);
    expect(mha_linear_transposed_fmt_f32(1, 1, 2, &a, 1, MHA_WEIGHTS_BF16, &a, 0, &c, 1) == MHA_EINVAL,
           "linear_transposed: short ldc refused", 0, 0);
}

/* a residual added in place (beta = 1), B read transposed; act with beta != 0 refused */
static void test_linear_residual(void) {
    const int64_t M = 50, Kr = 64, Nr = 33;
    double *A = random_array((size_t)(M * Kr)), *Bt = random_array((size_t)(Nr * Kr));
    double *bias = random_array((size_t)Nr), *C = random_array((size_t)(M * Nr));
    double *want = malloc(sizeof(double) * (size_t)(M * Nr));
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < Nr; j++) {
            double s = C[i * Nr + j] + bias[j];
            for (int64_t p = 0; p < Kr; p++) s += A[i * Kr + p] * Bt[j * Kr + p];
            want[i * Nr + j] = s;
        }
    int err = mha_linear_f64(M, Nr, Kr, A, Kr, Bt, Kr, 1, bias, MHA_ACT_NONE, 1, C, Nr);
    double e = err ? INFINITY : max_abs_diff(C, want, (size_t)(M * Nr));
    expect(e <= 1e-12, "linear f64: residual in place, B transposed", e, 1e-12);
    err = mha_linear_f64(M, Nr, Kr, A, Kr, Bt, Kr, 1, bias, MHA_ACT_GELU, 1, C, Nr);
    expect(err == MHA_EINVAL, "linear: an activation with beta != 0 is refused", err, 0);
    expect(mha_linear_f64(M, Nr, Kr, A, Kr, Bt, Kr, 1, bias, 9, 0, C, Nr) == MHA_EINVAL,
           "linear: an unknown activation is refused", 0, 0);
    free(A), free(Bt), free(bias), free(C), free(want);
}

/* mha_activation in place, float (edge values included) */
static void test_activation_in_place(void) {
    char what[96];
    enum { n = 203 };
    float x[n], y[n];
    for (int i = 0; i < n; i++) x[i] = (float)(12.0 * randn());
    x[0] = -100, x[1] = 100, x[2] = 0, x[3] = -88.5f;
    for (int act = MHA_ACT_GELU; act <= MHA_ACT_RELU; act++) {
        memcpy(y, x, sizeof x);
        int err = mha_activation_f32(y, n, y, n, 1, n, act);
        double e = err ? INFINITY : 0;
        for (int i = 0; i < n; i++) {
            double w = act_naive(act, x[i]);
            e = MHA_MAX(e, fabs(y[i] - w) / MHA_MAX(1.0, fabs(w)));
        }
        snprintf(what, sizeof what, "activation f32 act=%d", act);
        expect(e <= 2e-6, what, e, 2e-6);
    }
}

/* LayerNorm and RMSNorm against two-pass double loops; y == x allowed */
static void test_norms(void) {
    const int64_t rows = 9, d = 77;
    double *x = random_array((size_t)(rows * d)), *g = random_array((size_t)d), *c = random_array((size_t)d);
    double *y = malloc(sizeof(double) * (size_t)(rows * d)), *want = malloc(sizeof(double) * (size_t)(rows * d));
    float *xf = malloc(sizeof(float) * (size_t)(rows * d)), *gf = malloc(sizeof(float) * (size_t)d);
    float *cf = malloc(sizeof(float) * (size_t)d);
    for (int64_t i = 0; i < rows * d; i++) xf[i] = (float)(x[i] = 3 + 2 * x[i]);
    for (int64_t j = 0; j < d; j++) gf[j] = (float)g[j], cf[j] = (float)c[j];
    for (int rms = 0; rms <= 1; rms++) {
        for (int64_t i = 0; i < rows; i++) {
            double mean = 0, var = 0;
            if (!rms) {
                for (int64_t j = 0; j < d; j++) mean += x[i * d + j];
                mean /= (double)d;
            }
            for (int64_t j = 0; j < d; j++) var += (x[i * d + j] - mean) * (x[i * d + j] - mean);
            double inv = 1 / sqrt(var / (double)d + 1e-5);
            for (int64_t j = 0; j < d; j++)
                want[i * d + j] = (x[i * d + j] - mean) * inv * g[j] + (rms ? 0 : c[j]);
        }
        int err = rms ? mha_rms_norm_f64(y, d, x, d, rows, d, g, 1e-5)
                      : mha_layer_norm_f64(y, d, x, d, rows, d, g, c, 1e-5);
        double e = err ? INFINITY : max_abs_diff(y, want, (size_t)(rows * d));
        expect(e <= 1e-12, rms ? "rms_norm f64" : "layer_norm f64", e, 1e-12);
        float *yf = malloc(sizeof(float) * (size_t)(rows * d));
        memcpy(yf, xf, sizeof(float) * (size_t)(rows * d));
        err = rms ? mha_rms_norm_f32(yf, d, yf, d, rows, d, gf, 1e-5)
                  : mha_layer_norm_f32(yf, d, yf, d, rows, d, gf, cf, 1e-5);
        for (int64_t i = 0; i < rows * d; i++) y[i] = yf[i];
        e = err ? INFINITY : max_abs_diff(y, want, (size_t)(rows * d));
        expect(e <= 1e-4, rms ? "rms_norm f32 in place" : "layer_norm f32 in place", e, 1e-4);
        free(yf);
    }
    expect(mha_layer_norm_f64(y, d, x, d, rows, d, g, c, -1) == MHA_EINVAL, "layer_norm: eps < 0 refused", 0, 0);
    free(x), free(g), free(c), free(y), free(want), free(xf), free(gf), free(cf);
}

/* RoPE: rows of 2 heads of 6 and 3 more columns, period 4; norms kept, pairs turned */
static void test_rope(void) {
    enum { rows = 8, heads = 2, dh = 6, width = heads * dh + 3, period = 4 };
    double x[rows * width], y[rows * width], cs[period * dh / 2], sn[period * dh / 2];
    for (int i = 0; i < rows * width; i++) x[i] = randn();
    for (int p = 0; p < period; p++)
        for (int i = 0; i < dh / 2; i++) {
            double angle = p * pow(10000.0, -2.0 * i / dh);
            cs[p * dh / 2 + i] = cos(angle), sn[p * dh / 2 + i] = sin(angle);
        }
    memcpy(y, x, sizeof x);
    int err = mha_rope_f64(y, width, rows, heads, dh, cs, sn, period);
    double e = err ? INFINITY : 0;
    for (int r = 0; r < rows; r++) {
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < dh / 2; i++) {
                const double c = cs[(r % period) * dh / 2 + i], s = sn[(r % period) * dh / 2 + i];
                const double a = x[r * width + h * dh + i], b = x[r * width + h * dh + dh / 2 + i];
                e = MHA_MAX(e, fabs(y[r * width + h * dh + i] - (a * c - b * s)));
                e = MHA_MAX(e, fabs(y[r * width + h * dh + dh / 2 + i] - (b * c + a * s)));
            }
        for (int j = heads * dh; j < width; j++) e = MHA_MAX(e, fabs(y[r * width + j] - x[r * width + j]));
    }
    expect(e <= 1e-14, "rope f64", e, 1e-14);
    expect(mha_rope_f64(y, width, rows, heads, 5, cs, sn, period) == MHA_EINVAL, "rope: odd d_head refused", 0, 0);
}

/* embedding gather and accumulate; an id out of range writes nothing */
static void test_embedding(void) {
    float table[5 * 3], out[4 * 3], before[4 * 3];
    for (int i = 0; i < 15; i++) table[i] = (float)i;
    const int64_t ids[4] = {4, 0, 2, 4}, bad[4] = {1, 2, 5, 0};
    int err = mha_embedding_f32(out, 3, table, 5, 3, ids, 4, 0);
    err |= mha_embedding_f32(out, 3, table, 5, 3, ids, 4, 1);
    double e = err ? INFINITY : 0;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) e = MHA_MAX(e, fabs(out[i * 3 + j] - 2.0 * table[ids[i] * 3 + j]));
    expect(e == 0, "embedding f32 gather + accumulate", e, 0);
    memcpy(before, out, sizeof out);
    err = mha_embedding_f32(out, 3, table, 5, 3, bad, 4, 1);
    expect(err == MHA_EINVAL && memcmp(before, out, sizeof out) == 0, "embedding: an id out of range writes nothing", err, 0);
}

/* ---- the block's backward (block_impl.h) ---------------------------------------------------- */

/* act'(x) by the textbook derivatives in double (held to central differences of act_naive
 * below); ReLU's derivative is 0 at 0 and passes a NaN x's gradient, as torch. */
static double dact_naive(int act, double x) {
    const double pi = 3.141592653589793, phi = exp(-x * x / 2) / sqrt(2 * pi);
    double s, t, u;
    switch (act) {
    case MHA_ACT_GELU: return 0.5 * (1 + erf(x / sqrt(2.0))) + x * phi;
    case MHA_ACT_GELU_TANH:
        u = sqrt(2 / pi) * (x + 0.044715 * x * x * x);
        t = tanh(u);
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * sqrt(2 / pi) * (1 + 3 * 0.044715 * x * x);
    case MHA_ACT_SILU: s = 1 / (1 + exp(-x)); return s * (1 + x * (1 - s));
    case MHA_ACT_QUICK_GELU: s = 1 / (1 + exp(-1.702 * x)); return s * (1 + 1.702 * x * (1 - s));
    case MHA_ACT_RELU: return x <= 0 ? 0 : 1;
    default: return 1;
    }
}

static float *to_f32(const double *a, size_t n) {
    float *f = malloc(MHA_MAX(n, 1) * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = (float)a[i];
    return f;
}

static void round_f32(double *a, size_t n) { /* a's values as floats, so both twins see them */
    for (size_t i = 0; i < n; i++) a[i] = (float)a[i];
}

/* max |got - want| over max(1, max |want|), got in float */
static double rel_err_f32(const float *got, const double *want, size_t n) {
    double m = 0, scale = 1;
    for (size_t i = 0; i < n; i++) scale = MHA_MAX(scale, fabs(want[i]));
    for (size_t i = 0; i < n; i++) {
        double d = fabs(got[i] - want[i]);
        if (d > m || d != d) m = d;
    }
    return m / scale;
}

static double rel_err(const double *got, const double *want, size_t n) {
    double scale = 1;
    for (size_t i = 0; i < n; i++) scale = MHA_MAX(scale, fabs(want[i]));
    return max_abs_diff(got, want, n) / scale;
}

static void test_dact_naive(void) {
    double e = 0;
    for (int act = MHA_ACT_GELU; act <= MHA_ACT_QUICK_GELU; act++)
        for (double x = -6; x <= 6; x += 0.37) {
            const double h = 1e-5, fd = (act_naive(act, x + h) - act_naive(act, x - h)) / (2 * h);
            e = MHA_MAX(e, fabs(fd - dact_naive(act, x)));
        }
    expect(e <= 1e-8, "activation derivatives (naive) against central differences", e, 1e-8);
}

/* mha_linear_backward: every activation, plain and gated, B as it is and transposed, z saved
 * and recomputed, against loops in double; the outputs start nonzero (accumulated into) and
 * dA has a row stride wider than K. M spans the small product and several blocks. */
static void test_linear_backward_case(int64_t M, int act, int gated, int tb, int saved) {
    char what[128];
    const int64_t K = 70, N = 45, ldda = K + 3, NB = gated ? 2 * N : N, ldb = tb ? K : NB;
    const int full = act | (gated ? MHA_ACT_GATED : 0);
    const size_t nA = (size_t)(M * ldda), nB = (size_t)(K * NB), nb = (size_t)NB, nz = (size_t)(M * NB);
    double *A = random_array((size_t)(M * K)), *B = random_array(nB), *bias = random_array(nb);
    double *dC = random_array((size_t)(M * N)), *z = malloc(sizeof(double) * nz), *dz = malloc(sizeof(double) * nz);
    double *want[3] = {random_array(nA), random_array(nB), random_array(nb)}; /* start: dA, dB, dbias */
    const size_t sizes[3] = {nA, nB, nb};
    for (size_t i = 0; i < nB; i++) B[i] /= sqrt((double)K);
    round_f32(A, (size_t)(M * K)), round_f32(B, nB), round_f32(bias, nb), round_f32(dC, (size_t)(M * N));
    double *got[3];
    float *got_f[3];
    for (int o = 0; o < 3; o++) {
        round_f32(want[o], sizes[o]);
        got[o] = malloc(sizeof(double) * sizes[o]);
        memcpy(got[o], want[o], sizeof(double) * sizes[o]);
        got_f[o] = to_f32(want[o], sizes[o]);
    }
    /* element (p, j) of op(B): B stored (K, NB), or (NB, K) when transposed */
#define OPB(p, j) (tb ? B[(j) * K + (p)] : B[(p) * NB + (j)])
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < NB; j++) {
            double s = bias[j];
            for (int64_t p = 0; p < K; p++) s += A[i * K + p] * OPB(p, j);
            z[i * NB + j] = s;
        }
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            const double g = dC[i * N + j], x = z[i * NB + j];
            dz[i * NB + j] = g * dact_naive(act, x) * (gated ? z[i * NB + N + j] : 1);
            if (gated) dz[i * NB + N + j] = g * act_naive(act, x);
        }
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < NB; j++) {
            want[2][j] += dz[i * NB + j];
            for (int64_t p = 0; p < K; p++) {
                want[0][i * ldda + p] += dz[i * NB + j] * OPB(p, j);
                want[1][tb ? j * K + p : p * NB + j] += A[i * K + p] * dz[i * NB + j];
            }
        }
#undef OPB
    /* float64 packs op(B)^T into the caller's scratch, float32 into its own */
    int64_t width = 0;
    mha_pack_width_f64(&width);
    double *scratch = malloc(sizeof(double) * (size_t)((K + width - 1) / width * width * NB));
    int err = mha_linear_backward_f64(got[0], ldda, got[1], got[2], dC, N, A, K, B, ldb, tb, bias,
                                      saved ? z : NULL, full, M, N, K, scratch);
    free(scratch);
    float *Af = to_f32(A, (size_t)(M * K)), *Bf = to_f32(B, nB), *biasf = to_f32(bias, nb);
    float *dCf = to_f32(dC, (size_t)(M * N)), *zf = to_f32(z, nz);
    int err_f = mha_linear_backward_f32(got_f[0], ldda, got_f[1], got_f[2], dCf, N, Af, K, Bf, ldb, tb, biasf,
                                        saved ? zf : NULL, full, M, N, K, NULL);
    double e = err ? INFINITY : 0, e_f = err_f ? INFINITY : 0;
    for (int o = 0; o < 3; o++) {
        e = MHA_MAX(e, rel_err(got[o], want[o], sizes[o]));
        e_f = MHA_MAX(e_f, rel_err_f32(got_f[o], want[o], sizes[o]));
    }
    snprintf(what, sizeof what, "linear_backward f64 M=%lld act=%d gated=%d trans_b=%d z %s", (long long)M, act,
             gated, tb, saved ? "saved" : "recomputed");
    expect(e <= 1e-12, what, e, 1e-12);
    what[17] = '3', what[18] = '2'; /* f64 -> f32 */
    expect(e_f <= 1e-5, what, e_f, 1e-5);
    for (int o = 0; o < 3; o++) free(want[o]), free(got[o]), free(got_f[o]);
    free(A), free(B), free(bias), free(dC), free(z), free(dz), free(Af), free(Bf), free(biasf), free(dCf), free(zf);
}

static void test_linear_backward(void) {
    for (int act = MHA_ACT_NONE; act <= MHA_ACT_RELU; act++)
        for (int gated = 0; gated <= 1; gated++)
            for (int tb = 0; tb <= 1; tb++) {
                test_linear_backward_case(3, act, gated, tb, (act + tb) % 2);
                test_linear_backward_case(150, act, gated, tb, (act + gated) % 2);
            }
    double x = 0, dx = 0;
    expect(mha_linear_backward_f64(&dx, 1, NULL, NULL, &x, 1, &x, 1, &x, 1, 0, NULL, NULL, 7, 1, 1, 1, NULL) == MHA_EINVAL,
           "linear_backward: an unknown activation is refused", 0, 0);
}

/* mha_activation_backward on its own: edge values, in place on x (plain and gated), float */
static void test_activation_backward(void) {
    char what[96];
    enum { n = 203 };
    for (int code = 0; code < 2 * (MHA_ACT_RELU + 1); code++) {
        const int act = code % (MHA_ACT_RELU + 1), gated = code > MHA_ACT_RELU;
        const int64_t w = gated ? 2 * n : n;
        float x[2 * n], dx[2 * n], dy[n];
        for (int i = 0; i < w; i++) x[i] = (float)(4.0 * randn());
        for (int i = 0; i < n; i++) dy[i] = (float)randn();
        x[0] = -100, x[1] = 100, x[2] = 0, x[3] = -88.5f, x[4] = 9.5f;
        memcpy(dx, x, sizeof x);
        int err = mha_activation_backward_f32(dx, w, dy, n, dx, w, 1, n, act | (gated ? MHA_ACT_GATED : 0));
        double e = err ? INFINITY : 0;
        for (int i = 0; i < n; i++) {
            const double g = dy[i], xi = x[i];
            const double want = g * dact_naive(act, xi) * (gated ? x[n + i] : 1);
            e = MHA_MAX(e, fabs(dx[i] - want) / MHA_MAX(1.0, fabs(want)));
            if (gated) {
                const double up = g * act_naive(act, xi);
                e = MHA_MAX(e, fabs(dx[n + i] - up) / MHA_MAX(1.0, fabs(up)));
            }
        }
        snprintf(what, sizeof what, "activation_backward f32 in place act=%d gated=%d", act, gated);
        expect(e <= 2e-6, what, e, 2e-6);
    }
    double x = NAN, g = 2, dx = 0;
    int err = mha_activation_backward_f64(&dx, 1, &g, 1, &x, 1, 1, 1, MHA_ACT_RELU);
    expect(!err && dx == 2, "activation_backward: ReLU passes the gradient of a NaN input (torch)", dx, 0);
}

/* LayerNorm and RMSNorm backward against loops in double: with and without gain, strided
 * rows, accumulated into; 300 rows: several threads' shares */
static void test_norm_backward_case(int64_t rows, int rms, int with_gain) {
    char what[96];
    const int64_t d = 77, ld = d + 5;
    const size_t n = (size_t)(rows * ld), nd = (size_t)d;
    double *x = random_array(n), *dy = random_array(n), *g = random_array(nd);
    double *want[3] = {random_array(n), random_array(nd), random_array(nd)}; /* dx, dgain, dbias */
    const size_t sizes[3] = {n, nd, nd};
    for (size_t i = 0; i < n; i++) x[i] = 3 + 2 * x[i];
    round_f32(x, n), round_f32(dy, n), round_f32(g, nd);
    double *got[3];
    float *got_f[3];
    for (int o = 0; o < 3; o++) {
        round_f32(want[o], sizes[o]);
        got[o] = malloc(sizeof(double) * sizes[o]);
        memcpy(got[o], want[o], sizeof(double) * sizes[o]);
        got_f[o] = to_f32(want[o], sizes[o]);
    }
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * ld, *dyr = dy + r * ld;
        double mean = 0, var = 0, sg = 0, sgx = 0;
        if (!rms) {
            for (int64_t c = 0; c < d; c++) mean += xr[c];
            mean /= (double)d;
        }
        for (int64_t c = 0; c < d; c++) var += (xr[c] - mean) * (xr[c] - mean);
        const double rstd = 1 / sqrt(var / (double)d + 1e-5);
        for (int64_t c = 0; c < d; c++) {
            const double gc = dyr[c] * (with_gain ? g[c] : 1), xhat = (xr[c] - mean) * rstd;
            sg += gc, sgx += gc * xhat;
            want[1][c] += dyr[c] * xhat;
            want[2][c] += dyr[c];
        }
        for (int64_t c = 0; c < d; c++) {
            const double gc = dyr[c] * (with_gain ? g[c] : 1), xhat = (xr[c] - mean) * rstd;
            want[0][r * ld + c] += rstd * (gc - (rms ? 0 : sg / (double)d) - xhat * sgx / (double)d);
        }
    }
    if (!with_gain) memcpy(want[1], got[1], sizeof(double) * nd); /* no gain: dgain untouched */
    if (rms) memcpy(want[2], got[2], sizeof(double) * nd);        /* RMSNorm: no bias */
    float *xf = to_f32(x, n), *dyf = to_f32(dy, n), *gf = to_f32(g, nd);
    int err, err_f;
    if (rms) {
        err = mha_rms_norm_backward_f64(got[0], ld, got[1], dy, ld, x, ld, with_gain ? g : NULL, rows, d, 1e-5);
        err_f = mha_rms_norm_backward_f32(got_f[0], ld, got_f[1], dyf, ld, xf, ld, with_gain ? gf : NULL, rows, d, 1e-5);
    } else {
        err = mha_layer_norm_backward_f64(got[0], ld, got[1], got[2], dy, ld, x, ld, with_gain ? g : NULL, rows, d,
                                          1e-5);
        err_f = mha_layer_norm_backward_f32(got_f[0], ld, got_f[1], got_f[2], dyf, ld, xf, ld, with_gain ? gf : NULL,
                                            rows, d, 1e-5);
    }
    double e = err ? INFINITY : 0, e_f = err_f ? INFINITY : 0;
    for (int o = 0; o < 3; o++) {
        e = MHA_MAX(e, rel_err(got[o], want[o], sizes[o]));
        e_f = MHA_MAX(e_f, rel_err_f32(got_f[o], want[o], sizes[o]));
    }
    snprintf(what, sizeof what, "%s_backward f64 rows=%lld gain=%d", rms ? "rms_norm" : "layer_norm", (long long)rows,
             with_gain);
    expect(e <= 1e-12, what, e, 1e-12);
    snprintf(what, sizeof what, "%s_backward f32 rows=%lld gain=%d", rms ? "rms_norm" : "layer_norm", (long long)rows,
             with_gain);
    expect(e_f <= 1e-5, what, e_f, 1e-5);
    for (int o = 0; o < 3; o++) free(want[o]), free(got[o]), free(got_f[o]);
    free(x), free(dy), free(g), free(xf), free(dyf), free(gf);
}

static void test_norm_backward(void) {
    for (int rms = 0; rms <= 1; rms++)
        for (int with_gain = 0; with_gain <= 1; with_gain++) {
            test_norm_backward_case(9, rms, with_gain);
            test_norm_backward_case(300, rms, with_gain);
        }
    double x = 1, dx = 0;
    expect(mha_layer_norm_backward_f64(&dx, 1, NULL, NULL, &x, 1, &x, 1, NULL, 1, 1, -1) == MHA_EINVAL,
           "layer_norm_backward: eps < 0 refused", 0, 0);
}

/* RoPE backward is the forward's transpose: <rope(x), g> = <x, rope_backward(g)>, and the
 * gradient of the columns past the heads passes unchanged */
static void test_rope_backward(void) {
    enum { rows = 7, heads = 3, dh = 8, width = heads * dh + 3, period = 5 };
    double x[rows * width], y[rows * width], g[rows * width], dx[rows * width];
    double cs[period * dh / 2], sn[period * dh / 2];
    for (int i = 0; i < rows * width; i++) x[i] = randn(), g[i] = randn();
    for (int p = 0; p < period; p++)
        for (int i = 0; i < dh / 2; i++) {
            double angle = (p + 1) * pow(10000.0, -2.0 * i / dh);
            cs[p * dh / 2 + i] = cos(angle), sn[p * dh / 2 + i] = sin(angle);
        }
    memcpy(y, x, sizeof x), memcpy(dx, g, sizeof g);
    int err = mha_rope_f64(y, width, rows, heads, dh, cs, sn, period);
    err |= mha_rope_backward_f64(dx, width, rows, heads, dh, cs, sn, period);
    double lhs = 0, rhs = 0, e = 0;
    for (int i = 0; i < rows * width; i++) lhs += y[i] * g[i], rhs += x[i] * dx[i];
    for (int r = 0; r < rows; r++)
        for (int j = heads * dh; j < width; j++) e = MHA_MAX(e, fabs(dx[r * width + j] - g[r * width + j]));
    e = err ? INFINITY : MHA_MAX(e, fabs(lhs - rhs));
    expect(e <= 1e-12, "rope_backward f64: the forward's transpose", e, 1e-12);
    /* and undoes the forward (a rotation's transpose is its inverse) */
    err = mha_rope_backward_f64(y, width, rows, heads, dh, cs, sn, period);
    e = err ? INFINITY : max_abs_diff(y, x, (size_t)(rows * width));
    expect(e <= 1e-14, "rope_backward f64 undoes rope", e, 1e-14);
    expect(mha_rope_backward_f64(y, width, rows, heads, 5, cs, sn, period) == MHA_EINVAL,
           "rope_backward: odd d_head refused", 0, 0);
}

/* embedding backward: rows hit twice add up, in the same bits with 1 thread and with 2; an
 * id out of range writes nothing */
static void test_embedding_backward(void) {
    enum { vocab = 11, d = 150, n = 40 };
    double *g = random_array(n * d), *want = random_array(vocab * d);
    double *got = malloc(sizeof(double) * vocab * d), *got1 = malloc(sizeof(double) * vocab * d);
    int64_t ids[n];
    for (int i = 0; i < n; i++) ids[i] = (i * 7) % vocab;
    memcpy(got, want, sizeof(double) * vocab * d), memcpy(got1, want, sizeof(double) * vocab * d);
    for (int i = 0; i < n; i++)
        for (int c = 0; c < d; c++) want[ids[i] * d + c] += g[i * d + c];
    const int threads = mha_get_num_threads();
    int err = mha_embedding_backward_f64(got, g, d, ids, n, vocab, d);
    mha_set_num_threads(1);
    err |= mha_embedding_backward_f64(got1, g, d, ids, n, vocab, d);
    mha_set_num_threads(threads);
    double e = err ? INFINITY : max_abs_diff(got, want, vocab * d);
    expect(e <= 1e-13, "embedding_backward f64: scatter-add", e, 1e-13);
    expect(memcmp(got, got1, sizeof(double) * vocab * d) == 0, "embedding_backward: the same bits on 1 thread", 0, 0);
    ids[5] = vocab;
    memcpy(got1, got, sizeof(double) * vocab * d);
    err = mha_embedding_backward_f64(got, g, d, ids, n, vocab, d);
    expect(err == MHA_EINVAL && memcmp(got, got1, sizeof(double) * vocab * d) == 0,
           "embedding_backward: an id out of range writes nothing", err, 0);
    free(g), free(want), free(got), free(got1);
}

/* The Adam step against its formula in plain loops, in the same type: AdamW and Adam with L2
 * decay, three steps, on more elements than one task (with a tail of a vector); and the
 * same bits on one thread. */
#define ADAM_TEST(T, SFX, TOL)                                                                   \
    static void test_adam_step_##SFX(int decoupled) {                                            \
        enum { n = 40003 };                                                                      \
        const double lr = 0.01, b1 = 0.8, b2 = 0.99, eps = 1e-6, wd = 0.1;                       \
        T *p = malloc(n * sizeof *p), *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);      \
        T *wp = malloc(n * sizeof *p), *wm = calloc(n, sizeof *m), *wv = calloc(n, sizeof *v);   \
        T *p1 = malloc(n * sizeof *p), *m1 = calloc(n, sizeof *m), *v1 = calloc(n, sizeof *v);   \
        T *g = malloc(n * sizeof *g);                                                            \
        for (int i = 0; i < n; i++) wp[i] = p1[i] = p[i] = (T)randn();                           \
        int err = 0;                                                                             \
        const int threads = mha_get_num_threads();                                               \
        for (int t = 1; t <= 3; t++) {                                                           \
            for (int i = 0; i < n; i++) g[i] = (T)randn();                                       \
            err |= mha_adam_step_##SFX(p, m, v, g, n, lr, b1, b2, eps, wd, decoupled, t);        \
            mha_set_num_threads(1);                                                              \
            err |= mha_adam_step_##SFX(p1, m1, v1, g, n, lr, b1, b2, eps, wd, decoupled, t);     \
            mha_set_num_threads(threads);                                                        \
            const T step_size = (T)(lr / (1 - pow(b1, t))), bc2 = (T)sqrt(1 - pow(b2, t));       \
            for (int i = 0; i < n; i++) {                                                        \
                T gi = g[i];                                                                     \
                if (decoupled) wp[i] *= (T)(1 - lr * wd);                                        \
                else gi += (T)wd * wp[i];                                                        \
                wm[i] = wm[i] + (gi - wm[i]) * (T)(1 - b1);                                      \
                wv[i] = wv[i] * (T)b2 + gi * gi * (T)(1 - b2);                                   \
                wp[i] -= wm[i] / ((T)sqrt((double)wv[i]) / bc2 + (T)eps) * step_size;            \
            }                                                                                    \
        }                                                                                        \
        double e = 0;                                                                            \
        for (int i = 0; i < n; i++) {                                                            \
            double d = fabs((double)p[i] - wp[i]) / (fabs((double)wp[i]) + 1) +                  \
                       fabs((double)m[i] - wm[i]) / (fabs((double)wm[i]) + 1) +               \
                       fabs((double)v[i] - wv[i]) / (fabs((double)wv[i]) + 1e-2);                \
            if (d > e || d != d) e = d;                                                          \
        }                                                                                        \
        if (err) e = INFINITY;                                                                   \
        expect(e <= TOL, decoupled ? "adam_step " #SFX ": AdamW, 3 steps"                       \
                                   : "adam_step " #SFX ": Adam with L2, 3 steps", e, TOL);       \
        expect(memcmp(p, p1, n * sizeof *p) == 0 && memcmp(m, m1, n * sizeof *m) == 0 &&         \
               memcmp(v, v1, n * sizeof *v) == 0, "adam_step " #SFX ": the same bits on 1 thread", \
               0, 0);                                                                            \
        expect(mha_adam_step_##SFX(p, m, v, g, n, lr, b1, b2, eps, wd, decoupled, 0) ==          \
               MHA_EINVAL, "adam_step " #SFX ": step 0 refused", 0, 0);                          \
        free(p), free(m), free(v), free(wp), free(wm), free(wv), free(p1), free(m1), free(v1);   \
        free(g);                                                                                 \
    }
ADAM_TEST(float, f32, 1e-5)
ADAM_TEST(double, f64, 1e-13)
#undef ADAM_TEST

static void test_adam_step(void) {
    for (int decoupled = 0; decoupled < 2; decoupled++) {
        test_adam_step_f32(decoupled);
        test_adam_step_f64(decoupled);
    }
}

/* cross-entropy over the LM head in chunks (1, 4 rows, and the default) against the whole
 * logits in double; W (d, vocab) and tied (vocab, d); labels -100 not counted */
static void test_cross_entropy_case(int tw, int64_t chunk) {
    char what[96];
    enum { n = 13, d = 20, vocab = 37 };
    double *h = random_array(n * d), *W = random_array(d * vocab);
    double *want_dh = random_array(n * d), *want_dW = random_array(d * vocab);
    int64_t labels[n];
    for (int i = 0; i < n; i++) labels[i] = i % 4 == 1 ? -100 : (i * 5) % vocab;
    round_f32(h, n * d), round_f32(W, d * vocab), round_f32(want_dh, n * d), round_f32(want_dW, d * vocab);
    double *dh = malloc(sizeof(double) * n * d), *dW = malloc(sizeof(double) * d * vocab);
    memcpy(dh, want_dh, sizeof(double) * n * d), memcpy(dW, want_dW, sizeof(double) * d * vocab);
    float *hf = to_f32(h, n * d), *Wf = to_f32(W, d * vocab), *dhf = to_f32(dh, n * d), *dWf = to_f32(dW, d * vocab);
    double want_loss = 0, logits[vocab];
    int count = 0;
    for (int i = 0; i < n; i++) count += labels[i] != -100;
#define OPW(p, j) (tw ? W[(j) * d + (p)] : W[(p) * vocab + (j)])
    for (int i = 0; i < n; i++) {
        if (labels[i] == -100) continue;
        double max = -INFINITY, sum = 0;
        for (int j = 0; j < vocab; j++) {
            logits[j] = 0;
            for (int p = 0; p < d; p++) logits[j] += h[i * d + p] * OPW(p, j);
            max = MHA_MAX(max, logits[j]);
        }
        for (int j = 0; j < vocab; j++) sum += exp(logits[j] - max);
        want_loss += (max + log(sum) - logits[labels[i]]) / count;
        for (int j = 0; j < vocab; j++) {
            const double dl = (exp(logits[j] - max) / sum - (j == labels[i])) / count;
            for (int p = 0; p < d; p++) {
                want_dh[i * d + p] += dl * OPW(p, j);
                want_dW[tw ? j * d + p : p * vocab + j] += h[i * d + p] * dl;
            }
        }
    }
#undef OPW
    double loss = 0, loss_f = 0;
    const int64_t ldw = tw ? d : vocab;
    int err = mha_cross_entropy_f64(&loss, dh, d, dW, h, d, W, ldw, tw, labels, n, d, vocab, chunk);
    int err_f = mha_cross_entropy_f32(&loss_f, dhf, d, dWf, hf, d, Wf, ldw, tw, labels, n, d, vocab, chunk);
    double e = MHA_MAX(rel_err(dh, want_dh, n * d), rel_err(dW, want_dW, d * vocab));
    double e_f = MHA_MAX(rel_err_f32(dhf, want_dh, n * d), rel_err_f32(dWf, want_dW, d * vocab));
    e = err ? INFINITY : MHA_MAX(e, fabs(loss - want_loss));
    e_f = err_f ? INFINITY : MHA_MAX(e_f, fabs(loss_f - want_loss) / want_loss);
    snprintf(what, sizeof what, "cross_entropy f64 trans_w=%d chunk=%lld", tw, (long long)chunk);
    expect(e <= 1e-12, what, e, 1e-12);
    snprintf(what, sizeof what, "cross_entropy f32 trans_w=%d chunk=%lld", tw, (long long)chunk);
    expect(e_f <= 1e-5, what, e_f, 1e-5);
    free(h), free(W), free(want_dh), free(want_dW), free(dh), free(dW), free(hf), free(Wf), free(dhf), free(dWf);
}

static void test_cross_entropy(void) {
    for (int tw = 0; tw <= 1; tw++) {
        test_cross_entropy_case(tw, 1);
        test_cross_entropy_case(tw, 4);
        test_cross_entropy_case(tw, 0);
    }
    double h[2 * 3] = {1, 2, 3, 4, 5, 6}, W[3 * 4] = {0}, dh[2 * 3] = {0}, loss = 0;
    int64_t ignored[2] = {-100, -100}, bad[2] = {1, 4};
    int err = mha_cross_entropy_f64(&loss, dh, 3, NULL, h, 3, W, 4, 0, ignored, 2, 3, 4, 0);
    expect(!err && loss != loss && dh[0] == 0, "cross_entropy: every label ignored gives NaN, no gradient", loss, 0);
    loss = 7;
    err = mha_cross_entropy_f64(&loss, dh, 3, NULL, h, 3, W, 4, 0, bad, 2, 3, 4, 0);
    expect(err == MHA_EINVAL && loss == 7 && dh[0] == 0, "cross_entropy: a label out of range writes nothing", err, 0);
}


/* The thread layer (threads.c): every task of a job runs once, on a thread numbered below
 * the job's thread count, whether the pool holds more workers than the job uses (jobs of 2
 * and 3 threads after one of 8) or fewer; a task's own jobs run on its thread; the thread
 * count stays within 1 .. MHA_MAX_THREADS. */
typedef struct {
    int *runs, *thread_of, *inner_ok;
    int inner;
} count_job;

static void count_inner_task(void *ctx, int64_t i, int thread) {
    (void)i;
    *(int *)ctx &= thread == 0;
}

static void count_task(void *ctx, int64_t i, int thread) {
    const count_job *j = ctx;
    j->runs[i]++;
    j->thread_of[i] = thread;
    if (j->inner) {
        int ok = 1;
        mha_parallel_for(4, 3, 1, count_inner_task, &ok);
        j->inner_ok[i] = ok;
    }
}

static void test_threads(void) {
    enum { N = 2000 };
    static int runs[N], thread_of[N], inner_ok[N];
    const int old = mha_get_num_threads();
    const int serial = strstr(mha_build_info(), "threads=serial") != NULL;
    mha_set_num_threads(MHA_MAX_THREADS + 1000);
    expect(mha_get_num_threads() == (serial ? 1 : MHA_MAX_THREADS), "threads: n past MHA_MAX_THREADS counts as the limit",
           mha_get_num_threads(), MHA_MAX_THREADS);
    mha_set_num_threads(0);
    expect(mha_get_num_threads() >= 1 && mha_get_num_threads() <= MHA_MAX_THREADS,
           "threads: the default within 1 .. MHA_MAX_THREADS", mha_get_num_threads(), MHA_MAX_THREADS);
    const struct { int threads; int64_t n, chunk; int inner; } jobs[] = {
        {8, N, 1, 0}, {2, N, 1, 0}, {3, N, 7, 0}, {8, 5, 1, 0}, {2, 1, 1, 0},
        {8, 64, 1, 1}, {2, N, 1000, 0}, {8, N, 3, 0}, {1, 100, 1, 0},
    };
    for (int round = 0; round < 50; round++)
        for (size_t k = 0; k < sizeof jobs / sizeof jobs[0]; k++) {
            const int64_t n = jobs[k].n;
            memset(runs, 0, sizeof runs);
            count_job job = {runs, thread_of, inner_ok, jobs[k].inner};
            for (int64_t i = 0; i < n; i++) thread_of[i] = -1, inner_ok[i] = 1;
            mha_parallel_for(jobs[k].threads, n, jobs[k].chunk, count_task, &job);
            int once = 1, numbered = 1, inner = 1;
            for (int64_t i = 0; i < n; i++) {
                once &= runs[i] == 1;
                numbered &= thread_of[i] >= 0 && thread_of[i] < jobs[k].threads;
                inner &= inner_ok[i];
            }
            if (round == 49 || !(once && numbered && inner)) {
                char what[96];
                snprintf(what, sizeof what, "threads: job %zu (%d threads, %lld tasks)", k,
                         jobs[k].threads, (long long)n);
                expect(once, what, once, 0);
                expect(numbered, what, numbered, 0);
                expect(inner, what, inner, 0);
                if (!(once && numbered && inner)) break;
            }
        }
    mha_set_num_threads(old);
}

/* Scratch (common.h: mha_alloc, mha_free): every block 64-byte aligned and writable to its
 * end; where blocks are kept (the POSIX pool's builds, not under ASan) a freed block of
 * MHA_SCRATCH_KEEP_MIN bytes or more is the next request's that it holds (the smallest that
 * does, if at most twice the request), a held block is never handed out again, a small block
 * is never kept, and mha_release_scratch gives every kept byte back. */
static void test_scratch(void) {
    mha_release_scratch();
    const size_t big = (size_t)1 << 20, sizes[] = {1, 100, MHA_SCRATCH_KEEP_MIN, big, 3 * big};
    int aligned = 1;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        for (int round = 0; round < 2; round++) {
            char *p = mha_alloc(sizes[i]);
            aligned &= p != NULL && (uintptr_t)p % MHA_CACHE_LINE == 0;
            if (p) memset(p, 0x5a, sizes[i]);
            mha_free(p);
        }
    expect(aligned, "scratch: 64-byte aligned, writable to its end", aligned, 0);
    const size_t kept = mha_release_scratch(); /* the last large one (each larger request
                                                * dropped the smaller kept ones), or none */
    const int keeps = strncmp(mha_thread_runtime(), "mha pool", 8) == 0 && !MHA_ASAN;
    expect(kept == (keeps ? 3 * big : 0), "scratch: the freed large block kept (pool, no ASan)",
           (double)kept, (double)(keeps ? 3 * big : 0));
    if (!keeps) return;
    char *a = mha_alloc(big), *b = mha_alloc(3 * big);
    const uintptr_t a_at = (uintptr_t)a, b_at = (uintptr_t)b; /* (a freed pointer is not compared) */
    mha_free(a);
    mha_free(b);
    char *c = mha_alloc(big - 100), *d = mha_alloc(big), *e = mha_alloc(2 * big);
    const uintptr_t e_at = (uintptr_t)e;
    expect((uintptr_t)c == a_at, "scratch: the smallest kept block that holds a request", 0, 0);
    expect((uintptr_t)d != a_at && (uintptr_t)d != b_at,
           "scratch: a held block, or one over twice the request, not handed out", 0, 0);
    expect(e_at == b_at, "scratch: a larger kept block for a larger request", 0, 0);
    memset(c, 1, big - 100), memset(d, 2, big), memset(e, 3, 2 * big);
    expect(c[0] == 1 && d[big - 1] == 2 && e[0] == 3, "scratch: blocks in use apart", 0, 0);
    mha_free(c), mha_free(d), mha_free(e);
    char *small = mha_alloc(1000); /* below the minimum: no effect on the kept blocks */
    mha_free(small);
    char *f = mha_alloc(2 * big); /* e's block again: within twice the request */
    expect((uintptr_t)f == e_at, "scratch: a freed block taken again", 0, 0);
    mha_free(f);
    expect(mha_release_scratch() == big + big + 3 * big, "scratch: release gives back every kept byte",
           0, 0);
    expect(mha_release_scratch() == 0, "scratch: nothing kept after a release", 0, 0);
    a = mha_alloc(big), b = mha_alloc(big);
    mha_free(a), mha_free(b);
    char *g = mha_alloc(4 * big); /* none holds it: the smaller kept blocks are freed */
    expect(mha_release_scratch() == 0, "scratch: a request none holds drops the smaller blocks", 0, 0);
    mha_free(g);
    expect(mha_release_scratch() == 4 * big, "scratch: the larger block kept", 0, 0);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--paths") == 0) {
        puts(mha_simd_paths());
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--quick") == 0) fd_samples = 4;
    printf("%s, %d threads\n", mha_build_info(), mha_get_num_threads());
    const char *want = getenv("MHA_SIMD");
    if (want && *want && strcmp(want, "auto") != 0 && strcmp(want, mha_simd_path()) != 0) {
        printf("FAIL MHA_SIMD=%s, but the kernels run the %s path\n", want, mha_simd_path());
        return 1;
    }
    test_threads();
    test_gemm();
    test_gemm_shared_a();
    const attention_case cases[] = {
        {1, 1, 1, 5, 7, 4, 3, 0, 0, 0, 0, 0},   {2, 4, 2, 9, 9, 5, 6, 1, 0, 0, 0, 0},
        {2, 2, 1, 6, 3, 8, 8, 1, 1, 0, 0, 0},   {1, 3, 3, 70, 33, 17, 9, 0, 1, 0, 0, 0},
        {2, 2, 2, 8, 11, 4, 4, 0, 0, 0.3, 0, 0}, {1, 2, 1, 5, 5, 3, 2, 1, 1, 0.5, 0, 0},
        {1, 1, 1, 3, 0, 4, 4, 0, 0, 0, 0, 0},
        /* several key tiles (256) and query blocks (72): online softmax across tiles */
        {1, 2, 1, 150, 600, 24, 20, 1, 1, 0, 0, 0}, {2, 2, 2, 130, 300, 16, 16, 1, 0, 0.2, 0, 0},
        {1, 1, 1, 300, 270, 8, 8, 1, 1, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_attention_case(cases[i]);
    /* soft-capping (c tanh(s / c) before the masks) with key padding, causal, masks, GQA,
     * dropout, several tiles; scores ~ N(0, 1), so the small caps bend */
    const attention_case softcap_cases[] = {
        {1, 1, 1, 5, 7, 4, 3, 0, 0, 0, 0.5, 0},    {2, 4, 2, 9, 9, 5, 6, 1, 0, 0, 1.0, 1},
        {2, 2, 1, 6, 3, 8, 8, 1, 1, 0, 0.7, 1},    {2, 2, 2, 8, 11, 4, 4, 0, 0, 0.3, 1.5, 1},
        {1, 2, 1, 150, 600, 24, 20, 1, 1, 0, 2.0, 1}, {2, 1, 1, 300, 270, 8, 8, 1, 0, 0, 0.3, 1},
    };
    for (size_t i = 0; i < sizeof softcap_cases / sizeof softcap_cases[0]; i++)
        test_attention_case(softcap_cases[i]);
    test_softcap_tanh();
    test_layer();
    test_dropout_rng();
    test_exp_f32();
    test_nan_scores();
    const stats_case stats_cases[] = {
        {1, 1, 1, 5, 7, 4, 0, 0, 0, 1, 0},        {2, 4, 2, 9, 9, 5, 1, 0, 1, 0, 0},
        /* several key tiles (256) and query blocks (72); n_q > n_k (rows before the keys) */
        {2, 2, 1, 150, 600, 24, 1, 1, 1, 0, 0},   {1, 2, 2, 300, 270, 8, 1, 1, 0, 1, 0.3},
        {2, 2, 2, 130, 300, 16, 0, 0, 1, 0, 0.2}, {1, 3, 1, 40, 1030, 16, 0, 1, 0, 0, 0},
        {1, 1, 1, 3, 0, 4, 0, 0, 0, 0, 0},
        /* causal blocks of the weights path over 1 to 700 keys: each count of visible keys
         * a shared axis of its own length, whose workspace weights_gemm_bytes measures */
        {1, 1, 1, 700, 700, 64, 1, 0, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof stats_cases / sizeof stats_cases[0]; i++) test_row_stats_case(stats_cases[i]);
    test_row_stats_output();
    test_attention_flow();
    test_linear();
    test_linear_packed();
    test_pack_weight_transposed();
    test_scratch();
    test_narrow_conversions();
    test_linear_packed_narrow();
    test_linear_transposed();
    test_linear_residual();
    test_activation_in_place();
    test_norms();
    test_rope();
    test_embedding();
    test_dact_naive();
    test_linear_backward();
    test_activation_backward();
    test_norm_backward();
    test_rope_backward();
    test_embedding_backward();
    test_cross_entropy();
    test_adam_step();
    printf("%d passed, %d failed\n", checks - failures, failures);
    return failures != 0;
}
