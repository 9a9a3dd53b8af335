/* gemm_impl.h: the one matrix multiply, written once for a type `real`.
 * Included by kernels.h with real (float|double), SFX (f32|f64) defined, once per kernel unit.
 *
 * C = alpha * op(A) @ op(B) + beta * C (+ a bias row), row-major, in the BLIS scheme:
 *   for jc (NC columns of C):        pack op(B)[pc:pc+KC, jc:jc+NC] into NR-wide panels
 *     for pc (KC of the shared axis, see gemm_kc):
 *       for ic (MC rows, in parallel): pack op(A)[ic:ic+MC, pc:pc+KC] into MR-tall panels
 *         for jr, ir: an MR x NR micro-tile of C held in vector registers.
 * Packing absorbs the transposes, so one micro-kernel serves NN, NT, TN and TT.
 * Each element of C sums its products over the shared axis in order, one slice after
 * another, whatever the block sizes and the thread count: results are bitwise independent of
 * the threads, and differ between units only by their rounding of a * b + c (one rounding
 * with fused multiply-adds, two without).
 */
#define VEC_BYTES MHA_VEC_BYTES                /* 32 (AVX) or 16 (SSE2, NEON): vec.h      */
#define VL ((int)(VEC_BYTES / sizeof(real)))   /* elements per vector                     */
#define MR 6                                   /* micro-tile rows                         */
#define NV (MHA_VEC_REGS / 8)                  /* micro-tile columns in vectors (below)   */
#define NR (NV * VL)                           /* micro-tile columns                      */
#define KC 256                                 /* shared-axis block (see gemm_kc)          */
#define KC_ONE_SLICE 4096                      /* ... or the whole axis, up to this length  */
#define MC_MAX 144                             /* rows of A per block (multiple of MR)    */
#define NC 2048                                /* columns of B per block (see gemm_nc)    */
#define B_BLOCK (KC * NC)                      /* elements of a packed block of B, at most */
#define DIRECT_A_PANELS 8                      /* read A in place when B has <= 8 panels  */

#if MHA_GNU_C
typedef real FN(vec) __attribute__((vector_size(VEC_BYTES)));
#define vreal FN(vec)
#endif

/* Rows of A per block: at most MC_MAX, with the number of blocks a multiple of the thread
 * count where M allows, so that every thread gets the same work. */
static int64_t FN(gemm_mc)(int64_t M, int threads) {
    int64_t blocks = MHA_MAX(1, (M + MC_MAX - 1) / MC_MAX);
    blocks = (blocks + threads - 1) / threads * threads;
    int64_t mc = (M + blocks - 1) / blocks;
    return MHA_MAX(MR, MHA_MIN((mc + MR - 1) / MR * MR, MC_MAX));
}

/* Length of the shared-axis slices: the whole axis up to KC_ONE_SLICE, else slices of KC.
 * One slice writes each tile of C once; every further slice reads the tile back, adds and
 * writes it again, and those reads of C, from L2 or L3 at the end of each micro-tile, cost
 * more than what slices of KC gain by keeping a KC x NR panel of B in L1 (16 KiB of float
 * with 32-byte vectors). Measured on AMD Zen 4, 2 threads, B packed whole, interleaved
 * medians against slices of 256: 512 x 2304 x 768 +14% on the AVX2 path and +9% on AVX-512,
 * 197 x 3072 x 768 +9% and +2% (docs/benchmarks.md, "The AVX2 path"). */
static int64_t FN(gemm_kc)(int64_t K) {
    return K <= KC_ONE_SLICE ? K : KC;
}

/* Columns of B per block for slices of kc: NC, or fewer for long slices, so that a packed
 * block of B (kc x nc) stays within B_BLOCK elements (2 MiB of float) whatever kc. Blocks
 * of columns do not change any element's arithmetic. */
static int64_t FN(gemm_nc)(int64_t kc) {
    return MHA_MAX(NR, MHA_MIN(NC, B_BLOCK / MHA_MAX(kc, 1) / NR * NR));
}

/* Elements of the workspace's parts: packed B (one kc x nc block), then packed A (one
 * mc x kc block) per thread, each starting on a cache line. */
static void FN(gemm_parts)(int64_t N, int64_t K, int64_t mc, size_t *b_elems, size_t *a_elems) {
    size_t kc = (size_t)MHA_MAX(1, FN(gemm_kc)(K));
    size_t nc = mha_round_up((size_t)MHA_MAX(1, MHA_MIN(N, FN(gemm_nc)((int64_t)kc))), NR);
    *b_elems = mha_round_up(kc * nc, MHA_CACHE_LINE);
    *a_elems = mha_round_up(kc * (size_t)mc, MHA_CACHE_LINE);
}

static size_t FN(mha_gemm_workspace)(int64_t M, int64_t N, int64_t K, int threads) {
    size_t b_elems, a_elems;
    FN(gemm_parts)(N, K, FN(gemm_mc)(M, threads), &b_elems, &a_elems);
    return (b_elems + (size_t)threads * a_elems) * sizeof(real);
}

/* Packs op(A)[0:mc, 0:kc] (a points at its first element) into MR-row panels:
 * buf[panel][p][r], zero-padded to a multiple of MR rows. Loops run along memory. */
static void FN(pack_a)(real *buf, const real *a, int64_t lda, int trans, int64_t mc, int64_t kc) {
    for (int64_t i0 = 0; i0 < mc; i0 += MR) {
        int64_t rows = MHA_MIN(MR, mc - i0);
        if (trans) { /* op(A)[i][p] = a[p * lda + i]: row p of a holds the panel's p-th column */
            for (int64_t p = 0; p < kc; p++) {
                const real *src = a + p * lda + i0;
                for (int64_t r = 0; r < rows; r++) buf[p * MR + r] = src[r];
                for (int64_t r = rows; r < MR; r++) buf[p * MR + r] = 0;
            }
        } else {       /* op(A)[i][p] = a[i * lda + p]: read each row once, write with stride MR */
            for (int64_t r = 0; r < rows; r++) {
                const real *src = a + (i0 + r) * lda;
                for (int64_t p = 0; p < kc; p++) buf[p * MR + r] = src[p];
            }
            for (int64_t r = rows; r < MR; r++)
                for (int64_t p = 0; p < kc; p++) buf[p * MR + r] = 0;
        }
        buf += kc * MR;
    }
}

/* Packs op(B)[0:kc, 0:nc] into NR-column panels: buf[panel][p][c], zero-padded. */
static void FN(pack_b)(real *buf, const real *b, int64_t ldb, int trans, int64_t kc, int64_t nc) {
    for (int64_t j0 = 0; j0 < nc; j0 += NR) {
        int64_t cols = MHA_MIN(NR, nc - j0);
        if (trans) {   /* op(B)[p][j] = b[j * ldb + p]: VL x VL blocks transposed in registers */
            const int64_t c_full = cols / VL * VL, p_full = kc / VL * VL;
            for (int64_t c = 0; c < c_full; c += VL)
                for (int64_t p = 0; p < p_full; p += VL)
                    VN(mha_transpose_vl)(buf + p * NR + c, NR, b + (j0 + c) * ldb + p, ldb);
            for (int64_t c = 0; c < cols; c++) { /* what the blocks left: a ragged edge */
                const real *src = b + (j0 + c) * ldb;
                for (int64_t p = c < c_full ? p_full : 0; p < kc; p++) buf[p * NR + c] = src[p];
            }
            for (int64_t c = cols; c < NR; c++)
                for (int64_t p = 0; p < kc; p++) buf[p * NR + c] = 0;
        } else {
            for (int64_t p = 0; p < kc; p++) {
                const real *src = b + p * ldb + j0;
                real *dst = buf + p * NR;
                if (cols == NR) {
                    memcpy(dst, src, NR * sizeof(real));
                    continue;
                }
                for (int64_t c = 0; c < cols; c++) dst[c] = src[c];
                for (int64_t c = cols; c < NR; c++) dst[c] = 0;
            }
        }
        buf += kc * NR;
    }
}

/* The end of a micro-tile: c[0:m, 0:n] = alpha * tile + beta * c (c not read when beta == 0),
 * plus bias[0:n] on every row when bias is not NULL. */
MHA_INLINE void FN(tile_finish)(real tile[MR][NR], real *c, int64_t ldc, int64_t m, int64_t n,
                                real alpha, real beta, const real *bias) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t col = 0; col < n; col++) {
            real *cij = c + r * ldc + col;
            real x = alpha * tile[r][col] + (bias ? bias[col] : 0);
            *cij = beta == 0 ? x : x + beta * *cij;
        }
}

#if MHA_GNU_C
/* The same from the accumulators in registers (rows x nv vectors): whole vectors when the
 * tile is whole. */
