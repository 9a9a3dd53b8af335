/* attention_impl.h: scaled dot-product attention, forward and backward, for a type `real`.
 * Included by kernels.h with real (float|double), SFX (f32|f64) and EXP (expf|exp) defined,
 * once per kernel unit.
 *
 * Without weights the forward is fused (fused_forward: tiles of BK keys against blocks of BQF
 * query rows, online softmax, O(n) scratch) and can save each row's log-sum-exp; the backward
 * (fused_backward, FlashAttention-2's scheme) rebuilds P tile by tile from it, running the
 * fused forward first when the caller has not kept out and lse.
 * With weights, the forward works on query blocks of up to BQ_MAX rows: a block's scores
 * (rows, n_k) come from one GEMM, become probabilities row by row (the whole row is in hand)
 * and are copied out, then multiplied into V by a second GEMM.
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

/* Soft-capping (d->softcap = c > 0) of the scores p[0:ncols] of query row i against keys
 * [j0, j0 + ncols): p = c tanh(p / c), before the masks (mask_row), on the keys the row may see
 * (all ncols with dt, which then receives 1 - tanh^2 of every column, for the backward). */
static inline void FN(softcap_row)(real *p, real *dt, int64_t ncols, int64_t i, int64_t j0,
                                   const mha_attention_desc *d) {
    int64_t n = ncols;
    if (d->causal && !dt) n = MHA_MAX(0, MHA_MIN(ncols, i + (d->n_k - d->n_q) + 1 - j0));
    VN(mha_softcap)(p, n, (real)d->softcap, dt);
}

/* Masks on the scores p[0:ncols] of query row i against keys [j0, j0 + ncols) of head (b, h):
 * a float mask is added; bool mask, key padding set -inf. Returns the columns the row may
 * see (fewer than ncols when causal); the caller ignores the rest. */
static inline int64_t FN(mask_row)(real *p, int64_t ncols, int64_t b, int64_t h, int64_t i,
                                   int64_t j0, const mha_attention_desc *d) {
    if (d->mask_kind != MHA_MASK_NONE) {
        const int64_t sj = d->mask_strides[3];
        const int64_t base = b * d->mask_strides[0] + h * d->mask_strides[1] +
                             i * d->mask_strides[2] + j0 * sj;
        if (d->mask_kind == MHA_MASK_FLOAT) {
            const real *m = (const real *)d->mask + base;
            for (int64_t j = 0; j < ncols; j++) p[j] += m[j * sj];
        } else {
            const uint8_t *m = (const uint8_t *)d->mask + base;
            for (int64_t j = 0; j < ncols; j++)
                if (!m[j * sj]) p[j] = -INFINITY;
        }
    }
    if (d->key_padding) {
        const uint8_t *kp = d->key_padding + b * d->key_padding_stride + j0;
        for (int64_t j = 0; j < ncols; j++)
            if (!kp[j]) p[j] = -INFINITY;
    }
    if (!d->causal) return ncols;
    return MHA_MAX(0, MHA_MIN(ncols, i + (d->n_k - d->n_q) + 1 - j0));
}

/* ---- row statistics (mha_row_stats) --------------------------------------------------------
 * Every statistic is linear in a row's weights P_j = e_j / l, e_j = exp(s_j - m), once the
 * row's max m and sum l are known; so each is a running sum over the keys seen, rescaled by
 * alpha = exp(m_old - m_new) when the max grows, as the output is, then divided by l:
 *   entropy = log l - sum_j e_j (s_j - m) / l   (-sum P log P, with log P_j = s_j - m - log l)
 *   max weight = 1 / l (the max's own e is 1), key-set mass = sum_{j in set} e_j / l,
 *   distance = sum_j e_j |a - j| / l;
 * the entropy's sum, relative to m, becomes alpha (sum + (m_old - m_new) l_old) when the max
 * moves. The weights at keys a - 1, a, a + 1 and the argmax come from the scores themselves
 * (P_j = exp(s_j - m) / l at the end). The masked scores s are kept across the exp (which
 * overwrites them) in a row's copy. */

/* One row's running sums over the keys seen so far, relative to the running max m. */
typedef struct {
    real ent;                    /* sum_j e_j (s_j - m) (masked keys add nothing)        */
    real in_set;                 /* sum_j e_j over the keys of the key set                */
    real dist;                   /* sum_j e_j |a - j|                                     */
    real s_self, s_prev, s_next; /* the scores at keys a, a - 1, a + 1; -inf until seen   */
    int64_t argmax;              /* the first key of the largest score so far; -1: none   */
} FN(row_acc);

/* A thread's scratch for the statistics: every pointer NULL when none are asked. */
typedef struct {
    const TY(mha_row_stats) *out; /* the outputs                                          */
    FN(row_acc) *acc;             /* one per row of a task                                */
    real *s;                      /* (keys of a tile): a row's masked scores             */
    real *in_set;                 /* (keys of a tile): 1 for the keys of the set, else 0; */
} FN(stats_scratch);              /*   NULL without key_set_mass                          */

static void FN(stats_scratch_layout)(FN(stats_scratch) *s, mha_carver *c,
                                     const mha_attention_desc *d, size_t rows, size_t keys) {
    const TY(mha_row_stats) *out = d->row_stats;
    s->out = out;
    s->acc = mha_carve(c, out ? rows : 0, sizeof(FN(row_acc)));
    s->s = mha_carve(c, out ? keys : 0, sizeof(real));
    s->in_set = mha_carve(c, out && out->key_set_mass ? keys : 0, sizeof(real));
    if (!out) s->acc = NULL, s->s = NULL;
    if (!(out && out->key_set_mass)) s->in_set = NULL;
}

/* in_set[0:n] = 1 where batch b's key set holds keys j0 .. j0 + n - 1, else 0. */
static void FN(fill_in_set)(real *in_set, const TY(mha_row_stats) *out, int64_t b, int64_t j0,
                            int64_t n) {
    const uint8_t *ks = out->key_set + b * out->key_set_stride + j0;
    for (int64_t j = 0; j < n; j++) in_set[j] = ks[j] ? 1 : 0;
}

static void FN(row_acc_init)(FN(row_acc) *acc, int64_t n) {
    for (int64_t r = 0; r < n; r++)
        acc[r] = (FN(row_acc)){0, 0, 0, -INFINITY, -INFINITY, -INFINITY, -1};
}

/* From the masked scores s[0:n] of keys j0 .. j0 + n - 1, before the exp: the scores at keys
 * a - 1, a, a + 1, and the argmax when the tile's max t_max passes the max m_old before it
 * (strictly: the first key of a tie stays). */
