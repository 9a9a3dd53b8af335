/* mha.h: the public C API of mha's core (C11, no Python; see common.h for the compilers).
 *
 * Multi-head attention, forward and backward, for float (suffix _f32) and double (_f64).
 * Conventions, shared with the Python package (see docs/semantics.md):
 *   - Row-major arrays; the last axis of every q/k/v/out view is contiguous, the other axes
 *     are addressed with element strides (mha_view), so heads can live interleaved in a
 *     (B, n, H * d) projection without split/merge copies.
 *   - Masks: bool masks are bytes, nonzero = "may attend"; a float mask is added to the
 *     scores. A row whose every score is -inf gives output 0, weights 0 and gradient 0.
 *   - causal: query i may attend key j iff j <= i + (n_k - n_q) (bottom-right aligned).
 *   - Dropout on the attention weights with inverted scaling 1/(1-p), drawn from a
 *     counter-based RNG keyed by (seed, b, h, i, j) (mha_dropout_uniform), so the backward
 *     regenerates the mask and results do not depend on the thread count.
 * Every function returns MHA_OK or an error code; on error nothing has been written outside
 * the outputs and all scratch has been freed.
 */
#ifndef MHA_H
#define MHA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { MHA_OK = 0, MHA_ENOMEM = 1, MHA_EINVAL = 2 };

/* Element strides of a (B, H, n, d) view whose last axis is contiguous. */
typedef struct {
    int64_t batch, head, row;
} mha_view;

/* A mask broadcast to (B, H, n_q, n_k): element (b, h, i, j) is
 * data[b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3]] (strides in
 * elements, 0 on broadcast axes, possibly negative). */
enum { MHA_MASK_NONE = 0, MHA_MASK_BOOL = 1, MHA_MASK_FLOAT = 2 };

typedef struct {
    /* sizes */
    int64_t batch, heads, kv_heads;  /* heads % kv_heads == 0 (grouped-query attention)  */
    int64_t n_q, n_k, d_k, d_v;
    /* views: q (B, H, n_q, d_k), k (B, H_kv, n_k, d_k), v (B, H_kv, n_k, d_v),
     *        out (B, H, n_q, d_v); gradients share the views of what they differentiate. */
    mha_view q, k, v, out;
    /* masking */
    int mask_kind;                   /* MHA_MASK_NONE / _BOOL (uint8_t) / _FLOAT (same type as q) */
    const void *mask;
    int64_t mask_strides[4];
    const uint8_t *key_padding;      /* (B, n_k), nonzero = real token; or NULL             */
    int64_t key_padding_stride;      /* elements between batches (row stride)              */
    int causal;
    /* scaling and dropout */
    double scale;                    /* usually 1/sqrt(d_k)                                 */
    double softcap;                  /* logit soft-capping (Gemma 2): 0 = off; c > 0 turns   *
                                      * each score s = scale * q.k into c tanh(s / c) before  *
                                      * the masks (a float mask is added after it), so every  *
                                      * output (weights, lse, scores, row statistics) is of   *
                                      * the capped scores, and the backward passes dS through *
                                      * 1 - tanh(s / c)^2. Negative, NaN or infinite:         *
                                      * MHA_EINVAL                                            */
    double dropout;                  /* probability in [0, 1)                               */
    uint64_t seed;
    /* row statistics: the mha_row_stats_f32 / _f64 of mha_attention_forward_stats_f32 / _f64
     * (which set it on a copy of the descriptor), NULL otherwise                          */
    const void *row_stats;
    /* scores: NULL, or (B, H, n_q, n_k) contiguous, of q's type, written by the forward with
     * weights (weights not NULL, else MHA_EINVAL): each scale * q k^T (soft-capped when
     * softcap > 0) with the masks applied, -inf at every key a mask, the key padding or
     * causality hides (the input of the softmax) */
    void *scores;
} mha_attention_desc;

/* Fills a descriptor with contiguous views for (B, H, n, d) arrays, no mask, scale 1/sqrt(d_k),
 * no soft-capping (softcap 0), no dropout. */
void mha_attention_desc_init(mha_attention_desc *desc, int64_t batch, int64_t heads,
                             int64_t kv_heads, int64_t n_q, int64_t n_k, int64_t d_k,
                             int64_t d_v);

