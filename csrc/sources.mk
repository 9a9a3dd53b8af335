# The C core's files, in one place: csrc/Makefile includes this file and setup.py reads it
# (lines NAME = files, continued with a trailing backslash). The Python binding, module.c,
# is setup.py's own; test_core.c and bench_core.c are the Makefile's.
#
# CORE_SOURCES: compiled with the core's ordinary flags.
# ISA_UNITS: the kernel units of an instruction set (dispatch.h), compiled with its flags
#   (Makefile: AVX2_FLAGS, AVX512_FLAGS; setup.py: KERNEL_UNIT_FLAGS); a new unit needs its flags there too.
# HEADERS: what every object depends on.
CORE_SOURCES = threads.c attention.c dispatch.c kernels_baseline.c flow.c
ISA_UNITS = kernels_avx2.c kernels_avx512.c
HEADERS = mha.h common.h dispatch.h kernels.h vec.h gemm_impl.h attention_impl.h \
          multihead_impl.h block_impl.h narrow.h
