/* attention_impl.h: scaled dot-product attention, forward and backward, for a type `real`.
 * Included by attention.c with real (float|double), SFX (f32|f64) and EXP (expf|exp) defined.
 *
 * Without weights the forward is fused (fused_forward below: key tiles, online softmax, O(n)
 * scratch). With weights, and in the backward, work is split into query blocks of up to BQ rows. A block's scores S (rows, n_k) are
 * computed by one GEMM, turned into probabilities row by row (the whole row is in hand, so
 * the softmax is exact and needs no running rescale), and multiplied into V by a second GEMM.
 * The scratch is O(BQ * n_k) per thread, never n_q x n_k, unless the weights are requested.
 * The backward recomputes P with the same code, so it needs nothing saved by the forward.
 */

/* Rows of one query block: at most BQ_MAX, fewer when n_k is so long that the block's
 * scores would pass about 4 MiB. */
#define BQ_MAX 128
static int64_t FN(block_rows)(int64_t n_k) {
    int64_t rows = (int64_t)((4u << 20) / sizeof(real)) / MHA_MAX(n_k, 1);
    return MHA_MAX(1, MHA_MIN(BQ_MAX, rows));
}

/* Rows flagged dead (every key masked) are set to exactly 0, whatever v or k hold. */
static void FN(zero_dead_rows)(real *x, int64_t ld, int64_t width, const uint8_t *dead,
                               int64_t rows) {
    for (int64_t r = 0; r < rows; r++)
        if (dead[r]) memset(x + r * ld, 0, (size_t)width * sizeof(real));
}

/* Keys that a causal block's last row can see: columns [0, n_visible) of the block. */
static int64_t FN(visible_keys)(const mha_attention_desc *d, int64_t i_last) {
    if (!d->causal) return d->n_k;
    int64_t last = i_last + (d->n_k - d->n_q);
    return MHA_MAX(0, MHA_MIN(d->n_k, last + 1));
}

/* P (rows, n_vis) with row stride ld: the attention probabilities of query rows
 * [i0, i0 + rows) of head (b, h). On entry P holds scale * q k^T; masks are applied here.
 * A row with no finite score becomes all zeros and is flagged in dead[r]. */
MHA_HOT static void FN(softmax_rows)(real *P, uint8_t *dead, int64_t ld, int64_t rows,
                                     int64_t n_vis, int64_t b, int64_t h, int64_t i0,
                                     const mha_attention_desc *d) {
    const int64_t shift = d->n_k - d->n_q;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = i0 + r;
        real *p = P + r * ld;
        /* 1. masks: float added; bool, key padding and causal set -inf */
        if (d->mask_kind != MHA_MASK_NONE) {
            int64_t base = b * d->mask_strides[0] + h * d->mask_strides[1] + i * d->mask_strides[2];
            int64_t sj = d->mask_strides[3];
            if (d->mask_kind == MHA_MASK_FLOAT) {
                const real *m = (const real *)d->mask + base;
                for (int64_t j = 0; j < n_vis; j++) p[j] += m[j * sj];
            } else {
                const uint8_t *m = (const uint8_t *)d->mask + base;
                for (int64_t j = 0; j < n_vis; j++)
                    if (!m[j * sj]) p[j] = -INFINITY;
            }
        }
        if (d->key_padding) {
            const uint8_t *kp = d->key_padding + b * d->key_padding_stride;
            for (int64_t j = 0; j < n_vis; j++)
                if (!kp[j]) p[j] = -INFINITY;
        }
        int64_t n_row = n_vis; /* columns this row may see */
        if (d->causal) n_row = MHA_MAX(0, MHA_MIN(n_vis, i + shift + 1));
        /* 2. max (NaN propagates) */
        real m = FN(mha_max)(p, n_row);
        dead[r] = m == -INFINITY;
        if (dead[r]) { /* every key masked: the row is 0 */
            memset(p, 0, (size_t)n_vis * sizeof(real));
            continue;
        }
        /* 3. exp and normalise */
        real sum = FN(mha_exp_sum)(p, n_row, m);
        FN(mha_scale)(p, n_row, 1 / sum);
        for (int64_t j = n_row; j < n_vis; j++) p[j] = 0;
    }
}

