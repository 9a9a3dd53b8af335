/* kernels.h: the body of a kernel unit (dispatch.h): the GEMM, attention, the layer and the
 * rest of a transformer block (block_impl.h) for
 * float and double, compiled for the instruction set of the file that includes this one
 * (kernels_<isa>.c, which defines MHA_ISA as <isa>), and the unit's table of entry points.
 *
 * Every function here is static and named by FN: FN(mha_gemm) is mha_gemm_f32_avx2 in the
 * AVX2 unit's float part, so profiles name the unit. TY(name) is a public type of the current
 * real type (TY(mha_gemm_out): mha_gemm_out_f32), VN(name) a helper of vec.h
 * (VN(mha_exp_sum): mha_exp_sum_f32). */
#include <math.h>
#include <string.h>

#include "common.h"
#include "dispatch.h"
#include "mha.h"
#include "narrow.h"
#include "vec.h"

#define FN(name) MHA_CAT(MHA_CAT(name, SFX), MHA_ISA)
#define TY(name) MHA_CAT(name, SFX)
#define VN(name) MHA_CAT(name, SFX)

#define real float
#define SFX f32
#define EXP expf
#include "gemm_impl.h"
#include "attention_impl.h"
#include "multihead_impl.h"
#include "block_impl.h"
#undef real
#undef SFX
#undef EXP

#define real double
#define SFX f64
#define EXP exp
#include "gemm_impl.h"
#include "attention_impl.h"
#include "multihead_impl.h"
#include "block_impl.h"
#undef real
#undef SFX
#undef EXP

/* What the unit's code was compiled for (as the compiler reports it). */
#if defined(__AVX512F__)
#define MHA_UNIT_ISA "AVX-512"
#elif defined(__AVX2__) && (defined(__FMA__) || defined(_MSC_VER))
#define MHA_UNIT_ISA "AVX2+FMA"
#elif defined(__AVX__)
#define MHA_UNIT_ISA "AVX"
#elif defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#define MHA_UNIT_ISA "SSE2"
#elif defined(__ARM_NEON) || defined(_M_ARM64)
#define MHA_UNIT_ISA "NEON"
#else
#define MHA_UNIT_ISA "scalar"
#endif

#if MHA_GNU_C
#define MHA_UNIT_CODE "vector extensions"
#else
#define MHA_UNIT_CODE "portable C"
#endif

#define MHA_KERNEL_ENTRY(name, params, args) MHA_CAT(name, MHA_ISA),
static const mha_kernels MHA_CAT(kernels, MHA_ISA) = {
    MHA_UNIT_ISA " (" MHA_STR(MHA_VEC_BYTES) "-byte vectors)",
    MHA_UNIT_CODE,
    MHA_DISPATCHED(MHA_KERNEL_ENTRY, float, f32)
    MHA_DISPATCHED(MHA_KERNEL_ENTRY, double, f64)
};
#undef MHA_KERNEL_ENTRY

const mha_kernels *const MHA_CAT(mha_unit, MHA_ISA) = &MHA_CAT(kernels, MHA_ISA);
