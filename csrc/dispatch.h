/* dispatch.h: the kernels, compiled once per instruction set, and the table that picks one
 * set at run time (internal; the public API is mha.h).
 *
 * A kernel unit is one translation unit holding the whole numerical core (kernels.h: the GEMM,
 * attention and the layer, float and double), built with the flags of one instruction set:
 *   kernels_baseline.c  the target's baseline (SSE2 on x86-64, NEON on aarch64), always built
 *   kernels_avx2.c      AVX2+FMA (-mavx2 -mfma; MSVC /arch:AVX2), x86 only
 *   kernels_avx512.c    AVX-512 F/DQ/BW/VL (x86-64-v4; MSVC /arch:AVX512), x86 only
 * Each unit exports one table (mha_kernels) of the entry points below; dispatch.c probes the
 * CPU once, honours MHA_SIMD, and every public function calls through the chosen table. Only
 * the entry points are called through it: inside a unit every call is direct, and every loop
 * is compiled for the unit's instruction set.
 *
 * Adding a kernel: write it in a *_impl.h (type-generic, static functions named FN(...)),
 * include that file in kernels.h, declare its entry point in mha.h (public) or common.h
 * (internal), and add one line X(name, (parameters), (arguments)) below; the table field,
 * each unit's entry and the dispatching function are generated from that line. Entry points
 * return an int status (MHA_OK or an error code).
 * Adding an instruction set: a kernels_<isa>.c like kernels_avx2.c, listed in sources.mk's
 * ISA_UNITS, its compile flags in setup.py (KERNEL_UNIT_FLAGS) and csrc/Makefile
 * (FLAGS_kernels_<isa>), and a line in dispatch.c's list of paths with its CPU probe. */
#ifndef MHA_DISPATCH_H
#define MHA_DISPATCH_H

#include "common.h"
#include "mha.h"

