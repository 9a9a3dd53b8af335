/* block_impl.h: the rest of a transformer block, written once for a type `real`: the dense
 * layer with its activation fused into the product (mha_linear), activations on their own,
 * LayerNorm and RMSNorm, rotary position embedding, the embedding gather, and the
 * optimizer's elementwise Adam step. Included by
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

/* ---- derivatives of the activations (the backward's part of the epilogue) ---------------- */

#ifndef MHA_BLOCK_DACT_DEFINED /* type-specific: defined once per unit, for float and double */
#define MHA_BLOCK_DACT_DEFINED
/* d = act'(x) and a = act(x) of one activation, float32, on a float or a float vector T (SEL,
 * MAX, POW2 as vec.h's activations), from the same pieces as the forward (MHA_ACT_F32):
 *   GELU       a = x Phi(x), d = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi);
 *   GELU tanh  s = sigmoid(2u) = (1 + tanh u) / 2, u = sqrt(2/pi) (x + 0.044715 x^3):
 *              a = x s, d = s + 2 x s (1 - s) u', u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2);
 *   SiLU       s = sigmoid(x): a = x s, d = s + x s (1 - s); quick GELU the same at 1.702 x;
 *   ReLU       d = 0 where x <= 0, else 1 (a NaN x passes the gradient, as torch). */
#define MHA_DACT_F32(d_out, a_out, x_in, act, T, SEL, MAX, POW2)                                 \
    do {                                                                                         \
        T gx_ = (x_in), gd_, ga_, gs_;                                                           \
        switch (act) {                                                                           \
        case MHA_ACT_GELU:                                                                       \
            MHA_ERF_F32(gs_, gx_ * 0.70710678118654752f, T, SEL);                                \
            gs_ = 0.5f + 0.5f * gs_;                                                             \
            MHA_EXP_NONPOS(gd_, (T){0} - 0.5f * gx_ * gx_, T, MAX, POW2);                        \
            gd_ = gs_ + gx_ * (0.39894228040143268f * gd_);                                      \
            ga_ = gx_ * gs_;                                                                     \
            break;                                                                               \
        case MHA_ACT_GELU_TANH:                                                                  \
            MHA_SIGMOID_F32(gs_, (1.5957691216057308f * gx_) * (1.0f + 0.044715f * gx_ * gx_),   \
                            T, SEL, MAX, POW2);                                                  \
            gd_ = 1.5957691216057308f * (1.0f + 0.134145f * gx_ * gx_);  /* 2 u' */              \
            gd_ = gs_ + gx_ * gs_ * (1.0f - gs_) * gd_;                                          \
            ga_ = gx_ * gs_;                                                                     \
            break;                                                                               \
        case MHA_ACT_SILU:                                                                       \
            MHA_SIGMOID_F32(gs_, gx_, T, SEL, MAX, POW2);                                        \
            gd_ = gs_ + gx_ * gs_ * (1.0f - gs_);                                                \
            ga_ = gx_ * gs_;                                                                     \
            break;                                                                               \
        case MHA_ACT_QUICK_GELU:                                                                 \
            MHA_SIGMOID_F32(gs_, 1.702f * gx_, T, SEL, MAX, POW2);                               \
            gd_ = gs_ + 1.702f * gx_ * gs_ * (1.0f - gs_);                                       \
            ga_ = gx_ * gs_;                                                                     \
            break;                                                                               \
        case MHA_ACT_RELU:                                                                       \
            gd_ = SEL(gx_ <= (T){0}, (T){0}, (T){0} + 1.0f);                                     \
            ga_ = SEL(gx_ < (T){0}, (T){0}, gx_);                                                \
            break;                                                                               \
        default:                                                                                 \
            gd_ = (T){0} + 1.0f;                                                                 \
            ga_ = gx_;                                                                           \
        }                                                                                        \
        (d_out) = gd_;                                                                           \
        (a_out) = ga_;                                                                           \
    } while (0)

#if MHA_GNU_C
#define MHA_DACT_LOOP_F32(d, a, x, n, act)                                                       \
    do {                                                                                         \
        int64_t j_ = 0;                                                                          \
        for (; j_ + MHA_VL_F32 <= (n); j_ += MHA_VL_F32) {                                       \
            mha_vf32 v_, dv_, av_;                                                               \
            MHA_VLOAD(v_, (x) + j_);                                                             \
            MHA_DACT_F32(dv_, av_, v_, act, mha_vf32, MHA_VSEL, MHA_VMAX, MHA_VPOW2_BITS);       \
            MHA_VSTORE((d) + j_, dv_);                                                           \
            MHA_VSTORE((a) + j_, av_);                                                           \
        }                                                                                        \
        for (; j_ < (n); j_++)                                                                   \
            MHA_DACT_F32((d)[j_], (a)[j_], (x)[j_], act, float, MHA_SSEL, MHA_SMAX,              \
                         mha_pow2_bits_f32);                                                     \
    } while (0)