static void FN(row_acc_scores)(FN(row_acc) *acc, const real *s, int64_t n, int64_t j0,
                               int64_t a, real m_old, real t_max) {
    if (a >= j0 && a < j0 + n) acc->s_self = s[a - j0];
    if (a - 1 >= j0 && a - 1 < j0 + n) acc->s_prev = s[a - 1 - j0];
    if (a + 1 >= j0 && a + 1 < j0 + n) acc->s_next = s[a + 1 - j0];
    if (t_max > m_old) {
        int64_t j = 0;
        while (j < n && !(s[j] == t_max)) j++;
        acc->argmax = j0 + j;
    }
}

/* The sums moved from the max m_old (sum l_old) to m_new: alpha = exp(m_old - m_new). */
static void FN(row_acc_rescale)(FN(row_acc) *acc, real alpha, real m_old, real m_new,
                                real l_old) {
    if (m_old == m_new) return;
    acc->ent = m_old == -INFINITY ? 0 : alpha * (acc->ent + (m_old - m_new) * l_old);
    acc->in_set *= alpha;
    acc->dist *= alpha;
}

/* Adds keys j0 .. j0 + n - 1 to the sums: e[0:n] = exp(s - m), s[0:n] the masked scores,
 * in_set[0:n] the key set's indicator (or NULL), a the query's aligned position. */
static void FN(row_acc_add)(FN(row_acc) *acc, const real *e, const real *s,
                            const real *in_set, int64_t n, int64_t j0, int64_t a, real m) {
    real ent = 0, set = 0, dist = 0;
    const real d0 = (real)(j0 - a); /* j - a at the tile's key 0 */
    int64_t j = 0;
#if MHA_GNU_C
    typedef real vreal __attribute__((vector_size(MHA_VEC_BYTES)));
    typedef __typeof__((vreal){0} < (vreal){0}) vmask; /* a compare's result: 0 or all ones */
    enum { VL = MHA_VEC_BYTES / sizeof(real) };
    vreal v_ent = {0}, v_set = {0}, v_dist = {0}, lane = {0};
    for (int i = 0; i < VL; i++) lane[i] = (real)i;
    for (; j + VL <= n; j += VL) {
        vreal ve, vs, vk, t, dj;
        MHA_VLOAD(ve, e + j);
        MHA_VLOAD(vs, s + j);
        /* a masked key has e = 0 and s = -inf: its 0 * -inf (NaN) is dropped */
        t = ve * (vs - m);
        v_ent += (vreal)((vmask)t & (ve != (vreal){0}));
        if (in_set) {
            MHA_VLOAD(vk, in_set + j);
            v_set += ve * vk;
        }
        dj = lane + (d0 + (real)j);
        vmask neg = dj < (vreal){0};
        dj = (vreal)(((vmask)((vreal){0} - dj) & neg) | ((vmask)dj & ~neg)); /* |j - a| */
        v_dist += ve * dj;
    }
    for (int i = 0; i < VL; i++) ent += v_ent[i], set += v_set[i], dist += v_dist[i];
#endif
    for (; j < n; j++) {
        if (e[j] != 0) ent += e[j] * (s[j] - m);
        if (in_set) set += e[j] * in_set[j];
        const real dj = d0 + (real)j;
        dist += e[j] * (dj < 0 ? -dj : dj);
    }
    acc->ent += ent;
    acc->in_set += set;
    acc->dist += dist;
}

/* The statistics of row `at` ((b * H + h) * n_q + i) from its sums, max m and sum l
 * (m = -inf: fully masked, every statistic 0 and argmax -1). */
static void FN(row_stats_store)(const TY(mha_row_stats) *o, int64_t at, const FN(row_acc) *acc,
                                real m, real l) {
    if (m == -INFINITY) { /* acc may be NULL */
        if (o->entropy) o->entropy[at] = 0;
        if (o->max_weight) o->max_weight[at] = 0;
        if (o->argmax) o->argmax[at] = -1;
        if (o->key_set_mass) o->key_set_mass[at] = 0;
        if (o->self_weight) o->self_weight[at] = 0;
        if (o->prev_weight) o->prev_weight[at] = 0;
        if (o->next_weight) o->next_weight[at] = 0;
        if (o->distance) o->distance[at] = 0;
        return;
    }
    const real inv = 1 / l;
    if (o->entropy) o->entropy[at] = (real)log((double)l) - acc->ent * inv;
    if (o->max_weight) o->max_weight[at] = inv;
    if (o->argmax) o->argmax[at] = acc->argmax;
    if (o->key_set_mass) o->key_set_mass[at] = acc->in_set * inv;
    if (o->self_weight) o->self_weight[at] = EXP(acc->s_self - m) * inv;
    if (o->prev_weight) o->prev_weight[at] = EXP(acc->s_prev - m) * inv;
    if (o->next_weight) o->next_weight[at] = EXP(acc->s_next - m) * inv;
    if (o->distance) o->distance[at] = acc->dist * inv;
}

/* P (rows, n_vis) with row stride ld: the attention probabilities of query rows
 * [i0, i0 + rows) of head (b, h). On entry P holds scale * q k^T; masks are applied here.
 * A row with no finite score becomes all zeros and is flagged in dead[r]. lse[r] (if not
 * NULL) gets the row's log-sum-exp, -inf for a dead row; st->out (if not NULL) the row's
 * statistics (st->in_set holding the key set's first n_vis keys); d->scores (if not NULL) the
 * masked scores of the rows' n_k keys, -inf past those each row may see. */
static void FN(softmax_rows)(real *P, uint8_t *dead, real *lse, int64_t ld, int64_t rows,
                             int64_t n_vis, int64_t b, int64_t h, int64_t i0,
                             const mha_attention_desc *d, const FN(stats_scratch) *st) {
    const int64_t at0 = (b * d->heads + h) * d->n_q + i0, shift = d->n_k - d->n_q;
    for (int64_t r = 0; r < rows; r++) {
        real *p = P + r * ld;
        if (d->softcap > 0) FN(softcap_row)(p, NULL, n_vis, i0 + r, 0, d);
        const int64_t n_row = FN(mask_row)(p, n_vis, b, h, i0 + r, 0, d);
        if (d->scores) {
            real *s = (real *)d->scores + (at0 + r) * d->n_k;
            memcpy(s, p, (size_t)n_row * sizeof(real));
            for (int64_t j = n_row; j < d->n_k; j++) s[j] = -INFINITY;
        }
        real m = VN(mha_max)(p, n_row); /* NaN reaches the row through the sum */
        FN(row_acc) acc;
        dead[r] = m == -INFINITY;
        if (dead[r]) { /* every key masked: the row is 0 */
            memset(p, 0, (size_t)n_vis * sizeof(real));
            if (lse) lse[r] = -INFINITY;
            if (st->out) FN(row_stats_store)(st->out, at0 + r, NULL, m, 0);
            continue;
        }
        if (st->out) {
            FN(row_acc_init)(&acc, 1);
            FN(row_acc_scores)(&acc, p, n_row, 0, i0 + r + shift, -INFINITY, m);
            memcpy(st->s, p, (size_t)n_row * sizeof(real));
        }
        real sum = VN(mha_exp_sum)(p, n_row, m);
        if (st->out) {
            FN(row_acc_add)(&acc, p, st->s, st->in_set, n_row, 0, i0 + r + shift, m);
            FN(row_stats_store)(st->out, at0 + r, &acc, m, sum);
        }
        VN(mha_scale)(p, n_row, 1 / sum);
        memset(p + n_row, 0, (size_t)(n_vis - n_row) * sizeof(real));
        if (lse) lse[r] = m + (real)log((double)sum);
    }
}

