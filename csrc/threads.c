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

/* The pool: workers 1..workers (the caller of mha_parallel_for is thread 0). A job is posted
 * by bumping `generation`; each worker takes tasks from the shared counter `next`, `chunk`
 * at a time, then decrements `pending`. Between jobs a worker spins for SPIN_NS, checking
 * `generation`, then sleeps on a condition variable: calls that follow each other closely
 * (the products, norms and attention of a model's layers) find the workers awake, and
 * between forwards an idle pool costs nothing. One job at a time: a caller that finds the
 * pool busy (another Python thread) or calls from inside a task runs its tasks itself. */
#define SPIN_NS 100000 /* 0.1 ms */

typedef struct {
    mha_task_fn fn;
    void *ctx;
    int64_t n, chunk;
    int threads;
} pool_job;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int workers;  /* started (written by the pool's holder only) */
    int sleepers; /* under mu */
    atomic_uint generation;
    atomic_int pending;
    atomic_llong next;
    atomic_flag busy;
    pool_job job;
    unsigned start_generation[MHA_MAX_THREADS]; /* what worker t saw when it was started */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, ATOMIC_FLAG_INIT, {0}, {0}};

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
    if (t >= j->threads) return;
    in_task = 1;
    for (;;) {
        const int64_t i0 = atomic_fetch_add_explicit(&pool.next, j->chunk, memory_order_relaxed);
        if (i0 >= j->n) break;
        const int64_t i1 = MHA_MIN(j->n, i0 + j->chunk);
        for (int64_t i = i0; i < i1; i++) j->fn(j->ctx, i, t);
    }
    in_task = 0;
}

static void *pool_worker(void *arg) {
    const int t = (int)(intptr_t)arg;
    unsigned seen = pool.start_generation[t];
    for (;;) {
        unsigned g = atomic_load_explicit(&pool.generation, memory_order_acquire);
        const int64_t until = now_ns() + SPIN_NS;
        for (int spins = 0; g == seen; spins++) {
            cpu_relax();
            if (spins % 64 == 63 && now_ns() > until) break;
            g = atomic_load_explicit(&pool.generation, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&pool.mu);
            pool.sleepers++;
            while ((g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen)
                pthread_cond_wait(&pool.wake, &pool.mu);
            pool.sleepers--;
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        pool_run(t);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* A forked child has none of the parent's workers. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = pool.sleepers = 0;
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
        pool.start_generation[t] = atomic_load_explicit(&pool.generation, memory_order_relaxed);
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int err = pthread_create(&thread, &attr, pool_worker, (void *)(intptr_t)t);
        pthread_attr_destroy(&attr);
        if (err) break;
        pool.workers = t;
    }
    return pool.workers;
}

void mha_parallel_for(int threads, int64_t n, int64_t chunk, mha_task_fn fn, void *ctx) {
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    if ((int64_t)threads > (n + chunk - 1) / chunk) threads = (int)((n + chunk - 1) / chunk);
    if (threads <= 1 || in_task || atomic_flag_test_and_set_explicit(&pool.busy, memory_order_acquire)) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
        return;
    }
    threads = MHA_MIN(threads, 1 + pool_grow(threads - 1));
    pool.job = (pool_job){fn, ctx, n, chunk, threads};
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.pending, pool.workers, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_mutex_lock(&pool.mu);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
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

int mha_threads_for(double flops) {
    if (in_parallel()) return 1;
    double useful = flops / MHA_FLOPS_PER_THREAD;
    int n = mha_get_num_threads();
    return useful < n ? (int)MHA_MAX(1.0, useful) : n;
}