MHA_INLINE void FN(tile_store)(const int rows, const int nv, vreal acc[MR][NV], real *c,
                               int64_t ldc, int64_t m, int64_t n, real alpha, real beta,
                               const real *bias) {
    if (m == rows && n == nv * VL) {
        MHA_UNROLL(6)
        for (int r = 0; r < rows; r++)
            MHA_UNROLL(4)
            for (int v = 0; v < nv; v++) {
                real *c_rv = c + r * ldc + v * VL;
                vreal x = alpha * acc[r][v], y;
                if (bias) {
                    MHA_VLOAD(y, bias + v * VL);
                    x += y;
                }
                if (beta != 0) {
                    MHA_VLOAD(y, c_rv);
                    x += beta * y;
                }
                MHA_VSTORE(c_rv, x);
            }
        return;
    }
    real tile[MR][NR];
    MHA_UNROLL(6)
    for (int r = 0; r < rows; r++)
        MHA_UNROLL(4)
        for (int v = 0; v < nv; v++) MHA_VSTORE(tile[r] + v * VL, acc[r][v]);
    FN(tile_finish)(tile, c, ldc, m, n, alpha, beta, bias);
}
#endif

/* The micro-kernel: acc (rows x NR) = A rows (rows x kc) @ b_panel (kc x NR), then
 * c[0:m, 0:n] = alpha * acc + beta * c (c not read when beta == 0), plus bias[0:n] on every
 * row when bias is not NULL (the layer's projections: no second pass over C).
 * Element (r, p) of the A rows is a[r * a_rs + p * a_cs]: (1, MR) for a packed panel, or the
 * strides of op(A) itself when A is read in place; rows past m then repeat row m - 1 (valid
 * memory, results discarded) instead of reading past the matrix.
 * rows (MR, or m itself when m < MR: a decode step's single row costs one row's products,
 * not MR's) and nv (NV, or NV / 2 when n <= NR / 2: the panel's first nv vectors) are
 * constants where this is inlined, so the loops over them unroll.
 * NR = NV vectors: the MR x NV accumulators, NV vectors of B and a broadcast element of A
 * fill the register file (16 registers: NV = 2, 12 + 2 + 1; 32 registers: NV = 4, 24 + 4 + 1).
 * The loops are unrolled by pragma so that acc lives in registers at any -O level (rolled,
 * GCC at -O2 keeps acc on the stack). Portable C accumulates in an array and leaves the
 * registers to the compiler. */
MHA_INLINE void FN(micro_tile)(const int rows, const int nv, int64_t kc, const real *a,
                               int64_t a_rs, int64_t a_cs, const real *b, real *c, int64_t ldc,
                               int64_t m, int64_t n, real alpha, real beta, const real *bias) {
    const real *row[MR];
    MHA_UNROLL(6)
    for (int r = 0; r < rows; r++) row[r] = a + MHA_MIN(r, m - 1) * a_rs;
#if MHA_GNU_C
    vreal acc[MR][NV];
    MHA_UNROLL(6)
    for (int r = 0; r < rows; r++)
        MHA_UNROLL(4)
        for (int v = 0; v < nv; v++) acc[r][v] = (vreal){0};
    for (int64_t p = 0; p < kc; p++) {
        vreal bv[NV];
        MHA_UNROLL(4)
        for (int v = 0; v < nv; v++) MHA_VLOAD(bv[v], b + p * NR + v * VL);
        MHA_UNROLL(6)
        for (int r = 0; r < rows; r++) {
            real a_r = row[r][p * a_cs];
            MHA_UNROLL(4)
            for (int v = 0; v < nv; v++) acc[r][v] += a_r * bv[v];
        }
    }
    FN(tile_store)(rows, nv, acc, c, ldc, m, n, alpha, beta, bias);
#else
    real tile[MR][NR] = {{0}};
    for (int64_t p = 0; p < kc; p++) {
        const real *b_p = b + p * NR;
        for (int r = 0; r < rows; r++) {
            const real a_r = row[r][p * a_cs];
            for (int col = 0; col < nv * VL; col++) tile[r][col] += a_r * b_p[col];
        }
    }
    FN(tile_finish)(tile, c, ldc, m, n, alpha, beta, bias);
#endif
}

/* ---- the micro-kernel on a narrow panel (mha.h: mha_weight_format), widened in registers --- */

/* Where the compiler converts vectors element-wise (GCC >= 9, clang), the narrow weights are
 * widened a vector at a time: bfloat16 by a shift of 16 (exact), IEEE half by its bits
 * (exact, subnormals and NaNs included; AVX-512's vcvtph2ps where the unit has it), Q8_0's
 * int8 by a conversion and a product with the block's scale (exact: 8 by 11 bits). */
#if MHA_GNU_C && defined(__has_builtin)
#if __has_builtin(__builtin_convertvector)
#define NW_VECTORS 1
#endif
#endif
#ifndef NW_VECTORS
#define NW_VECTORS 0
#endif
#ifndef NW_Q8_BLOCK_SUMS
#define NW_Q8_BLOCK_SUMS 1
#endif

#if NW_VECTORS
typedef uint16_t FN(vu16) __attribute__((vector_size(VL * 2)));
typedef uint32_t FN(vu32) __attribute__((vector_size(VL * 4)));
typedef int32_t FN(vi32) __attribute__((vector_size(VL * 4)));
typedef int8_t FN(vi8) __attribute__((vector_size(VL)));
typedef float FN(vf32) __attribute__((vector_size(VL * 4)));

/* VL bfloat16 at src -> *out */
MHA_INLINE void FN(widen_bf16)(vreal *out, const unsigned char *src) {
    FN(vu16) h;
    memcpy(&h, src, sizeof h);
    const FN(vu32) u = __builtin_convertvector(h, FN(vu32)) << 16;
    FN(vf32) f;
    memcpy(&f, &u, sizeof f);
    *out = __builtin_convertvector(f, vreal);
}

/* VL IEEE halves at src -> *out, as mha_half_to_float lane by lane */
MHA_INLINE void FN(widen_half)(vreal *out, const unsigned char *src) {
#if defined(__AVX512F__)
    if (sizeof(real) == sizeof(float)) { /* 16 halves: vcvtph2ps (AVX512F) */
        __m256i h;
        memcpy(&h, src, sizeof h);
        const __m512 f = _mm512_cvtph_ps(h);
        memcpy(out, &f, sizeof f);
        return;
    }
#endif
    FN(vu16) h;
    memcpy(&h, src, sizeof h);
    const FN(vu32) u = __builtin_convertvector(h, FN(vu32));
    const FN(vu32) sign = (u & 0x8000u) << 16, em = u & 0x7FFFu;
    const FN(vu32) inf_nan = (FN(vu32))(em >= 0x7C00u), sub = (FN(vu32))(em < 0x400u);
    /* normal: rebias 15 -> 127; exponent 31 (infinity, NaN): 255 */
    const FN(vu32) normal = (em << 13) + (112u << 23) + (inf_nan & (112u << 23));
    /* zero or subnormal: m * 2^-24, exact in float */
    const FN(vf32) tiny = __builtin_convertvector((FN(vi32))em, FN(vf32)) * 5.9604644775390625e-8f;
    FN(vu32) tiny_bits;
    memcpy(&tiny_bits, &tiny, sizeof tiny_bits);
    const FN(vu32) bits = sign | (sub & tiny_bits) | (~sub & normal);
    FN(vf32) f;
    memcpy(&f, &bits, sizeof f);
    *out = __builtin_convertvector(f, vreal);
}

/* VL int8 at src times the scales d -> *out. The sign extension to int32 is x86's pmovsxbd
 * where the unit has it: GCC 12 turns a vector conversion from int8 into scalar code. */
MHA_INLINE void FN(widen_q8)(vreal *out, const int8_t *src, vreal d) {
    FN(vi32) q32;
#if defined(__AVX512F__)
    if (VL == 16) {
        const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)src));
        memcpy(&q32, &x, sizeof q32);
        *out = d * __builtin_convertvector(q32, vreal);
        return;
    }
#endif
#if defined(__AVX2__)
    if (VL == 8) {
        const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)src));
        memcpy(&q32, &x, sizeof q32);
        *out = d * __builtin_convertvector(q32, vreal);
        return;
    }
    if (VL == 4) {
        int32_t w;
        memcpy(&w, src, sizeof w);
        const __m128i x = _mm_cvtepi8_epi32(_mm_cvtsi32_si128(w));
        memcpy(&q32, &x, sizeof q32);
        *out = d * __builtin_convertvector(q32, vreal);
        return;
    }
#endif
    FN(vi8) q;
    memcpy(&q, src, sizeof q);
    q32 = __builtin_convertvector(q, FN(vi32));
    *out = d * __builtin_convertvector(q32, vreal);
}
#endif /* NW_VECTORS */

/* Row p of a bfloat16 or half panel widened, NR values: the scalar form */
MHA_INLINE void FN(widen_row16)(real *dst, int fmt, const unsigned char *src) {
    uint16_t h[NR];
    memcpy(h, src, sizeof h);
    if (fmt == MHA_WEIGHTS_BF16)
        for (int c = 0; c < NR; c++) dst[c] = (real)mha_bf16_to_float(h[c]);
    else
        for (int c = 0; c < NR; c++) dst[c] = (real)mha_half_to_float(h[c]);
}

