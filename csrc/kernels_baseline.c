/* kernels_baseline.c: the kernel unit for the target's baseline instruction set (SSE2 on
 * x86-64, NEON on aarch64), compiled with the core's ordinary flags; always built, and the
 * path every CPU of the target can run (dispatch.h). */
#define MHA_ISA baseline
#include "kernels.h"
