/* threads.c: how the kernels run in parallel (common.h: mha_parallel_for, mha_threads_for)
 * and how many threads they use (mha.h: mha_set_num_threads, mha_get_num_threads).
 *
 * On POSIX systems the kernels run on mha's own pool (below), not on OpenMP: how its idle
 * threads wait is then mha's choice, whatever runtime another library loaded first. GNU
 * libgomp fixes its waiting when it loads (GOMP_SPINCOUNT, OMP_WAIT_POLICY), and a process
 * that imported torch first shares torch's libgomp, whose threads spin for 300,000
 * iterations after every parallel region: on a busy machine they take the cores that the next
 * call needs. Elsewhere (Windows) the kernels use OpenMP when the compiler has it and run
 * serial without it; -DMHA_SERIAL builds the serial core everywhere. */
#if !defined(_WIN32) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* pthreads, clock_gettime, sched_yield under -std=c11 */
#endif
#include "common.h"
#include "mha.h"

#if !defined(MHA_SERIAL) && !defined(_WIN32) && !defined(__STDC_NO_ATOMICS__) && \
    (defined(__unix__) || defined(__APPLE__))
#define MHA_POOL 1
#else
#define MHA_POOL 0
#endif

static int g_num_threads = 0; /* 0: the default (OMP_NUM_THREADS, else the core count) */

void mha_set_num_threads(int n) { g_num_threads = n > 0 ? MHA_MIN(n, MHA_MAX_THREADS) : 0; }

#if MHA_POOL
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

/* The pool: workers 1 .. MHA_MAX_THREADS - 1, started as jobs first ask for them (the caller
 * of mha_parallel_for is thread 0). A job of `threads` threads goes to workers
 * 1 .. threads - 1 only: each of them has its own job counter, which the caller bumps; the
 * worker takes tasks from the shared counter `next`, `chunk` at a time, then decrements
 * `pending`. The other workers are not woken, so a small job costs the same whatever the
 * size of the pool. After a job a worker spins for SPIN_NS watching its counter, then sleeps
 * on its own condition variable: calls that follow each other closely (the products, norms
 * and attention of a model's layers) find their workers awake, and between forwards an idle
 * pool costs nothing. One job at a time: a caller that finds the pool busy (another Python
 * thread) or calls from inside a task runs its tasks itself. */
#define SPIN_NS 100000 /* 0.1 ms */

typedef struct {
    mha_task_fn fn;
    void *ctx;
    int64_t n, chunk;
} pool_job;

/* One worker's place, on cache lines of its own: the counter it spins on is written only by
 * the callers that give it a job. */
typedef struct {
    _Alignas(MHA_CACHE_LINE) atomic_uint jobs; /* jobs given to this worker so far */
    unsigned jobs_at_start;                     /* `jobs` when the worker was started */
    int sleeping;                               /* waiting on `wake` (under pool.mu) */
    pthread_cond_t wake;
} pool_slot;

static struct {
    pthread_mutex_t mu;
    int workers; /* started (written by the pool's holder only) */
    atomic_int pending;
    atomic_llong next;
    atomic_flag busy;
    pool_job job;
    pool_slot slot[MHA_MAX_THREADS]; /* slot[t] for worker t >= 1 */
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .busy = ATOMIC_FLAG_INIT};

static _Thread_local int in_task = 0; /* this thread is running a task of the pool */

static inline void cpu_relax(void) {
#if MHA_GNU_C && (defined(__x86_64__) || defined(__i386__))
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void pool_run(int t) {
    const pool_job *j = &pool.job;
    in_task = 1;
    for (;;) {
        const int64_t i0 = atomic_fetch_add_explicit(&pool.next, j->chunk, memory_order_relaxed);
        if (i0 >= j->n) break;
        const int64_t i1 = MHA_MIN(j->n, i0 + j->chunk);
        for (int64_t i = i0; i < i1; i++) j->fn(j->ctx, i, t);
    }
    in_task = 0;
}

/* Worker t: waits until its job counter passes `done` (spinning, then asleep), runs the job. */
static void *pool_worker(void *arg) {
    const int t = (int)(intptr_t)arg;
    pool_slot *me = &pool.slot[t];
    unsigned done = me->jobs_at_start;
    for (;;) {
        unsigned given = atomic_load_explicit(&me->jobs, memory_order_acquire);
        const int64_t until = now_ns() + SPIN_NS;
        for (int spins = 0; given == done; spins++) {
            cpu_relax();
            if (spins % 64 == 63 && now_ns() > until) break;
            given = atomic_load_explicit(&me->jobs, memory_order_acquire);
        }
        if (given == done) {
            pthread_mutex_lock(&pool.mu);
            me->sleeping = 1;
            while ((given = atomic_load_explicit(&me->jobs, memory_order_acquire)) == done)
                pthread_cond_wait(&me->wake, &pool.mu);
            me->sleeping = 0;
            pthread_mutex_unlock(&pool.mu);
        }
        done = given; /* one job: its caller waits for it before giving another */
        pool_run(t);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* A forked child has none of the parent's workers (their slots' condition variables are
 * initialised again when workers start). */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL);
    for (int t = 1; t <= pool.workers; t++) pool.slot[t].sleeping = 0;
    pool.workers = 0;
    atomic_flag_clear(&pool.busy);
}

