/* attention.c: scaled dot-product attention, forward + backward (see attention_impl.h). */
#include <math.h>
#include <string.h>

#include "common.h"
#include "mha.h"
#include "vec.h"

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

#define real float
#define SFX f32
#define EXP expf
#include "attention_impl.h"
#undef real
#undef SFX
#undef EXP

#define real double
#define SFX f64
#define EXP exp
#include "attention_impl.h"
#undef real
#undef SFX
#undef EXP