/* micro_tile with B rows [pc, pc + kc) of a narrow panel (NR columns, the whole shared axis,
 * format fmt: a constant where this is inlined; pc a multiple of 32), each row widened in
 * registers as the micro-kernel reads it: no buffer between the packed weights and the
 * products. The arithmetic of each element of C is micro_tile's on the widened panel, except
 * Q8_0 on tiles of up to 3 rows (NW_Q8_BLOCK_SUMS): there each block's products a * q
 * accumulate apart and the block's scale multiplies their sum once (acc += d * sum), one
 * multiplication a block instead of one a weight, which decode's Q8_0 spends its time on;
 * the extra accumulators fit in the registers for 3 rows, not for MR. */
MHA_INLINE void FN(micro_tile_nw)(const int rows, const int fmt, int64_t kc, const real *a,
                                  int64_t a_rs, int64_t a_cs, const unsigned char *panel,
                                  int64_t pc, real *c, int64_t ldc, int64_t m, int64_t n,
                                  real alpha, real beta, const real *bias) {
    const real *row[MR];
    MHA_UNROLL(6)
    for (int r = 0; r < rows; r++) row[r] = a + MHA_MIN(r, m - 1) * a_rs;
#if NW_VECTORS
    vreal acc[MR][NV];
    MHA_UNROLL(6)
    for (int r = 0; r < rows; r++)
        MHA_UNROLL(4)
        for (int v = 0; v < NV; v++) acc[r][v] = (vreal){0};
    if (fmt == MHA_WEIGHTS_Q8_0) {
        for (int64_t p0 = 0; p0 < kc; p0 += MHA_Q8_0_BLOCK) {
            const unsigned char *blk = panel + (size_t)((pc + p0) / MHA_Q8_0_BLOCK) * (NR * (2 + MHA_Q8_0_BLOCK));
            const int8_t *q = (const int8_t *)(blk + 2 * NR);
            const int64_t block_rows = MHA_MIN(MHA_Q8_0_BLOCK, kc - p0);
            vreal d[NV];
            MHA_UNROLL(4)
            for (int v = 0; v < NV; v++) FN(widen_half)(&d[v], blk + v * VL * 2);
            if (NW_Q8_BLOCK_SUMS && rows <= 3) {
                vreal bs[3][NV];
                MHA_UNROLL(3)
                for (int r = 0; r < rows; r++)
                    MHA_UNROLL(4)
                    for (int v = 0; v < NV; v++) bs[r][v] = (vreal){0};
                const vreal one = (vreal){0} + 1;
                for (int64_t i = 0; i < block_rows; i++) {
                    vreal bv[NV];
                    MHA_UNROLL(4)
                    for (int v = 0; v < NV; v++) FN(widen_q8)(&bv[v], q + i * NR + v * VL, one);
                    MHA_UNROLL(3)
                    for (int r = 0; r < rows; r++) {
                        const real a_r = row[r][(p0 + i) * a_cs];
                        MHA_UNROLL(4)
                        for (int v = 0; v < NV; v++) bs[r][v] += a_r * bv[v];
                    }
                }
                MHA_UNROLL(3)
                for (int r = 0; r < rows; r++)
                    MHA_UNROLL(4)
                    for (int v = 0; v < NV; v++) acc[r][v] += d[v] * bs[r][v];
                continue;
            }
            for (int64_t i = 0; i < block_rows; i++) {
                vreal bv[NV];
                MHA_UNROLL(4)
                for (int v = 0; v < NV; v++) FN(widen_q8)(&bv[v], q + i * NR + v * VL, d[v]);
                MHA_UNROLL(6)
                for (int r = 0; r < rows; r++) {
                    const real a_r = row[r][(p0 + i) * a_cs];
                    MHA_UNROLL(4)
                    for (int v = 0; v < NV; v++) acc[r][v] += a_r * bv[v];
                }
            }
        }
    } else {
        const unsigned char *src = panel + (size_t)pc * NR * 2;
        for (int64_t p = 0; p < kc; p++) {
            vreal bv[NV];
            MHA_UNROLL(4)
            for (int v = 0; v < NV; v++) {
                if (fmt == MHA_WEIGHTS_BF16) FN(widen_bf16)(&bv[v], src + (size_t)(p * NR + v * VL) * 2);
                else FN(widen_half)(&bv[v], src + (size_t)(p * NR + v * VL) * 2);
            }
            MHA_UNROLL(6)
            for (int r = 0; r < rows; r++) {
                const real a_r = row[r][p * a_cs];
                MHA_UNROLL(4)
                for (int v = 0; v < NV; v++) acc[r][v] += a_r * bv[v];
            }
        }
    }
    FN(tile_store)(rows, NV, acc, c, ldc, m, n, alpha, beta, bias);
#else
    real tile[MR][NR] = {{0}}, b_p[NR];
    if (fmt == MHA_WEIGHTS_Q8_0) {
        for (int64_t p0 = 0; p0 < kc; p0 += MHA_Q8_0_BLOCK) {
            const unsigned char *blk = panel + (size_t)((pc + p0) / MHA_Q8_0_BLOCK) * (NR * (2 + MHA_Q8_0_BLOCK));
            const int8_t *q = (const int8_t *)(blk + 2 * NR);
            const int64_t block_rows = MHA_MIN(MHA_Q8_0_BLOCK, kc - p0);
            real d[NR];
            FN(widen_row16)(d, MHA_WEIGHTS_F16, blk);
            for (int64_t i = 0; i < block_rows; i++) {
                for (int col = 0; col < NR; col++) b_p[col] = d[col] * (real)q[i * NR + col];
                for (int r = 0; r < rows; r++) {
                    const real a_r = row[r][(p0 + i) * a_cs];
                    for (int col = 0; col < NR; col++) tile[r][col] += a_r * b_p[col];
                }
            }
        }
    } else {
        for (int64_t p = 0; p < kc; p++) {
            FN(widen_row16)(b_p, fmt, panel + (size_t)(pc + p) * NR * 2);
            for (int r = 0; r < rows; r++) {
                const real a_r = row[r][p * a_cs];
                for (int col = 0; col < NR; col++) tile[r][col] += a_r * b_p[col];
            }
        }
    }
    FN(tile_finish)(tile, c, ldc, m, n, alpha, beta, bias);
#endif
}

/* mc rows of C (n <= NR columns) from one narrow panel in format fmt (a constant where this
 * is inlined), over rows [pc, pc + kc) of its shared axis; op(A)[i][p] = a[i * a_rs + p * a_cs]. */
MHA_INLINE void FN(macro_kernel_nw_fmt)(const int fmt, int64_t mc, int64_t n, int64_t kc,
                                        const real *a, int64_t a_rs, int64_t a_cs,
                                        const unsigned char *panel, int64_t pc, real *c,
                                        int64_t ldc, real alpha, real beta, const real *bias) {
    for (int64_t ir = 0; ir < mc; ir += MR) {
        const int64_t m = MHA_MIN(MR, mc - ir);
        const real *a_i = a + ir * a_rs;
        real *c_i = c + ir * ldc;
        switch (m) {
        case 1: FN(micro_tile_nw)(1, fmt, kc, a_i, a_rs, a_cs, panel, pc, c_i, ldc, m, n, alpha, beta, bias); break;
        case 2: FN(micro_tile_nw)(2, fmt, kc, a_i, a_rs, a_cs, panel, pc, c_i, ldc, m, n, alpha, beta, bias); break;
        case 3: FN(micro_tile_nw)(3, fmt, kc, a_i, a_rs, a_cs, panel, pc, c_i, ldc, m, n, alpha, beta, bias); break;
        default: FN(micro_tile_nw)(MR, fmt, kc, a_i, a_rs, a_cs, panel, pc, c_i, ldc, m, n, alpha, beta, bias); break;
        }
    }
}

static void FN(macro_kernel_bf16)(int64_t mc, int64_t n, int64_t kc, const real *a, int64_t a_rs,
                                  int64_t a_cs, const unsigned char *panel, int64_t pc, real *c,
                                  int64_t ldc, real alpha, real beta, const real *bias) {
    FN(macro_kernel_nw_fmt)(MHA_WEIGHTS_BF16, mc, n, kc, a, a_rs, a_cs, panel, pc, c, ldc, alpha, beta, bias);
}

static void FN(macro_kernel_f16)(int64_t mc, int64_t n, int64_t kc, const real *a, int64_t a_rs,
                                 int64_t a_cs, const unsigned char *panel, int64_t pc, real *c,
                                 int64_t ldc, real alpha, real beta, const real *bias) {
    FN(macro_kernel_nw_fmt)(MHA_WEIGHTS_F16, mc, n, kc, a, a_rs, a_cs, panel, pc, c, ldc, alpha, beta, bias);
}

static void FN(macro_kernel_q8_0)(int64_t mc, int64_t n, int64_t kc, const real *a, int64_t a_rs,
                                  int64_t a_cs, const unsigned char *panel, int64_t pc, real *c,
                                  int64_t ldc, real alpha, real beta, const real *bias) {
    FN(macro_kernel_nw_fmt)(MHA_WEIGHTS_Q8_0, mc, n, kc, a, a_rs, a_cs, panel, pc, c, ldc, alpha, beta, bias);
}