/* Starts workers up to `want` (held: the pool's busy flag); returns how many run. */
static int pool_grow(int want) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        registered = 1;
    }
    want = MHA_MIN(want, MHA_MAX_THREADS - 1);
    while (pool.workers < want) {
        const int t = pool.workers + 1;
        pool_slot *slot = &pool.slot[t];
        slot->jobs_at_start = atomic_load_explicit(&slot->jobs, memory_order_relaxed);
        slot->sleeping = 0;
        if (pthread_cond_init(&slot->wake, NULL)) break;
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int err = pthread_create(&thread, &attr, pool_worker, (void *)(intptr_t)t);
        pthread_attr_destroy(&attr);
        if (err) {
            pthread_cond_destroy(&slot->wake);
            break;
        }
        pool.workers = t;
    }
    return pool.workers;
}

void mha_parallel_for(int threads, int64_t n, int64_t chunk, mha_task_fn fn, void *ctx) {
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    const int64_t chunks = (n + chunk - 1) / chunk; /* no more threads than chunks */
    if ((int64_t)threads > chunks) threads = (int)chunks;
    if (threads <= 1 || in_task || atomic_flag_test_and_set_explicit(&pool.busy, memory_order_acquire)) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
        return;
    }
    threads = MHA_MIN(threads, 1 + pool_grow(threads - 1));
    pool.job = (pool_job){fn, ctx, n, chunk};
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.pending, threads - 1, memory_order_relaxed);
    for (int t = 1; t < threads; t++) /* release: the job above is visible to the worker */
        atomic_fetch_add_explicit(&pool.slot[t].jobs, 1, memory_order_release);
    pthread_mutex_lock(&pool.mu);
    for (int t = 1; t < threads; t++)
        if (pool.slot[t].sleeping) pthread_cond_signal(&pool.slot[t].wake);
    pthread_mutex_unlock(&pool.mu);
    pool_run(0);
    for (int spins = 0; atomic_load_explicit(&pool.pending, memory_order_acquire) > 0; spins++) {
        cpu_relax();
        if (spins > 4096) sched_yield(); /* a worker lost its core: give it ours */
    }
    atomic_flag_clear_explicit(&pool.busy, memory_order_release);
}

/* OMP_NUM_THREADS (the usual knob, honoured as OpenMP would), else the core count, at most
 * MHA_MAX_THREADS: read once, at the first call, as an OpenMP runtime reads it when it loads.
 * A library may set it later in the process for its own workers (Dask's LocalCluster writes
 * OMP_NUM_THREADS=1 into its caller's environment); read on every call, it would change
 * mha's threads while that library runs. */
static int default_threads(void) {
    static atomic_int cached = 0;
    int n = atomic_load_explicit(&cached, memory_order_relaxed);
    if (n > 0) return n;
    const char *env = getenv("OMP_NUM_THREADS");
    n = env ? atoi(env) : 0;
    if (n <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        n = cores > 0 ? (int)MHA_MIN(cores, MHA_MAX_THREADS) : 1;
    }
    n = MHA_MIN(n, MHA_MAX_THREADS);
    atomic_store_explicit(&cached, n, memory_order_relaxed);
    return n;
}

int mha_get_num_threads(void) { return g_num_threads > 0 ? g_num_threads : default_threads(); }

static int in_parallel(void) { return in_task; }

const char *mha_thread_runtime(void) { return "mha pool (POSIX threads, idle workers spin 0.1 ms then sleep)"; }

#elif defined(_OPENMP) && !defined(MHA_SERIAL)
#include <omp.h>

void mha_parallel_for(int threads, int64_t n, int64_t chunk, mha_task_fn fn, void *ctx) {
    if (chunk < 1) chunk = 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk) if (threads > 1)
    for (int64_t i = 0; i < n; i++) fn(ctx, i, omp_get_thread_num());
}

int mha_get_num_threads(void) {
    return g_num_threads > 0 ? g_num_threads : MHA_MIN(omp_get_max_threads(), MHA_MAX_THREADS);
}

static int in_parallel(void) { return omp_in_parallel(); }

const char *mha_thread_runtime(void) { return "OpenMP " MHA_STR(_OPENMP); }

#else

void mha_parallel_for(int threads, int64_t n, int64_t chunk, mha_task_fn fn, void *ctx) {
    (void)threads;
    (void)chunk;
    for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
}

int mha_get_num_threads(void) { return 1; }

static int in_parallel(void) { return 0; }

const char *mha_thread_runtime(void) { return "serial"; }

#endif

/* ---- scratch memory (common.h: mha_alloc, mha_free) ---------------------------------------- */

/* What precedes a block's aligned start: the malloc'd address and the bytes usable from the
 * start. */
typedef struct {
    void *raw;
    size_t capacity;
} scratch_header;

/* Gives a block (its aligned start) back to malloc. */
static void free_raw(void *p) { free(((scratch_header *)p - 1)->raw); }