/* Scaled dot-product attention.
 * out: (B, H, n_q, d_v) by desc->out; weights: (B, H, n_q, n_k) contiguous, or NULL (then no
 * n_q x n_k buffer is allocated); q, k, v by desc views. */
int mha_attention_forward_f32(float *out, float *weights, const float *q, const float *k,
                              const float *v, const mha_attention_desc *desc);
int mha_attention_forward_f64(double *out, double *weights, const double *q, const double *k,
                              const double *v, const mha_attention_desc *desc);

/* The same, also writing lse (B, H, n_q) contiguous, or NULL: each row's log-sum-exp of its
 * masked, scaled (and soft-capped) scores (-inf for a fully masked row), which the saved
 * backward needs. */
int mha_attention_forward_lse_f32(float *out, float *weights, float *lse, const float *q,
                                  const float *k, const float *v, const mha_attention_desc *desc);
int mha_attention_forward_lse_f64(double *out, double *weights, double *lse, const double *q,
                                  const double *k, const double *v, const mha_attention_desc *desc);
/* Row statistics of the attention weights P = softmax(scale * q k^T + masks) (before
 * dropout), computed with the output, from each row's running max and sum, without the
 * (n_q, n_k) matrix (docs/semantics.md, "Row statistics"). For row (b, h, i), with
 * a = i + (n_k - n_q) the query's position among the keys (as causal aligns it):
 *   entropy        -sum_j P_ij log P_ij (nats)
 *   max_weight     max_j P_ij;   argmax: the first key j reaching it
 *   key_set_mass   sum_j P_ij over the keys j of key_set
 *   self_weight, prev_weight, next_weight: P_ia, P_i(a-1), P_i(a+1) (0 outside [0, n_k))
 *   distance       sum_j P_ij |a - j|
 * Each output is (B, H, n_q) contiguous, or NULL when not wanted. A fully masked row gives
 * 0 everywhere and argmax -1. key_set: bytes, nonzero = in the set, batch b's n_k at
 * key_set + b * key_set_stride (stride 0: one set for every batch); required (else
 * MHA_EINVAL) with key_set_mass. */
#define MHA_DECLARE_ROW_STATS(T, SFX)                                                          \
    typedef struct {                                                                           \
        T *entropy, *max_weight;                                                               \
        int64_t *argmax;                                                                       \
        T *key_set_mass, *self_weight, *prev_weight, *next_weight, *distance;                   \
        const uint8_t *key_set;                                                                \
        int64_t key_set_stride;                                                                \
    } mha_row_stats_##SFX;                                                                     \
    /* mha_attention_forward_lse with the row statistics in stats (any of its outputs NULL). */ \
    int mha_attention_forward_stats_##SFX(T *out, T *weights, T *lse,                         \
                                          const mha_row_stats_##SFX *stats, const T *q,        \
                                          const T *k, const T *v,                              \
                                          const mha_attention_desc *desc);

MHA_DECLARE_ROW_STATS(float, f32)
MHA_DECLARE_ROW_STATS(double, f64)

/* Its backward from the forward's out (like out) and lse: tiled over keys and queries
 * (FlashAttention-2's scheme), O(n) scratch. out and lse NULL (both): the forward runs first.
 * dq like q, dk like k, dv like v (overwritten); d_out like out. */
int mha_attention_backward_saved_f32(float *dq, float *dk, float *dv, const float *d_out,
                                     const float *q, const float *k, const float *v,
                                     const float *out, const float *lse,
                                     const mha_attention_desc *desc);
int mha_attention_backward_saved_f64(double *dq, double *dk, double *dv, const double *d_out,
                                     const double *q, const double *k, const double *v,
                                     const double *out, const double *lse,
                                     const mha_attention_desc *desc);
/* Its backward, stateless: runs the forward again for out and lse (O(n) scratch).
 * dq like q, dk like k, dv like v (overwritten); d_out like out. */
int mha_attention_backward_f32(float *dq, float *dk, float *dv, const float *d_out,
                               const float *q, const float *k, const float *v,
                               const mha_attention_desc *desc);
int mha_attention_backward_f64(double *dq, double *dk, double *dv, const double *d_out,
                               const double *q, const double *k, const double *v,
                               const mha_attention_desc *desc);

/* ---- the multi-head layer ------------------------------------------------------------- */