/* A tile of m <= MR rows: a full one, or the ragged last rows of a block (or a decode step's
 * one to three rows) with only their own products; and of n <= NR / 2 columns (a ragged
 * right edge, or attention's P v at d_head 32 on AVX-512's 64-column panels) with half the
 * vectors, the panel's zero columns costing no products. Each element's arithmetic is the
 * same whichever form runs it. */
#define MICRO_ROWS(nv)                                                                           \
    switch (m) {                                                                                 \
    case 1: FN(micro_tile)(1, nv, kc, a, a_rs, a_cs, b, c, ldc, m, n, alpha, beta, bias); return; \
    case 2: FN(micro_tile)(2, nv, kc, a, a_rs, a_cs, b, c, ldc, m, n, alpha, beta, bias); return; \
    case 3: FN(micro_tile)(3, nv, kc, a, a_rs, a_cs, b, c, ldc, m, n, alpha, beta, bias); return; \
    default: FN(micro_tile)(MR, nv, kc, a, a_rs, a_cs, b, c, ldc, m, n, alpha, beta, bias); return; \
    }
MHA_INLINE void FN(micro_kernel)(int64_t kc, const real *a, int64_t a_rs, int64_t a_cs,
                             const real *b, real *c, int64_t ldc, int64_t m, int64_t n,
                             real alpha, real beta, const real *bias) {
    if (n <= NR / 2) MICRO_ROWS(NV / 2) /* NV is 2 or 4 */
    MICRO_ROWS(NV)
}
#undef MICRO_ROWS

/* One MC x NC block of C from packed panels of A and B; B's panels start b_ps elements apart
 * (kc * NR when packed per slice, K * NR when packed whole, with b_pack at the slice). */
static void FN(macro_kernel)(int64_t mc, int64_t nc, int64_t kc, const real *a_pack,
                             const real *b_pack, int64_t b_ps, real *c, int64_t ldc, real alpha,
                             real beta, const real *bias) {
    for (int64_t jr = 0; jr < nc; jr += NR) {
        int64_t n = MHA_MIN(NR, nc - jr);
        for (int64_t ir = 0; ir < mc; ir += MR) {
            int64_t m = MHA_MIN(MR, mc - ir);
            FN(micro_kernel)(kc, a_pack + ir * kc, 1, MR, b_pack + jr / NR * b_ps,
                             c + ir * ldc + jr, ldc, m, n, alpha, beta, bias ? bias + jr : NULL);
        }
    }
}

/* The same with A read in place: op(A)[i][p] = a[i * a_rs + p * a_cs]. Used when B has so
 * few panels that packing A would cost about as much as the products it feeds (attention's
 * P v with d_head = 32 .. 64). */
static void FN(macro_kernel_direct)(int64_t mc, int64_t nc, int64_t kc, const real *a,
                                    int64_t a_rs, int64_t a_cs, const real *b_pack, int64_t b_ps,
                                    real *c, int64_t ldc, real alpha, real beta,
                                    const real *bias) {
    for (int64_t jr = 0; jr < nc; jr += NR) {
        int64_t n = MHA_MIN(NR, nc - jr);
        for (int64_t ir = 0; ir < mc; ir += MR) {
            int64_t m = MHA_MIN(MR, mc - ir);
            FN(micro_kernel)(kc, a + ir * a_rs, a_rs, a_cs, b_pack + jr / NR * b_ps,
                             c + ir * ldc + jr, ldc, m, n, alpha, beta, bias ? bias + jr : NULL);
        }
    }
}

/* Products too small to repay packing (tiny heads: n = 12, d_head = 8): plain loops, with
 * the inner loop along contiguous memory (rows of B, or a dot product when B is transposed). */
#define SMALL_GEMM_MNK 16384
static void FN(gemm_small)(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, real alpha,
                           const real *A, int64_t lda, const real *B, int64_t ldb, real beta,
                           real *C, int64_t ldc) {
    for (int64_t i = 0; i < M; i++) {
        real *c = C + i * ldc;
        if (trans_b) {   /* c[j] = alpha * dot(op(A)[i, :], B[j, :]) + beta * c[j] */
            for (int64_t j = 0; j < N; j++) {
                const real *b = B + j * ldb;
                real s = 0;
                for (int64_t p = 0; p < K; p++) s += (trans_a ? A[p * lda + i] : A[i * lda + p]) * b[p];
                c[j] = beta == 0 ? alpha * s : alpha * s + beta * c[j];
            }
        } else {         /* c = beta * c + sum_p alpha * op(A)[i, p] * B[p, :] */
            for (int64_t j = 0; j < N; j++) c[j] = beta == 0 ? 0 : beta * c[j];
            for (int64_t p = 0; p < K; p++) {
                const real a = alpha * (trans_a ? A[p * lda + i] : A[i * lda + p]);
                const real *b = B + p * ldb;
                for (int64_t j = 0; j < N; j++) c[j] += a * b[j];
            }
        }
    }
}

/* C = beta * C + bias on every row (bias may be NULL): a product with nothing to sum. */
static void FN(scale_c)(int64_t M, int64_t N, real beta, const real *bias, real *C, int64_t ldc) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++)
            C[i * ldc + j] = (beta == 0 ? 0 : beta * C[i * ldc + j]) + (bias ? bias[j] : 0);
}

/* y = act(x) on one row of n (enum mha_activation); gated: x holds 2n (the gate, then the
 * up) and y[j] = act(x[j]) * x[n + j]. y may be x; otherwise they do not overlap. */
#define ACT_CHUNK 256
static void FN(act_apply_row)(real *y, const real *x, int64_t n, int act) {
    const int kind = act & ~MHA_ACT_GATED;
    if (!(act & MHA_ACT_GATED)) {
        if (y != x) memcpy(y, x, (size_t)n * sizeof(real));
        VN(mha_act_row)(y, n, kind);
        return;
    }
    real gate[ACT_CHUNK]; /* x's gate, activated a chunk at a time: y may be x */
    for (int64_t j0 = 0; j0 < n; j0 += ACT_CHUNK) {
        const int64_t m = MHA_MIN(ACT_CHUNK, n - j0);
        memcpy(gate, x + j0, (size_t)m * sizeof(real));
        VN(mha_act_row)(gate, m, kind);
        const real *up = x + n + j0;
        for (int64_t j = 0; j < m; j++) y[j0 + j] = gate[j] * up[j];
    }
}

/* What a product does to each finished row of its first output C before it returns:
 * dst row i = act_apply_row(C row i) (dst may be C itself when act is not gated). */
typedef struct {
    int act;
    int64_t n;     /* the activation's width (half of C's when gated) */
    real *dst;
    int64_t ld_dst;
} FN(gemm_epilogue);

static void FN(epilogue_rows)(const FN(gemm_epilogue) *ep, const TY(mha_gemm_out) *out,
                              int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++)
        FN(act_apply_row)(ep->dst + i * ep->ld_dst, out->C + i * out->ldc, ep->n, ep->act);
}

/* Panels of NR columns: the outputs' columns side by side, each output padded to whole panels.
 * first[o] is output o's first panel, first[n_out] the total. */
#define GEMM_MAX_OUTS 3
static int64_t FN(gemm_panels)(const TY(mha_gemm_out) *outs, int n_out, int64_t first[GEMM_MAX_OUTS + 1]) {
    first[0] = 0;
    for (int o = 0; o < n_out; o++) first[o + 1] = first[o] + (MHA_MAX(outs[o].N, 0) + NR - 1) / NR;
    return first[n_out];
}

/* One product in flight (gemm_shared_a), shared by its tasks: the current block of panels
 * [q0, q0 + panels) and shared-axis slice [pc, pc + kc); or, when every B is packed whole
 * (`whole`), all panels and every slice, each task running the slices of its own part of C
 * one after another (no barrier between slices) and its rows' epilogue when it owns their
 * every column (`fused_ep`). */
typedef struct {
    int trans_a, trans_b, n_out, whole, fused_ep;
    int64_t M, K, lda, mc_block, n_chunks, a_elems, kc_block;
    real alpha, beta;
    const real *A;
    const TY(mha_gemm_out) *outs;
    const int64_t *first;
    const FN(gemm_epilogue) *ep;
    real *b_pack, *a_packs;
    int64_t q0, panels, pc, kc;
    /* a narrow weight (one output, packed whole in a format of mha.h's mha_weight_format):
     * with few rows (nw_regs) widened in registers by the micro-kernel, else a panel slice at
     * a time into the thread's buffer of w_elems (kc_block x NR) */
    int fmt, nw_regs;
    const unsigned char *narrow;
    size_t narrow_ps;                 /* bytes per panel */
    real *w_bufs;
    int64_t w_elems;
} FN(gemm_job);

/* Bytes of one panel (NR columns, the whole shared axis) of a weight packed in format fmt:
 * bfloat16 and half, K x NR uint16; Q8_0, ceil(K / 32) blocks of NR half scales then
 * 32 x NR int8. */