/* The entry points, written once for T = float, SFX = f32 and T = double, SFX = f64. */
#define MHA_DISPATCHED(X, T, SFX)                                                              \
    X(mha_gemm_##SFX,                                                                          \
      (int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T *A,         \
       int64_t lda, const T *B, int64_t ldb, T beta, T *C, int64_t ldc),                       \
      (trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc))                        \
    X(mha_gemm_bias_##SFX,                                                                     \
      (int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const T *A, int64_t lda,     \
       const T *B, int64_t ldb, const T *bias, T *C, int64_t ldc),                             \
      (trans_a, trans_b, M, N, K, A, lda, B, ldb, bias, C, ldc))                               \
    X(mha_gemm_shared_a_##SFX,                                                                 \
      (int64_t M, int64_t K, const T *A, int64_t lda, const mha_gemm_out_##SFX *outs,          \
       int n_out),                                                                             \
      (M, K, A, lda, outs, n_out))                                                             \
    X(mha_linear_##SFX,                                                                        \
      (int64_t M, int64_t N, int64_t K, const T *A, int64_t lda, const T *B, int64_t ldb,      \
       int trans_b, const T *bias, int act, T beta, T *C, int64_t ldc),                        \
      (M, N, K, A, lda, B, ldb, trans_b, bias, act, beta, C, ldc))                             \
    X(mha_linear_packed_##SFX,                                                                 \
      (int64_t M, int64_t N, int64_t K, const T *A, int64_t lda, const T *Bp, const T *bias,   \
       int act, T beta, T *C, int64_t ldc),                                                    \
      (M, N, K, A, lda, Bp, bias, act, beta, C, ldc))                                          \
    X(mha_pack_weight_##SFX,                                                                   \
      (T *packed, const T *B, int64_t ldb, int trans_b, int64_t K, int64_t N),                 \
      (packed, B, ldb, trans_b, K, N))                                                         \
    X(mha_pack_weight_transposed_##SFX,                                                        \
      (T *out, const T *packed, int64_t K, int64_t N), (out, packed, K, N))                    \
    X(mha_pack_width_##SFX, (int64_t *width), (width))                                         \
    X(mha_packed_bytes_##SFX, (int format, int64_t K, int64_t N, size_t *bytes),               \
      (format, K, N, bytes))                                                                   \
    X(mha_pack_weight_fmt_##SFX,                                                               \
      (void *packed, int format, const T *B, int64_t ldb, int trans_b, int64_t K, int64_t N),  \
      (packed, format, B, ldb, trans_b, K, N))                                                 \
    X(mha_pack_weight_bf16_bits_##SFX,                                                         \
      (void *packed, const uint16_t *B, int64_t ldb, int trans_b, int64_t K, int64_t N),       \
      (packed, B, ldb, trans_b, K, N))                                                         \
    X(mha_pack_weight_f16_bits_##SFX,                                                          \
      (void *packed, const uint16_t *B, int64_t ldb, int trans_b, int64_t K, int64_t N),       \
      (packed, B, ldb, trans_b, K, N))                                                         \
    X(mha_pack_weight_q8_0_blocks_##SFX,                                                       \
      (void *packed, const void *blocks, int64_t K, int64_t N), (packed, blocks, K, N))        \
    X(mha_linear_packed_fmt_##SFX,                                                             \
      (int64_t M, int64_t N, int64_t K, const T *A, int64_t lda, int format,                   \
       const void *packed, const T *bias, int act, T beta, T *C, int64_t ldc),                 \
      (M, N, K, A, lda, format, packed, bias, act, beta, C, ldc))                              \
    X(mha_linear_transposed_fmt_##SFX,                                                         \
      (int64_t M, int64_t N, int64_t K, const T *A, int64_t lda, int format,                   \
       const void *packed, T beta, T *C, int64_t ldc),                                         \
      (M, N, K, A, lda, format, packed, beta, C, ldc))                                         \
    X(mha_activation_##SFX,                                                                    \
      (T *y, int64_t ldy, const T *x, int64_t ldx, int64_t rows, int64_t n, int act),          \
      (y, ldy, x, ldx, rows, n, act))                                                          \
    X(mha_layer_norm_##SFX,                                                                    \
      (T *y, int64_t ldy, const T *x, int64_t ldx, int64_t rows, int64_t d, const T *gain,     \
       const T *bias, double eps),                                                             \
      (y, ldy, x, ldx, rows, d, gain, bias, eps))                                              \
    X(mha_rms_norm_##SFX,                                                                      \
      (T *y, int64_t ldy, const T *x, int64_t ldx, int64_t rows, int64_t d, const T *gain,     \
       double eps),                                                                            \
      (y, ldy, x, ldx, rows, d, gain, eps))                                                    \
    X(mha_rope_##SFX,                                                                          \
      (T *x, int64_t ldx, int64_t rows, int64_t heads, int64_t d_head, const T *cos,           \
       const T *sin, int64_t period),                                                          \
      (x, ldx, rows, heads, d_head, cos, sin, period))                                         \
    X(mha_embedding_##SFX,                                                                     \
      (T *out, int64_t ldo, const T *table, int64_t vocab, int64_t d, const int64_t *ids,      \
       int64_t n, int accumulate),                                                             \
      (out, ldo, table, vocab, d, ids, n, accumulate))                                         \
    X(mha_linear_backward_##SFX,                                                               \
      (T *dA, int64_t ldda, T *dB, T *dbias, const T *dC, int64_t lddc, const T *A,            \
       int64_t lda, const T *B, int64_t ldb, int trans_b, const T *bias, const T *z, int act,  \
       int64_t M, int64_t N, int64_t K, T *scratch),                                           \
      (dA, ldda, dB, dbias, dC, lddc, A, lda, B, ldb, trans_b, bias, z, act, M, N, K, scratch))\
    X(mha_activation_backward_##SFX,                                                           \
      (T *dx, int64_t lddx, const T *dy, int64_t lddy, const T *x, int64_t ldx, int64_t rows,  \
       int64_t n, int act),                                                                    \
      (dx, lddx, dy, lddy, x, ldx, rows, n, act))                                              \
    X(mha_layer_norm_backward_##SFX,                                                           \
      (T *dx, int64_t lddx, T *dgain, T *dbias, const T *dy, int64_t lddy, const T *x,         \
       int64_t ldx, const T *gain, int64_t rows, int64_t d, double eps),                       \
      (dx, lddx, dgain, dbias, dy, lddy, x, ldx, gain, rows, d, eps))                          \
    X(mha_rms_norm_backward_##SFX,                                                             \
      (T *dx, int64_t lddx, T *dgain, const T *dy, int64_t lddy, const T *x, int64_t ldx,      \
       const T *gain, int64_t rows, int64_t d, double eps),                                    \
      (dx, lddx, dgain, dy, lddy, x, ldx, gain, rows, d, eps))                                 \
    X(mha_rope_backward_##SFX,                                                                 \
      (T *dx, int64_t ldx, int64_t rows, int64_t heads, int64_t d_head, const T *cos,          \
       const T *sin, int64_t period),                                                          \
      (dx, ldx, rows, heads, d_head, cos, sin, period))                                        \
    X(mha_embedding_backward_##SFX,                                                            \
      (T *d_table, const T *d_out, int64_t ldo, const int64_t *ids, int64_t n, int64_t vocab,  \
       int64_t d),                                                                             \
      (d_table, d_out, ldo, ids, n, vocab, d))                                                 \
    X(mha_cross_entropy_##SFX,                                                                 \
      (double *loss, T *d_hidden, int64_t ldd, T *dW, const T *hidden, int64_t ldh,            \
       const T *W, int64_t ldw, int trans_w, const int64_t *labels, int64_t n, int64_t d,      \
       int64_t vocab, int64_t chunk),                                                          \
      (loss, d_hidden, ldd, dW, hidden, ldh, W, ldw, trans_w, labels, n, d, vocab, chunk))     \
    X(mha_adam_step_##SFX,                                                                     \
      (T *p, T *m, T *v, const T *g, int64_t n, double lr, double beta1, double beta2,         \
       double eps, double weight_decay, int decoupled, int64_t step),                          \
      (p, m, v, g, n, lr, beta1, beta2, eps, weight_decay, decoupled, step))                   \
    X(mha_attention_forward_lse_##SFX,                                                         \
      (T *out, T *weights, T *lse, const T *q, const T *k, const T *v,                         \
       const mha_attention_desc *desc),                                                        \
      (out, weights, lse, q, k, v, desc))                                                      \
    X(mha_attention_backward_saved_##SFX,                                                      \
      (T *dq, T *dk, T *dv, const T *d_out, const T *q, const T *k, const T *v, const T *out,  \
       const T *lse, const mha_attention_desc *desc),                                          \
      (dq, dk, dv, d_out, q, k, v, out, lse, desc))                                            \
    X(mha_layer_forward_##SFX,                                                                 \
      (T *out, T *weights, const mha_layer_saved_##SFX *saved, const T *x_q, const T *x_k,     \
       const T *x_v, const mha_layer_params_##SFX *params, const mha_layer_dims *dims,         \
       const mha_attention_desc *attn_desc),                                                   \
      (out, weights, saved, x_q, x_k, x_v, params, dims, attn_desc))                           \
    X(mha_layer_backward_##SFX,                                                                \
      (T *dx_q, T *dx_k, T *dx_v, const mha_layer_grads_##SFX *grads, const T *d_out,          \
       const mha_layer_saved_##SFX *saved, const T *x_q, const T *x_k, const T *x_v,           \
       const mha_layer_params_##SFX *params, const mha_layer_dims *dims,                       \
       const mha_attention_desc *attn_desc),                                                   \
      (dx_q, dx_k, dx_v, grads, d_out, saved, x_q, x_k, x_v, params, dims, attn_desc))

/* One unit's table: what it was compiled for, then one pointer per entry point. */
typedef struct mha_kernels {
    const char *isa;  /* the instructions it was compiled for: "AVX2+FMA", "SSE2", "NEON", ... */
    const char *code; /* "vector extensions" (GNU C) or "portable C" (MHA_GNU_C == 0) */
#define MHA_KERNEL_FIELD(name, params, args) int(*name) params;
    MHA_DISPATCHED(MHA_KERNEL_FIELD, float, f32)
    MHA_DISPATCHED(MHA_KERNEL_FIELD, double, f64)
#undef MHA_KERNEL_FIELD
} mha_kernels;

/* The units' tables: NULL for a unit built without its instruction set (kernels_avx2.c on
 * aarch64, or without its flags). */
extern const mha_kernels *const mha_unit_baseline;
extern const mha_kernels *const mha_unit_avx2;
extern const mha_kernels *const mha_unit_avx512;

#endif /* MHA_DISPATCH_H */