/* A = P * keep / (1 - p): dropout of rows [i0, i0 + rows) of head (b, h), out of place
 * (A may equal P). */
static void FN(dropout_rows)(real *A, const real *P, int64_t ld, int64_t rows, int64_t n_vis,
                             int64_t b, int64_t h, int64_t i0, const mha_attention_desc *d) {
    const double p_drop = d->dropout;
    const real keep_scale = (real)(1.0 / (1.0 - p_drop));
    for (int64_t r = 0; r < rows; r++) {
        uint64_t state = mha_dropout_row_state(d->seed, (uint64_t)b, (uint64_t)h, (uint64_t)(i0 + r));
        for (int64_t j = 0; j < n_vis; j++) {
            int keep = mha_uniform_from_state(state, (uint64_t)j) >= p_drop;
            A[r * ld + j] = keep ? P[r * ld + j] * keep_scale : 0;
        }
    }
}

/* Pointers to head (b, h) of a view. */
#define AT(ptr, view, b, h) ((ptr) + (b) * (view).batch + (h) * (view).head)

/* Scores then probabilities of one query block into P; returns the visible key count. */
static int64_t FN(block_probs)(real *P, uint8_t *dead, int64_t ld, real *gemm_ws, const real *q_bh,
                               const real *k_bh, int64_t b, int64_t h, int64_t i0, int64_t rows,
                               const mha_attention_desc *d) {
    int64_t n_vis = FN(visible_keys)(d, i0 + rows - 1);
    FN(mha_gemm_ws)(0, 1, rows, n_vis, d->d_k, (real)d->scale, q_bh + i0 * d->q.row, d->q.row,
                    k_bh, d->k.row, 0, P, ld, gemm_ws, 1);
    FN(softmax_rows)(P, dead, ld, rows, n_vis, b, h, i0, d);
    return n_vis;
}

static size_t FN(attention_gemm_ws)(const mha_attention_desc *d, int64_t bq) {
    size_t ws = 0, w;
    int64_t dk = MHA_MAX(d->d_k, d->d_v);
    w = FN(mha_gemm_workspace)(bq, d->n_k, dk, 1);      ws = MHA_MAX(ws, w); /* S, dA        */
    w = FN(mha_gemm_workspace)(bq, dk, d->n_k, 1);      ws = MHA_MAX(ws, w); /* O, dQ        */
    w = FN(mha_gemm_workspace)(d->n_k, dk, bq, 1);      ws = MHA_MAX(ws, w); /* dK, dV       */
    return mha_round_up(ws, MHA_CACHE_LINE);
}

/* Threads and per-thread scratch for `tasks` independent tasks doing `flops` in all. Each
 * thread owns n_buffers blocks of (bq, ld), then `extra` elements, then a GEMM workspace
 * starting at byte gemm_offset of its slice. */
typedef struct {
    int threads;
    int64_t chunk;      /* tasks per fetch: several when they are tiny */
    size_t per_thread;  /* bytes of scratch each thread owns */
    size_t gemm_offset; /* where its GEMM workspace starts */
    char *scratch;      /* threads * per_thread bytes, freed by the caller */
} FN(plan);

static int FN(make_plan)(FN(plan) *pl, const mha_attention_desc *d, int64_t tasks, double flops,
                         int64_t bq, int64_t ld, int n_buffers, int64_t extra) {
    int ok = 1;
    size_t elems = mha_mul_size(mha_mul_size((size_t)bq, (size_t)ld, &ok), (size_t)n_buffers, &ok);
    if (__builtin_add_overflow(elems, (size_t)extra, &elems)) ok = 0;
    pl->gemm_offset = mha_round_up(mha_mul_size(elems, sizeof(real), &ok), MHA_CACHE_LINE);
    pl->per_thread = pl->gemm_offset + FN(attention_gemm_ws)(d, bq);
    pl->threads = (int)MHA_MIN((int64_t)mha_threads_for(flops), tasks);
    pl->chunk = MHA_MAX(1, tasks / (8 * pl->threads));
    if (!ok || pl->per_thread > SIZE_MAX / (size_t)pl->threads) return MHA_ENOMEM;
    pl->scratch = mha_alloc(pl->per_thread * (size_t)pl->threads);
    return pl->scratch ? MHA_OK : MHA_ENOMEM;
}

