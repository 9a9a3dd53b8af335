/* gemm.c: the one matrix multiply every other file calls (see gemm_impl.h). */
#include <string.h>

#include "common.h"
#include "mha.h"
#include "vec.h"

#define real float
#define SFX f32
#include "gemm_impl.h"
#undef real
#undef SFX

#define real double
#define SFX f64
#include "gemm_impl.h"
#undef real
#undef SFX