typedef struct {
    int64_t batch, n_q, n_k;         /* n_k: keys attended (cache length + new keys)        */
    int64_t n_new;                   /* rows of x_k / x_v projected by this call (n_k unless a
                                        KV cache supplies the first n_k - n_new)           */
    int64_t d_model, kdim, vdim;
    int64_t heads, kv_heads, d_head;
    int64_t kv_row_offset;           /* row where new keys are written in k_proj / v_proj   */
    int64_t kv_batch_stride;         /* rows between batches of k_proj / v_proj (>= n_k)    */
} mha_layer_dims;

/* The layer's structs and functions for one element type T (float: _f32, double: _f64).
 * Fill the structs by name, e.g. (mha_layer_params_f32){.W_q = W_q, .W_k = W_k, ...}: a field
 * left out is NULL.
 *
 * mha_layer_params: stored (in, out) so that x @ W is the projection.
 *   W_q (d_model, H*d_head)  W_k (kdim, H_kv*d_head)  W_v (vdim, H_kv*d_head)
 *   W_o (H*d_head, d_model)  b_q (H*d_head)  b_k, b_v (H_kv*d_head)  b_o (d_model)
 *   head_mask (H): multiplies each head's output before W_o.
 *   The biases may be NULL (no bias); head_mask NULL means all ones.
 * mha_layer_grads: the gradients, with the shapes of the parameters (head_mask: (H)); a
 *   NULL field is not computed.
 * mha_layer_saved: what the forward writes for the backward.
 *   q_proj (B, n_q, H*d_head)
 *   k_proj, v_proj (B, kv_batch_stride, H_kv*d_head): the forward writes rows
 *     [kv_row_offset, kv_row_offset + n_new) of each batch (a KV cache holds the others)
 *   attn (B, n_q, H*d_head): the heads' outputs before head_mask
 *   lse (B, H, n_q): each attention row's log-sum-exp; may be NULL (the backward then runs
 *     the attention's forward again). */
#define MHA_DECLARE_LAYER(T, SFX)                                                              \
    typedef struct {                                                                           \
        const T *W_q, *W_k, *W_v, *W_o;                                                        \
        const T *b_q, *b_k, *b_v, *b_o;                                                        \
        const T *head_mask;                                                                    \
    } mha_layer_params_##SFX;                                                                  \
    typedef struct {                                                                           \
        T *W_q, *W_k, *W_v, *W_o;                                                              \
        T *b_q, *b_k, *b_v, *b_o;                                                              \
        T *head_mask;                                                                          \
    } mha_layer_grads_##SFX;                                                                   \
    typedef struct {                                                                           \
        T *q_proj, *k_proj, *v_proj, *attn, *lse;                                              \
    } mha_layer_saved_##SFX;                                                                   \
    /* Forward. out (B, n_q, d_model); weights (B, H, n_q, n_k) or NULL; saved: written;      \
     * x_q (B, n_q, d_model), x_k (B, n_new, kdim), x_v (B, n_new, vdim). attn_desc gives     \
     * masks, causal, dropout (its sizes and views are filled in here). */                     \
    int mha_layer_forward_##SFX(T *out, T *weights, const mha_layer_saved_##SFX *saved,       \
                                const T *x_q, const T *x_k, const T *x_v,                      \
                                const mha_layer_params_##SFX *params,                          \
                                const mha_layer_dims *dims,                                    \
                                const mha_attention_desc *attn_desc);                          \
    /* Backward. Gradients of the inputs (dx_q like x_q, dx_k like x_k, dx_v like x_v) and of  \
     * the parameters (grads), from d_out (B, n_q, d_model) and what the forward saved (read   \
     * only). Requires kv_row_offset == 0 (no cache). When an input is another one             \
     * (self-attention), pass the same dx buffer for both: their gradients are summed there. */ \
    int mha_layer_backward_##SFX(T *dx_q, T *dx_k, T *dx_v, const mha_layer_grads_##SFX *grads, \
                                 const T *d_out, const mha_layer_saved_##SFX *saved,         \
                                 const T *x_q, const T *x_k, const T *x_v,                     \
                                 const mha_layer_params_##SFX *params,                         \
                                 const mha_layer_dims *dims,                                   \
                                 const mha_attention_desc *attn_desc);

MHA_DECLARE_LAYER(float, f32)
MHA_DECLARE_LAYER(double, f64)

/* ---- building blocks -------------------------------------------------------------------- */

