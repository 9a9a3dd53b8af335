/* kernels_avx2.c: the kernel unit for AVX2+FMA (x86-64-v3's vector instructions), compiled with
 * -mavx2 -mfma (MSVC: /arch:AVX2). Without them (another architecture, or a build that did not
 * pass them) the unit is empty and its table NULL: dispatch.c then offers the baseline only.
 * The path runs on CPUs whose CPUID reports AVX2, FMA, BMI1 and BMI2 and whose OS saves the
 * YMM registers (dispatch.c). */
#if defined(__AVX2__) && (defined(__FMA__) || defined(_MSC_VER))
#define MHA_ISA avx2
#include "kernels.h"
#else
#include "dispatch.h"
const mha_kernels *const mha_unit_avx2 = NULL;
#endif