/* A = P * keep / (1 - p): dropout of rows [i0, i0 + rows), columns [j0, j0 + n_vis) of
 * head (b, h), out of place (A may equal P). The same keep mask turns dA into dP. */
static void FN(dropout_rows)(real *A, const real *P, int64_t ld, int64_t rows, int64_t n_vis,
                             int64_t b, int64_t h, int64_t i0, int64_t j0,
                             const mha_attention_desc *d) {
    const double p_drop = d->dropout;
    const real keep_scale = (real)(1.0 / (1.0 - p_drop));
    for (int64_t r = 0; r < rows; r++) {
        uint64_t state = mha_dropout_row_state(d->seed, (uint64_t)b, (uint64_t)h, (uint64_t)(i0 + r));
        for (int64_t j = 0; j < n_vis; j++) {
            int keep = mha_uniform_from_state(state, (uint64_t)(j0 + j)) >= p_drop;
            A[r * ld + j] = keep ? P[r * ld + j] * keep_scale : 0;
        }
    }
}

/* Pointers to head (b, h) of a view. */
#define AT(ptr, view, b, h) ((ptr) + (b) * (view).batch + (h) * (view).head)

/* Scores then probabilities of one query block into P; returns the visible key count. */
static int64_t FN(block_probs)(real *P, uint8_t *dead, real *lse, int64_t ld, real *gemm_ws,
                               const real *q_bh, const real *k_bh, int64_t b, int64_t h,
                               int64_t i0, int64_t rows, const mha_attention_desc *d,
                               const FN(stats_scratch) *st) {
    int64_t n_vis = FN(visible_keys)(d, i0 + rows - 1);
    FN(mha_gemm_ws)(0, 1, rows, n_vis, d->d_k, (real)d->scale, q_bh + i0 * d->q.row, d->q.row,
                    k_bh, d->k.row, 0, NULL, P, ld, gemm_ws, 1);
    if (st->in_set) FN(fill_in_set)(st->in_set, st->out, b, 0, n_vis);
    FN(softmax_rows)(P, dead, lse, ld, rows, n_vis, b, h, i0, d, st);
    return n_vis;
}

/* Thread t's slice of a per-thread scratch block (slices of `bytes` each), to carve. */
static inline mha_carver FN(thread_slice)(char *block, size_t bytes, int t) {
    return (mha_carver){block + (size_t)t * bytes, 0, 1};
}

/* Sizes that the core can take: non-negative, kv_heads dividing heads. */
static int FN(check_desc)(const mha_attention_desc *d) {
    if (d->batch < 0 || d->heads < 0 || d->kv_heads < 0 || d->n_q < 0 || d->n_k < 0 ||
        d->d_k < 0 || d->d_v < 0)
        return MHA_EINVAL;
    if (d->heads > 0 && (d->kv_heads == 0 || d->heads % d->kv_heads != 0)) return MHA_EINVAL;
    if (!(d->softcap >= 0 && d->softcap < INFINITY)) return MHA_EINVAL; /* NaN fails both */
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
#define BQF 72 /* query rows per block: 12 whole micro-tiles of the GEMM's 6 rows */

/* The online-softmax step for a block of scores S (rows, cols) of key tile j0: masks, then
 * per row m_new = max(m, max S), alpha = exp(m - m_new), S = exp(S - m_new) (0 where masked,
 * and for columns [ncols, cols) that no row of the block may see), l = alpha * l + sum S.
 * Dropout scales the kept entries of S after the sum (l is the undropped normaliser).
 * acc (NULL: no statistics): the rows' running sums of the statistics, moved along with l. */
static void FN(online_softmax_tile)(real *S, int64_t ld, int64_t rows, int64_t ncols,
                                    int64_t cols, int64_t b, int64_t h, int64_t i0,
                                    int64_t j0, real *m, real *l, real *alpha,
                                    FN(row_acc) *acc, const FN(stats_scratch) *st,
                                    const mha_attention_desc *d) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = i0 + r;
        real *p = S + r * ld;
        if (d->softcap > 0) FN(softcap_row)(p, NULL, ncols, i, j0, d);
        const int64_t n_row = FN(mask_row)(p, ncols, b, h, i, j0, d);
        real t_max = VN(mha_max)(p, n_row);
        real m_new = t_max > m[r] ? t_max : m[r];
        if (t_max != t_max) m_new = t_max;
        if (m_new == -INFINITY) { /* nothing seen yet */
            memset(p, 0, (size_t)cols * sizeof(real));
            alpha[r] = 1;
            continue;
        }
        alpha[r] = m_new == m[r] ? 1 : EXP(m[r] - m_new);
        const int64_t a = i + (d->n_k - d->n_q);
        if (acc) {
            FN(row_acc_scores)(acc + r, p, n_row, j0, a, m[r], t_max);
            memcpy(st->s, p, (size_t)n_row * sizeof(real));
        }
        real sum = VN(mha_exp_sum)(p, n_row, m_new);
        memset(p + n_row, 0, (size_t)(cols - n_row) * sizeof(real));
        if (acc) {
            FN(row_acc_rescale)(acc + r, alpha[r], m[r], m_new, l[r]);
            FN(row_acc_add)(acc + r, p, st->s, st->in_set, n_row, j0, a, m_new);
        }
        l[r] = l[r] * alpha[r] + sum;
        m[r] = m_new;
        if (d->dropout > 0) FN(dropout_rows)(p, p, ld, 1, n_row, b, h, i, j0, d);
    }
}

/* One thread's scratch of the fused forward. */
typedef struct {
    real *Kp;    /* (d_k, BK) in NR-wide panels: the key tile transposed, S's right operand */
    real *Vp;    /* (BK, d_v) in NR-wide panels: the value tile, the output's right operand */
    real *S;     /* (BQF, BK): a block's scores, then exp(S - m) */
    real *alpha; /* (BQF): exp(m_old - m_new) of each row of the block */
    real *m, *l; /* (group, chunk_rows) each: running max and sum of the task's rows */
    FN(stats_scratch) st; /* acc (group, chunk_rows), s and in_set (BK): row statistics */
} FN(fused_scratch);

