/* flow.c: attention flow (Abnar & Zuidema, ACL 2020): exact maximum flows on the layered
 * attention graph, for every (output position, input token) pair.
 *
 * The graph has L + 1 layers of n nodes; node (l, a) is position a after layer l (layer 0: the
 * input tokens). Edge (l + 1, a) -> (l, b) has capacity W[l][a][b], the (fused,
 * residual-corrected) attention of layer l from query a to key b. out[i][j] is the maximum
 * flow from (L, i) to (0, j).
 *
 * Only the source's own edges and the sink's own edges of the outer layers can carry flow (the
 * other top nodes have no way in, the other bottom nodes no way out), so a pair works on
 * s -> inner layers L-1 .. 1 -> t. Each maximum flow is Dinic's (1970): blocking flows by
 * depth-first search over level graphs. The first level graph is the layered graph itself
 * (with no flow yet every path from s to t has L arcs), so its search is skipped, and the
 * search after a blocking flow is skipped as well when the flow has reached the obvious bound
 * min(capacity out of s, capacity into t) (in MiniLM's attention the first blocking flow is
 * maximum for about 43% of the pairs, the bound is the maximum for about 88%). The scans of a
 * node's n arcs test 4 arcs at a time.
 *
 * Capacities are rounded to integers, c = round(w * 2^61 / R) with R the largest total
 * capacity out of one node, so the arithmetic is exact and always terminates: the flows are
 * the exact maximum flows of the rounded capacities, within (edges of a minimum cut) * R *
 * 2^-62 of the real ones (below 1e-12 R at 128 tokens and 6 layers).
 *
 * Sources are independent: they are spread over threads, each with its own workspace.
 */
#include <math.h>
#include <string.h>

#include "common.h"
#include "mha.h"

typedef struct {
    int64_t L, n;           /* layers, tokens                                                  */
    int64_t inner;          /* inner nodes (L - 1) * n: node (m, a), m in 1..L-1, is (m-1)*n + a */
    const int64_t *C;       /* (L, n, n) capacities: C[l][a][b] on (l + 1, a) -> (l, b)         */
} flow_graph;

typedef struct {            /* one thread's state for one source                                */
    int64_t *R, *FT;        /* (L - 2, n, n) residual capacity of (m, a) -> (m - 1, b) at
                               [m - 2][a][b], and its flow at [m - 2][b][a]                     */
    int64_t *bottom;        /* (n,) flow on (1, a) -> t                                         */
    int64_t *source;        /* (n,) flow on s -> (L - 1, b)                                     */
    int64_t *log;           /* (log_size,) edges of R changed since the last clear              */
    int64_t n_log, log_size;
    int64_t *level;         /* (inner,) distance from s in the level graph; -1: not in it      */
    int64_t *current;       /* (inner,) the next arc to look at: down arcs 0..n-1, up n..2n-1   */
    int64_t *bfs;           /* (inner,) breadth-first order                                     */
    int64_t sink_level;     /* the level of t                                                   */
    int layered;            /* the level graph is the layered graph itself: no arc goes up      */
} flow_state;

/* ---- scans of a node's arcs, 4 at a time -------------------------------------------------- */

/* With GNU C vector extensions the scans test 4 arcs at once and skip groups without a hit;
 * the portable build (MHA_GNU_C == 0) runs only the scalar loops after them. */
#if MHA_GNU_C
typedef int64_t flow_v4 __attribute__((vector_size(32)));
#define FLOW_V4 1
#else
#define FLOW_V4 0
#endif

/* The first j in [from, n) with res[j] > 0 and lev[j] == want, or n. */
static int64_t next_arc(const int64_t *res, const int64_t *lev, int64_t want, int64_t from,
                        int64_t n) {
    int64_t j = from;
#if FLOW_V4
    const flow_v4 zero = {0, 0, 0, 0}, w = zero + want;
    for (; j + 4 <= n; j += 4) {
        flow_v4 r, l;
        memcpy(&r, res + j, sizeof r);
        memcpy(&l, lev + j, sizeof l);
        flow_v4 hit = (r > zero) & (l == w);
        if (hit[0] | hit[1] | hit[2] | hit[3]) break;
    }
#endif
    for (; j < n; j++)
        if (res[j] > 0 && lev[j] == want) return j;
    return n;
}