/* Sizes that the core can take: non-negative, kv_heads dividing heads. */
static int FN(check_desc)(const mha_attention_desc *d) {
    if (d->batch < 0 || d->heads < 0 || d->kv_heads < 0 || d->n_q < 0 || d->n_k < 0 ||
        d->d_k < 0 || d->d_v < 0)
        return MHA_EINVAL;
    if (d->heads > 0 && (d->kv_heads == 0 || d->heads % d->kv_heads != 0)) return MHA_EINVAL;
    return MHA_OK;
}

#define NONE(a, b, c, e) ((a) == 0 || (b) == 0 || (c) == 0 || (e) == 0) /* an empty 4-D array */

/* ---- the fused forward (no weights requested) ---------------------------------------------
 * Tasks are (b, key/value head, chunk of query rows). A task packs each tile of BK keys (K^T
 * and V) once, then runs every query block of its chunk, for every query head of the group,
 * against it: S = scale * q k^T for (BQF x BK), the online softmax (running max m and sum l
 * per row; earlier output rescaled by exp(m_old - m_new)), and out += exp(S - m) v. Out holds
 * the unnormalised sum until the last tile; then each row is divided by l. Each row sees the
 * tiles in the same order whatever the chunking, so results do not depend on the threads.
 * Scratch per thread: two packed tiles, one block of scores, and m, l of the chunk's rows. */
#define BK 256
#define BQF 64

/* The online-softmax step for a block of scores S (rows, cols) of key tile j0: masks, then
 * per row m_new = max(m, max S), alpha = exp(m - m_new), S = exp(S - m_new) (0 where masked,
 * and for columns [ncols, cols) that no row of the block may see), l = alpha * l + sum S.
 * Dropout scales the kept entries of S after the sum (l is the undropped normaliser). */
MHA_HOT static void FN(online_softmax_tile)(real *S, int64_t ld, int64_t rows, int64_t ncols,
                                            int64_t cols, int64_t b, int64_t h, int64_t i0,
                                            int64_t j0, real *m, real *l, real *alpha,
                                            const mha_attention_desc *d) {
    const int64_t shift = d->n_k - d->n_q;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = i0 + r;
        real *p = S + r * ld;
        if (d->mask_kind != MHA_MASK_NONE) {
            int64_t base = b * d->mask_strides[0] + h * d->mask_strides[1] + i * d->mask_strides[2];
            int64_t sj = d->mask_strides[3];
            base += j0 * sj;
            if (d->mask_kind == MHA_MASK_FLOAT) {
                const real *mk = (const real *)d->mask + base;
                for (int64_t j = 0; j < ncols; j++) p[j] += mk[j * sj];
            } else {
                const uint8_t *mk = (const uint8_t *)d->mask + base;
                for (int64_t j = 0; j < ncols; j++)
                    if (!mk[j * sj]) p[j] = -INFINITY;
            }
        }
        if (d->key_padding) {
            const uint8_t *kp = d->key_padding + b * d->key_padding_stride + j0;
            for (int64_t j = 0; j < ncols; j++)
                if (!kp[j]) p[j] = -INFINITY;
        }
        int64_t n_row = ncols;
        if (d->causal) n_row = MHA_MAX(0, MHA_MIN(ncols, i + shift + 1 - j0));
        real t_max = FN(mha_max)(p, n_row);
        real m_new = t_max > m[r] ? t_max : m[r];
        if (t_max != t_max) m_new = t_max;
        if (m_new == -INFINITY) { /* nothing seen yet */
            memset(p, 0, (size_t)cols * sizeof(real));
            alpha[r] = 1;
            continue;
        }
        alpha[r] = m_new == m[r] ? 1 : EXP(m[r] - m_new);
        real sum = FN(mha_exp_sum)(p, n_row, m_new);
        memset(p + n_row, 0, (size_t)(cols - n_row) * sizeof(real));
        l[r] = l[r] * alpha[r] + sum;
        m[r] = m_new;
        if (d->dropout > 0) {
            const real keep_scale = (real)(1.0 / (1.0 - d->dropout));
            uint64_t state = mha_dropout_row_state(d->seed, (uint64_t)b, (uint64_t)h, (uint64_t)i);
            for (int64_t j = 0; j < n_row; j++) {
                int keep = mha_uniform_from_state(state, (uint64_t)(j0 + j)) >= d->dropout;
                p[j] = keep ? p[j] * keep_scale : 0;
            }
        }
    }
}