static void FN(fused_scratch_layout)(FN(fused_scratch) *s, mha_carver *c,
                                     const mha_attention_desc *d, int64_t chunk_rows) {
    const size_t rows = mha_mul_size((size_t)(d->heads / d->kv_heads), (size_t)chunk_rows, &c->ok);
    s->Kp = mha_carve(c, FN(mha_packed_b_size)(d->d_k, BK), sizeof(real));
    s->Vp = mha_carve(c, FN(mha_packed_b_size)(BK, d->d_v), sizeof(real));
    s->S = mha_carve(c, (size_t)BQF * BK, sizeof(real));
    s->alpha = mha_carve(c, BQF, sizeof(real));
    s->m = mha_carve(c, rows, sizeof(real));
    s->l = mha_carve(c, rows, sizeof(real));
    FN(stats_scratch_layout)(&s->st, c, d, rows, BK);
}

/* One task of the fused forward: query rows [r0, r1) of every query head of kv head g in
 * batch b; chunk_rows: the rows of m and l per head of the group. A block's output rows are
 * first written by its product with key tile 0 (beta = 0: nothing to clear or rescale
 * beforehand). */
static void FN(fused_task)(real *out, real *lse, const real *q, const real *k,
                           const real *v, const mha_attention_desc *d, int64_t b,
                           int64_t g, int64_t r0, int64_t r1, int64_t chunk_rows,
                           const FN(fused_scratch) *ws) {
    const int64_t H = d->heads, group = H / d->kv_heads;
    real *Kp = ws->Kp, *Vp = ws->Vp, *S = ws->S, *alpha = ws->alpha, *m = ws->m, *l = ws->l;
    const FN(stats_scratch) *st = &ws->st;
    const real *k_bg = AT(k, d->k, b, g), *v_bg = AT(v, d->v, b, g);
    for (int64_t e = 0; e < group * chunk_rows; e++) { m[e] = -INFINITY; l[e] = 0; }
    if (st->acc) FN(row_acc_init)(st->acc, group * chunk_rows);
    const int64_t n_seen = r1 > r0 ? FN(visible_keys)(d, r1 - 1) : 0;
    for (int64_t j0 = 0; j0 < n_seen; j0 += BK) {
        const int64_t cols = MHA_MIN(BK, d->n_k - j0);
        FN(mha_pack_b_full)(Kp, k_bg + j0 * d->k.row, d->k.row, 1, d->d_k, cols);
        FN(mha_pack_b_full)(Vp, v_bg + j0 * d->v.row, d->v.row, 0, cols, d->d_v);
        if (st->in_set) FN(fill_in_set)(st->in_set, st->out, b, j0, cols);
        for (int64_t hh = 0; hh < group; hh++) {
            const int64_t h = g * group + hh;
            const real *q_bh = AT(q, d->q, b, h);
            real *o_bh = AT(out, d->out, b, h);
            for (int64_t i0 = r0; i0 < r1; i0 += BQF) {
                const int64_t rows = MHA_MIN(BQF, r1 - i0);
                const int64_t ncols = MHA_MIN(cols, FN(visible_keys)(d, i0 + rows - 1) - j0);
                if (ncols <= 0) continue; /* then no later tile either: the rows stay dead */
                const int64_t blk = hh * chunk_rows + (i0 - r0); /* the block's first row in m, l */
                real *o_blk = o_bh + i0 * d->out.row;
                FN(mha_gemm_packed)(0, rows, ncols, d->d_k, (real)d->scale, q_bh + i0 * d->q.row,
                                    d->q.row, Kp, 0, S, BK);
                FN(online_softmax_tile)(S, BK, rows, ncols, cols, b, h, i0, j0, m + blk, l + blk, alpha,
                                        st->acc ? st->acc + blk : NULL, st, d);
                if (j0 > 0)
                    for (int64_t r = 0; r < rows; r++)
                        if (alpha[r] != 1) VN(mha_scale)(o_blk + r * d->out.row, d->d_v, alpha[r]);
                FN(mha_gemm_packed)(0, rows, d->d_v, cols, 1, S, BK, Vp, j0 > 0, o_blk, d->out.row);
            }
        }
    }
    for (int64_t hh = 0; hh < group; hh++) {
        const int64_t h = g * group + hh;
        real *o_bh = AT(out, d->out, b, h);
        for (int64_t i = r0; i < r1; i++) {
            const int64_t e = hh * chunk_rows + (i - r0);
            const real mi = m[e], li = l[e];
            real *o = o_bh + i * d->out.row;
            if (mi == -INFINITY) memset(o, 0, (size_t)d->d_v * sizeof(real));
            else VN(mha_scale)(o, d->d_v, 1 / li);
            if (lse) lse[(b * H + h) * d->n_q + i] = mi == -INFINITY ? -INFINITY : mi + (real)log((double)li);
            if (st->out) FN(row_stats_store)(st->out, (b * H + h) * d->n_q + i, st->acc + e, mi, li);
        }
    }
}

/* fused_forward's tasks: (batch, kv head, chunk of query blocks). */
typedef struct {
    real *out, *lse;
    const real *q, *k, *v;
    const mha_attention_desc *d;
    int64_t q_blocks, chunks, chunk_rows;
    char *scratch;     /* a fused_scratch per thread */
    size_t per_thread; /* bytes */
} FN(fused_job);

static void FN(fused_forward_task)(void *ctx, int64_t task, int thread) {
    const FN(fused_job) *j = ctx;
    const int64_t H_kv = j->d->kv_heads, chunks = j->chunks, n_q = j->d->n_q;
    const int64_t b = task / (H_kv * chunks), g = task / chunks % H_kv, c = task % chunks;
    const int64_t r0 = MHA_MIN(n_q, j->q_blocks * c / chunks * BQF);
    const int64_t r1 = MHA_MIN(n_q, j->q_blocks * (c + 1) / chunks * BQF);
    FN(fused_scratch) ws;
    mha_carver slice = FN(thread_slice)(j->scratch, j->per_thread, thread);
    FN(fused_scratch_layout)(&ws, &slice, j->d, j->chunk_rows);
    FN(fused_task)(j->out, j->lse, j->q, j->k, j->v, j->d, b, g, r0, r1, j->chunk_rows, &ws);
}

/* out (by d->out) without weights; lse (B, H, n_q) contiguous or NULL receives m + log(l)
 * (-inf for fully masked rows). */