#else
#define MHA_DACT_LOOP_F32(d, a, x, n, act)                                                       \
    do {                                                                                         \
        for (int64_t j_ = 0; j_ < (n); j_++)                                                     \
            MHA_DACT_F32((d)[j_], (a)[j_], (x)[j_], act, float, MHA_SSEL, MHA_SMAX,              \
                         mha_pow2_bits_f32);                                                     \
    } while (0)
#endif

/* d[j] = act'(x[j]), a[j] = act(x[j]) for j < n (one loop per activation, as mha_act_row). */
static void mha_dact_row_f32(float *d, float *a, const float *x, int64_t n, int act) {
    switch (act) {
    case MHA_ACT_GELU: MHA_DACT_LOOP_F32(d, a, x, n, MHA_ACT_GELU); break;
    case MHA_ACT_GELU_TANH: MHA_DACT_LOOP_F32(d, a, x, n, MHA_ACT_GELU_TANH); break;
    case MHA_ACT_SILU: MHA_DACT_LOOP_F32(d, a, x, n, MHA_ACT_SILU); break;
    case MHA_ACT_QUICK_GELU: MHA_DACT_LOOP_F32(d, a, x, n, MHA_ACT_QUICK_GELU); break;
    case MHA_ACT_RELU: MHA_DACT_LOOP_F32(d, a, x, n, MHA_ACT_RELU); break;
    default: MHA_DACT_LOOP_F32(d, a, x, n, MHA_ACT_NONE); break;
    }
}

/* The same in float64 on libm (the formulas above, tanh in place of the sigmoid). */
static void mha_dact_row_f64(double *d, double *a, const double *x, int64_t n, int act) {
    for (int64_t j = 0; j < n; j++) {
        const double v = x[j];
        double s, t;
        switch (act) {
        case MHA_ACT_GELU:
            s = 0.5 * (1.0 + erf(v * 0.70710678118654752));
            d[j] = s + v * 0.39894228040143268 * exp(-0.5 * v * v);
            a[j] = v * s;
            break;
        case MHA_ACT_GELU_TANH:
            t = tanh(0.79788456080286536 * (v + 0.044715 * v * v * v));
            d[j] = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * 0.79788456080286536 * (1.0 + 0.134145 * v * v);
            a[j] = 0.5 * v * (1.0 + t);
            break;
        case MHA_ACT_SILU:
        case MHA_ACT_QUICK_GELU: {
            const double k = act == MHA_ACT_SILU ? 1.0 : 1.702;
            s = 1.0 / (1.0 + exp(-k * v));
            d[j] = s + k * v * s * (1.0 - s);
            a[j] = v * s;
            break;
        }
        case MHA_ACT_RELU:
            d[j] = v <= 0 ? 0.0 : 1.0;
            a[j] = v < 0 ? 0.0 : v;
            break;
        default:
            d[j] = 1.0;
            a[j] = v;
        }
    }
}
#endif /* MHA_BLOCK_DACT_DEFINED */

/* dx = dy * act'(x) on one row (mha_activation_backward); dx may be x, or dy when not gated:
 * each chunk of x is read whole before its gradient is written. */
#define DACT_CHUNK 256
static void FN(act_backward_row)(real *dx, const real *dy, const real *x, int64_t n, int act) {
    const int kind = act & ~MHA_ACT_GATED, gated = (act & MHA_ACT_GATED) != 0;
    real d[DACT_CHUNK], a[DACT_CHUNK];
    for (int64_t j0 = 0; j0 < n; j0 += DACT_CHUNK) {
        const int64_t m = MHA_MIN(DACT_CHUNK, n - j0);
        VN(mha_dact_row)(d, a, x + j0, m, kind);
        if (!gated) { /* forward: y = act(x) */
            for (int64_t j = 0; j < m; j++) dx[j0 + j] = dy[j0 + j] * d[j];
            continue;
        }
        /* forward: y[j] = act(gate[j]) * up[j], gate = x[:n], up = x[n:] */
        const real *up = x + n + j0;
        for (int64_t j = 0; j < m; j++) {
            const real u = up[j], g = dy[j0 + j];
            dx[j0 + j] = g * u * d[j];  /* d gate */
            dx[n + j0 + j] = g * a[j];  /* d up   */
        }
    }
}

typedef struct {
    real *dx;
    const real *dy, *x;
    int64_t lddx, lddy, ldx, n;
    int act;
} FN(act_grad_job);

static void FN(act_grad_task)(void *ctx, int64_t i, int thread) {
    const FN(act_grad_job) *j = ctx;
    (void)thread;
    FN(act_backward_row)(j->dx + i * j->lddx, j->dy + i * j->lddy, j->x + i * j->ldx, j->n, j->act);
}

static void FN(act_grad_rows)(real *dx, int64_t lddx, const real *dy, int64_t lddy,
                              const real *x, int64_t ldx, int64_t rows, int64_t n, int act) {
    FN(act_grad_job) job = {dx, dy, x, lddx, lddy, ldx, n, act};
    mha_parallel_for(mha_threads_for(30.0 * (double)rows * (double)n), rows, 4, FN(act_grad_task), &job);
}