/* out (by d->out) without weights; lse (B, H, n_q) contiguous or NULL receives m + log(l)
 * (-inf for fully masked rows). */
static int FN(fused_forward)(real *out, real *lse, const real *q, const real *k, const real *v,
                             const mha_attention_desc *d) {
    const int64_t B = d->batch, H = d->heads, H_kv = d->kv_heads, group = H / H_kv;
    const int64_t q_blocks = (d->n_q + BQF - 1) / BQF;
    const double flops = 2.0 * B * H * d->n_q * d->n_k * (double)(d->d_k + d->d_v);
    const int threads = mha_threads_for(flops);
    /* chunks of query blocks per (b, kv head): enough tasks to balance the threads */
    const int64_t want = (4 * (int64_t)threads + B * H_kv - 1) / (B * H_kv);
    const int64_t chunks = MHA_MAX(1, MHA_MIN(q_blocks, threads > 1 ? want : 1));
    const int64_t tasks = B * H_kv * chunks;
    const int64_t chunk_rows = (q_blocks + chunks - 1) / chunks * BQF;
    const size_t kp_elems = mha_round_up(FN(mha_packed_b_size)(d->d_k, BK), MHA_CACHE_LINE);
    const size_t vp_elems = mha_round_up(FN(mha_packed_b_size)(BK, d->d_v), MHA_CACHE_LINE);
    const size_t s_elems = (size_t)BQF * BK;
    int ok = 1;
    size_t row_elems = mha_mul_size((size_t)group, (size_t)chunk_rows, &ok);
    size_t per_thread = kp_elems + vp_elems + s_elems + BQF;
    if (__builtin_add_overflow(per_thread, mha_mul_size(row_elems, 2, &ok), &per_thread)) ok = 0;
    per_thread = mha_round_up(mha_mul_size(per_thread, sizeof(real), &ok), MHA_CACHE_LINE);
    const int nt = (int)MHA_MIN((int64_t)threads, tasks);
    if (!ok || per_thread > SIZE_MAX / (size_t)nt) return MHA_ENOMEM;
    char *scratch = mha_alloc(per_thread * (size_t)nt);
    if (!scratch) return MHA_ENOMEM;

#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
#endif
    for (int64_t task = 0; task < tasks; task++) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        real *Kp = (real *)(scratch + (size_t)t * per_thread);
        real *Vp = Kp + kp_elems, *S = Vp + vp_elems, *alpha = S + s_elems;
        real *m = alpha + BQF, *l = m + row_elems;
        const int64_t b = task / (H_kv * chunks), g = task / chunks % H_kv, c = task % chunks;
        const int64_t r0 = MHA_MIN(d->n_q, q_blocks * c / chunks * BQF);
        const int64_t r1 = MHA_MIN(d->n_q, q_blocks * (c + 1) / chunks * BQF);
        const real *k_bg = AT(k, d->k, b, g), *v_bg = AT(v, d->v, b, g);
        for (int64_t hh = 0; hh < group; hh++) {
            real *o_bh = AT(out, d->out, b, g * group + hh);
            for (int64_t i = r0; i < r1; i++) memset(o_bh + i * d->out.row, 0, (size_t)d->d_v * sizeof(real));
        }
        for (size_t e = 0; e < row_elems; e++) { m[e] = -INFINITY; l[e] = 0; }
        const int64_t n_seen = r1 > r0 ? FN(visible_keys)(d, r1 - 1) : 0;
        for (int64_t j0 = 0; j0 < n_seen; j0 += BK) {
            const int64_t cols = MHA_MIN(BK, d->n_k - j0);
            FN(mha_pack_b_full)(Kp, k_bg + j0 * d->k.row, d->k.row, 1, d->d_k, cols);
            FN(mha_pack_b_full)(Vp, v_bg + j0 * d->v.row, d->v.row, 0, cols, d->d_v);
            for (int64_t hh = 0; hh < group; hh++) {
                const int64_t h = g * group + hh;
                const real *q_bh = AT(q, d->q, b, h);
                real *o_bh = AT(out, d->out, b, h);
                for (int64_t i0 = r0; i0 < r1; i0 += BQF) {
                    const int64_t rows = MHA_MIN(BQF, r1 - i0);
                    const int64_t ncols = MHA_MIN(cols, FN(visible_keys)(d, i0 + rows - 1) - j0);
                    if (ncols <= 0) continue;
                    real *m_blk = m + hh * chunk_rows + (i0 - r0), *l_blk = l + hh * chunk_rows + (i0 - r0);
                    real *o_blk = o_bh + i0 * d->out.row;
                    FN(mha_gemm_packed)(rows, ncols, d->d_k, (real)d->scale, q_bh + i0 * d->q.row,
                                        d->q.row, Kp, 0, S, BK);
                    FN(online_softmax_tile)(S, BK, rows, ncols, cols, b, h, i0, j0, m_blk, l_blk, alpha, d);
                    for (int64_t r = 0; r < rows; r++)
                        if (alpha[r] != 1) FN(mha_scale)(o_blk + r * d->out.row, d->d_v, alpha[r]);
                    FN(mha_gemm_packed)(rows, d->d_v, cols, 1, S, BK, Vp, 1, o_blk, d->out.row);
                }
            }
        }
        for (int64_t hh = 0; hh < group; hh++) {
            const int64_t h = g * group + hh;
            real *o_bh = AT(out, d->out, b, h);
            for (int64_t i = r0; i < r1; i++) {
                const real mi = m[hh * chunk_rows + (i - r0)], li = l[hh * chunk_rows + (i - r0)];
                real *o = o_bh + i * d->out.row;
                if (mi == -INFINITY) memset(o, 0, (size_t)d->d_v * sizeof(real));
                else FN(mha_scale)(o, d->d_v, 1 / li);
                if (lse) lse[(b * H + h) * d->n_q + i] = mi == -INFINITY ? -INFINITY : mi + (real)log((double)li);
            }
        }
    }
    free(scratch);
    return MHA_OK;
}

