/* kernels_avx512.c: the kernel unit for AVX-512 (x86-64-v4's vector instructions: AVX512F,
 * AVX512DQ, AVX512BW and AVX512VL, with AVX2 and FMA), compiled with -mavx512f -mavx512dq
 * -mavx512bw -mavx512vl -mavx2 -mfma (MSVC: /arch:AVX512). Its vectors are 64 bytes and it
 * has 32 of them (vec.h), so the GEMM's micro-tile is 6 x 64 floats: twice the work of an
 * AVX2 micro-tile per step of the shared axis. Without the flags (another architecture, or a
 * compiler that lacks them) the unit is empty and its table NULL: dispatch.c then offers the
 * other paths. The path runs on CPUs whose CPUID reports those extensions and whose OS saves
 * the ZMM and opmask registers (dispatch.c). */
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && (defined(__FMA__) || defined(_MSC_VER))
#define MHA_ISA avx512
#include "kernels.h"
#else
#include "dispatch.h"
const mha_kernels *const mha_unit_avx512 = NULL;
#endif