/* Levels d for every j with res[j] > 0 and lev[j] < 0, appended to order[*tail]. */
static void visit(int64_t *lev, int64_t *order, int64_t *tail, const int64_t *res, int64_t base,
                  int64_t d, int64_t n) {
    int64_t j = 0;
#if FLOW_V4
    const flow_v4 zero = {0, 0, 0, 0};
    for (; j + 4 <= n; j += 4) {
        flow_v4 r, l;
        memcpy(&r, res + j, sizeof r);
        memcpy(&l, lev + j, sizeof l);
        flow_v4 hit = (r > zero) & (l < zero);
        if (!(hit[0] | hit[1] | hit[2] | hit[3])) continue;
        for (int64_t k = j; k < j + 4; k++)
            if (res[k] > 0 && lev[k] < 0) lev[k] = d, order[(*tail)++] = base + k;
    }
#endif
    for (; j < n; j++)
        if (res[j] > 0 && lev[j] < 0) lev[j] = d, order[(*tail)++] = base + j;
}

/* ---- Dinic ---------------------------------------------------------------------------------- */

/* Levels: breadth-first distances from s in the residual graph, up to t's (nodes farther away
 * cannot be on a shortest path and keep -1). Returns 0 when t cannot be reached. */
static int levels(flow_state *st, const flow_graph *g, int64_t s, int64_t t) {
    const int64_t L = g->L, n = g->n, nn = n * n;
    int64_t *lev = st->level, tail = 0, reach = -1;
    for (int64_t u = 0; u < g->inner; u++) lev[u] = -1;
    const int64_t *cap_s = g->C + (L - 1) * nn + s * n;
    for (int64_t b = 0; b < n; b++)
        if (cap_s[b] - st->source[b] > 0) lev[(L - 2) * n + b] = 1, st->bfs[tail++] = (L - 2) * n + b;
    for (int64_t h = 0; h < tail; h++) {
        int64_t u = st->bfs[h], m = u / n + 1, a = u % n, d = lev[u] + 1;
        if (reach >= 0 && d >= reach) break;
        if (m == 1) {
            if (reach < 0 && g->C[a * n + t] - st->bottom[a] > 0) reach = d;
        } else {
            visit(lev + (m - 2) * n, st->bfs, &tail, st->R + (m - 2) * nn + a * n, (m - 2) * n, d, n);
        }
        if (m + 1 <= L - 1) visit(lev + m * n, st->bfs, &tail, st->FT + (m - 1) * nn + a * n, m * n, d, n);
    }
    st->sink_level = reach;
    return reach >= 0;
}

static void log_change(flow_state *st, int64_t edge) {
    if (st->n_log < st->log_size) st->log[st->n_log] = edge;
    st->n_log++;
}

/* A blocking flow by depth-first search with current arcs: push up to `limit` from
 * u = (m, a) toward t along arcs that go one level further; returns what went. Arcs of u: down
 * to (m - 1, b) (to t from layer 1), then up to (m + 1, c) against the flow there. A node that
 * cannot pass on all it is offered leaves the level graph (level -1), so no arc leads to it
 * again in this phase. */
