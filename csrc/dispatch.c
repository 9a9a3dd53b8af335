/* dispatch.c: the choice of a kernel unit (dispatch.h), once, at the first call of the core,
 * and the public entry points that call through it; the build information.
 *
 * The CPU is probed with CPUID on x86 (the way NumPy's npy_cpu_features.c does: the feature
 * bits, and XGETBV for the registers the OS saves on a context switch); every other target
 * runs its baseline unit. */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "dispatch.h"

/* ---- the CPU ------------------------------------------------------------------------------ */

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
static void cpuid(unsigned leaf, unsigned r[4]) {
    int v[4];
    __cpuidex(v, (int)leaf, 0);
    for (int i = 0; i < 4; i++) r[i] = (unsigned)v[i];
}
static unsigned long long xcr0(void) { return _xgetbv(0); }
#else
#include <cpuid.h>
static void cpuid(unsigned leaf, unsigned r[4]) {
    r[0] = r[1] = r[2] = r[3] = 0;
    const unsigned max_leaf = (unsigned)__get_cpuid_max(0, NULL);
    if (leaf <= max_leaf) __cpuid_count(leaf, 0, r[0], r[1], r[2], r[3]);
}
/* XGETBV spelled as its bytes: some assemblers (older macOS ones) lack the mnemonic. */
static unsigned long long xcr0(void) {
    unsigned lo, hi;
    __asm__ __volatile__(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
    return (unsigned long long)hi << 32 | lo;
}
#endif

/* AVX2 and FMA (the unit's instructions), BMI1 and BMI2 (which MSVC's /arch:AVX2 may use as
 * well: every CPU with AVX2 has them), and the OS saving the XMM and YMM registers (XCR0 bits
 * 1 and 2; a kernel booted with noxsave, or a hypervisor, may clear them). */
static int cpu_runs_avx2(void) {
    unsigned r[4];
    cpuid(1, r);
    const unsigned ecx1 = r[2];
    const int fma = ecx1 >> 12 & 1, osxsave = ecx1 >> 27 & 1, avx = ecx1 >> 28 & 1;
    if (!(fma && osxsave && avx) || (xcr0() & 6) != 6) return 0;
    cpuid(7, r);
    const int bmi1 = r[1] >> 3 & 1, avx2 = r[1] >> 5 & 1, bmi2 = r[1] >> 8 & 1;
    return avx2 && bmi1 && bmi2;
}

/* All of the above, AVX512F, AVX512DQ, AVX512BW and AVX512VL (the -mavx512* flags the unit is
 * compiled with), and the OS saving the opmask and ZMM registers too (XCR0 bits 5 to 7). */
static int cpu_runs_avx512(void) {
    if (!cpu_runs_avx2() || (xcr0() & 0xe6) != 0xe6) return 0;
    unsigned r[4];
    cpuid(7, r);
    const unsigned ebx = r[1];
    const int f = ebx >> 16 & 1, dq = ebx >> 17 & 1, bw = ebx >> 30 & 1, vl = ebx >> 31 & 1;
    return f && dq && bw && vl;
}
#else
static int cpu_runs_avx2(void) { return 0; }
static int cpu_runs_avx512(void) { return 0; }
#endif

/* ---- the paths, best first ---------------------------------------------------------------- */

static const struct mha_path {
    const char *name;               /* MHA_SIMD's value for it */
    const mha_kernels *const *unit; /* its unit's table (NULL: not built) */
    int (*cpu_runs)(void);          /* NULL: every CPU of the target */
    const char *needs;              /* what cpu_runs checks */
} paths[] = {
    {"avx512", &mha_unit_avx512, cpu_runs_avx512,
     "AVX512F, AVX512DQ, AVX512BW and AVX512VL (with AVX2 and FMA) with ZMM registers enabled by "
     "the OS"},
    {"avx2", &mha_unit_avx2, cpu_runs_avx2,
     "AVX2, FMA, BMI1 and BMI2 with YMM registers enabled by the OS"},
    {"baseline", &mha_unit_baseline, NULL, ""},
};
enum { N_PATHS = sizeof paths / sizeof paths[0] };

/* ---- the choice, made once ------------------------------------------------------------------
 * The first call of the core (from any thread) makes it; a call that finds it under way waits
 * for it. State: 0 not made, 1 being made, 2 made (then `chosen` is read-only). */
static struct {
    const mha_kernels *table;
    const char *path;
    char paths_here[64];  /* the paths this build and CPU run, best first: "avx512 avx2 baseline" */
    char choice[256];     /* how it was chosen */
    char info[640];       /* mha_build_info's text */
} chosen;

#if !defined(__STDC_NO_ATOMICS__)
#include <stdatomic.h>
static atomic_int state;
static int state_load(void) { return atomic_load_explicit(&state, memory_order_acquire); }
static int state_claim(void) {
    int expected = 0;
    return atomic_compare_exchange_strong_explicit(&state, &expected, 1, memory_order_acquire,
                                                   memory_order_acquire);
}
static void state_publish(void) { atomic_store_explicit(&state, 2, memory_order_release); }
#elif defined(_MSC_VER)
/* MSVC's C11 mode has no <stdatomic.h> (without /experimental:c11atomics): its interlocked
 * functions are full barriers. */
#include <intrin.h>
static volatile long state;
static int state_load(void) { return (int)_InterlockedOr(&state, 0); }
static int state_claim(void) { return _InterlockedCompareExchange(&state, 1, 0) == 0; }
static void state_publish(void) { _InterlockedExchange(&state, 2); }
#else
/* No atomics: the first call must not race with another (make one before starting threads). */
static int state;
static int state_load(void) { return state; }
static int state_claim(void) { return state == 0 ? (state = 1) : 0; }
static void state_publish(void) { state = 2; }
#endif

static int same_name(const char *a, const char *b) { /* ASCII, ignoring case */
    for (; *a && *b; a++, b++)
        if (tolower((unsigned char)*a) != tolower((unsigned char)*b)) return 0;
    return *a == *b;
}

#if defined(__clang__)
#define MHA_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define MHA_COMPILER "gcc " MHA_STR(__GNUC__) "." MHA_STR(__GNUC_MINOR__) "." MHA_STR(__GNUC_PATCHLEVEL__)
#elif defined(_MSC_VER)
#define MHA_COMPILER "msvc " MHA_STR(_MSC_VER)
#else
#define MHA_COMPILER "unknown compiler"
#endif

static void choose(void) {
    int runs[N_PATHS], best = N_PATHS - 1;
    chosen.paths_here[0] = 0;
    for (int i = N_PATHS - 1; i >= 0; i--) { /* the baseline always runs */
        runs[i] = *paths[i].unit != NULL && (!paths[i].cpu_runs || paths[i].cpu_runs());
        if (runs[i]) best = i;
    }
    for (int i = 0; i < N_PATHS; i++)
        if (runs[i])
            snprintf(chosen.paths_here + strlen(chosen.paths_here),
                     sizeof chosen.paths_here - strlen(chosen.paths_here), "%s%s",
                     chosen.paths_here[0] ? " " : "", paths[i].name);

    /* MHA_SIMD's value, cut to 32 characters of [A-Za-z0-9_-] for the messages */
    const char *env = getenv("MHA_SIMD");
    char want[33] = "";
    for (int i = 0; env && env[i] && i < 32; i++)
        want[i] = isalnum((unsigned char)env[i]) || env[i] == '_' || env[i] == '-' ? env[i] : '?';
    int pick = best;
    if (!*want || same_name(want, "auto")) {
        snprintf(chosen.choice, sizeof chosen.choice, "auto (the best this CPU runs)");
    } else {
        int asked = -1;
        for (int i = 0; i < N_PATHS; i++)
            if (same_name(want, paths[i].name)) asked = i;
        char why[160] = "";
        if (asked < 0)
            snprintf(why, sizeof why, "not a SIMD path of mha (auto, avx512, avx2, baseline)");
        else if (!*paths[asked].unit)
            snprintf(why, sizeof why, "this build has no %s kernels", paths[asked].name);
        else if (!runs[asked])
            snprintf(why, sizeof why, "this CPU lacks %s", paths[asked].needs);
        if (*why) {
            snprintf(chosen.choice, sizeof chosen.choice, "MHA_SIMD=%s ignored: %s", want, why);
            fprintf(stderr, "mha: warning: %s; using %s\n", chosen.choice, paths[best].name);
        } else {
            pick = asked;
            snprintf(chosen.choice, sizeof chosen.choice, "MHA_SIMD=%s", paths[asked].name);
        }
    }
    chosen.table = *paths[pick].unit;
    chosen.path = paths[pick].name;
    snprintf(chosen.info, sizeof chosen.info,
             "compiler=%s; simd=%s; simd_isa=%s; simd_paths=%s; simd_choice=%s; kernels=%s; "
             "threads=%s",
             MHA_COMPILER, chosen.path, chosen.table->isa, chosen.paths_here, chosen.choice,
             chosen.table->code, mha_thread_runtime());
}

static void ensure_chosen(void) {
    if (state_load() == 2) return;
    if (state_claim()) {
        choose();
        state_publish();
    }
    while (state_load() != 2) { /* another thread is choosing: microseconds */
    }
}

static const mha_kernels *kernels(void) {
    ensure_chosen();
    return chosen.table;
}

const char *mha_simd_path(void) {
    ensure_chosen();
    return chosen.path;
}

const char *mha_simd_paths(void) {
    ensure_chosen();
    return chosen.paths_here;
}

const char *mha_build_info(void) {
    ensure_chosen();
    return chosen.info;
}

/* ---- the dispatched entry points ------------------------------------------------------------ */

#define MHA_DISPATCH_CALL(name, params, args) \
    int name params { return kernels()->name args; }
MHA_DISPATCHED(MHA_DISPATCH_CALL, float, f32)
MHA_DISPATCHED(MHA_DISPATCH_CALL, double, f64)
