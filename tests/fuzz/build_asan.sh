#!/usr/bin/env bash
# Builds a copy of the mha package whose C extension (module.c + the core) is compiled with
# AddressSanitizer + UndefinedBehaviorSanitizer, in a directory outside the source tree, and
# prints the environment that runs Python against it:
#
#     eval "$(bash tests/fuzz/build_asan.sh [OUT_DIR])"
#     $MHA_ASAN_PYTHON tests/fuzz/fuzz_binding.py --seconds 60
#
# The core's own test program already runs under ASan (make -C csrc asan); this build puts the
# *binding* (argument checks, buffer sizes handed to the core, reference counting on error
# paths) under the sanitizers too, driven by the fuzz target or by pytest. The thread pool is
# built (POSIX threads), so the parallel paths are checked; every SIMD unit is built (the AVX2
# and AVX-512 ones with their flags, on x86-64), so MHA_SIMD picks the path under test. Needs
# gcc (or clang) with libasan/libubsan; numpy from the Python used.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${1:-${TMPDIR:-/tmp}/mha-asan}"
CC="${CC:-gcc}"

mkdir -p "$OUT"
rm -rf "$OUT/mha"
# the pure Python part of the package, as it is in the tree
cp -r "$ROOT/src/mha" "$OUT/mha"
find "$OUT/mha" -name '*.so' -delete
find "$OUT/mha" -name '__pycache__' -prune -exec rm -rf {} +

read -r PYINC NPINC SUFFIX < <("$PY" -c 'import sysconfig, numpy; print(sysconfig.get_paths()["include"], numpy.get_include(), sysconfig.get_config_var("EXT_SUFFIX"))')
FLAGS=(-std=c11 -O1 -g -fno-omit-frame-pointer -fPIC -fsanitize=address,undefined
       -fno-sanitize-recover=undefined -pthread -Wall -Wextra -I"$ROOT/csrc" -I"$PYINC" -I"$NPINC")
UNITS=()
case "$("$CC" -dumpmachine)" in
    x86_64*|amd64*)  # each unit of sources.mk's ISA_UNITS with its flags (setup.py's, csrc/Makefile's)
        "$CC" "${FLAGS[@]}" -mavx2 -mfma -c "$ROOT/csrc/kernels_avx2.c" -o "$OUT/kernels_avx2.o" >&2
        "$CC" "${FLAGS[@]}" -mavx2 -mfma -mavx512f -mavx512dq -mavx512bw -mavx512vl \
            -c "$ROOT/csrc/kernels_avx512.c" -o "$OUT/kernels_avx512.o" >&2
        UNITS=("$OUT/kernels_avx2.o" "$OUT/kernels_avx512.o") ;;
    *)  # the x86 units compile empty elsewhere (their tables NULL)
        for unit in $(sed -n 's/^ISA_UNITS *= *//p' "$ROOT/csrc/sources.mk"); do
            "$CC" "${FLAGS[@]}" -c "$ROOT/csrc/$unit" -o "$OUT/${unit%.c}.o" >&2
            UNITS+=("$OUT/${unit%.c}.o")
        done ;;
esac
# the core's sources as setup.py and csrc/Makefile read them (csrc/sources.mk)
CORE=($(sed -n 's/^CORE_SOURCES *= *//p' "$ROOT/csrc/sources.mk"))
"$CC" "${FLAGS[@]}" -shared "$ROOT/csrc/module.c" "${CORE[@]/#/$ROOT/csrc/}" "${UNITS[@]}" -lm \
    -o "$OUT/mha/_C$SUFFIX" >&2

ASAN_LIB="$("$CC" -print-file-name=libasan.so)"
UBSAN_LIB="$("$CC" -print-file-name=libubsan.so)"
# Python's own allocations are not freed at exit: leak detection off (leaks are measured by
# tests/test_leaks_threads.py instead); any memory error aborts with a report.
cat <<ENV
export MHA_ASAN_DIR='$OUT'
export MHA_ASAN_PYTHON='env LD_PRELOAD=$ASAN_LIB:$UBSAN_LIB PYTHONPATH=$OUT ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:max_allocation_size_mb=4096 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 PYTHONMALLOC=malloc $PY'
ENV