static int FN(fused_forward)(real *out, real *lse, const real *q, const real *k, const real *v,
                             const mha_attention_desc *d) {
    const int64_t B = d->batch, H = d->heads, H_kv = d->kv_heads;
    const int64_t q_blocks = (d->n_q + BQF - 1) / BQF;
    const double flops = 2.0 * B * H * d->n_q * d->n_k * (double)(d->d_k + d->d_v);
    const int threads = mha_threads_for(flops);
    /* chunks of query blocks per (b, kv head): at least 8 tasks per thread where the rows
     * allow, and a task count the threads divide (otherwise, say 25 heads on 2 threads, one
     * thread runs a whole task after the other has finished). A chunk repacks the key tiles,
     * a cost of d per query row and key against the 2 (d_k + d_v) FLOPs per row and key of
     * its products. */
    int64_t chunks = 1;
    if (threads > 1 && B * H_kv > 0) {
        chunks = (8 * (int64_t)threads + B * H_kv - 1) / (B * H_kv);
        while (chunks < q_blocks && B * H_kv * chunks % threads != 0) chunks++;
        chunks = MHA_MAX(1, MHA_MIN(q_blocks, chunks));
    }
    const int64_t tasks = B * H_kv * chunks;
    const int64_t chunk_rows = (q_blocks + chunks - 1) / chunks * BQF;
    const int nt = (int)MHA_MIN((int64_t)threads, tasks);
    FN(fused_scratch) unused;
    mha_carver size = {NULL, 0, 1};
    FN(fused_scratch_layout)(&unused, &size, d, chunk_rows);
    char *scratch = size.ok ? mha_alloc_slices(size.bytes, nt) : NULL;
    if (!scratch) return MHA_ENOMEM;
    FN(fused_job) job = {out, lse, q, k, v, d, q_blocks, chunks, chunk_rows, scratch, size.bytes};
    mha_parallel_for(nt, tasks, 1, FN(fused_forward_task), &job);
    mha_free(scratch);
    return MHA_OK;
}

/* One thread's scratch of the forward with weights (the probabilities are computed in place,
 * in weights). */
typedef struct {
    real *A;       /* (bq, n_k): dropout(P) of a block; empty without dropout (A is P then) */
    real *gemm_ws; /* the workspace of the block's products S = q k^T and O = A v */
    FN(stats_scratch) st; /* s and in_set (n_k): row statistics */
} FN(weights_scratch);

/* Bytes of the GEMM workspace of a block's products: S = q k^T (n_vis <= n_k columns) and
 * O = A v (over n_vis keys). A causal block's n_vis is any count up to n_k, and the GEMM's
 * workspace does not grow with its shared axis (a long axis is cut into shorter slices than
 * a mid-length one is), so every count is measured. */
static size_t FN(weights_gemm_bytes)(const mha_attention_desc *d, int64_t bq) {
    size_t bytes = FN(mha_gemm_workspace)(bq, d->n_k, d->d_k, 1);
    for (int64_t n_vis = d->causal ? 1 : d->n_k; n_vis <= d->n_k; n_vis++)
        bytes = MHA_MAX(bytes, FN(mha_gemm_workspace)(bq, d->d_v, n_vis, 1));
    return bytes;
}

static void FN(weights_scratch_layout)(FN(weights_scratch) *s, mha_carver *c,
                                       const mha_attention_desc *d, int64_t bq,
                                       size_t gemm_bytes) {
    s->A = mha_carve(c, d->dropout > 0 ? mha_mul_size((size_t)bq, (size_t)d->n_k, &c->ok) : 0,
                     sizeof(real));
    s->gemm_ws = mha_carve(c, gemm_bytes, 1);
    FN(stats_scratch_layout)(&s->st, c, d, 0, (size_t)d->n_k);
}

/* The forward with weights: tasks (batch, head, block of query rows). */
typedef struct {
    real *out, *weights, *lse;
    const real *q, *k, *v;
    const mha_attention_desc *d;
    int64_t bq, q_blocks;
    size_t gemm_bytes; /* the GEMM workspace of a block (weights_gemm_bytes) */
    char *scratch;     /* a weights_scratch per thread */
    size_t per_thread; /* bytes */
} FN(weights_job);

static void FN(weights_forward_task)(void *ctx, int64_t task, int thread) {
    const FN(weights_job) *j = ctx;
    const mha_attention_desc *d = j->d;
    real *out = j->out, *weights = j->weights, *lse = j->lse;
    const real *q = j->q, *k = j->k, *v = j->v;
    const int64_t H = d->heads, group = d->heads / d->kv_heads, bq = j->bq, q_blocks = j->q_blocks;
    const int64_t ld = d->n_k;
    FN(weights_scratch) ws;
    mha_carver slice = FN(thread_slice)(j->scratch, j->per_thread, thread);
    FN(weights_scratch_layout)(&ws, &slice, d, bq, j->gemm_bytes);
    real *A = ws.A, *gemm_ws = ws.gemm_ws;
    const int64_t b = task / (H * q_blocks), h = task / q_blocks % H;
    const int64_t i0 = task % q_blocks * bq, rows = MHA_MIN(bq, d->n_q - i0);
    const real *q_bh = AT(q, d->q, b, h);
    const real *k_bh = AT(k, d->k, b, h / group), *v_bh = AT(v, d->v, b, h / group);
    real *o_blk = AT(out, d->out, b, h) + i0 * d->out.row;
    real *lse_blk = lse ? lse + (b * H + h) * d->n_q + i0 : NULL;

    // 1. P = softmax(scale * q k^T + masks), block (rows, n_vis), written in weights
    uint8_t dead[BQ_MAX];
    real *P = weights + ((b * H + h) * d->n_q + i0) * d->n_k;
    int64_t n_vis = FN(block_probs)(P, dead, lse_blk, ld, gemm_ws, q_bh, k_bh, b, h, i0, rows, d, &ws.st);
    for (int64_t r = 0; r < rows; r++) /* keys past a causal block's last row */
        memset(P + r * ld + n_vis, 0, (size_t)(d->n_k - n_vis) * sizeof(real));
    // 2. A = dropout(P), or P itself
    if (d->dropout > 0) FN(dropout_rows)(A, P, ld, rows, n_vis, b, h, i0, 0, d);
    else A = P;
    // 3. O = A v
    FN(mha_gemm_ws)(0, 0, rows, d->d_v, n_vis, 1, A, ld, v_bh, d->v.row, 0, NULL, o_blk,
                    d->out.row, gemm_ws, 1);
    FN(zero_dead_rows)(o_blk, d->out.row, d->d_v, dead, rows);
}

/* Forward
 * out: (B, H, n_q, d_v) by d->out   weights: (B, H, n_q, n_k) contiguous or NULL
 * d->scores: (B, H, n_q, n_k) contiguous or NULL (with weights only): the masked scores
 * lse: (B, H, n_q) contiguous or NULL: each row's log-sum-exp of its masked, scaled scores
 * (what the backward needs to rebuild P; -inf for a fully masked row)
 * q: (B, H, n_q, d_k)   k: (B, H_kv, n_k, d_k)   v: (B, H_kv, n_k, d_v)
 * d->row_stats: NULL, or the mha_row_stats (of this type) that receives the row statistics,
 * computed on either path. */