static size_t FN(narrow_panel_bytes)(int fmt, int64_t K) {
    if (fmt == MHA_WEIGHTS_BF16 || fmt == MHA_WEIGHTS_F16) return (size_t)K * NR * 2;
    return (size_t)((K + MHA_Q8_0_BLOCK - 1) / MHA_Q8_0_BLOCK) * (size_t)(NR * (2 + MHA_Q8_0_BLOCK));
}

/* Rows [pc, pc + kc) of one narrow panel widened to real, buf[p - pc][c] (kc x NR): exact
 * (a bfloat16 is float's top half; a Q8_0 value d * q is an 11-bit by 8-bit product). pc is
 * a multiple of 32 (slices of KC, or 0). The inner loops run over NR, a constant. */
static void FN(widen_slice)(real *buf, int fmt, const unsigned char *panel, int64_t pc, int64_t kc) {
    if (fmt != MHA_WEIGHTS_Q8_0) {
        const unsigned char *src = panel + (size_t)pc * NR * 2;
#if NW_VECTORS
        for (int64_t p = 0; p < kc; p++)
            for (int v = 0; v < NV; v++) {
                vreal w;
                if (fmt == MHA_WEIGHTS_BF16) FN(widen_bf16)(&w, src + (size_t)(p * NR + v * VL) * 2);
                else FN(widen_half)(&w, src + (size_t)(p * NR + v * VL) * 2);
                MHA_VSTORE(buf + p * NR + v * VL, w);
            }
#else
        for (int64_t p = 0; p < kc; p++) FN(widen_row16)(buf + p * NR, fmt, src + (size_t)p * NR * 2);
#endif
        return;
    }
    for (int64_t p0 = pc; p0 < pc + kc; p0 += MHA_Q8_0_BLOCK) {
        const unsigned char *blk = panel + (size_t)(p0 / MHA_Q8_0_BLOCK) * (NR * (2 + MHA_Q8_0_BLOCK));
        const int64_t rows = MHA_MIN(MHA_Q8_0_BLOCK, pc + kc - p0);
        uint16_t h[NR];
        real d[NR];
        memcpy(h, blk, sizeof h);
        for (int c = 0; c < NR; c++) d[c] = (real)mha_half_to_float(h[c]);
        const int8_t *q = (const int8_t *)(blk + 2 * NR);
        real *dst = buf + (p0 - pc) * NR;
        for (int64_t r = 0; r < rows; r++)
            for (int c = 0; c < NR; c++) dst[r * NR + c] = d[c] * (real)q[r * NR + c];
    }
}

/* Task: pack panel `panel` of the current block of op(B). */
static void FN(gemm_pack_b_task)(void *ctx, int64_t panel, int thread) {
    const FN(gemm_job) *g = ctx;
    (void)thread;
    int o = 0;
    while (g->q0 + panel >= g->first[o + 1]) o++;
    const TY(mha_gemm_out) *u = &g->outs[o];
    if (u->Bp) return; /* packed whole already */
    const int64_t j0 = (g->q0 + panel - g->first[o]) * NR;
    const real *b = g->trans_b ? u->B + j0 * u->ldb + g->pc : u->B + g->pc * u->ldb + j0;
    FN(pack_b)(g->b_pack + panel * NR * g->kc, b, u->ldb, g->trans_b, g->kc, MHA_MIN(NR, u->N - j0));
}

/* One block of rows of A (packed into the thread's own buffer) times one chunk of the
 * packed panels, over the slice [pc, pc + kc) of the shared axis, into every output the
 * chunk covers. */
static void FN(gemm_block_slice)(const FN(gemm_job) *g, int64_t blk, int64_t chunk, int thread,
                                 int64_t pc, int64_t kc) {
    const int64_t ic = blk * g->mc_block, mc = MHA_MIN(g->mc_block, g->M - ic);
    const int64_t p0 = g->q0 + g->panels * chunk / g->n_chunks;
    const int64_t p1 = g->q0 + g->panels * (chunk + 1) / g->n_chunks;
    if (p0 == p1) return;
    const int64_t lda = g->lda;
    const real *a = g->trans_a ? g->A + pc * lda + ic : g->A + ic * lda + pc;
    const real beta_block = pc == 0 ? g->beta : 1;
    real *a_pack = g->a_packs + (size_t)thread * (size_t)g->a_elems;
    const int direct = p1 - p0 <= DIRECT_A_PANELS;
    if (!direct) FN(pack_a)(a_pack, a, lda, g->trans_a, mc, kc);
    for (int o = 0; o < g->n_out; o++) { /* the outputs' panels in [p0, p1) */
        const int64_t s0 = MHA_MAX(p0, g->first[o]), s1 = MHA_MIN(p1, g->first[o + 1]);
        if (s0 >= s1) continue;
        const TY(mha_gemm_out) *u = &g->outs[o];
        const int64_t j0 = (s0 - g->first[o]) * NR;
        const int64_t cols = MHA_MIN(u->N, (s1 - g->first[o]) * NR) - j0;
        real *c = u->C + ic * u->ldc + j0;
        const real *bias_c = pc == 0 && u->bias ? u->bias + j0 : NULL;
        if (g->narrow) { /* one panel at a time, widened into the thread's buffer */
            real *wb = g->w_bufs + (size_t)thread * (size_t)g->w_elems;
            for (int64_t s = s0; s < s1; s++) {
                const int64_t js = (s - g->first[o]) * NR, n = MHA_MIN(NR, u->N - js);
                FN(widen_slice)(wb, g->fmt, g->narrow + (size_t)(s - g->first[o]) * g->narrow_ps, pc, kc);
                if (direct)
                    FN(macro_kernel_direct)(mc, n, kc, a, g->trans_a ? 1 : lda, g->trans_a ? lda : 1,
                                            wb, kc * NR, u->C + ic * u->ldc + js, u->ldc, g->alpha,
                                            beta_block, bias_c ? bias_c + (js - j0) : NULL);
                else
                    FN(macro_kernel)(mc, n, kc, a_pack, wb, kc * NR, u->C + ic * u->ldc + js, u->ldc,
                                     g->alpha, beta_block, bias_c ? bias_c + (js - j0) : NULL);
            }
            continue;
        }
        /* B's panels: packed whole once (mha_pack_weight; K x NR each) or by the pack tasks */
        const int64_t b_ps = u->Bp ? g->K * NR : kc * NR;
        const real *bp = u->Bp ? u->Bp + (s0 - g->first[o]) * b_ps + pc * NR
                               : g->b_pack + (s0 - g->q0) * b_ps;
        if (direct)
            FN(macro_kernel_direct)(mc, cols, kc, a, g->trans_a ? 1 : lda, g->trans_a ? lda : 1,
                                    bp, b_ps, c, u->ldc, g->alpha, beta_block, bias_c);
        else
            FN(macro_kernel)(mc, cols, kc, a_pack, bp, b_ps, c, u->ldc, g->alpha, beta_block,
                             bias_c);
    }
}

/* Task: one (row block, panel chunk) of C, over the current slice, or over every slice and
 * then its rows' epilogue when the job is `whole`. */
/* gemm_block_slice's work for a narrow weight and few rows (nw_regs), every slice: A read in
 * place, each panel widened in registers by the micro-kernel, the panels outermost so that
 * each is read from memory front to back (one stream, whatever the slices), each element of
 * C summing its slices in order as gemm_block_slice does. */
static void FN(gemm_block_nw)(const FN(gemm_job) *g, int64_t blk, int64_t chunk) {
    const int64_t ic = blk * g->mc_block, mc = MHA_MIN(g->mc_block, g->M - ic);
    const int64_t p0 = g->panels * chunk / g->n_chunks, p1 = g->panels * (chunk + 1) / g->n_chunks;
    const TY(mha_gemm_out) *u = &g->outs[0]; /* a narrow weight is the one output */
    const int64_t a_rs = g->trans_a ? 1 : g->lda, a_cs = g->trans_a ? g->lda : 1;
    for (int64_t s = p0; s < p1; s++) {
        const int64_t js = s * NR, n = MHA_MIN(NR, u->N - js);
        const unsigned char *panel = g->narrow + (size_t)s * g->narrow_ps;
        real *c = u->C + ic * u->ldc + js;
        for (int64_t pc = 0; pc < g->K; pc += g->kc_block) {
            const int64_t kc = MHA_MIN(g->kc_block, g->K - pc);
            const real *a = g->trans_a ? g->A + pc * g->lda + ic : g->A + ic * g->lda + pc;
            const real beta = pc == 0 ? g->beta : 1;
            const real *bias = pc == 0 && u->bias ? u->bias + js : NULL;
            if (g->fmt == MHA_WEIGHTS_BF16)
                FN(macro_kernel_bf16)(mc, n, kc, a, a_rs, a_cs, panel, pc, c, u->ldc, g->alpha, beta, bias);
            else if (g->fmt == MHA_WEIGHTS_F16)
                FN(macro_kernel_f16)(mc, n, kc, a, a_rs, a_cs, panel, pc, c, u->ldc, g->alpha, beta, bias);
            else
                FN(macro_kernel_q8_0)(mc, n, kc, a, a_rs, a_cs, panel, pc, c, u->ldc, g->alpha, beta, bias);
        }
    }
}

