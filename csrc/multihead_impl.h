/* multihead_impl.h: the multi-head attention layer, forward and backward, for a type `real`.
 * Included by kernels.h with real (float|double) and SFX (f32|f64) defined, once per kernel
 * unit.
 *
 * Heads are never split or merged by copying: a projection (B, n, H * d_head) is read as
 * (B, H, n, d_head) through strides (mha_view), so head h of row i starts at
 * row i * H * d_head + h * d_head.
 */

#define PARAMS TY(mha_layer_params)
#define GRADS TY(mha_layer_grads)
#define SAVED TY(mha_layer_saved)

/* grad_bias[c] = sum over rows of dy[r, c]. */
static void FN(sum_rows)(real *grad_bias, const real *dy, int64_t rows, int64_t cols) {
    if (!grad_bias) return;
    memset(grad_bias, 0, (size_t)cols * sizeof(real));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) grad_bias[c] += dy[r * cols + c];
}

/* concat (rows, H * d_head) = attn with head h scaled by head_mask[h] */
static void FN(apply_head_mask)(real *concat, const real *attn, const real *head_mask,
                                int64_t rows, int64_t H, int64_t d_head) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t c = 0; c < d_head; c++) {
                int64_t at = (r * H + h) * d_head + c;
                concat[at] = attn[at] * head_mask[h];
            }
}

/* The attention descriptor of the layer: sizes and strided views into the projections. */
static mha_attention_desc FN(layer_attention_desc)(const mha_layer_dims *m,
                                                   const mha_attention_desc *opts) {
    mha_attention_desc d = *opts;
    const int64_t E_q = m->heads * m->d_head, E_kv = m->kv_heads * m->d_head;
    d.batch = m->batch;
    d.heads = m->heads;
    d.kv_heads = m->kv_heads;
    d.n_q = m->n_q;
    d.n_k = m->n_k;
    d.d_k = d.d_v = m->d_head;
    d.q = d.out = (mha_view){m->n_q * E_q, m->d_head, E_q};
    d.k = d.v = (mha_view){m->kv_batch_stride * E_kv, m->d_head, E_kv};
    return d;
}

/* y (rows of each batch at y + b * y_batch, row stride ld) = x @ W + bias, the bias added
 * as the GEMM writes y */
static int FN(project)(real *y, int64_t y_batch, int64_t ld, const real *x, int64_t x_batch,
                       int64_t batch, int64_t rows, int64_t d_in, const real *W,
                       const real *bias, int64_t d_out) {
    if (y_batch == rows * ld && x_batch == rows * d_in) { /* one GEMM over all batches */
        rows *= batch;
        batch = 1;
    }
    for (int64_t b = 0; b < batch; b++) {
        int err = FN(mha_gemm_bias)(0, 0, rows, d_out, d_in, x + b * x_batch, d_in, W, d_out,
                                    bias, y + b * y_batch, ld);
        if (err) return err;
    }
    return MHA_OK;
}

/* Forward
 * out: (B, n_q, d_model)  weights: (B, H, n_q, n_k) or NULL
 * saved->q_proj: (B, n_q, H*d_head)  saved->k_proj, v_proj: (B, kv_batch_stride, H_kv*d_head)
 * saved->attn: (B, n_q, H*d_head)  saved->lse: (B, H, n_q) or NULL
 * x_q: (B, n_q, d_model)  x_k: (B, n_new, kdim)  x_v: (B, n_new, vdim) */