static int FN(mha_attention_forward_lse)(real *out, real *weights, real *lse, const real *q,
                                         const real *k, const real *v,
                                         const mha_attention_desc *d) {
    const TY(mha_row_stats) *stats = d->row_stats;
    if (FN(check_desc)(d) || (stats && stats->key_set_mass && !stats->key_set) ||
        (d->scores && !weights))
        return MHA_EINVAL;
    const int64_t B = d->batch, H = d->heads;
    /* nothing to write (this also bounds the task count below by an array's size) */
    if (NONE(B, H, d->n_q, d->d_v) && (!weights || NONE(B, H, d->n_q, d->n_k)) &&
        ((!lse && !stats) || NONE(B, H, d->n_q, 1)))
        return MHA_OK;
    if (!weights) return FN(fused_forward)(out, lse, q, k, v, d);
    const int64_t bq = FN(block_rows)(d->n_k);
    const int64_t q_blocks = (d->n_q + bq - 1) / bq;
    const int64_t tasks = B * H * q_blocks;
    const double flops = 2.0 * B * H * d->n_q * d->n_k * (double)(d->d_k + d->d_v);
    const int nt = (int)MHA_MIN((int64_t)mha_threads_for(flops), tasks);
    const int64_t chunk = MHA_MAX(1, tasks / (8 * nt)); /* tasks per fetch when they are tiny */
    FN(weights_scratch) unused;
    mha_carver size = {NULL, 0, 1};
    const size_t gemm_bytes = FN(weights_gemm_bytes)(d, bq);
    FN(weights_scratch_layout)(&unused, &size, d, bq, gemm_bytes);
    char *scratch = size.ok ? mha_alloc_slices(size.bytes, nt) : NULL;
    if (!scratch) return MHA_ENOMEM;

    FN(weights_job) job = {out, weights, lse, q, k, v, d, bq, q_blocks, gemm_bytes, scratch, size.bytes};
    mha_parallel_for(nt, tasks, chunk, FN(weights_forward_task), &job);
    mha_free(scratch);
    return MHA_OK;
}

/* P = exp(S + masks - lse) for a (rows, ncols) block of scores of key tile j0, zero past
 * each row's keys up to cols; rows with lse = -inf (fully masked) are all zero. Returns
 * whether the block has such a row. With soft-capping S is capped first and G (same layout
 * as P) receives 1 - tanh(S / c)^2 in columns [0, ncols). */
static int FN(probs_from_lse)(real *P, real *G, int64_t ld, int64_t rows, int64_t ncols,
                              int64_t cols, const real *lse, int64_t b, int64_t h,
                              int64_t i0, int64_t j0, const mha_attention_desc *d) {
    int any_dead = 0;
    for (int64_t r = 0; r < rows; r++) {
        real *p = P + r * ld;
        if (d->softcap > 0) FN(softcap_row)(p, G + r * ld, ncols, i0 + r, j0, d);
        int64_t n_row = FN(mask_row)(p, ncols, b, h, i0 + r, j0, d);
        if (lse[r] == -INFINITY) { any_dead = 1; n_row = 0; }
        else VN(mha_exp_sum)(p, n_row, lse[r]);
        memset(p + n_row, 0, (size_t)(cols - n_row) * sizeof(real));
    }
    return any_dead;
}

/* dS = P * (dP - delta) in place of dP, zero in columns [ncols, cols); with soft-capping
 * (G not NULL: 1 - tanh^2 of the raw scores, same layout) the gradient of the raw scores,
 * dS = P * (dP - delta) * G. */
static void FN(softmax_grad_tile)(real *D, const real *P, const real *G, int64_t ld,
                                  int64_t rows, int64_t ncols, int64_t cols, const real *delta) {
    for (int64_t r = 0; r < rows; r++) {
        const real *p = P + r * ld;
        real *ds = D + r * ld;
        const real dl = delta[r];
        if (G) {
            const real *g = G + r * ld;
            for (int64_t j = 0; j < ncols; j++) ds[j] = p[j] * (ds[j] - dl) * g[j];
        } else {
            for (int64_t j = 0; j < ncols; j++) ds[j] = p[j] * (ds[j] - dl);
        }
        memset(ds + ncols, 0, (size_t)(cols - ncols) * sizeof(real));
    }
}

/* x[j * ldx + c] += t[c * ldt + j] for j < rows, c < cols: a transposed tile added in. */
static void FN(add_transposed)(real *x, int64_t ldx, const real *t, int64_t ldt,
                               int64_t rows, int64_t cols) {
    enum { TV = MHA_VEC_BYTES / sizeof(real) }; /* the register transpose's block (vec.h) */
    const int64_t j_full = rows / TV * TV, c_full = cols / TV * TV;
    real blk[TV * TV];
    for (int64_t j = 0; j < j_full; j += TV)
        for (int64_t c = 0; c < c_full; c += TV) {
            VN(mha_transpose_vl)(blk, TV, t + c * ldt + j, ldt); /* blk[jj][cc] = t[c + cc][j + jj] */
            for (int jj = 0; jj < TV; jj++)
                for (int cc = 0; cc < TV; cc++) x[(j + jj) * ldx + c + cc] += blk[jj * TV + cc];
        }
    for (int64_t j = 0; j < rows; j++) /* the ragged edges */
        for (int64_t c = j < j_full ? c_full : 0; c < cols; c++) x[j * ldx + c] += t[c * ldt + j];
}

/* ---- the fused backward ---------------------------------------------------------------------
 * FlashAttention-2's scheme on a CPU. Tasks are (b, key/value head), because dK and dV gather
 * from every query row of every head in the group. A task walks the keys in tiles of BK,
 * packs each tile three ways (K^T and V^T for the products with q and dO, K for dq), and
 * for every query block of every head in the group rebuilds P = exp(S - lse) from the saved
 * log-sum-exp, then
 *   dV_tile^T += dO^T A,   dP = (dO V^T) * Z,   dS = P * (dP - delta),   delta = rowsum(dO * O)
 *   dq_blk    += scale * dS K,   dK_tile^T += scale * q^T dS
 * All five products run on (BQF x BK) blocks that stay in the core's caches; dK and dV of a
 * tile are gathered transposed (so that every product reads its left operand along rows of
 * a small block) and added into dk, dv once per tile. Rows with lse = -inf (fully masked)
 * have no output: their dq is 0 and their dO reaches nothing.
 * backward_task is one task: every query head of kv head g in batch b, against every key
 * tile. */