/* Blocks kept for reuse: from MHA_SCRATCH_KEEP_MIN bytes, at most SCRATCH_KEEP_BLOCKS of them
 * and SCRATCH_KEEP_BYTES in all; a request takes the smallest kept block that holds it, if
 * that is at most twice its size (a large block stays for a large request); a request that
 * none holds frees the kept blocks smaller than it. Only with the POSIX pool's mutex, and not
 * under AddressSanitizer (whose use-after-free checks need freed memory to go back to it). */
#if MHA_POOL && !MHA_ASAN
#define SCRATCH_CACHE 1
#define SCRATCH_KEEP_BYTES ((size_t)64 << 20)
#define SCRATCH_KEEP_BLOCKS 32
static struct {
    pthread_mutex_t mu;
    void *block[SCRATCH_KEEP_BLOCKS]; /* aligned starts, or NULL */
    size_t bytes;                     /* their capacities in all */
} kept = {.mu = PTHREAD_MUTEX_INITIALIZER};

static size_t capacity_of(void *p) { return ((scratch_header *)p - 1)->capacity; }

static void *take_kept(size_t bytes) {
    if (bytes < MHA_SCRATCH_KEEP_MIN) return NULL;
    void *p = NULL, *smaller[SCRATCH_KEEP_BLOCKS] = {NULL};
    pthread_mutex_lock(&kept.mu);
    int best = -1;
    for (int i = 0; i < SCRATCH_KEEP_BLOCKS; i++) {
        const size_t cap = kept.block[i] ? capacity_of(kept.block[i]) : 0;
        if (cap >= bytes && cap / 2 <= bytes && (best < 0 || cap < capacity_of(kept.block[best])))
            best = i;
    }
    if (best >= 0) {
        p = kept.block[best];
        kept.block[best] = NULL;
        kept.bytes -= capacity_of(p);
    } else { /* a miss: the calls have grown; blocks too small for it go, so that memory kept
              * from smaller calls does not stay resident beside the new one */
        for (int i = 0; i < SCRATCH_KEEP_BLOCKS; i++)
            if (kept.block[i] && capacity_of(kept.block[i]) < bytes) {
                smaller[i] = kept.block[i];
                kept.bytes -= capacity_of(kept.block[i]);
                kept.block[i] = NULL;
            }
    }
    pthread_mutex_unlock(&kept.mu);
    for (int i = 0; i < SCRATCH_KEEP_BLOCKS; i++)
        if (smaller[i]) free_raw(smaller[i]);
    return p;
}

/* 1 if p was kept, 0 if the caller frees it. */
static int keep_block(void *p) {
    const size_t cap = capacity_of(p);
    if (cap < MHA_SCRATCH_KEEP_MIN || cap > SCRATCH_KEEP_BYTES) return 0;
    int done = 0;
    pthread_mutex_lock(&kept.mu);
    if (kept.bytes + cap <= SCRATCH_KEEP_BYTES)
        for (int i = 0; i < SCRATCH_KEEP_BLOCKS && !done; i++)
            if (!kept.block[i]) {
                kept.block[i] = p;
                kept.bytes += cap;
                done = 1;
            }
    pthread_mutex_unlock(&kept.mu);
    return done;
}
#else
#define SCRATCH_CACHE 0
#endif

void *mha_alloc(size_t bytes) {
#if SCRATCH_CACHE
    void *reused = take_kept(bytes);
    if (reused) return reused;
#endif
    const size_t extra = MHA_CACHE_LINE + sizeof(scratch_header);
    if (bytes > SIZE_MAX - extra) return NULL;
    char *raw = malloc(bytes + extra);
    if (!raw) return NULL;
    uintptr_t start = ((uintptr_t)raw + extra) & ~(uintptr_t)(MHA_CACHE_LINE - 1);
    scratch_header *h = (scratch_header *)start - 1;
    h->raw = raw;
    h->capacity = bytes;
    return (void *)start;
}

void mha_free(void *p) {
    if (!p) return;
#if SCRATCH_CACHE
    if (keep_block(p)) return;
#endif
    free_raw(p);
}

size_t mha_release_scratch(void) {
    size_t bytes = 0;
#if SCRATCH_CACHE
    void *drop[SCRATCH_KEEP_BLOCKS];
    pthread_mutex_lock(&kept.mu);
    for (int i = 0; i < SCRATCH_KEEP_BLOCKS; i++) {
        drop[i] = kept.block[i];
        kept.block[i] = NULL;
    }
    bytes = kept.bytes;
    kept.bytes = 0;
    pthread_mutex_unlock(&kept.mu);
    for (int i = 0; i < SCRATCH_KEEP_BLOCKS; i++)
        if (drop[i]) free_raw(drop[i]);
#endif
    return bytes;
}

int mha_threads_for(double flops) {
    if (in_parallel()) return 1;
    double useful = flops / MHA_FLOPS_PER_THREAD;
    int n = mha_get_num_threads();
    return useful < n ? (int)MHA_MAX(1.0, useful) : n;
}