static int FN(mha_layer_forward)(real *out, real *weights, const SAVED *saved, const real *x_q,
                                 const real *x_k, const real *x_v, const PARAMS *p,
                                 const mha_layer_dims *m, const mha_attention_desc *opts) {
    real *q_proj = saved->q_proj, *k_proj = saved->k_proj, *v_proj = saved->v_proj;
    real *attn = saved->attn, *lse = saved->lse;
    const int64_t B = m->batch, E_q = m->heads * m->d_head, E_kv = m->kv_heads * m->d_head;
    const int64_t kv_batch = m->kv_batch_stride * E_kv, kv_first = m->kv_row_offset * E_kv;
    int err;
    // 1. projections: Q = x_q W_q + b_q; new rows of K and V. Self-attention without a cache
    //    (one input, K and V rows contiguous over the batch) runs them as one product whose
    //    blocks of x are packed once for the three.
    if (x_k == x_q && x_v == x_q && m->kdim == m->d_model && m->vdim == m->d_model &&
        m->n_new == m->n_q && m->kv_batch_stride == m->n_new && kv_first == 0) {
        const TY(mha_gemm_out) qkv[3] = {{p->W_q, E_q, p->b_q, q_proj, E_q, E_q, NULL},
                                         {p->W_k, E_kv, p->b_k, k_proj, E_kv, E_kv, NULL},
                                         {p->W_v, E_kv, p->b_v, v_proj, E_kv, E_kv, NULL}};
        if ((err = FN(mha_gemm_shared_a)(B * m->n_q, m->d_model, x_q, m->d_model, qkv, 3))) return err;
    } else {
        if ((err = FN(project)(q_proj, m->n_q * E_q, E_q, x_q, m->n_q * m->d_model, B, m->n_q,
                               m->d_model, p->W_q, p->b_q, E_q)))
            return err;
        if ((err = FN(project)(k_proj + kv_first, kv_batch, E_kv, x_k, m->n_new * m->kdim, B,
                               m->n_new, m->kdim, p->W_k, p->b_k, E_kv)))
            return err;
        if ((err = FN(project)(v_proj + kv_first, kv_batch, E_kv, x_v, m->n_new * m->vdim, B,
                               m->n_new, m->vdim, p->W_v, p->b_v, E_kv)))
            return err;
    }
    // 2. attention of every head, written into attn (B, n_q, H*d_head)
    mha_attention_desc d = FN(layer_attention_desc)(m, opts);
    if ((err = FN(mha_attention_forward_lse)(attn, weights, lse, q_proj, k_proj, v_proj, &d))) return err;
    // 3. concat = attn * head_mask; out = concat W_o + b_o
    const int64_t rows = B * m->n_q;
    const real *concat = attn;
    real *masked = NULL;
    if (p->head_mask) {
        int ok = 1;
        size_t bytes = mha_mul_size(mha_mul_size((size_t)rows, (size_t)E_q, &ok), sizeof(real), &ok);
        if (!ok || !(masked = mha_alloc(bytes))) return MHA_ENOMEM;
        FN(apply_head_mask)(masked, attn, p->head_mask, rows, m->heads, m->d_head);
        concat = masked;
    }
    err = FN(project)(out, 0, m->d_model, concat, 0, 1, rows, E_q, p->W_o, p->b_o, m->d_model);
    mha_free(masked);
    return err;
}

/* The layer backward's scratch (rows_q = B * n_q, rows_k = B * n_k). */
typedef struct {
    real *dC;     /* (rows_q, H*d_head): d of the heads' concatenation */
    real *masked; /* (rows_q, H*d_head): the concatenation times head_mask; empty without one */
    real *dQ;     /* (rows_q, H*d_head) */
    real *dK;     /* (rows_k, H_kv*d_head) */
    real *dV;     /* (rows_k, H_kv*d_head) */
} FN(layer_scratch);

static void FN(layer_scratch_layout)(FN(layer_scratch) *s, mha_carver *c, const mha_layer_dims *m,
                                     int head_mask) {
    const size_t q_elems = mha_mul_size(mha_mul_size((size_t)m->batch, (size_t)m->n_q, &c->ok),
                                        (size_t)(m->heads * m->d_head), &c->ok);
    const size_t k_elems = mha_mul_size(mha_mul_size((size_t)m->batch, (size_t)m->n_k, &c->ok),
                                        (size_t)(m->kv_heads * m->d_head), &c->ok);
    s->dC = mha_carve(c, q_elems, sizeof(real));
    s->masked = mha_carve(c, head_mask ? q_elems : 0, sizeof(real));
    s->dQ = mha_carve(c, q_elems, sizeof(real));
    s->dK = mha_carve(c, k_elems, sizeof(real));
    s->dV = mha_carve(c, k_elems, sizeof(real));
}

/* Backward: mirrors the forward's passes in reverse.
 * dx_q like x_q, dx_k like x_k, dx_v like x_v; d_out (B, n_q, d_model); saved as the forward
 * wrote it (saved->lse may be NULL). */