/* sum[c] += x[r][c] over the rows r in order, for c < cols: tasks own blocks of columns, so
 * every sum is added in the same order whatever the threads. */
#define COLUMN_BLOCK 64
typedef struct {
    real *sum;
    const real *x;
    int64_t ldx, rows, cols;
} FN(colsum_job);

static void FN(colsum_task)(void *ctx, int64_t blk, int thread) {
    const FN(colsum_job) *j = ctx;
    (void)thread;
    const int64_t c0 = blk * COLUMN_BLOCK, c1 = MHA_MIN(j->cols, c0 + COLUMN_BLOCK);
    real *sum = j->sum;
    for (int64_t r = 0; r < j->rows; r++) {
        const real *xr = j->x + r * j->ldx;
        for (int64_t c = c0; c < c1; c++) sum[c] += xr[c];
    }
}

static void FN(column_sums)(real *sum, const real *x, int64_t ldx, int64_t rows, int64_t cols) {
    FN(colsum_job) job = {sum, x, ldx, rows, cols};
    mha_parallel_for(mha_threads_for((double)rows * (double)cols), (cols + COLUMN_BLOCK - 1) / COLUMN_BLOCK,
                     1, FN(colsum_task), &job);
}

/* mha_linear with op(B) given as it is (B, ldb, trans_b) or packed whole (Bp). */
static int FN(linear_nw)(int64_t M, int64_t N, int64_t K, const real *A, int64_t lda, const real *B,
                         int64_t ldb, int trans_b, const real *Bp, const FN(gemm_narrow) *nw,
                         const real *bias, int act, real beta, real *C, int64_t ldc) {
    if (M < 0 || N < 0 || K < 0 || !FN(act_valid)(act) || (act != MHA_ACT_NONE && beta != 0))
        return MHA_EINVAL;
    if (!(act & MHA_ACT_GATED)) {
        const TY(mha_gemm_out) out = {B, ldb, bias, C, ldc, N, Bp};
        const FN(gemm_epilogue) ep = {act, N, C, ldc};
        return FN(gemm_auto_nw)(0, trans_b, M, K, 1, A, lda, beta, &out, 1,
                                act == MHA_ACT_NONE ? NULL : &ep, nw);
    }
    /* gated: the product's 2N columns go to scratch, the epilogue writes act(gate) * up to C */
    int ok = 1;
    size_t bytes = mha_mul_size(mha_mul_size((size_t)M, 2 * (size_t)N, &ok), sizeof(real), &ok);
    if (!ok) return MHA_ENOMEM;
    real *scratch = mha_alloc(MHA_MAX(bytes, 1));
    if (!scratch) return MHA_ENOMEM;
    const TY(mha_gemm_out) out = {B, ldb, bias, scratch, 2 * N, 2 * N, Bp};
    const FN(gemm_epilogue) ep = {act, N, C, ldc};
    int err = FN(gemm_auto_nw)(0, trans_b, M, K, 1, A, lda, 0, &out, 1, &ep, nw);
    mha_free(scratch);
    return err;
}