static void FN(gemm_block_task)(void *ctx, int64_t task, int thread) {
    const FN(gemm_job) *g = ctx;
    const int64_t blk = task / g->n_chunks, chunk = task % g->n_chunks;
    if (!g->whole) {
        FN(gemm_block_slice)(g, blk, chunk, thread, g->pc, g->kc);
        return;
    }
    if (g->nw_regs)
        FN(gemm_block_nw)(g, blk, chunk);
    else
        for (int64_t pc = 0; pc < g->K; pc += g->kc_block)
            FN(gemm_block_slice)(g, blk, chunk, thread, pc, MHA_MIN(g->kc_block, g->K - pc));
    if (g->fused_ep) {
        const int64_t ic = blk * g->mc_block;
        FN(epilogue_rows)(g->ep, g->outs, ic, MHA_MIN(g->M, ic + g->mc_block));
    }
}

/* Task: the epilogue of a block of EPILOGUE_ROWS finished rows. */
#define EPILOGUE_ROWS 8
/* What streaming one weight from memory is worth in flops, for the thread rule (gemm_auto_nw):
 * one thread's decode step (M = 1, from DRAM, widened in registers) reads about 11 G bfloat16
 * or float16 weights a second and 16 G Q8_0 weights (benchmarks/narrow_gemm.py, AVX-512), where
 * the same thread's GEMM runs about 90 Gflop/s: 8 and 6 flops a weight, the product's own
 * 2 among them. */
#define NARROW_WORK_PER_WEIGHT_16 6.0 /* bfloat16, float16 */
#define NARROW_WORK_PER_WEIGHT_Q8 4.0 /* Q8_0 */
/* Up to this many rows, narrow weights widen in registers (micro_tile_nw); beyond, through
 * the buffer, which widens each panel slice once for all the rows instead of once per MR rows.
 * Measured crossovers (benchmarks/narrow_gemm.py, SmolLM2's shapes): with 32 vector registers
 * (AVX-512) the registers win up to 256 rows; with 16 (AVX2) the buffer wins from 17. */
#ifndef NARROW_REG_ROWS
#define NARROW_REG_ROWS (MHA_VEC_REGS >= 32 ? 64 : 16)
#endif
static void FN(gemm_epilogue_task)(void *ctx, int64_t task, int thread) {
    const FN(gemm_job) *g = ctx;
    (void)thread;
    FN(epilogue_rows)(g->ep, g->outs, task * EPILOGUE_ROWS, MHA_MIN(g->M, (task + 1) * EPILOGUE_ROWS));
}

/* The products of several outputs with one A (at most GEMM_MAX_OUTS): each block of A is
 * packed once and multiplied into every output's B (the layer's Q, K and V projections of
 * one input). Panel by panel the arithmetic is that of one product, so each output is
 * bitwise what its own mha_gemm_ws call gives. ep (or NULL): applied to each row of the first
 * output once the product is done. */
/* A narrow weight for gemm_run: the one output's op(B) packed whole in format fmt. */
typedef struct {
    int fmt;
    const void *packed;
} FN(gemm_narrow);

static int FN(gemm_run)(int trans_a, int trans_b, int64_t M, int64_t K, real alpha,
                        const real *A, int64_t lda, real beta, const TY(mha_gemm_out) *outs,
                        int n_out, real *workspace, int threads, const FN(gemm_epilogue) *ep,
                        const FN(gemm_narrow) *nw) {
    int64_t first[GEMM_MAX_OUTS + 1] = {0}; /* = {0}: GCC -O3 serial sees a false "maybe uninitialized" */
    const int64_t P = FN(gemm_panels)(outs, n_out, first);
    if (M <= 0 || P == 0) return MHA_OK;
    if (K <= 0 || alpha == 0) {
        for (int o = 0; o < n_out; o++)
            FN(scale_c)(M, outs[o].N, beta, outs[o].bias, outs[o].C, outs[o].ldc);
        if (ep) FN(epilogue_rows)(ep, outs, 0, M);
        return MHA_OK;
    }
    /* products too small to repay packing: plain loops, one output at a time */
    int small = 0;
    for (int o = 0; o < n_out; o++)
        small |= !nw && outs[o].N > 0 && !outs[o].Bp && (double)M * (double)outs[o].N * (double)K <= SMALL_GEMM_MNK;
    if (small && n_out > 1) {
        for (int o = 0; o < n_out; o++) {
            int err = FN(gemm_run)(trans_a, trans_b, M, K, alpha, A, lda, beta, &outs[o], 1,
                                   workspace, threads, o == 0 ? ep : NULL, NULL);
            if (err) return err;
        }
        return MHA_OK;
    }
    if (small) {
        FN(gemm_small)(trans_a, trans_b, M, outs->N, K, alpha, A, lda, outs->B, outs->ldb, beta,
                       outs->C, outs->ldc);
        if (outs->bias) FN(scale_c)(M, outs->N, 1, outs->bias, outs->C, outs->ldc);
        if (ep) FN(epilogue_rows)(ep, outs, 0, M);
        return MHA_OK;
    }
    if (threads < 1) threads = 1;
    const int64_t mc_block = FN(gemm_mc)(M, threads);
    const int64_t m_blocks = (M + mc_block - 1) / mc_block;
    /* Tasks are (row block, panel chunk): with fewer row blocks than threads (short, wide
     * products such as the weight gradients), the panels are split too. */
    const int64_t n_chunks = m_blocks >= threads ? 1 : (threads + m_blocks - 1) / m_blocks;
    const int64_t tasks = m_blocks * n_chunks;
    if (threads > tasks) threads = (int)tasks;
    const int64_t kc_block = FN(gemm_kc)(K), nc_panels = FN(gemm_nc)(kc_block) / NR;
    size_t b_elems, a_elems;
    FN(gemm_parts)(P * NR, K, mc_block, &b_elems, &a_elems);
    int whole = 1; /* every B packed whole (mha_pack_weight): no packing, no slice barriers */
    for (int o = 0; o < n_out; o++) whole &= outs[o].Bp != NULL;
    if (nw) whole = 1;
    /* a narrow weight: each thread's widening buffer (kc_block x NR) after the A blocks */
    const size_t w_elems = nw ? mha_round_up((size_t)kc_block * NR, MHA_CACHE_LINE) : 0;
    real *owned = NULL;
    if (!workspace) {
        if (nw) b_elems = 0; /* nothing packed per call */
        owned = mha_alloc(nw ? (b_elems + (size_t)threads * (a_elems + w_elems)) * sizeof(real)
                             : FN(mha_gemm_workspace)(M, P * NR, K, threads));
        if (!owned) return MHA_ENOMEM;
        workspace = owned;
    }
    const int fused_ep = whole && ep && n_chunks == 1;
    FN(gemm_job) g = {trans_a, trans_b, n_out, whole, fused_ep, M, K, lda, mc_block, n_chunks,
                      (int64_t)a_elems, kc_block, alpha, beta, A, outs, first, ep, workspace,
                      workspace + b_elems, 0, 0, 0, 0, 0, 0, NULL, 0, NULL, 0};
    if (nw) {
        g.fmt = nw->fmt;
        g.nw_regs = M <= NARROW_REG_ROWS;
        g.narrow = nw->packed;
        g.narrow_ps = FN(narrow_panel_bytes)(nw->fmt, K);
        g.w_bufs = workspace + b_elems + (size_t)threads * a_elems;
        g.w_elems = (int64_t)w_elems;
    }
    if (whole) { /* one parallel region: each task its part of C, every slice, its epilogue */
        g.panels = P;
        mha_parallel_for(threads, tasks, 1, FN(gemm_block_task), &g);
    } else {
        /* Per block of panels and slice of the shared axis: the threads pack B's panels
         * together, then each packs its own blocks of A and runs the micro-kernels on them. */
        for (g.q0 = 0; g.q0 < P; g.q0 += nc_panels) {
            g.panels = MHA_MIN(nc_panels, P - g.q0);
            for (g.pc = 0; g.pc < K; g.pc += kc_block) {
                g.kc = MHA_MIN(kc_block, K - g.pc);
                mha_parallel_for(threads, g.panels, 1, FN(gemm_pack_b_task), &g);
                mha_parallel_for(threads, tasks, 1, FN(gemm_block_task), &g);
            }
        }
    }
    if (ep && !fused_ep) /* every row of C is done: the epilogue, by blocks of rows */
        mha_parallel_for(threads, (M + EPILOGUE_ROWS - 1) / EPILOGUE_ROWS, 1, FN(gemm_epilogue_task), &g);
    mha_free(owned);
    return MHA_OK;
}