/* C = alpha * op(A) @ op(B) + beta * C, row-major; op(X) = X or X^T (trans_X != 0).
 * op(A): (M, K), op(B): (K, N), C: (M, N) with leading dimensions lda, ldb, ldc.
 * With beta == 0, C is not read. Uses mha_get_num_threads() threads unless called from
 * inside a parallel region. */
int mha_gemm_f32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                 float *C, int64_t ldc);
int mha_gemm_f64(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, double alpha,
                 const double *A, int64_t lda, const double *B, int64_t ldb, double beta,
                 double *C, int64_t ldc);

/* The rest of a transformer block (block_impl.h). Rows are row-major with the given leading
 * dimensions (elements between the starts of consecutive rows); every function returns
 * MHA_EINVAL, having written nothing, for negative sizes or an unknown activation.
 *
 * Activations, elementwise. float32 uses vectorised formulas (vec.h: erf within 4e-7, the
 * sigmoid within 3e-7 relative), float64 libm's erf, tanh and exp. */
enum mha_activation {
    MHA_ACT_NONE = 0,
    MHA_ACT_GELU = 1,       /* x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)): BERT's "gelu"            */
    MHA_ACT_GELU_TANH = 2,  /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): GPT-2's          */
    MHA_ACT_SILU = 3,       /* x sigmoid(x): LLaMA's "silu"                                     */
    MHA_ACT_QUICK_GELU = 4, /* x sigmoid(1.702 x)                                               */
    MHA_ACT_RELU = 5        /* max(x, 0); a NaN stays NaN                                        */
};
/* Or'ed into an activation: gated, y[j] = act(x[j]) * x[n + j] over rows of 2n (SwiGLU with
 * MHA_ACT_SILU; Shazeer 2020). */
#define MHA_ACT_GATED 16

/* The layouts of a weight packed whole for mha_linear_packed_fmt (mha_pack_weight_fmt), W the
 * panel width of the type and SIMD path in use (mha_pack_width), op(B) (K, N) cut into
 * P = ceil(N / W) panels of W columns (zero-padded), each holding the whole shared axis:
 *   MHA_WEIGHTS_NATIVE  the compute type itself: mha_pack_weight's K x W panels of T.
 *   MHA_WEIGHTS_BF16    K x W uint16 bfloat16 per panel (2 bytes a weight), element (p, c) at
 *                       [p * W + c]; widening to float is exact (bits << 16). Packed from T
 *                       (via float) with rounding to nearest even, NaN -> 0x7FC0, as torch's
 *                       .to(torch.bfloat16); or from raw bfloat16 bits, kept as they are.
 *   MHA_WEIGHTS_F16     K x W uint16 IEEE half per panel (GGUF's F16), laid out as bfloat16;
 *                       widening is exact. Packed from T (via float) with rounding to nearest
 *                       even (narrow.h: mha_float_to_half), or from raw half bits, kept.
 *   MHA_WEIGHTS_Q8_0    ggml's Q8_0 (blocks of 32 consecutive values along K, one IEEE half
 *                       scale d each, value = d * q, q int8), kept in blocks for each column:
 *                       per panel ceil(K / 32) blocks of 34 W bytes, block b = W half scales
 *                       (column c's at bytes [2c, 2c + 2), little-endian host order) then
 *                       32 x W int8 (row r of the block, column c at byte 2W + r W + c).
 *                       K not a multiple of 32: the last block is padded with zeros (the
 *                       quantisation sees only the K - 32 floor(K / 32) real values, its padded
 *                       q are 0). 34/32 = 1.0625 bytes a weight. Quantised from T (via float)
 *                       as ggml's quantize_row_q8_0_ref (narrow.h), or taken from ggml's blocks.
 * With few rows of A (up to 16, or 64 on a path with 32 vector registers: decode steps and
 * short prompts) the micro-kernel widens (dequantises) each row of a panel in registers as it
 * reads it, each panel read front to back; with more, one panel
 * slice of at most 256 x W (K <= 640: the whole axis) at a time is widened into a per-thread
 * buffer of T that the micro-kernel then reads once per block of rows. Either way the product
 * equals, bit for bit, mha_linear_packed on the widened weights (every widening is exact),
 * except Q8_0 with few rows: there a micro-tile of up to 3 rows sums each block's 32 products
 * a * q before the block's scale multiplies them (one multiplication a block instead of one a
 * weight), which rounds differently, within float rounding of the same product. */
