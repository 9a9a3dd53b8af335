/* block_impl.h: the rest of a transformer block, written once for a type `real`: the dense
 * layer with its activation fused into the product (mha_linear), activations on their own,
 * LayerNorm and RMSNorm, rotary position embedding and the embedding gather. Included by
 * kernels.h after gemm_impl.h (whose product and epilogue mha_linear uses), with real, SFX
 * defined, once per kernel unit. The contracts are mha.h's; mha.reference.block holds the
 * NumPy twins the tests compare these with.
 */
#if MHA_GNU_C
typedef real FN(bvec) __attribute__((vector_size(MHA_VEC_BYTES)));
#define BVEC FN(bvec)
#define BVL ((int64_t)(MHA_VEC_BYTES / sizeof(real)))
#endif

static int FN(act_valid)(int act) {
    const int kind = act & ~MHA_ACT_GATED;
    return kind >= MHA_ACT_NONE && kind <= MHA_ACT_RELU;
}

/* mha_linear with op(B) given as it is (B, ldb, trans_b) or packed whole (Bp). */
static int FN(linear)(int64_t M, int64_t N, int64_t K, const real *A, int64_t lda, const real *B,
                      int64_t ldb, int trans_b, const real *Bp, const real *bias, int act,
                      real beta, real *C, int64_t ldc) {
    if (M < 0 || N < 0 || K < 0 || !FN(act_valid)(act) || (act != MHA_ACT_NONE && beta != 0))
        return MHA_EINVAL;
    if (!(act & MHA_ACT_GATED)) {
        const TY(mha_gemm_out) out = {B, ldb, bias, C, ldc, N, Bp};
        const FN(gemm_epilogue) ep = {act, N, C, ldc};
        return FN(gemm_auto)(0, trans_b, M, K, 1, A, lda, beta, &out, 1,
                             act == MHA_ACT_NONE ? NULL : &ep);
    }
    /* gated: the product's 2N columns go to scratch, the epilogue writes act(gate) * up to C */
    int ok = 1;
    size_t bytes = mha_mul_size(mha_mul_size((size_t)M, 2 * (size_t)N, &ok), sizeof(real), &ok);
    if (!ok) return MHA_ENOMEM;
    real *scratch = mha_alloc(MHA_MAX(bytes, 1));
    if (!scratch) return MHA_ENOMEM;
    const TY(mha_gemm_out) out = {B, ldb, bias, scratch, 2 * N, 2 * N, Bp};
    const FN(gemm_epilogue) ep = {act, N, C, ldc};
    int err = FN(gemm_auto)(0, trans_b, M, K, 1, A, lda, 0, &out, 1, &ep);
    mha_free(scratch);
    return err;
}

static int FN(mha_linear)(int64_t M, int64_t N, int64_t K, const real *A, int64_t lda,
                          const real *B, int64_t ldb, int trans_b, const real *bias, int act,
                          real beta, real *C, int64_t ldc) {
    return FN(linear)(M, N, K, A, lda, B, ldb, trans_b, NULL, bias, act, beta, C, ldc);
}

static int FN(mha_linear_packed)(int64_t M, int64_t N, int64_t K, const real *A, int64_t lda,
                                 const real *Bp, const real *bias, int act, real beta, real *C,
                                 int64_t ldc) {
    return FN(linear)(M, N, K, A, lda, NULL, 0, 0, Bp, bias, act, beta, C, ldc);
}

typedef struct {
    real *y;
    const real *x;
    int64_t ldy, ldx, n;
    int act;
} FN(act_job);

static void FN(act_task)(void *ctx, int64_t i, int thread) {
    const FN(act_job) *j = ctx;
    (void)thread;
    FN(act_apply_row)(j->y + i * j->ldy, j->x + i * j->ldx, j->n, j->act);
}

static int FN(mha_activation)(real *y, int64_t ldy, const real *x, int64_t ldx, int64_t rows,
                              int64_t n, int act) {
    if (rows < 0 || n < 0 || !FN(act_valid)(act)) return MHA_EINVAL;
    FN(act_job) job = {y, x, ldy, ldx, n, act};
    mha_parallel_for(mha_threads_for(20.0 * (double)rows * (double)n), rows, 4, FN(act_task), &job);
    return MHA_OK;
}

/* sum_j (x[j] - shift)^2 and sum_j x[j] of one row, in `real` (float: vector lanes of
 * partial sums, about 1e-7 relative error on a row of a few thousand). */