static int FN(linear)(int64_t M, int64_t N, int64_t K, const real *A, int64_t lda, const real *B,
                      int64_t ldb, int trans_b, const real *Bp, const real *bias, int act,
                      real beta, real *C, int64_t ldc) {
    return FN(linear_nw)(M, N, K, A, lda, B, ldb, trans_b, Bp, NULL, bias, act, beta, C, ldc);
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

/* mha.h: mha_linear_packed_fmt. The product's columns N' (2N when gated) are the packing's. */
static int FN(mha_linear_packed_fmt)(int64_t M, int64_t N, int64_t K, const real *A, int64_t lda,
                                     int format, const void *packed, const real *bias, int act,
                                     real beta, real *C, int64_t ldc) {
    if (format == MHA_WEIGHTS_NATIVE)
        return FN(linear)(M, N, K, A, lda, NULL, 0, 0, (const real *)packed, bias, act, beta, C, ldc);
    if (!FN(narrow_fmt)(format)) return MHA_EINVAL;
    const FN(gemm_narrow) nw = {format, packed};
    return FN(linear_nw)(M, N, K, A, lda, NULL, 0, 0, NULL, &nw, bias, act, beta, C, ldc);
}

/* One panel of a weight packed whole (mha_pack_weight's layout), for a parallel packing. */
typedef struct {
    real *packed;
    const real *B;
    int64_t ldb, K, N, width;
    int trans;
} FN(pack_job);

static void FN(pack_panel_task)(void *ctx, int64_t panel, int thread) {
    const FN(pack_job) *j = ctx;
    (void)thread;
    const int64_t j0 = panel * j->width;
    FN(pack_b)(j->packed + panel * j->K * j->width, j->trans ? j->B + j0 * j->ldb : j->B + j0, j->ldb,
               j->trans, j->K, MHA_MIN(j->width, j->N - j0));
}

/* One panel of op(B)^T (N, K) packed from op(B)'s packing, for mha_pack_weight_transposed. */
typedef struct {
    real *out;
    const real *packed;
    int64_t K, N, width;
} FN(transpose_job);

static void FN(transpose_panel_task)(void *ctx, int64_t panel, int thread) {
    const FN(transpose_job) *j = ctx;
    (void)thread;
    /* out's panel holds op(B)^T's columns k0 .. k0 + W, i.e. op(B)'s rows k0 .. k0 + W: of
     * every source panel (K x W, its columns n0 .. n0 + W) a W x W block, transposed as
     * pack_b reads a transposed operand (the source block is stored (k, n), ldb W) */
    const int64_t W = j->width, n0 = panel * W, rows = MHA_MIN(W, j->N - n0);
    for (int64_t k0 = 0; k0 < j->K; k0 += W)
        FN(pack_b)(j->out + k0 * j->N + n0 * W, j->packed + n0 * j->K + k0 * W, W, 1, rows,
                   MHA_MIN(W, j->K - k0));
}

/* mha.h: op(B)^T packed whole from op(B)'s packing, one pass, in parallel over out's panels. */
static int FN(mha_pack_weight_transposed)(real *out, const real *packed, int64_t K, int64_t N) {
    if (K < 0 || N < 0) return MHA_EINVAL;
    if (K == 0 || N == 0) return MHA_OK;
    FN(transpose_job) job = {out, packed, K, N, 0};
    FN(mha_pack_width)(&job.width);
    mha_parallel_for(mha_threads_for((double)N * (double)K), (N + job.width - 1) / job.width, 1,
                     FN(transpose_panel_task), &job);
    return MHA_OK;
}

/* dA (M, K) += dz (M, NB) @ op(B)^T, op(B) (K, NB) given as B, ldb, trans_b: op(B)^T is packed
 * whole first, in parallel, then read by one product in one parallel region (as
 * mha_linear_packed). The product on B as it is packs op(B)^T per slice of its shared axis
 * NB, between two barriers each: on a machine loaded by other work the threads' waits there
 * were most of the product's time, while on a quiet one (2 threads, MiniLM's and GPT-2's
 * weights, 128 to 2,048 rows) it ran as fast as this, packing included. scratch: room for the
 * packed copy (mha.h), or NULL: allocated here. */
static int FN(input_grad)(real *dA, int64_t ldda, const real *dz, int64_t lddz, const real *B,
                          int64_t ldb, int trans_b, int64_t M, int64_t NB, int64_t K,
                          real *scratch) {
    if (M == 0 || K == 0) return MHA_OK;
    int64_t width;
    FN(mha_pack_width)(&width);
    const int64_t panels = (K + width - 1) / width;
    real *packed = scratch;
    if (!scratch) {
        int ok = 1;
        size_t bytes = mha_mul_size(mha_mul_size((size_t)panels, (size_t)width, &ok), (size_t)NB, &ok);
        bytes = mha_mul_size(bytes, sizeof(real), &ok);
        if (!ok || !(packed = mha_alloc(MHA_MAX(bytes, 1)))) return MHA_ENOMEM;
    }
    /* op(B)^T (NB, K): B^T when B is stored (K, NB), B itself when stored (NB, K) */
    FN(pack_job) job = {packed, B, ldb, NB, K, width, !trans_b};
    mha_parallel_for(mha_threads_for((double)NB * (double)K), panels, 1, FN(pack_panel_task), &job);
    int err = FN(linear)(M, K, NB, dz, lddz, NULL, 0, 0, packed, NULL, MHA_ACT_NONE, 1, dA, ldda);
    if (!scratch) mha_free(packed);
    return err;
}

/* Backward of mha_linear (mha.h). Its forward, per row:  z = A @ op(B) + bias;  C = act(z).
 * packed: mha.h's scratch, room for op(B)^T packed (or NULL); scratch here holds dz. */
static int FN(mha_linear_backward)(real *dA, int64_t ldda, real *dB, real *dbias, const real *dC,
                                   int64_t lddc, const real *A, int64_t lda, const real *B,
                                   int64_t ldb, int trans_b, const real *bias, const real *z,
                                   int act, int64_t M, int64_t N, int64_t K, real *packed) {
    if (M < 0 || N < 0 || K < 0 || !FN(act_valid)(act)) return MHA_EINVAL;
    const int64_t NB = act & MHA_ACT_GATED ? 2 * N : N; /* z's columns */
    const real *dz = dC;
    int64_t lddz = lddc;
    real *scratch = NULL;
    int err = MHA_OK;
    if (act != MHA_ACT_NONE) { /* C = act(z): dz = dC * act'(z), in scratch (M, NB) */
        int ok = 1;
        size_t bytes = mha_mul_size(mha_mul_size((size_t)M, (size_t)NB, &ok), sizeof(real), &ok);
        if (!ok || !(scratch = mha_alloc(MHA_MAX(bytes, 1)))) return MHA_ENOMEM;
        if (!z) { /* the forward's product again, without its activation */
            err = FN(linear)(M, NB, K, A, lda, B, ldb, trans_b, NULL, bias, MHA_ACT_NONE, 0, scratch, NB);
            z = scratch;
        }
        if (!err) FN(act_grad_rows)(scratch, NB, dC, lddc, z, NB, M, N, act);
        dz = scratch;
        lddz = NB;
    }
    /* z = ... + bias:          dbias += sum over rows of dz */
    if (!err && dbias) FN(column_sums)(dbias, dz, lddz, M, NB);
    /* z = A @ op(B):           dA += dz @ op(B)^T */
    if (!err && dA) err = FN(input_grad)(dA, ldda, dz, lddz, B, ldb, trans_b, M, NB, K, packed);
    /*                          d op(B) += A^T @ dz: dB += A^T dz, or (dz^T A) for B stored (NB, K) */
    if (!err && dB)
        err = trans_b ? FN(mha_gemm)(1, 0, NB, K, M, 1, dz, lddz, A, lda, 1, dB, ldb)
                      : FN(mha_gemm)(1, 0, K, NB, M, 1, A, lda, dz, lddz, 1, dB, ldb);
    mha_free(scratch);
    return err;
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

/* Backward of mha_activation. Forward: y = act(x) (gated: y = act(gate) * up). */
static int FN(mha_activation_backward)(real *dx, int64_t lddx, const real *dy, int64_t lddy,
                                       const real *x, int64_t ldx, int64_t rows, int64_t n,
                                       int act) {
    if (rows < 0 || n < 0 || !FN(act_valid)(act)) return MHA_EINVAL;
    FN(act_grad_rows)(dx, lddx, dy, lddy, x, ldx, rows, n, act);
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

/* Backward of LayerNorm (rms = 0) and RMSNorm (rms = 1). Forward, per row:
 *   mean = sum(x) / d (LayerNorm; 0 for RMSNorm);  rstd = 1 / sqrt(sum((x - mean)^2) / d + eps);
 *   xhat = (x - mean) rstd;  y = xhat * gain + bias.
 * mean and rstd are recomputed by the forward's own code (row_moments), not saved: one more
 * read of each row, small beside the products around a norm, and the forward stays as it
 * is, callable without a buffer for them. Pass 1 (rows in parallel) writes dx and keeps each
 * row's mean and rstd; pass 2 (blocks of columns in parallel) sums dgain and dbias over the
 * rows in order. */
typedef struct {
    real *dx, *dgain, *dbias, *mean, *rstd;
    const real *dy, *x, *gain;
    int64_t lddx, lddy, ldx, rows, d;
    double eps;
    int rms;
} FN(norm_grad_job);

static void FN(norm_grad_row_task)(void *ctx, int64_t i, int thread) {
    const FN(norm_grad_job) *j = ctx;
    (void)thread;
    const int64_t d = j->d;
    const real *xi = j->x + i * j->ldx, *dyi = j->dy + i * j->lddy, *gain = j->gain;
    real sum, sq, mean = 0;
    if (!j->rms) {
        FN(row_moments)(xi, d, 0, &sum, &sq);
        mean = sum / (real)d;
    }
    FN(row_moments)(xi, d, mean, &sum, &sq);
    const real rstd = (real)(1.0 / sqrt((double)(sq / (real)d) + j->eps));
    j->mean[i] = mean;
    j->rstd[i] = rstd;
    if (!j->dx) return;
    /* y = xhat * gain:  g = dy * gain;  xhat = (x - mean) rstd:
     * dx = rstd (g - mean(g) - xhat mean(g xhat)), without mean(g) for RMSNorm */
    double sg = 0, sgx = 0;
    for (int64_t c = 0; c < d; c++) {
        const real g = gain ? dyi[c] * gain[c] : dyi[c];
        sg += g;
        sgx += (double)g * (double)((xi[c] - mean) * rstd);
    }
    const real mg = j->rms ? 0 : (real)(sg / (double)d), mgx = (real)(sgx / (double)d);
    real *dxi = j->dx + i * j->lddx;
    for (int64_t c = 0; c < d; c++) {
        const real g = gain ? dyi[c] * gain[c] : dyi[c], xhat = (xi[c] - mean) * rstd;
        dxi[c] += rstd * (g - mg - xhat * mgx);
    }
}

static void FN(norm_grad_column_task)(void *ctx, int64_t blk, int thread) {
    const FN(norm_grad_job) *j = ctx;
    (void)thread;
    const int64_t c0 = blk * COLUMN_BLOCK, c1 = MHA_MIN(j->d, c0 + COLUMN_BLOCK);
    for (int64_t r = 0; r < j->rows; r++) {
        const real *xr = j->x + r * j->ldx, *dyr = j->dy + r * j->lddy;
        const real mean = j->mean[r], rstd = j->rstd[r];
        if (j->dgain) /* y = xhat * gain + ...: dgain += dy xhat */
            for (int64_t c = c0; c < c1; c++) j->dgain[c] += dyr[c] * ((xr[c] - mean) * rstd);
        if (j->dbias) /* y = ... + bias:        dbias += dy */
            for (int64_t c = c0; c < c1; c++) j->dbias[c] += dyr[c];
    }
}

static int FN(norm_backward)(real *dx, int64_t lddx, real *dgain, real *dbias, const real *dy,
                             int64_t lddy, const real *x, int64_t ldx, const real *gain,
                             int64_t rows, int64_t d, double eps, int rms) {
    if (rows < 0 || d < 0 || !(eps >= 0)) return MHA_EINVAL;
    if (!gain) dgain = NULL;
    if (d == 0 || rows == 0 || (!dx && !dgain && !dbias)) return MHA_OK;
    int ok = 1;
    size_t bytes = mha_mul_size(mha_mul_size((size_t)rows, 2, &ok), sizeof(real), &ok);
    real *stats = ok ? mha_alloc(bytes) : NULL;
    if (!stats) return MHA_ENOMEM;
    FN(norm_grad_job) job = {dx, dgain, dbias, stats, stats + rows, dy, x, gain, lddx, lddy, ldx,
                             rows, d, eps, rms};
    const double work = (double)rows * (double)d;
    mha_parallel_for(mha_threads_for(12.0 * work), rows, 8, FN(norm_grad_row_task), &job);
    if (dgain || dbias)
        mha_parallel_for(mha_threads_for(4.0 * work), (d + COLUMN_BLOCK - 1) / COLUMN_BLOCK, 1,
                         FN(norm_grad_column_task), &job);
    mha_free(stats);
    return MHA_OK;
}

static int FN(mha_layer_norm_backward)(real *dx, int64_t lddx, real *dgain, real *dbias,
                                       const real *dy, int64_t lddy, const real *x, int64_t ldx,
                                       const real *gain, int64_t rows, int64_t d, double eps) {
    return FN(norm_backward)(dx, lddx, dgain, dbias, dy, lddy, x, ldx, gain, rows, d, eps, 0);
}

static int FN(mha_rms_norm_backward)(real *dx, int64_t lddx, real *dgain, const real *dy,
                                     int64_t lddy, const real *x, int64_t ldx, const real *gain,
                                     int64_t rows, int64_t d, double eps) {
    return FN(norm_backward)(dx, lddx, dgain, NULL, dy, lddy, x, ldx, gain, rows, d, eps, 1);
}

/* Rotates the pairs of every head of every row by the angles of row r % period: by +angle
 * (sign 1, the forward) or by -angle (sign -1, its transpose: the backward). */
static int FN(rope_rows)(real *x, int64_t ldx, int64_t rows, int64_t heads, int64_t d_head,
                         const real *cos, const real *sin, int64_t period, real sign) {
    if (rows < 0 || heads < 0 || d_head < 0 || d_head % 2 || (rows > 0 && period < 1))
        return MHA_EINVAL;
    const int64_t half = d_head / 2;
    for (int64_t r = 0; r < rows; r++) {
        const real *c = cos + (r % period) * half, *s = sin + (r % period) * half;
        for (int64_t h = 0; h < heads; h++) {
            real *lo = x + r * ldx + h * d_head, *hi = lo + half;
            for (int64_t i = 0; i < half; i++) {
                const real a = lo[i], b = hi[i], sn = sign * s[i];
                lo[i] = a * c[i] - b * sn;
                hi[i] = b * c[i] + a * sn;
            }
        }
    }
    return MHA_OK;
}

static int FN(mha_rope)(real *x, int64_t ldx, int64_t rows, int64_t heads, int64_t d_head,
                        const real *cos, const real *sin, int64_t period) {
    return FN(rope_rows)(x, ldx, rows, heads, d_head, cos, sin, period, 1);
}

/* Its backward. Forward, per pair: lo' = a c - b s, hi' = b c + a s, a linear map whose
 * transpose takes (g_lo, g_hi) to (g_lo c + g_hi s, g_hi c - g_lo s): the rotation by -s. */
static int FN(mha_rope_backward)(real *dx, int64_t ldx, int64_t rows, int64_t heads,
                                 int64_t d_head, const real *cos, const real *sin,
                                 int64_t period) {
    return FN(rope_rows)(dx, ldx, rows, heads, d_head, cos, sin, period, -1);
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

/* Backward of mha_embedding. Forward: out[i] = table[ids[i]]. So d_table[ids[i]] += d_out[i]:
 * tasks own blocks of columns and run over i in order, so a row hit twice sums its gradients
 * in the same order whatever the threads (no atomics, no per-thread copies of the table). */
typedef struct {
    real *d_table;
    const real *d_out;
    const int64_t *ids;
    int64_t ldo, n, d;
} FN(embed_grad_job);

static void FN(embed_grad_task)(void *ctx, int64_t blk, int thread) {
    const FN(embed_grad_job) *j = ctx;
    (void)thread;
    const int64_t c0 = blk * COLUMN_BLOCK, c1 = MHA_MIN(j->d, c0 + COLUMN_BLOCK);
    for (int64_t i = 0; i < j->n; i++) {
        real *row = j->d_table + j->ids[i] * j->d;
        const real *g = j->d_out + i * j->ldo;
        for (int64_t c = c0; c < c1; c++) row[c] += g[c];
    }
}

static int FN(mha_embedding_backward)(real *d_table, const real *d_out, int64_t ldo,
                                      const int64_t *ids, int64_t n, int64_t vocab, int64_t d) {
    if (vocab < 0 || d < 0 || n < 0) return MHA_EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) return MHA_EINVAL;
    FN(embed_grad_job) job = {d_table, d_out, ids, ldo, n, d};
    mha_parallel_for(mha_threads_for((double)n * (double)d), (d + COLUMN_BLOCK - 1) / COLUMN_BLOCK, 1,
                     FN(embed_grad_task), &job);
    return MHA_OK;
}

/* ---- softmax cross-entropy over the LM head, in chunks of rows ---------------------------- */

/* One chunk's rows: each row of logits becomes its gradient in place, its loss goes to
 * loss[i] (0 for an ignored row). Forward, per counted row:
 *   loss_i = logsumexp(logits_i) - logits_i[label]   (mean over the counted rows)
 * Backward:  d_logits_i = (softmax(logits_i) - onehot(label)) / count. */
#define IGNORE_LABEL (-100)
#define XENT_CHUNK_BYTES ((int64_t)1 << 26) /* 64 MiB of logits per chunk by default */
typedef struct {
    real *logits;
    double *loss;
    const int64_t *labels;
    int64_t vocab;
    real inv_count;
} FN(xent_job);

static void FN(xent_row_task)(void *ctx, int64_t i, int thread) {
    const FN(xent_job) *j = ctx;
    (void)thread;
    real *x = j->logits + i * j->vocab;
    const int64_t label = j->labels[i];
    if (label == IGNORE_LABEL) {
        j->loss[i] = 0;
        memset(x, 0, (size_t)j->vocab * sizeof(real));
        return;
    }
    const real target = x[label], max = VN(mha_max)(x, j->vocab);
    const real sum = VN(mha_exp_sum)(x, j->vocab, max); /* x = exp(x - max) */
    j->loss[i] = (double)max + log((double)sum) - (double)target;
    VN(mha_scale)(x, j->vocab, j->inv_count / sum);
    x[label] -= j->inv_count;
}

static int FN(mha_cross_entropy)(double *loss, real *d_hidden, int64_t ldd, real *dW,
                                 const real *hidden, int64_t ldh, const real *W, int64_t ldw,
                                 int trans_w, const int64_t *labels, int64_t n, int64_t d,
                                 int64_t vocab, int64_t chunk) {
    if (n < 0 || d < 0 || vocab < 0) return MHA_EINVAL;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (labels[i] == IGNORE_LABEL) continue;
        if (labels[i] < 0 || labels[i] >= vocab) return MHA_EINVAL;
        count++;
    }
    if (count == 0) {
        *loss = NAN;
        return MHA_OK;
    }
    /* By default a chunk's logits fill up to XENT_CHUNK_BYTES: each chunk reads the whole of W
     * three times (its logits, d_hidden, dW) and its products cross the threads' barriers
     * once per slice of their shared axes, so fewer, larger chunks cost less (GPT-2's 50,257
     * words on 4 x 128 tokens: 2 chunks instead of 7, a fifth less time on 2 threads). */
    if (chunk <= 0) chunk = MHA_MAX(1, (int64_t)(XENT_CHUNK_BYTES / sizeof(real)) / vocab); /* vocab >= 1: a label is counted */
    chunk = MHA_MIN(chunk, n);
    int ok = 1;
    size_t bytes = mha_mul_size(mha_mul_size((size_t)chunk, (size_t)vocab, &ok), sizeof(real), &ok);
    bytes = mha_add_size(bytes, mha_mul_size((size_t)chunk, sizeof(double), &ok), &ok);
    char *scratch = ok ? mha_alloc(bytes) : NULL;
    if (!scratch) return MHA_ENOMEM;
    double *row_loss = (double *)scratch;                                      /* (chunk)        */
    real *logits = (real *)(scratch + (size_t)chunk * sizeof(double));        /* (chunk, vocab) */
    FN(xent_job) job = {logits, row_loss, NULL, vocab, (real)(1.0 / (double)count)};
    double total = 0;
    int err = MHA_OK;
    for (int64_t r0 = 0; r0 < n && !err; r0 += chunk) {
        const int64_t R = MHA_MIN(chunk, n - r0);
        const real *h = hidden + r0 * ldh;
        /* logits = hidden @ op(W) */
        err = FN(mha_gemm)(0, trans_w, R, vocab, d, 1, h, ldh, W, ldw, 0, logits, vocab);
        if (err) break;
        job.labels = labels + r0;
        mha_parallel_for(mha_threads_for(20.0 * (double)R * (double)vocab), R, 1, FN(xent_row_task), &job);
        for (int64_t i = 0; i < R; i++) total += row_loss[i];
        /* logits = hidden @ op(W):  d_hidden += d_logits @ op(W)^T */
        if (d_hidden)
            err = FN(mha_gemm)(0, !trans_w, R, d, vocab, 1, logits, vocab, W, ldw, 1, d_hidden + r0 * ldd, ldd);
        /*                           d op(W) += hidden^T @ d_logits (transposed for W (vocab, d)) */
        if (!err && dW)
            err = trans_w ? FN(mha_gemm)(1, 0, vocab, d, R, 1, logits, vocab, h, ldh, 1, dW, ldw)
                          : FN(mha_gemm)(1, 0, d, vocab, R, 1, h, ldh, logits, vocab, 1, dW, ldw);
    }
    mha_free(scratch);
    if (!err) *loss = total / (double)count;
    return err;
}

/* ---- the Adam step (mha_adam_step) ---------------------------------------------------------
 * One pass over (p, g, m, v), in the operations and order of mha.train's NumPy step, each
 * rounded to `real`: p *= decay; g' = g + wd p (L2); m += (g' - m) c1; v = v b2 + (g' g') c2;
 * p -= (m / (sqrt(v) / bc2 + eps)) step_size. Where the compiler fuses a product and a sum
 * (-ffp-contract=fast with FMA), the result is equal to rounding rather than bitwise. */
typedef struct {
    real *p, *m, *v;
    const real *g;
    int64_t n;
    real decay, wd, c1, b2, c2, bc2, eps, step_size;
    int l2;
} FN(adam_job);

#ifndef MHA_ADAM_BLOCK
#define MHA_ADAM_BLOCK 16384 /* elements of one task */
#endif

static void FN(adam_task)(void *ctx, int64_t task, int thread) {
    const FN(adam_job) *a = ctx;
    (void)thread;
    const int64_t lo = task * MHA_ADAM_BLOCK;
    const int64_t hi = a->n - lo < MHA_ADAM_BLOCK ? a->n : lo + MHA_ADAM_BLOCK;
    real *p = a->p, *m = a->m, *v = a->v;
    const real *g = a->g;
    const real decay = a->decay, wd = a->wd, c1 = a->c1, b2 = a->b2, c2 = a->c2, bc2 = a->bc2;
    const real eps = a->eps, step_size = a->step_size;
    int64_t j = lo;
#if MHA_GNU_C
    for (; j + BVL <= hi; j += BVL) {
        BVEC pj, gj, mj, vj, d;
        MHA_VLOAD(pj, p + j);
        MHA_VLOAD(gj, g + j);
        MHA_VLOAD(mj, m + j);
        MHA_VLOAD(vj, v + j);
        pj *= decay;
        if (a->l2) gj += wd * pj;
        mj += (gj - mj) * c1;
        vj = vj * b2 + gj * gj * c2;
        for (int64_t l = 0; l < BVL; l++) d[l] = (real)sqrt((double)vj[l]);
        d = d / bc2 + eps;
        pj -= mj / d * step_size;
        MHA_VSTORE(p + j, pj);
        MHA_VSTORE(m + j, mj);
        MHA_VSTORE(v + j, vj);
    }
#endif
    for (; j < hi; j++) {
        real pj = p[j] * decay, gj = g[j];
        if (a->l2) gj += wd * pj;
        m[j] += (gj - m[j]) * c1;
        v[j] = v[j] * b2 + gj * gj * c2;
        p[j] = pj - m[j] / ((real)sqrt((double)v[j]) / bc2 + eps) * step_size;
    }
}

static int FN(mha_adam_step)(real *p, real *m, real *v, const real *g, int64_t n, double lr,
                             double beta1, double beta2, double eps, double weight_decay,
                             int decoupled, int64_t step) {
    if (n < 0 || step < 1) return MHA_EINVAL;
    const int decay = weight_decay != 0 && decoupled;
    FN(adam_job) job = {
        p, m, v, g, n,
        (real)(decay ? 1.0 - lr * weight_decay : 1.0), (real)weight_decay,
        (real)(1.0 - beta1), (real)beta2, (real)(1.0 - beta2),
        (real)sqrt(1.0 - pow(beta2, (double)step)), (real)eps,
        (real)(lr / (1.0 - pow(beta1, (double)step))),
        weight_decay != 0 && !decoupled,
    };
    const int64_t tasks = (n + MHA_ADAM_BLOCK - 1) / MHA_ADAM_BLOCK;
    mha_parallel_for(mha_threads_for(12.0 * (double)n), tasks, 1, FN(adam_task), &job);
    return MHA_OK;
}

#undef DACT_CHUNK
#undef COLUMN_BLOCK
#undef IGNORE_LABEL
#undef XENT_CHUNK_BYTES
#if MHA_GNU_C
#undef BVEC
#undef BVL
#endif
