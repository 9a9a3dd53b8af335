/* multihead.c: the multi-head attention layer, forward + backward (see multihead_impl.h). */
#include <string.h>

#include "common.h"
#include "mha.h"

#define real float
#define SFX f32
#include "multihead_impl.h"
#undef real
#undef SFX

#define real double
#define SFX f64
#include "multihead_impl.h"
#undef real
#undef SFX