static void FN(row_moments)(const real *x, int64_t n, real shift, real *sum, real *sum_sq) {
    real s = 0, q = 0;
    int64_t j = 0;
#if MHA_GNU_C
    BVEC vs = {0}, vq = {0}, vs1 = {0}, vq1 = {0};
    for (; j + 2 * BVL <= n; j += 2 * BVL) {
        BVEC a, b;
        MHA_VLOAD(a, x + j);
        MHA_VLOAD(b, x + j + BVL);
        vs += a;
        vs1 += b;
        a -= shift;
        b -= shift;
        vq += a * a;
        vq1 += b * b;
    }
    vs += vs1;
    vq += vq1;
    for (int64_t l = 0; l < BVL; l++) {
        s += vs[l];
        q += vq[l];
    }
#endif
    for (; j < n; j++) {
        s += x[j];
        q += (x[j] - shift) * (x[j] - shift);
    }
    *sum = s;
    *sum_sq = q;
}

/* LayerNorm (rms = 0) or RMSNorm (rms = 1) of one row of d; two passes over it (the mean,
 * then the variance about it). */
typedef struct {
    real *y;
    const real *x, *gain, *bias;
    int64_t ldy, ldx, d;
    double eps;
    int rms;
} FN(norm_job);

static void FN(norm_task)(void *ctx, int64_t i, int thread) {
    const FN(norm_job) *j = ctx;
    (void)thread;
    const int64_t d = j->d;
    const real *xi = j->x + i * j->ldx, *gain = j->gain, *bias = j->bias;
    real *yi = j->y + i * j->ldy;
    real sum, sq, mean = 0;
    if (!j->rms) {
        FN(row_moments)(xi, d, 0, &sum, &sq);
        mean = sum / (real)d;
    }
    FN(row_moments)(xi, d, mean, &sum, &sq);
    const real inv = (real)(1.0 / sqrt((double)(sq / (real)d) + j->eps));
    if (gain && bias)
        for (int64_t c = 0; c < d; c++) yi[c] = (xi[c] - mean) * inv * gain[c] + bias[c];
    else if (gain)
        for (int64_t c = 0; c < d; c++) yi[c] = (xi[c] - mean) * inv * gain[c];
    else
        for (int64_t c = 0; c < d; c++) yi[c] = (xi[c] - mean) * inv + (bias ? bias[c] : 0);
}

static int FN(norm_rows)(real *y, int64_t ldy, const real *x, int64_t ldx, int64_t rows,
                         int64_t d, const real *gain, const real *bias, double eps, int rms) {
    if (rows < 0 || d < 0 || !(eps >= 0)) return MHA_EINVAL;
    if (d == 0) return MHA_OK;
    FN(norm_job) job = {y, x, gain, bias, ldy, ldx, d, eps, rms};
    mha_parallel_for(mha_threads_for(8.0 * (double)rows * (double)d), rows, 8, FN(norm_task), &job);
    return MHA_OK;
}

static int FN(mha_layer_norm)(real *y, int64_t ldy, const real *x, int64_t ldx, int64_t rows,
                              int64_t d, const real *gain, const real *bias, double eps) {
    return FN(norm_rows)(y, ldy, x, ldx, rows, d, gain, bias, eps, 0);
}

static int FN(mha_rms_norm)(real *y, int64_t ldy, const real *x, int64_t ldx, int64_t rows,
                            int64_t d, const real *gain, double eps) {
    return FN(norm_rows)(y, ldy, x, ldx, rows, d, gain, NULL, eps, 1);
}

static int FN(mha_rope)(real *x, int64_t ldx, int64_t rows, int64_t heads, int64_t d_head,
                        const real *cos, const real *sin, int64_t period) {
    if (rows < 0 || heads < 0 || d_head < 0 || d_head % 2 || (rows > 0 && period < 1))
        return MHA_EINVAL;
    const int64_t half = d_head / 2;
    for (int64_t r = 0; r < rows; r++) {
        const real *c = cos + (r % period) * half, *s = sin + (r % period) * half;
        for (int64_t h = 0; h < heads; h++) {
            real *lo = x + r * ldx + h * d_head, *hi = lo + half;
            for (int64_t i = 0; i < half; i++) {
                const real a = lo[i], b = hi[i];
                lo[i] = a * c[i] - b * s[i];
                hi[i] = b * c[i] + a * s[i];
            }
        }
    }
    return MHA_OK;
}

static int FN(mha_embedding)(real *out, int64_t ldo, const real *table, int64_t vocab,
                             int64_t d, const int64_t *ids, int64_t n, int accumulate) {
    if (vocab < 0 || d < 0 || n < 0) return MHA_EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) return MHA_EINVAL;
    for (int64_t i = 0; i < n; i++) {
        const real *row = table + ids[i] * d;
        real *o = out + i * ldo;
        if (accumulate)
            for (int64_t j = 0; j < d; j++) o[j] += row[j];
        else if (d > 0)
            memcpy(o, row, (size_t)d * sizeof(real));
    }
    return MHA_OK;
}

#if MHA_GNU_C
#undef BVEC
#undef BVL
#endif