enum mha_weight_format {
    MHA_WEIGHTS_NATIVE = 0,
    MHA_WEIGHTS_BF16 = 1,
    MHA_WEIGHTS_Q8_0 = 2,
    MHA_WEIGHTS_F16 = 3
};

#define MHA_DECLARE_BLOCK(T, SFX)                                                              \
    /* C = act(A @ op(B) + bias) + beta * C: A (M, K), op(B) (K, N') where N' = N, or 2N      \
     * when act is gated (the gate's columns, then the up's); bias (N') or NULL. The         \
     * activation runs on each row when its product is done, inside the product's parallel   \
     * region. beta must be 0 when act is not MHA_ACT_NONE (beta = 1: a residual added in    \
     * place). Threads as mha_gemm. */                                                        \
    int mha_linear_##SFX(int64_t M, int64_t N, int64_t K, const T *A, int64_t lda,            \
                         const T *B, int64_t ldb, int trans_b, const T *bias, int act,         \
                         T beta, T *C, int64_t ldc);                                           \
    /* Backward of mha_linear (beta = 0), accumulating (+=, as llm.c: zero the outputs         \
     * first for a plain gradient; residual branches then add up):                             \
     *   z = A @ op(B) + bias (M, N'), C = act(z) (M, N); dz = dC * act'(z) (gated: d gate =   \
     *   dC * up * act'(gate), d up = dC * act(gate));                                         \
     *   dA (M, K) += dz @ op(B)^T; dB (B's shape, leading dimension ldb) += A^T dz (or its    \
     *   transpose with trans_b); dbias (N') += the column sums of dz, rows in order.          \
     * Any of dA, dB, dbias may be NULL (not computed). z: the forward's pre-activation        \
     * (M, N') contiguous, or NULL: recomputed from A, B and bias (one more product); unused   \
     * when act is MHA_ACT_NONE (dz is dC). Results do not depend on the thread count.         \
     * dA's product reads op(B)^T packed whole (mha_pack_weight's layout) into scratch:        \
     * NULL (allocated per call), or room for ceil(K / W) * W * N' elements, W from            \
     * mha_pack_width (callers making many calls pass one, sparing an allocation each). */     \
    int mha_linear_backward_##SFX(T *dA, int64_t ldda, T *dB, T *dbias, const T *dC,           \
                                  int64_t lddc, const T *A, int64_t lda, const T *B,           \
                                  int64_t ldb, int trans_b, const T *bias, const T *z,         \
                                  int act, int64_t M, int64_t N, int64_t K, T *scratch);       \
    /* Weights packed once for many products (a model's dense layers): mha_pack_weight writes \
     * op(B) (K, N) into ceil(N / W) panels of K x W, W = *width from mha_pack_width (it      \
     * depends on the SIMD path in use; zero-padded columns), K * W * ceil(N / W) elements;   \
     * mha_linear_packed is mha_linear with op(B) read from them and no packing per call:     \
     * bitwise the same result, except for products small enough (M N K <= 16384) that        \
     * mha_linear runs them in plain loops (then equal to rounding). */                       \
    int mha_pack_width_##SFX(int64_t *width);                                                  \
    int mha_pack_weight_##SFX(T *packed, const T *B, int64_t ldb, int trans_b, int64_t K,      \
                              int64_t N);                                                      \
    /* mha_pack_weight_transposed writes op(B)^T (N, K) packed (ceil(K / W) panels of N x W,  \
     * ceil(K / W) * W * N elements) into out from op(B)'s packing alone: the weight that a    \
     * backward's dA = dz @ op(B)^T multiplies by, when a model keeps only the packing.        \
     * Bitwise what mha_pack_weight makes of op(B)^T; out must not overlap packed. */          \
    int mha_pack_weight_transposed_##SFX(T *out, const T *packed, int64_t K, int64_t N);      \
    int mha_linear_packed_##SFX(int64_t M, int64_t N, int64_t K, const T *A, int64_t lda,     \
                                const T *Bp, const T *bias, int act, T beta, T *C,             \
                                int64_t ldc);                                                  \
    /* Packed weights of any format (enum mha_weight_format, layouts above): *bytes of op(B)   \
     * (K, N) packed in format (EINVAL for an unknown format or an overflowing size);          \
     * mha_pack_weight_fmt packs op(B) from T; mha_pack_weight_bf16_bits packs raw bfloat16    \
     * bits (a checkpoint's tensor, MHA_WEIGHTS_BF16 kept bit for bit), _f16_bits raw IEEE     \
     * half bits (MHA_WEIGHTS_F16, kept; B, ldb, trans_b as there); _q8_0_blocks re-lays       \
     * out ggml's Q8_0 blocks of a weight stored (N, K) (GGUF's ne0 = K: N rows of             \
     * ceil(K / 32) blocks of 34 bytes, a half d then 32 int8) into MHA_WEIGHTS_Q8_0 panels.   \
     * mha_linear_packed_fmt is mha_linear_packed on such a packing (N' columns, as there).    \
     * All of them are per SIMD path and type (W): pack with the functions of the type the    \
     * product runs in, in the same process. */                                               \
    int mha_packed_bytes_##SFX(int format, int64_t K, int64_t N, size_t *bytes);               \
    int mha_pack_weight_fmt_##SFX(void *packed, int format, const T *B, int64_t ldb,           \
                                  int trans_b, int64_t K, int64_t N);                          \
    int mha_pack_weight_bf16_bits_##SFX(void *packed, const uint16_t *B, int64_t ldb,          \
                                        int trans_b, int64_t K, int64_t N);                    \
    int mha_pack_weight_f16_bits_##SFX(void *packed, const uint16_t *B, int64_t ldb,           \
                                       int trans_b, int64_t K, int64_t N);                     \
    int mha_pack_weight_q8_0_blocks_##SFX(void *packed, const void *blocks, int64_t K,         \
                                          int64_t N);                                          \
    int mha_linear_packed_fmt_##SFX(int64_t M, int64_t N, int64_t K, const T *A, int64_t lda, \
                                    int format, const void *packed, const T *bias, int act,   \
                                    T beta, T *C, int64_t ldc);                                \
    /* The product with the transpose of such a packing (any format, MHA_WEIGHTS_NATIVE too): \
     * C (M, K) = A (M, N) @ op(B)^T + beta * C, op(B) (K, N) as packed by mha_pack_weight_fmt \
     * (N columns; the gradient of mha_linear_packed_fmt's input, dA = dC @ op(B)^T). The      \
     * packing is widened a chunk of its rows at a time (about 1 MiB of T), each chunk then    \
     * the GEMM's B; within float rounding of the product on the widened weights. */           \
    int mha_linear_transposed_fmt_##SFX(int64_t M, int64_t N, int64_t K, const T *A,           \
                                        int64_t lda, int format, const void *packed, T beta,   \
                                        T *C, int64_t ldc);                                    \
    /* y = act(x) on rows of n (gated: x rows of 2n, y = act(gate) * up). y may be x (same    \
     * leading dimension); otherwise they must not overlap. */                                 \
    int mha_activation_##SFX(T *y, int64_t ldy, const T *x, int64_t ldx, int64_t rows,        \
                             int64_t n, int act);                                              \
    /* Backward of mha_activation from its input x: dx = dy * act'(x) on rows of n (dy),       \
     * overwritten; gated: x and dx rows of 2n, d gate = dy * up * act'(gate), d up = dy *     \
     * act(gate). ReLU passes dy where x > 0 or x is NaN (torch's rule). dx may be x (same     \
     * leading dimension), or dy when not gated. */                                            \
    int mha_activation_backward_##SFX(T *dx, int64_t lddx, const T *dy, int64_t lddy,          \
                                      const T *x, int64_t ldx, int64_t rows, int64_t n,        \
                                      int act);                                                \
    /* LayerNorm over each row of d: y = (x - mean) / sqrt(var + eps) * gain + bias (biased     \
     * variance, like torch); gain, bias may be NULL (1 and 0). y may be x. */                 \
    int mha_layer_norm_##SFX(T *y, int64_t ldy, const T *x, int64_t ldx, int64_t rows,        \
                             int64_t d, const T *gain, const T *bias, double eps);             \
    /* Backward of mha_layer_norm from its input x (each row's mean and rstd = 1 /             \
     * sqrt(var + eps) recomputed as the forward computes them), accumulating (+=):            \
     *   xhat = (x - mean) rstd, g = dy * gain;                                                \
     *   dx += rstd (g - mean(g) - xhat mean(g xhat)); dgain += sum over rows of dy xhat;      \
     *   dbias += sum over rows of dy (rows in order, whatever the threads).                   \
     * gain NULL means 1 (no dgain); any output may be NULL; dx must not overlap dy. */        \
    int mha_layer_norm_backward_##SFX(T *dx, int64_t lddx, T *dgain, T *dbias, const T *dy,    \
                                      int64_t lddy, const T *x, int64_t ldx, const T *gain,    \
                                      int64_t rows, int64_t d, double eps);                    \
    /* RMSNorm (Zhang and Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * gain (gain may be     \
     * NULL). y may be x. */                                                                   \
    int mha_rms_norm_##SFX(T *y, int64_t ldy, const T *x, int64_t ldx, int64_t rows,          \
                           int64_t d, const T *gain, double eps);                              \
    /* Backward of mha_rms_norm the same way: xhat = x rstd, g = dy * gain;                    \
     *   dx += rstd (g - xhat mean(g xhat)); dgain += sum over rows of dy xhat. */             \
    int mha_rms_norm_backward_##SFX(T *dx, int64_t lddx, T *dgain, const T *dy, int64_t lddy,  \
                                    const T *x, int64_t ldx, const T *gain, int64_t rows,      \
                                    int64_t d, double eps);                                    \
    /* Rotary position embedding in place, the half-split form of Hugging Face's LLaMA         \
     * (Su et al. 2021): in each of `heads` consecutive d_head-wide slices of a row, the pair \
     * (x_i, x_{i + d_head/2}) becomes (x_i c - x_{i+h} s, x_{i+h} c + x_i s) with c, s row    \
     * r % period of cos and sin ((period, d_head / 2) each). d_head must be even. */           \
    int mha_rope_##SFX(T *x, int64_t ldx, int64_t rows, int64_t heads, int64_t d_head,        \
                       const T *cos, const T *sin, int64_t period);                            \
    /* Backward of mha_rope, in place on the gradient: the rotation's transpose, the pair      \
     * (g_i, g_{i+h}) becomes (g_i c + g_{i+h} s, g_{i+h} c - g_i s). Same arguments. */       \
    int mha_rope_backward_##SFX(T *dx, int64_t ldx, int64_t rows, int64_t heads,               \
                                int64_t d_head, const T *cos, const T *sin, int64_t period);   \
    /* Rows of an embedding table (vocab, d) for n ids: out[i] = table[ids[i]], or += when    \
     * accumulate; MHA_EINVAL, with nothing written, when an id is outside [0, vocab). */      \
    int mha_embedding_##SFX(T *out, int64_t ldo, const T *table, int64_t vocab, int64_t d,    \
                            const int64_t *ids, int64_t n, int accumulate);                    \
    /* Backward of mha_embedding: d_table (vocab, d) += the rows of d_out (n, d) at ids, each  \
     * table row summing its ids in order (a row hit twice adds both, the same bits whatever   \
     * the threads); MHA_EINVAL, with nothing written, for an id outside [0, vocab). */        \
    int mha_embedding_backward_##SFX(T *d_table, const T *d_out, int64_t ldo,                  \
                                     const int64_t *ids, int64_t n, int64_t vocab, int64_t d); \
    /* Softmax cross-entropy over an LM head in chunks of rows, never the whole (n, vocab)     \
     * logits: logits = hidden (n, d) @ op(W) (d, vocab) (W (d, vocab), or (vocab, d) with     \
     * trans_w: a tied embedding table); *loss = the mean over counted rows of                 \
     * logsumexp(logits_i) - logits_i[labels[i]], a row whose label is -100 not counted (as    \
     * transformers); no counted row: NaN (as torch) and no gradient. With d_logits =          \
     * (softmax - onehot) / count: d_hidden (n, d) += d_logits @ op(W)^T, dW (W's shape,       \
     * leading dimension ldw) += hidden^T d_logits (or its transpose with trans_w), `chunk`    \
     * rows at a time (chunk <= 0: as many as keep a chunk's logits within 64 MiB);            \
     * d_hidden, dW may be NULL. MHA_EINVAL, nothing written, for a label outside              \
     * [0, vocab) but -100. */                                                                 \
    int mha_cross_entropy_##SFX(double *loss, T *d_hidden, int64_t ldd, T *dW,                 \
                                const T *hidden, int64_t ldh, const T *W, int64_t ldw,         \
                                int trans_w, const int64_t *labels, int64_t n, int64_t d,      \
                                int64_t vocab, int64_t chunk);                             \
    /* One Adam step in place on n parameters p with their gradient g and moments m, v, in     \
     * torch.optim.Adam's arithmetic (step = t >= 1, the steps taken with this one):           \
     *   decoupled weight decay (AdamW): p *= 1 - lr weight_decay; else g' = g + weight_decay p; \
     *   m += (g' - m)(1 - beta1); v = beta2 v + (1 - beta2) g'^2;                             \
     *   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps),                    \
     * each operation rounded to T (scalars computed in double, then rounded), as               \
     * mha.train.Adam's NumPy step; equal to it to rounding where products and sums are fused. \
     * p, m, v must not overlap each other or g. MHA_EINVAL for n < 0 or step < 1. */          \
    int mha_adam_step_##SFX(T *p, T *m, T *v, const T *g, int64_t n, double lr, double beta1,  \
                            double beta2, double eps, double weight_decay, int decoupled,      \
                            int64_t step);