static int64_t augment(flow_state *st, const flow_graph *g, int64_t u, int64_t t, int64_t limit) {
    const int64_t L = g->L, n = g->n, nn = n * n, m = u / n + 1, a = u % n;
    const int64_t next = st->level[u] + 1;
    int64_t total = 0;
    if (m == 1 && next == st->sink_level) { /* the arc to t is u's only way on */
        total = MHA_MIN(limit, g->C[a * n + t] - st->bottom[a]);
        st->bottom[a] += total;
        if (total < limit) st->level[u] = -1;
        return total;
    }
    if (m > 1 && st->current[u] < n) {
        const int64_t *lev = st->level + (m - 2) * n;
        int64_t *res = st->R + (m - 2) * nn + a * n, *flow = st->FT + (m - 2) * nn;
        for (int64_t b = next_arc(res, lev, next, st->current[u], n); b < n;
             b = next_arc(res, lev, next, b + 1, n)) {
            int64_t x = augment(st, g, (m - 2) * n + b, t, MHA_MIN(limit - total, res[b]));
            if (x == 0) continue;
            res[b] -= x, flow[b * n + a] += x, total += x;
            log_change(st, (m - 2) * nn + a * n + b);
            if (total == limit) {
                st->current[u] = b;
                return total;
            }
        }
        st->current[u] = n;
    }
    if (m + 1 <= L - 1 && !st->layered) {
        const int64_t *lev = st->level + m * n;
        int64_t *flow = st->FT + (m - 1) * nn + a * n, *res = st->R + (m - 1) * nn;
        for (int64_t c = next_arc(flow, lev, next, MHA_MAX(st->current[u] - n, 0), n); c < n;
             c = next_arc(flow, lev, next, c + 1, n)) {
            int64_t x = augment(st, g, m * n + c, t, MHA_MIN(limit - total, flow[c]));
            if (x == 0) continue;
            flow[c] -= x, res[c * n + a] += x, total += x;
            log_change(st, (m - 1) * nn + c * n + a);
            if (total == limit) {
                st->current[u] = n + c;
                return total;
            }
        }
    }
    st->current[u] = 2 * n;
    st->level[u] = -1;
    return total;
}

/* Back to zero flow: undo the logged edges, or reset everything when the log overflowed. */
static void clear_flows(flow_state *st, const flow_graph *g) {
    const int64_t n = g->n, nn = n * n, mid = (g->L - 2) * nn;
    if (st->n_log > st->log_size) {
        memcpy(st->R, g->C + nn, (size_t)mid * sizeof *st->R);
        memset(st->FT, 0, (size_t)mid * sizeof *st->FT);
    } else {
        for (int64_t i = 0; i < st->n_log; i++) {
            int64_t e = st->log[i], layer = e / nn, a = e % nn / n, b = e % n;
            st->R[e] = g->C[nn + e], st->FT[layer * nn + b * n + a] = 0;
        }
    }
    st->n_log = 0;
    memset(st->bottom, 0, (size_t)n * sizeof *st->bottom);
    memset(st->source, 0, (size_t)n * sizeof *st->source);
}

/* The maximum flow from (L, s) to every (0, t), t = 0 .. n-1, into row[t] (capacity units);
 * into[t]: the capacity into t. */
static void flows_from(int64_t *row, flow_state *st, const flow_graph *g, int64_t s,
                       const int64_t *into) {
    const int64_t L = g->L, n = g->n, nn = n * n, inner = g->inner;
    const int64_t *cap_s = g->C + (L - 1) * nn + s * n;
    int64_t out_s = 0;
    for (int64_t b = 0; b < n; b++) out_s += cap_s[b];
    st->n_log = st->log_size + 1; /* start from a full reset */
    clear_flows(st, g);
    for (int64_t t = 0; t < n; t++) {
        const int64_t bound = MHA_MIN(out_s, into[t]);
        int64_t value = 0;
        for (int64_t u = 0; u < inner; u++) st->level[u] = L - 1 - u / n; /* the layered graph */
        st->sink_level = L;
        st->layered = 1;
        do {
            memset(st->current, 0, (size_t)inner * sizeof *st->current);
            for (int64_t b = 0; b < n && value < bound; b++) {
                int64_t u = (L - 2) * n + b, res = cap_s[b] - st->source[b];
                if (res <= 0 || st->level[u] != 1) continue;
                int64_t x = augment(st, g, u, t, MHA_MIN(res, bound - value));
                st->source[b] += x, value += x;
            }
            st->layered = 0;
        } while (value < bound && levels(st, g, s, t));
        row[t] = value;
        clear_flows(st, g);
    }
}

static size_t flow_state_bytes(int64_t L, int64_t n, int *ok) {
    size_t nn = mha_mul_size((size_t)n, (size_t)n, ok);
    size_t mid = mha_mul_size((size_t)(L - 2), nn, ok);
    size_t inner = mha_mul_size((size_t)(L - 1), (size_t)n, ok);
    size_t words = 2 * mid + 2 * (size_t)n + 3 * inner + 8 * inner; /* the log: 8 inner */
    return mha_round_up(mha_mul_size(words, sizeof(int64_t), ok), MHA_CACHE_LINE);
}