/* Forward
 * out: (B, H, n_q, d_v) by d->out   weights: (B, H, n_q, n_k) contiguous or NULL
 * q: (B, H, n_q, d_k)   k: (B, H_kv, n_k, d_k)   v: (B, H_kv, n_k, d_v)   */
int FN(mha_attention_forward)(real *out, real *weights, const real *q, const real *k,
                              const real *v, const mha_attention_desc *d) {
    if (FN(check_desc)(d)) return MHA_EINVAL;
    const int64_t B = d->batch, H = d->heads;
    /* nothing to write (this also bounds the task count below by an array's size) */
    if (NONE(B, H, d->n_q, d->d_v) && (!weights || NONE(B, H, d->n_q, d->n_k))) return MHA_OK;
    if (!weights) return FN(fused_forward)(out, NULL, q, k, v, d);
    const int64_t group = d->heads / d->kv_heads;
    const int64_t bq = FN(block_rows)(d->n_k), ld = MHA_MAX(d->n_k, 1);
    const int64_t q_blocks = (d->n_q + bq - 1) / bq;
    const int64_t tasks = B * H * q_blocks;
    FN(plan) pl;
    if (FN(make_plan)(&pl, d, tasks, 2.0 * B * H * d->n_q * d->n_k * (double)(d->d_k + d->d_v),
                      bq, ld, 1, 0))
        return MHA_ENOMEM;

#ifdef _OPENMP
#pragma omp parallel for num_threads(pl.threads) schedule(dynamic, pl.chunk) if (pl.threads > 1)
#endif
    for (int64_t task = 0; task < tasks; task++) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        real *P = (real *)(pl.scratch + (size_t)t * pl.per_thread);
        real *gemm_ws = (real *)((char *)P + pl.gemm_offset);
        const int64_t b = task / (H * q_blocks), h = task / q_blocks % H;
        const int64_t i0 = task % q_blocks * bq, rows = MHA_MIN(bq, d->n_q - i0);
        const real *q_bh = AT(q, d->q, b, h);
        const real *k_bh = AT(k, d->k, b, h / group), *v_bh = AT(v, d->v, b, h / group);
        real *o_blk = AT(out, d->out, b, h) + i0 * d->out.row;

        // 1. P = softmax(scale * q k^T + masks), block (rows, n_vis)
        uint8_t dead[BQ_MAX];
        int64_t n_vis = FN(block_probs)(P, dead, ld, gemm_ws, q_bh, k_bh, b, h, i0, rows, d);
        if (weights) {
            real *w = weights + ((b * H + h) * d->n_q + i0) * d->n_k;
            for (int64_t r = 0; r < rows; r++) {
                memcpy(w + r * d->n_k, P + r * ld, (size_t)n_vis * sizeof(real));
                memset(w + r * d->n_k + n_vis, 0, (size_t)(d->n_k - n_vis) * sizeof(real));
            }
        }
        // 2. A = dropout(P), in place
        if (d->dropout > 0) FN(dropout_rows)(P, P, ld, rows, n_vis, b, h, i0, d);
        // 3. O = A v
        FN(mha_gemm_ws)(0, 0, rows, d->d_v, n_vis, 1, P, ld, v_bh, d->v.row, 0, o_blk,
                        d->out.row, gemm_ws, 1);
        FN(zero_dead_rows)(o_blk, d->out.row, d->d_v, dead, rows);
    }
    free(pl.scratch);
    return MHA_OK;
}