static int FN(mha_layer_backward)(real *dx_q, real *dx_k, real *dx_v, const GRADS *g,
                                  const real *d_out, const SAVED *saved, const real *x_q,
                                  const real *x_k, const real *x_v, const PARAMS *p,
                                  const mha_layer_dims *m, const mha_attention_desc *opts) {
    if (m->kv_row_offset != 0 || m->n_new != m->n_k || m->kv_batch_stride != m->n_k)
        return MHA_EINVAL;
    const int64_t B = m->batch, H = m->heads, dh = m->d_head;
    const int64_t E_q = H * dh, E_kv = m->kv_heads * dh;
    const int64_t rows_q = B * m->n_q, rows_k = B * m->n_k;
    const real *attn = saved->attn;
    FN(layer_scratch) ws;
    mha_carver size = {NULL, 0, 1};
    FN(layer_scratch_layout)(&ws, &size, m, p->head_mask != NULL);
    char *scratch = size.ok ? mha_alloc(size.bytes) : NULL;
    if (!scratch) return MHA_ENOMEM;
    mha_carver block = {scratch, 0, 1};
    FN(layer_scratch_layout)(&ws, &block, m, p->head_mask != NULL);
    real *dC = ws.dC, *masked = ws.masked, *dQ = ws.dQ, *dK = ws.dK, *dV = ws.dV;
    int err = MHA_OK;

    // 3. out = concat W_o + b_o  ->  dconcat = d_out W_o^T, dW_o = concat^T d_out, db_o
    const real *concat = attn; /* without a head mask the concatenation is attn itself */
    if (p->head_mask) {
        FN(apply_head_mask)(masked, attn, p->head_mask, rows_q, H, dh);
        concat = masked;
    }
    if ((err = FN(mha_gemm)(0, 1, rows_q, E_q, m->d_model, 1, d_out, m->d_model, p->W_o,
                            m->d_model, 0, dC, E_q)))
        goto done;
    if ((err = FN(mha_gemm)(1, 0, E_q, m->d_model, rows_q, 1, concat, E_q, d_out, m->d_model, 0,
                            g->W_o, m->d_model)))
        goto done;
    FN(sum_rows)(g->b_o, d_out, rows_q, m->d_model);
    // concat = attn * head_mask  ->  d_head_mask[h] = sum(dconcat_h * attn_h), dattn = dconcat * head_mask
    if (g->head_mask) {
        for (int64_t h = 0; h < H; h++) g->head_mask[h] = 0;
        for (int64_t r = 0; r < rows_q; r++)
            for (int64_t h = 0; h < H; h++) {
                real s = 0;
                for (int64_t c = 0; c < dh; c++) s += dC[(r * H + h) * dh + c] * attn[(r * H + h) * dh + c];
                g->head_mask[h] += s;
            }
    }
    if (p->head_mask) FN(apply_head_mask)(dC, dC, p->head_mask, rows_q, H, dh);
    // 2. attention -> dQ, dK, dV
    mha_attention_desc d = FN(layer_attention_desc)(m, opts);
    if ((err = FN(mha_attention_backward_saved)(dQ, dK, dV, dC, saved->q_proj, saved->k_proj,
                                                saved->v_proj, saved->lse ? attn : NULL,
                                                saved->lse, &d)))
        goto done;
    // 1. projections X W + b  ->  dW = X^T dY, db = sum_rows dY, dX = dY W^T
    struct { const real *x, *W; const real *dY; real *dX, *dW, *db; int64_t rows, d_in, d_out; } proj[3] = {
        {x_q, p->W_q, dQ, dx_q, g->W_q, g->b_q, rows_q, m->d_model, E_q},
        {x_k, p->W_k, dK, dx_k, g->W_k, g->b_k, rows_k, m->kdim, E_kv},
        {x_v, p->W_v, dV, dx_v, g->W_v, g->b_v, rows_k, m->vdim, E_kv},
    };
    for (int i = 0; i < 3; i++) {
        if ((err = FN(mha_gemm)(1, 0, proj[i].d_in, proj[i].d_out, proj[i].rows, 1, proj[i].x,
                                proj[i].d_in, proj[i].dY, proj[i].d_out, 0, proj[i].dW,
                                proj[i].d_out)))
            goto done;
        FN(sum_rows)(proj[i].db, proj[i].dY, proj[i].rows, proj[i].d_out);
        /* an input that is another one (self-attention) gathers both gradients in one buffer */
        real beta = 0;
        for (int j = 0; j < i; j++)
            if (proj[j].dX == proj[i].dX) beta = 1;
        if ((err = FN(mha_gemm)(0, 1, proj[i].rows, proj[i].d_in, proj[i].d_out, 1, proj[i].dY,
                                proj[i].d_out, proj[i].W, proj[i].d_out, beta, proj[i].dX,
                                proj[i].d_in)))
            goto done;
    }
done:
    mha_free(scratch);
    return err;
}

#undef PARAMS
#undef GRADS
#undef SAVED