static void flow_state_init(flow_state *st, int64_t *p, int64_t L, int64_t n) {
    const int64_t mid = (L - 2) * n * n, inner = (L - 1) * n;
    st->R = p, p += mid;
    st->FT = p, p += mid;
    st->bottom = p, p += n;
    st->source = p, p += n;
    st->log = p, p += 8 * inner;
    st->log_size = 8 * inner;
    st->level = p, p += inner;
    st->current = p, p += inner;
    st->bfs = p;
}

/* The flows from each source, one task per source, on per-thread search state. */
typedef struct {
    int64_t *rows;
    unsigned char *mem;
    size_t state;
    int64_t L, n;
    const flow_graph *g;
    const int64_t *sources;
    const int64_t *into;
} flow_job;

static void flow_task(void *ctx, int64_t i, int thread) {
    const flow_job *j = ctx;
    flow_state st;
    flow_state_init(&st, (int64_t *)(j->mem + (size_t)thread * j->state), j->L, j->n);
    flows_from(j->rows + i * j->n, &st, j->g, j->sources ? j->sources[i] : i, j->into);
}

int mha_attention_flow_f64(double *out, const double *weights, int64_t layers, int64_t n,
                           const int64_t *sources, int64_t n_sources) {
    if (layers < 1 || n < 1 || n_sources < 0) return MHA_EINVAL;
    if (!sources) n_sources = n;
    for (int64_t i = 0; sources && i < n_sources; i++)
        if (sources[i] < 0 || sources[i] >= n) return MHA_EINVAL;
    const int64_t L = layers, nn = n * n;
    /* R: the largest total capacity out of one node (every flow value is at most R) */
    double R = 0;
    for (int64_t r = 0; r < L * n; r++) {
        double sum = 0;
        for (int64_t b = 0; b < n; b++) {
            double w = weights[r * n + b];
            if (!(w >= 0 && w <= 1e300)) return MHA_EINVAL; /* NaN, negative or infinite */
            sum += w;
        }
        if (!(sum <= 1e300)) return MHA_EINVAL;
        R = MHA_MAX(R, sum);
    }
    if (L == 1 || R == 0) { /* one layer: the edge itself; no capacity: no flow */
        for (int64_t i = 0; i < n_sources; i++)
            for (int64_t j = 0; j < n; j++) out[i * n + j] = L == 1 ? weights[(sources ? sources[i] : i) * n + j] : 0.0;
        return MHA_OK;
    }
    const double unit = 0x1p61 / R;
    int ok = 1;
    size_t caps = mha_mul_size(mha_mul_size((size_t)L, (size_t)nn, &ok), sizeof(int64_t), &ok);
    size_t state = flow_state_bytes(L, n, &ok);
    int threads = (int)MHA_MIN((int64_t)mha_threads_for((double)L * (double)nn * (double)n * (double)n_sources), MHA_MAX(n_sources, 1));
    size_t total = mha_mul_size(state, (size_t)threads, &ok);
    int64_t *rows = NULL, *C = NULL;
    unsigned char *mem = NULL;
    if (ok) {
        rows = mha_alloc((size_t)(n_sources * n + n) * sizeof *rows);
        C = mha_alloc(caps);
        mem = mha_alloc(total);
    }
    if (!ok || !rows || !C || !mem) {
        mha_free(rows), mha_free(C), mha_free(mem);
        return MHA_ENOMEM;
    }
    int64_t *into = rows + n_sources * n; /* (n,) capacity into each sink */
    for (int64_t i = 0; i < L * nn; i++) C[i] = (int64_t)llround(weights[i] * unit);
    for (int64_t t = 0; t < n; t++) into[t] = 0;
    for (int64_t a = 0; a < n; a++)
        for (int64_t t = 0; t < n; t++) into[t] += C[a * n + t];
    const flow_graph g = {L, n, (L - 1) * n, C};
    flow_job job = {rows, mem, state, L, n, &g, sources, into};
    mha_parallel_for(threads, n_sources, 1, flow_task, &job);
    for (int64_t i = 0; i < n_sources * n; i++) out[i] = (double)rows[i] / unit;
    mha_free(rows), mha_free(C), mha_free(mem);
    return MHA_OK;
}