static int FN(gemm_shared_a)(int trans_a, int trans_b, int64_t M, int64_t K, real alpha,
                             const real *A, int64_t lda, real beta, const TY(mha_gemm_out) *outs,
                             int n_out, real *workspace, int threads, const FN(gemm_epilogue) *ep) {
    return FN(gemm_run)(trans_a, trans_b, M, K, alpha, A, lda, beta, outs, n_out, workspace,
                        threads, ep, NULL);
}

static int FN(mha_gemm_ws)(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, real alpha,
                           const real *A, int64_t lda, const real *B, int64_t ldb, real beta,
                           const real *bias, real *C, int64_t ldc, real *workspace, int threads) {
    const TY(mha_gemm_out) out = {B, ldb, bias, C, ldc, N, NULL};
    return FN(gemm_shared_a)(trans_a, trans_b, M, K, alpha, A, lda, beta, &out, 1, workspace, threads,
                             NULL);
}

/* Pre-packed B, for attention's tiles: op(B) (K x N) packed once into NR-column panels with
 * the whole K axis per panel, then used by many products whose A is read in place. */
static size_t FN(mha_packed_b_size)(int64_t K, int64_t N) {
    return (size_t)MHA_MAX(K, 0) * mha_round_up((size_t)MHA_MAX(N, 0), NR);
}

static void FN(mha_pack_b_full)(real *packed, const real *B, int64_t ldb, int trans_b, int64_t K, int64_t N) {
    if (K > 0 && N > 0) FN(pack_b)(packed, B, ldb, trans_b, K, N);
}

/* The public face of the same packing (mha.h: mha_pack_weight, mha_pack_width): a weight
 * packed once, for every later product with it (mha_linear_packed). */
static int FN(mha_pack_weight)(real *packed, const real *B, int64_t ldb, int trans_b, int64_t K,
                               int64_t N) {
    if (K < 0 || N < 0) return MHA_EINVAL;
    FN(mha_pack_b_full)(packed, B, ldb, trans_b, K, N);
    return MHA_OK;
}

static int FN(mha_pack_width)(int64_t *width) {
    *width = NR;
    return MHA_OK;
}

/* ---- narrow packed weights (mha.h: mha_weight_format) ---------------------------------- */

static int FN(narrow_fmt)(int fmt) {
    return fmt == MHA_WEIGHTS_BF16 || fmt == MHA_WEIGHTS_F16 || fmt == MHA_WEIGHTS_Q8_0;
}

/* Bytes of op(B) (K, N) packed in format fmt: 0 when the format is unknown or the size
 * overflows (*ok cleared). */
static size_t FN(packed_bytes)(int fmt, int64_t K, int64_t N, int *ok) {
    if (K < 0 || N < 0 || (fmt != MHA_WEIGHTS_NATIVE && !FN(narrow_fmt)(fmt))) {
        *ok = 0;
        return 0;
    }
    const size_t panels = (size_t)((N + NR - 1) / NR);
    if (fmt == MHA_WEIGHTS_NATIVE)
        return mha_mul_size(mha_mul_size(panels, (size_t)K * NR, ok), sizeof(real), ok);
    return mha_mul_size(panels, FN(narrow_panel_bytes)(fmt, K), ok);
}

static int FN(mha_packed_bytes)(int format, int64_t K, int64_t N, size_t *bytes) {
    int ok = 1;
    *bytes = FN(packed_bytes)(format, K, N, &ok);
    return ok ? MHA_OK : MHA_EINVAL;
}

/* One panel of a narrow packing: panel `panel` of op(B) (K, N), source of kind src. */
typedef struct {
    int fmt, src, trans_b;
    unsigned char *packed;
    const void *B;
    int64_t ldb, K, N;
    size_t panel_bytes;
} FN(narrow_pack_job);

/* op(B)[p][j] of a source of T, as float */
MHA_INLINE float FN(narrow_src_at)(const FN(narrow_pack_job) *j, int64_t p, int64_t col) {
    const int64_t at = j->trans_b ? col * j->ldb + p : p * j->ldb + col;
    return (float)((const real *)j->B)[at];
}

static void FN(narrow_pack_task)(void *ctx, int64_t panel, int thread) {
    const FN(narrow_pack_job) *j = ctx;
    (void)thread;
    unsigned char *dst = j->packed + (size_t)panel * j->panel_bytes;
    const int64_t j0 = panel * NR, cols = MHA_MIN(NR, j->N - j0);
    if (j->fmt == MHA_WEIGHTS_BF16 || j->fmt == MHA_WEIGHTS_F16) {
        for (int64_t p = 0; p < j->K; p++) {
            uint16_t h[NR];
            for (int64_t c = 0; c < NR; c++) {
                if (c >= cols) h[c] = 0;
                else if (j->src == NARROW_SRC_BITS16) /* the bits kept as they are */
                    h[c] = ((const uint16_t *)j->B)[j->trans_b ? (j0 + c) * j->ldb + p : p * j->ldb + j0 + c];
                else if (j->fmt == MHA_WEIGHTS_BF16)
                    h[c] = mha_float_to_bf16(FN(narrow_src_at)(j, p, j0 + c));
                else
                    h[c] = mha_float_to_half(FN(narrow_src_at)(j, p, j0 + c));
            }
            memcpy(dst + (size_t)p * NR * 2, h, sizeof h);
        }
        return;
    }
    const int64_t blocks = (j->K + MHA_Q8_0_BLOCK - 1) / MHA_Q8_0_BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        unsigned char *blk = dst + (size_t)b * (NR * (2 + MHA_Q8_0_BLOCK));
        int8_t *q = (int8_t *)(blk + 2 * NR);
        const int64_t p0 = b * MHA_Q8_0_BLOCK, n = MHA_MIN(MHA_Q8_0_BLOCK, j->K - p0);
        for (int64_t c = 0; c < NR; c++) {
            uint16_t h = 0;
            if (c >= cols) {
                for (int r = 0; r < MHA_Q8_0_BLOCK; r++) q[r * NR + c] = 0;
            } else if (j->src == NARROW_SRC_Q8_0_BLOCKS) { /* ggml's blocks: row j0 + c, block b */
                const unsigned char *src = (const unsigned char *)j->B +
                                           ((size_t)(j0 + c) * (size_t)blocks + (size_t)b) * (2 + MHA_Q8_0_BLOCK);
                memcpy(&h, src, 2);
                for (int r = 0; r < MHA_Q8_0_BLOCK; r++) q[r * NR + c] = (int8_t)src[2 + r];
            } else {
                float x[MHA_Q8_0_BLOCK];
                for (int64_t r = 0; r < n; r++) x[r] = FN(narrow_src_at)(j, p0 + r, j0 + c);
                h = mha_q8_0_block(q + c, NR, x, n);
            }
            memcpy(blk + 2 * c, &h, 2);
        }
    }
}

static int FN(narrow_pack)(void *packed, int fmt, int src, const void *B, int64_t ldb, int trans_b,
                           int64_t K, int64_t N) {
    if (K < 0 || N < 0 || !FN(narrow_fmt)(fmt) || (src == NARROW_SRC_BITS16 && fmt == MHA_WEIGHTS_Q8_0) ||
        (K > 0 && N > 0 && (!packed || !B || ldb < (trans_b ? K : N))))
        return MHA_EINVAL;
    if (K == 0 || N == 0) return MHA_OK;
    const int64_t panels = (N + NR - 1) / NR;
    FN(narrow_pack_job) job = {fmt, src, trans_b, packed, B, ldb, K, N, FN(narrow_panel_bytes)(fmt, K)};
    mha_parallel_for(mha_threads_for(64.0 * (double)K * (double)N), panels, 1, FN(narrow_pack_task), &job);
    return MHA_OK;
}

/* mha.h: mha_pack_weight_fmt; MHA_WEIGHTS_NATIVE is mha_pack_weight */
static int FN(mha_pack_weight_fmt)(void *packed, int format, const real *B, int64_t ldb, int trans_b,
                                   int64_t K, int64_t N) {
    if (format == MHA_WEIGHTS_NATIVE) {
        if (K < 0 || N < 0 || (K > 0 && N > 0 && (!packed || !B || ldb < (trans_b ? K : N))))
            return MHA_EINVAL;
        FN(mha_pack_b_full)((real *)packed, B, ldb, trans_b, K, N);
        return MHA_OK;
    }
    return FN(narrow_pack)(packed, format, NARROW_SRC_REAL, B, ldb, trans_b, K, N);
}

static int FN(mha_pack_weight_bf16_bits)(void *packed, const uint16_t *B, int64_t ldb, int trans_b,
                                         int64_t K, int64_t N) {
    return FN(narrow_pack)(packed, MHA_WEIGHTS_BF16, NARROW_SRC_BITS16, B, ldb, trans_b, K, N);
}

static int FN(mha_pack_weight_f16_bits)(void *packed, const uint16_t *B, int64_t ldb, int trans_b,
                                        int64_t K, int64_t N) {
    return FN(narrow_pack)(packed, MHA_WEIGHTS_F16, NARROW_SRC_BITS16, B, ldb, trans_b, K, N);
}