/* Backward: tasks are (b, key/value head), because dK and dV gather from every query row of
 * every query head in the group.
 * dq like q, dk like k, dv like v; d_out like out.   */
int FN(mha_attention_backward)(real *dq, real *dk, real *dv, const real *d_out, const real *q,
                               const real *k, const real *v, const mha_attention_desc *d) {
    if (FN(check_desc)(d)) return MHA_EINVAL;
    const int64_t B = d->batch, H = d->heads, H_kv = d->kv_heads;
    if (NONE(B, H, d->n_q, d->d_k) && NONE(B, H_kv, d->n_k, d->d_k) && NONE(B, H_kv, d->n_k, d->d_v))
        return MHA_OK;
    const int64_t group = H / H_kv;
    const int64_t bq = FN(block_rows)(d->n_k), ld = MHA_MAX(d->n_k, 1);
    const int64_t tasks = B * H_kv;
    FN(plan) pl;
    if (FN(make_plan)(&pl, d, tasks, 5.0 * B * H * d->n_q * d->n_k * (double)(d->d_k + d->d_v),
                      bq, ld, 3, bq * d->d_v))
        return MHA_ENOMEM;

#ifdef _OPENMP
#pragma omp parallel for num_threads(pl.threads) schedule(dynamic, pl.chunk) if (pl.threads > 1)
#endif
    for (int64_t task = 0; task < tasks; task++) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        char *mine = pl.scratch + (size_t)t * pl.per_thread;
        real *P = (real *)mine;                                /* probabilities  (rows, n_vis) */
        real *D = P + (size_t)bq * ld;                          /* dA, dP, then dS              */
        real *A = d->dropout > 0 ? D + (size_t)bq * ld : P;     /* P after dropout              */
        real *dO_live = P + 3 * (size_t)bq * ld;                /* d_out, fully masked rows 0   */
        real *gemm_ws = (real *)(mine + pl.gemm_offset);
        const int64_t b = task / H_kv, g = task % H_kv;
        const real *k_bg = AT(k, d->k, b, g), *v_bg = AT(v, d->v, b, g);
        real *dk_bg = AT(dk, d->k, b, g), *dv_bg = AT(dv, d->v, b, g);
        for (int64_t j = 0; j < d->n_k; j++) {
            memset(dk_bg + j * d->k.row, 0, (size_t)d->d_k * sizeof(real));
            memset(dv_bg + j * d->v.row, 0, (size_t)d->d_v * sizeof(real));
        }
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            const real *q_bh = AT(q, d->q, b, h), *do_bh = AT(d_out, d->out, b, h);
            real *dq_bh = AT(dq, d->q, b, h);
            for (int64_t i0 = 0; i0 < d->n_q; i0 += bq) {
                const int64_t rows = MHA_MIN(bq, d->n_q - i0);
                const real *q_blk = q_bh + i0 * d->q.row, *do_blk = do_bh + i0 * d->out.row;
                int64_t do_ld = d->out.row;
                real *dq_blk = dq_bh + i0 * d->q.row;
                // forward 1: P = softmax(scale * q k^T + masks), recomputed
                uint8_t dead[BQ_MAX];
                int64_t n_vis = FN(block_probs)(P, dead, ld, gemm_ws, q_bh, k_bg, b, h, i0, rows, d);
                // a fully masked row has no output: its d_out (even NaN) must not reach dk, dv
                if (memchr(dead, 1, (size_t)rows)) {
                    for (int64_t r = 0; r < rows; r++) {
                        if (dead[r]) memset(dO_live + r * d->d_v, 0, (size_t)d->d_v * sizeof(real));
                        else memcpy(dO_live + r * d->d_v, do_blk + r * d->out.row, (size_t)d->d_v * sizeof(real));
                    }
                    do_blk = dO_live;
                    do_ld = d->d_v;
                }
                // forward 2: A = dropout(P)
                if (d->dropout > 0) FN(dropout_rows)(A, P, ld, rows, n_vis, b, h, i0, d);
                // forward 3: O = A v  ->  dv += A^T dO,  dA = dO v^T
                FN(mha_gemm_ws)(1, 0, n_vis, d->d_v, rows, 1, A, ld, do_blk, do_ld, 1,
                                dv_bg, d->v.row, gemm_ws, 1);
                FN(mha_gemm_ws)(0, 1, rows, n_vis, d->d_v, 1, do_blk, do_ld, v_bg,
                                d->v.row, 0, D, ld, gemm_ws, 1);
                // forward 2: A = P * Z  ->  dP = dA * Z  (Z = A / P, regenerated)
                if (d->dropout > 0) {
                    const real keep_scale = (real)(1.0 / (1.0 - d->dropout));
                    for (int64_t r = 0; r < rows; r++) {
                        uint64_t state = mha_dropout_row_state(d->seed, (uint64_t)b, (uint64_t)h,
                                                               (uint64_t)(i0 + r));
                        for (int64_t j = 0; j < n_vis; j++) {
                            int keep = mha_uniform_from_state(state, (uint64_t)j) >= d->dropout;
                            D[r * ld + j] = keep ? D[r * ld + j] * keep_scale : 0;
                        }
                    }
                }
                // forward 1 (softmax): dS = P * (dP - rowsum(P * dP))
                for (int64_t r = 0; r < rows; r++) {
                    const real *p = P + r * ld;
                    real *ds = D + r * ld;
                    real dot = 0;
                    for (int64_t j = 0; j < n_vis; j++) dot += p[j] * ds[j];
                    for (int64_t j = 0; j < n_vis; j++) ds[j] = p[j] * (ds[j] - dot);
                }
                // forward 1 (scores S = scale * q k^T): dq = scale * dS k,  dk += scale * dS^T q
                FN(mha_gemm_ws)(0, 0, rows, d->d_k, n_vis, (real)d->scale, D, ld, k_bg,
                                d->k.row, 0, dq_blk, d->q.row, gemm_ws, 1);
                FN(zero_dead_rows)(dq_blk, d->q.row, d->d_k, dead, rows);
                FN(mha_gemm_ws)(1, 0, n_vis, d->d_k, rows, (real)d->scale, D, ld, q_blk,
                                d->q.row, 1, dk_bg, d->k.row, gemm_ws, 1);
            }
        }
    }
    free(pl.scratch);
    return MHA_OK;
}

#undef AT
#undef NONE
#undef BQ_MAX
#undef BK
#undef BQF