/* One thread's scratch of the fused backward. */
typedef struct {
    real *KpT;     /* (d_k, BK) in NR-wide panels: the key tile transposed, for S = q k^T */
    real *VpT;     /* (d_v, BK) in NR-wide panels: the value tile transposed, for dP = dO v^T */
    real *KpN;     /* (BK, d_k) in NR-wide panels: the key tile, for dq = dS k */
    real *P;       /* (BQF, BK): a block's probabilities */
    real *D;       /* (BQF, BK): dP, then dS in place */
    real *A;       /* (BQF, BK): dropout(P); empty without dropout (A is P then) */
    real *G;       /* (BQF, BK): 1 - tanh^2 of the raw scores with soft-capping, else NULL */
    real *Bp;      /* (BQF, BK) in NR-wide panels: A, then dS, as a product's right operand */
    real *dKt;     /* (d_k, BK): the key tile's dK, transposed */
    real *dVt;     /* (d_v, BK): the key tile's dV, transposed */
    real *dO_live; /* (BQF, d_v): a block of d_out with its fully masked rows zeroed */
    real *delta;   /* (group, n_q): rowsum(dO * O) of the group's rows */
} FN(backward_scratch);

static void FN(backward_scratch_layout)(FN(backward_scratch) *s, mha_carver *c,
                                        const mha_attention_desc *d) {
    const size_t blk = (size_t)BQF * BK;
    const size_t rows = mha_mul_size((size_t)(d->heads / d->kv_heads), (size_t)d->n_q, &c->ok);
    s->KpT = mha_carve(c, FN(mha_packed_b_size)(d->d_k, BK), sizeof(real));
    s->VpT = mha_carve(c, FN(mha_packed_b_size)(d->d_v, BK), sizeof(real));
    s->KpN = mha_carve(c, FN(mha_packed_b_size)(BK, d->d_k), sizeof(real));
    s->P = mha_carve(c, blk, sizeof(real));
    s->D = mha_carve(c, blk, sizeof(real));
    s->A = mha_carve(c, d->dropout > 0 ? blk : 0, sizeof(real));
    if (!(d->dropout > 0)) s->A = s->P;
    s->G = mha_carve(c, d->softcap > 0 ? blk : 0, sizeof(real));
    if (!(d->softcap > 0)) s->G = NULL;
    s->Bp = mha_carve(c, FN(mha_packed_b_size)(BQF, BK), sizeof(real));
    s->dKt = mha_carve(c, (size_t)d->d_k * BK, sizeof(real));
    s->dVt = mha_carve(c, (size_t)d->d_v * BK, sizeof(real));
    s->dO_live = mha_carve(c, (size_t)BQF * (size_t)d->d_v, sizeof(real));
    s->delta = mha_carve(c, rows, sizeof(real));
}

/* o: the forward's output, with view o_view; lse: (B, H, n_q) contiguous. */
static void FN(backward_task)(real *dq, real *dk, real *dv, const real *d_out,
                              const real *q, const real *k, const real *v,
                              const real *o, mha_view o_view, const real *lse,
                              const mha_attention_desc *d, int64_t b, int64_t g,
                              const FN(backward_scratch) *ws) {
    const int64_t H = d->heads, group = H / d->kv_heads;
    const real scale = (real)d->scale;
    real *KpT = ws->KpT, *VpT = ws->VpT, *KpN = ws->KpN, *P = ws->P, *D = ws->D, *A = ws->A, *G = ws->G;
    real *Bp = ws->Bp, *dKt = ws->dKt, *dVt = ws->dVt, *dO_live = ws->dO_live, *delta = ws->delta;
    const real *k_bg = AT(k, d->k, b, g), *v_bg = AT(v, d->v, b, g);
    real *dk_bg = AT(dk, d->k, b, g), *dv_bg = AT(dv, d->v, b, g);
    for (int64_t j = 0; j < d->n_k; j++) {
        memset(dk_bg + j * d->k.row, 0, (size_t)d->d_k * sizeof(real));
        memset(dv_bg + j * d->v.row, 0, (size_t)d->d_v * sizeof(real));
    }
    // delta = rowsum(dO * O); dq = 0
    for (int64_t hh = 0; hh < group; hh++) {
        const int64_t h = g * group + hh;
        for (int64_t i = 0; i < d->n_q; i++) {
            const real *o_i = AT(o, o_view, b, h) + i * o_view.row;
            const real *do_i = AT(d_out, d->out, b, h) + i * d->out.row;
            real s = 0; /* a fully masked row's d_out (even NaN) reaches nothing */
            if (lse[(b * H + h) * d->n_q + i] != -INFINITY)
                for (int64_t c = 0; c < d->d_v; c++) s += o_i[c] * do_i[c];
            delta[hh * d->n_q + i] = s;
            memset(AT(dq, d->q, b, h) + i * d->q.row, 0, (size_t)d->d_k * sizeof(real));
        }
    }
    const int64_t n_seen = d->n_q > 0 ? FN(visible_keys)(d, d->n_q - 1) : 0;
    for (int64_t j0 = 0; j0 < n_seen; j0 += BK) {
        const int64_t cols = MHA_MIN(BK, d->n_k - j0);
        FN(mha_pack_b_full)(KpT, k_bg + j0 * d->k.row, d->k.row, 1, d->d_k, cols);
        FN(mha_pack_b_full)(VpT, v_bg + j0 * d->v.row, d->v.row, 1, d->d_v, cols);
        FN(mha_pack_b_full)(KpN, k_bg + j0 * d->k.row, d->k.row, 0, cols, d->d_k);
        memset(dKt, 0, (size_t)d->d_k * BK * sizeof(real));
        memset(dVt, 0, (size_t)d->d_v * BK * sizeof(real));
        for (int64_t hh = 0; hh < group; hh++) {
            const int64_t h = g * group + hh;
            const real *q_bh = AT(q, d->q, b, h), *do_bh = AT(d_out, d->out, b, h);
            const real *lse_bh = lse + (b * H + h) * d->n_q;
            real *dq_bh = AT(dq, d->q, b, h);
            for (int64_t i0 = 0; i0 < d->n_q; i0 += BQF) {
                const int64_t rows = MHA_MIN(BQF, d->n_q - i0);
                const int64_t ncols = MHA_MIN(cols, FN(visible_keys)(d, i0 + rows - 1) - j0);
                if (ncols <= 0) continue;
                const real *q_blk = q_bh + i0 * d->q.row, *do_blk = do_bh + i0 * d->out.row;
                int64_t do_ld = d->out.row;
                // P = exp(scale * q k^T + masks - lse), 0 past each row's keys
                FN(mha_gemm_packed)(0, rows, ncols, d->d_k, scale, q_blk, d->q.row, KpT, 0, P, BK);
                int any_dead = FN(probs_from_lse)(P, G, BK, rows, ncols, cols, lse_bh + i0, b, h, i0, j0, d);
                // a fully masked row has no output: its d_out (even NaN) must not reach dk, dv
                if (any_dead) {
                    for (int64_t r = 0; r < rows; r++) {
                        if (lse_bh[i0 + r] == -INFINITY) memset(dO_live + r * d->d_v, 0, (size_t)d->d_v * sizeof(real));
                        else memcpy(dO_live + r * d->d_v, do_blk + r * d->out.row, (size_t)d->d_v * sizeof(real));
                    }
                    do_blk = dO_live;
                    do_ld = d->d_v;
                }
                // A = dropout(P);  dv^T += dO^T A
                if (d->dropout > 0) FN(dropout_rows)(A, P, BK, rows, ncols, b, h, i0, j0, d);
                FN(mha_pack_b_full)(Bp, A, BK, 0, rows, ncols);
                FN(mha_gemm_packed)(1, d->d_v, ncols, rows, 1, do_blk, do_ld, Bp, 1, dVt, BK);
                // dP = (dO v^T) * Z;  dS = P * (dP - delta)
                FN(mha_gemm_packed)(0, rows, ncols, d->d_v, 1, do_blk, do_ld, VpT, 0, D, BK);
                if (d->dropout > 0) FN(dropout_rows)(D, D, BK, rows, ncols, b, h, i0, j0, d);
                FN(softmax_grad_tile)(D, P, G, BK, rows, ncols, cols, delta + hh * d->n_q + i0);
                // dq += scale * dS k;  dk^T += scale * q^T dS
                FN(mha_gemm_packed)(0, rows, d->d_k, cols, scale, D, BK, KpN, 1,
                                    dq_bh + i0 * d->q.row, d->q.row);
                FN(mha_pack_b_full)(Bp, D, BK, 0, rows, ncols);
                FN(mha_gemm_packed)(1, d->d_k, ncols, rows, scale, q_blk, d->q.row, Bp, 1, dKt, BK);
            }
        }
        FN(add_transposed)(dk_bg + j0 * d->k.row, d->k.row, dKt, BK, cols, d->d_k);
        FN(add_transposed)(dv_bg + j0 * d->v.row, d->v.row, dVt, BK, cols, d->d_v);
    }
    // fully masked rows: dq exactly 0 (0 * k could be NaN)
    for (int64_t hh = 0; hh < group; hh++) {
        const int64_t h = g * group + hh;
        for (int64_t i = 0; i < d->n_q; i++)
            if (lse[(b * H + h) * d->n_q + i] == -INFINITY)
                memset(AT(dq, d->q, b, h) + i * d->q.row, 0, (size_t)d->d_k * sizeof(real));
    }
}