static int FN(mha_pack_weight_q8_0_blocks)(void *packed, const void *blocks, int64_t K, int64_t N) {
    return FN(narrow_pack)(packed, MHA_WEIGHTS_Q8_0, NARROW_SRC_Q8_0_BLOCKS, blocks,
                           (K + MHA_Q8_0_BLOCK - 1) / MHA_Q8_0_BLOCK * MHA_Q8_0_BLOCK, 1, K, N);
}

/* C = alpha * op(A) @ Bp + beta * C on the calling thread, op(A) (M x K) read in place (A
 * has row stride lda), Bp from mha_pack_b_full(K, N). */
static void FN(mha_gemm_packed)(int trans_a, int64_t M, int64_t N, int64_t K, real alpha,
                                const real *A, int64_t lda, const real *packed, real beta,
                                real *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) { FN(scale_c)(M, N, beta, NULL, C, ldc); return; }
    FN(macro_kernel_direct)(M, N, K, A, trans_a ? 1 : lda, trans_a ? lda : 1, packed, K * NR, C,
                            ldc, alpha, beta, NULL);
}

/* gemm_shared_a with its own workspace and threads chosen by the work between two barriers
 * (one slice of the shared axis, every output), not by the whole product. */
static int FN(gemm_auto_nw)(int trans_a, int trans_b, int64_t M, int64_t K, real alpha,
                            const real *A, int64_t lda, real beta, const TY(mha_gemm_out) *outs,
                            int n_out, const FN(gemm_epilogue) *ep, const FN(gemm_narrow) *nw) {
    double cols = 0;
    for (int o = 0; o < n_out; o++) cols += (double)MHA_MAX(outs[o].N, 0);
    double work = 2.0 * (double)M * cols * (double)FN(gemm_kc)(K);
    /* A narrow weight is packed whole (no barrier between slices) and its product reads it
     * once per row block: a decode step's few rows are bound by those bytes, not by the
     * flops, so its threads are chosen by the whole product plus a cost per weight. A
     * second thread then comes with some 2 x 4e6 flops of one thread's work (about 90 us):
     * a decode step's 960 x 960 product stays on one thread, 2560 x 960 takes two. */
    if (nw)
        work = 2.0 * (double)M * cols * (double)K +
               (nw->fmt == MHA_WEIGHTS_Q8_0 ? NARROW_WORK_PER_WEIGHT_Q8 : NARROW_WORK_PER_WEIGHT_16) * cols * (double)K;
    return FN(gemm_run)(trans_a, trans_b, M, K, alpha, A, lda, beta, outs, n_out, NULL,
                        mha_threads_for(work), ep, nw);
}

static int FN(gemm_auto)(int trans_a, int trans_b, int64_t M, int64_t K, real alpha,
                         const real *A, int64_t lda, real beta, const TY(mha_gemm_out) *outs,
                         int n_out, const FN(gemm_epilogue) *ep) {
    return FN(gemm_auto_nw)(trans_a, trans_b, M, K, alpha, A, lda, beta, outs, n_out, ep, NULL);
}

/* C = op(A) @ op(B) + bias on every row (bias may be NULL). */
static int FN(mha_gemm_bias)(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const real *A,
                             int64_t lda, const real *B, int64_t ldb, const real *bias, real *C,
                             int64_t ldc) {
    const TY(mha_gemm_out) out = {B, ldb, bias, C, ldc, N, NULL};
    return FN(gemm_auto)(trans_a, trans_b, M, K, 1, A, lda, 0, &out, 1, NULL);
}

static int FN(mha_gemm)(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, real alpha,
                        const real *A, int64_t lda, const real *B, int64_t ldb, real beta, real *C,
                        int64_t ldc) {
    const TY(mha_gemm_out) out = {B, ldb, NULL, C, ldc, N, NULL};
    return FN(gemm_auto)(trans_a, trans_b, M, K, alpha, A, lda, beta, &out, 1, NULL);
}

static int FN(mha_gemm_shared_a)(int64_t M, int64_t K, const real *A, int64_t lda,
                                 const TY(mha_gemm_out) *outs, int n_out) {
    if (n_out < 1 || n_out > GEMM_MAX_OUTS) return MHA_EINVAL;
    return FN(gemm_auto)(0, 0, M, K, 1, A, lda, 0, outs, n_out, NULL);
}

/* Task: rows [pc, pc + kc) of one panel of a packing, widened, into the chunk buffer's
 * columns of that panel: wc[p - pc][j] = op(B)[p][j] (kc x N). */
typedef struct {
    int fmt;
    const unsigned char *packed;
    size_t panel_bytes;
    int64_t K, N, pc, kc;
    real *wc, *tmp; /* tmp: kc x NR per thread */
} FN(unpack_job);

static void FN(unpack_task)(void *ctx, int64_t panel, int thread) {
    const FN(unpack_job) *j = ctx;
    const int64_t j0 = panel * NR, n = MHA_MIN(NR, j->N - j0);
    const unsigned char *src = j->packed + (size_t)panel * j->panel_bytes;
    const real *rows;
    if (j->fmt == MHA_WEIGHTS_NATIVE) {
        rows = (const real *)(const void *)src + j->pc * NR;
    } else {
        real *tmp = j->tmp + (size_t)thread * (size_t)(j->kc * NR);
        FN(widen_slice)(tmp, j->fmt, src, j->pc, j->kc);
        rows = tmp;
    }
    for (int64_t p = 0; p < j->kc; p++) memcpy(j->wc + p * j->N + j0, rows + p * NR, (size_t)n * sizeof(real));
}

/* mha.h: mha_linear_transposed_fmt. op(B) (K, N) packed in format; C (M, K) = A (M, N) @
 * op(B)^T + beta * C. Chunks of the packing's rows (op(B)'s rows p, a multiple of 32 each
 * but the last) are widened into a buffer of kc x N, then C[:, chunk] comes from the GEMM on
 * it (B transposed); chunks of about 1 MiB, so that the buffer stays in the caches. */
static int FN(mha_linear_transposed_fmt)(int64_t M, int64_t N, int64_t K, const real *A, int64_t lda,
                                         int format, const void *packed, real beta, real *C,
                                         int64_t ldc) {
    if (M < 0 || N < 0 || K < 0 || (format != MHA_WEIGHTS_NATIVE && !FN(narrow_fmt)(format)) ||
        (M > 0 && K > 0 && (!A || !C || ldc < K || lda < N || (N > 0 && !packed))))
        return MHA_EINVAL;
    if (M == 0 || K == 0) return MHA_OK;
    if (N == 0) {
        FN(scale_c)(M, K, beta, NULL, C, ldc);
        return MHA_OK;
    }
    const int64_t panels = (N + NR - 1) / NR;
    int64_t kc = (int64_t)(((size_t)1 << 20) / sizeof(real)) / N / MHA_Q8_0_BLOCK * MHA_Q8_0_BLOCK;
    kc = MHA_MIN(MHA_MAX(kc, MHA_Q8_0_BLOCK), (K + MHA_Q8_0_BLOCK - 1) / MHA_Q8_0_BLOCK * MHA_Q8_0_BLOCK);
    const int threads = mha_threads_for(4.0 * (double)kc * (double)N);
    int ok = 1;
    size_t elems = mha_mul_size((size_t)kc, (size_t)N, &ok);
    elems += mha_mul_size(mha_mul_size((size_t)kc, NR, &ok), (size_t)threads, &ok);
    size_t bytes = mha_mul_size(elems, sizeof(real), &ok);
    real *buf = ok ? mha_alloc(bytes) : NULL;
    if (!buf) return MHA_ENOMEM;
    FN(unpack_job) job = {format, packed, format == MHA_WEIGHTS_NATIVE ? (size_t)K * NR * sizeof(real)
                                                                       : FN(narrow_panel_bytes)(format, K),
                          K, N, 0, 0, buf, buf + (size_t)kc * (size_t)N};
    int err = MHA_OK;
    for (int64_t pc = 0; pc < K && !err; pc += kc) {
        job.pc = pc;
        job.kc = MHA_MIN(kc, K - pc);
        mha_parallel_for(threads, panels, 1, FN(unpack_task), &job);
        const TY(mha_gemm_out) out = {buf, N, NULL, C + pc, ldc, job.kc, NULL};
        err = FN(gemm_auto)(0, 1, M, N, 1, A, lda, beta, &out, 1, NULL);
    }
    mha_free(buf);
    return err;
}

#if MHA_GNU_C
#undef vreal
#endif
#undef VEC_BYTES
#undef VL
#undef MR
#undef NR
#undef NV
#undef KC
#undef KC_ONE_SLICE
#undef MC_MAX
#undef NC
#undef B_BLOCK
#undef DIRECT_A_PANELS
#undef SMALL_GEMM_MNK
#undef GEMM_MAX_OUTS
#undef ACT_CHUNK
#undef EPILOGUE_ROWS
#undef NARROW_WORK_PER_WEIGHT_16
#undef NARROW_WORK_PER_WEIGHT_Q8
#undef NARROW_REG_ROWS
#undef NW_VECTORS