MHA_DECLARE_BLOCK(float, f32)
MHA_DECLARE_BLOCK(double, f64)

/* The dropout RNG: a uniform double in [0, 1) for (seed, b, h, i, j); position (i, j) is
 * dropped iff the value is < p. */
double mha_dropout_uniform(uint64_t seed, uint64_t b, uint64_t h, uint64_t i, uint64_t j);

/* Attention flow (Abnar & Zuidema 2020): out (n_sources, n), out[i][j] = the maximum flow from
 * node (layers, sources[i]) to node (0, j) of the layered graph whose edge (l + 1, a) -> (l, b)
 * has capacity weights[l][a][b]; weights (layers, n, n) row-major, finite and >= 0 (else
 * MHA_EINVAL); sources NULL: all n positions in order (n_sources is then ignored). Exact for the
 * capacities rounded to multiples of R * 2^-61, R the largest row sum (flow.c). */
int mha_attention_flow_f64(double *out, const double *weights, int64_t layers, int64_t n,
                           const int64_t *sources, int64_t n_sources);

/* Threads of the core's parallel work: on POSIX systems mha's own pool of POSIX threads,
 * elsewhere OpenMP when compiled with it (threads.c); a serial build (-DMHA_SERIAL, or no
 * OpenMP on Windows) always runs 1. Results do not depend on the thread count.
 * mha_set_num_threads(n): n threads from now on, n in 1 .. MHA_MAX_THREADS (a larger n
 * counts as MHA_MAX_THREADS); n <= 0 restores the default: OMP_NUM_THREADS when set, else
 * the core count, at most MHA_MAX_THREADS. */