typedef struct {
    real *dq, *dk, *dv;
    const real *d_out, *q, *k, *v, *o;
    mha_view o_view;
    const real *lse;
    const mha_attention_desc *d;
    char *scratch;     /* a backward_scratch per thread */
    size_t per_thread; /* bytes */
} FN(backward_job);

/* fused_backward's tasks: (batch, kv head). */
static void FN(backward_job_task)(void *ctx, int64_t task, int thread) {
    const FN(backward_job) *j = ctx;
    const int64_t H_kv = j->d->kv_heads;
    FN(backward_scratch) ws;
    mha_carver slice = FN(thread_slice)(j->scratch, j->per_thread, thread);
    FN(backward_scratch_layout)(&ws, &slice, j->d);
    FN(backward_task)(j->dq, j->dk, j->dv, j->d_out, j->q, j->k, j->v, j->o, j->o_view, j->lse, j->d,
                      task / H_kv, task % H_kv, &ws);
}

static int FN(fused_backward)(real *dq, real *dk, real *dv, const real *d_out, const real *q,
                              const real *k, const real *v, const real *o, mha_view o_view,
                              const real *lse, const mha_attention_desc *d) {
    const int64_t B = d->batch, H = d->heads, H_kv = d->kv_heads;
    const int64_t tasks = B * H_kv;
    const double flops = 5.0 * B * H * d->n_q * d->n_k * (double)(d->d_k + d->d_v);
    const int nt = (int)MHA_MIN((int64_t)mha_threads_for(flops), tasks);
    FN(backward_scratch) unused;
    mha_carver size = {NULL, 0, 1};
    FN(backward_scratch_layout)(&unused, &size, d);
    char *scratch = size.ok ? mha_alloc_slices(size.bytes, nt) : NULL;
    if (!scratch) return MHA_ENOMEM;

    FN(backward_job) job = {dq, dk, dv, d_out, q, k, v, o, o_view, lse, d, scratch, size.bytes};
    mha_parallel_for(nt, tasks, 1, FN(backward_job_task), &job);
    mha_free(scratch);
    return MHA_OK;
}

/* Backward from the forward's saved output and log-sum-exp, or (out and lse NULL) from
 * nothing: then the fused forward runs first into O(n) scratch.
 * dq like q, dk like k, dv like v; d_out and out like out; lse (B, H, n_q) contiguous. */
static int FN(mha_attention_backward_saved)(real *dq, real *dk, real *dv, const real *d_out,
                                            const real *q, const real *k, const real *v,
                                            const real *out, const real *lse,
                                            const mha_attention_desc *d) {
    if (FN(check_desc)(d) || (out == NULL) != (lse == NULL)) return MHA_EINVAL;
    const int64_t B = d->batch, H = d->heads, H_kv = d->kv_heads;
    if (NONE(B, H, d->n_q, d->d_k) && NONE(B, H_kv, d->n_k, d->d_k) && NONE(B, H_kv, d->n_k, d->d_v))
        return MHA_OK;
    if (out) return FN(fused_backward)(dq, dk, dv, d_out, q, k, v, out, d->out, lse, d);
    int ok = 1;
    size_t rows = mha_mul_size(mha_mul_size((size_t)B, (size_t)H, &ok), (size_t)d->n_q, &ok);
    size_t o_elems = mha_mul_size(rows, (size_t)d->d_v, &ok);
    size_t total = mha_add_size(o_elems, rows, &ok);
    if (!ok || total > SIZE_MAX / sizeof(real)) return MHA_ENOMEM;
    real *o = mha_alloc(total * sizeof(real));
    if (!o) return MHA_ENOMEM;
    real *o_lse = o + o_elems;
    mha_attention_desc fwd = *d; /* out contiguous: (B, H, n_q, d_v) */
    fwd.out = (mha_view){H * d->n_q * d->d_v, d->n_q * d->d_v, d->d_v};
    fwd.row_stats = NULL;
    int err = FN(mha_attention_forward_lse)(o, NULL, o_lse, q, k, v, &fwd);
    if (!err) err = FN(fused_backward)(dq, dk, dv, d_out, q, k, v, o, fwd.out, o_lse, d);
    mha_free(o);
    return err;
}

#undef AT
#undef NONE
#undef BQ_MAX
#undef BK
#undef BQF
