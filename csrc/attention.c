/* attention.c: the attention API's functions compiled once, outside the kernel units
 * (dispatch.h): the descriptor's initialiser, the dropout RNG's public entry point, and the
 * forward and backward that only call a dispatched one (the forward without lse, the
 * forward with row statistics, the backward without a saved forward). */
#include <math.h>
#include <string.h>

#include "common.h"
#include "mha.h"

double mha_dropout_uniform(uint64_t seed, uint64_t b, uint64_t h, uint64_t i, uint64_t j) {
    return mha_uniform_from_state(mha_dropout_row_state(seed, b, h, i), j);
}

void mha_attention_desc_init(mha_attention_desc *d, int64_t batch, int64_t heads,
                             int64_t kv_heads, int64_t n_q, int64_t n_k, int64_t d_k,
                             int64_t d_v) {
    memset(d, 0, sizeof *d);
    d->batch = batch;
    d->heads = heads;
    d->kv_heads = kv_heads;
    d->n_q = n_q;
    d->n_k = n_k;
    d->d_k = d_k;
    d->d_v = d_v;
    d->q = (mha_view){heads * n_q * d_k, n_q * d_k, d_k};
    d->k = (mha_view){kv_heads * n_k * d_k, n_k * d_k, d_k};
    d->v = (mha_view){kv_heads * n_k * d_v, n_k * d_v, d_v};
    d->out = (mha_view){heads * n_q * d_v, n_q * d_v, d_v};
    d->scale = d_k > 0 ? 1.0 / sqrt((double)d_k) : 1.0;
}

int mha_attention_forward_f32(float *out, float *weights, const float *q, const float *k,
                              const float *v, const mha_attention_desc *desc) {
    return mha_attention_forward_lse_f32(out, weights, NULL, q, k, v, desc);
}

int mha_attention_forward_f64(double *out, double *weights, const double *q, const double *k,
                              const double *v, const mha_attention_desc *desc) {
    return mha_attention_forward_lse_f64(out, weights, NULL, q, k, v, desc);
}

int mha_attention_forward_stats_f32(float *out, float *weights, float *lse,
                                    const mha_row_stats_f32 *stats, const float *q,
                                    const float *k, const float *v,
                                    const mha_attention_desc *desc) {
    mha_attention_desc d = *desc;
    d.row_stats = stats;
    return mha_attention_forward_lse_f32(out, weights, lse, q, k, v, &d);
}

int mha_attention_forward_stats_f64(double *out, double *weights, double *lse,
                                    const mha_row_stats_f64 *stats, const double *q,
                                    const double *k, const double *v,
                                    const mha_attention_desc *desc) {
    mha_attention_desc d = *desc;
    d.row_stats = stats;
    return mha_attention_forward_lse_f64(out, weights, lse, q, k, v, &d);
}

int mha_attention_backward_f32(float *dq, float *dk, float *dv, const float *d_out,
                               const float *q, const float *k, const float *v,
                               const mha_attention_desc *desc) {
    return mha_attention_backward_saved_f32(dq, dk, dv, d_out, q, k, v, NULL, NULL, desc);
}

int mha_attention_backward_f64(double *dq, double *dk, double *dv, const double *d_out,
                               const double *q, const double *k, const double *v,
                               const mha_attention_desc *desc) {
    return mha_attention_backward_saved_f64(dq, dk, dv, d_out, q, k, v, NULL, NULL, desc);
}