#define MHA_MAX_THREADS 256
void mha_set_num_threads(int n);
int mha_get_num_threads(void);

/* ---- SIMD dispatch (dispatch.c) ------------------------------------------------------- */

/* The kernels are compiled once per instruction set ("paths": "avx512" for AVX-512 and
 * "avx2" for AVX2+FMA on x86, "baseline" for the target's baseline: SSE2 on x86-64, NEON on
 * aarch64). The first call of any function of the core chooses one for the process: the best
 * this CPU runs, unless the environment variable MHA_SIMD names another (auto, avx512, avx2
 * or baseline, any case). A value
 * that names no path, or one this build or CPU lacks, is ignored with a warning on stderr.
 * Results differ between paths by rounding only (docs/semantics.md, "SIMD paths"). */
/* The path in use: "avx512", "avx2" or "baseline" (a static string). */
const char *mha_simd_path(void);
/* The paths this build runs on this CPU, best first, separated by spaces:
 * "avx512 avx2 baseline". */
const char *mha_simd_paths(void);
/* A static string of "key=value" fields separated by "; ": compiler, simd (the path in use),
 * simd_isa (what its unit was compiled for), simd_paths, simd_choice (how the path was
 * chosen), kernels (vector extensions or portable C), threads (what runs them: mha's pool,
 * OpenMP or serial). */
const char *mha_build_info(void);

/* The kernels keep freed scratch blocks of 256 KiB or more (up to 64 MiB in all, POSIX
 * builds) for their next calls; this frees them and returns their bytes (0 where none are
 * kept). */
size_t mha_release_scratch(void);

#ifdef __cplusplus
}
#endif
#endif /* MHA_H */
