/* CPU expert workers: a pool of pinned pthreads serving the mailbox (offload/mailbox.py),
 * the direct expert call the tests use, and the host bandwidth probe. The library's one
 * translation unit: it includes experts.c (the arithmetic) and probe.c (build.py). */
#define _GNU_SOURCE
#include "experts.c"
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

enum { REQ = 0, LAYER = 1, ROWS = 2, DONE = 16, STOP = 32 };
#define MAXT 256
#define IDLE_NS 2000000L   /* spin this long after the last work, then sleep between polls: */
#define NAP_NS 30000L      /* ~30 us while decode rounds come and go, */
#define DOZE_NS 100000000L /* longer after 100 ms idle (a server between requests; */
#define DOZE_NAP_NS 500000L /* the first post after such a pause waits up to this) */

/* The IEEE default on every thread that computes: round to nearest, no flush to zero. */
static void fp_defaults(void) {
#if defined(__x86_64__)
    _mm_setcsr(0x1f80);
#endif
}

/* A layer's experts and their activation (ACTS' id); gate_up.N == 0: the layer has none. */
typedef struct { qmat gate_up, down; int32_t act; } layer_desc;

/* Prepared activations (aq_prep's outputs) for n rows of up to K values: x[i] is row i's. */
typedef struct { xprep *x; int8_t *xp, *xi; int32_t *ssum; float *xsum, *dxs; } xset;

typedef struct {
    grpbuf gb;                 /* a decoded row, its scales and the row scratch (group.c) */
    float *act;                /* [max_k] one pair's activation, before quantization */
    const xprep **xv; float **ov;   /* [max_w k] a group's activations and outputs */
} tscratch;

typedef struct pool pool;
typedef struct { pool *p; int id; } targ;

#define MAXTASK 4096

/* The pool's clock (aq_pool_stats), for the round's parts: posts served, ns from thread 0
 * seeing REQ to DONE (the CPU's part of a post), ns from a DONE to the next REQ seen when
 * under GAP_NS (the GPU's part between two posts of one round), the gaps counted, and the
 * posts' pairs and groups (distinct experts: weight rows read once a group). */
enum { ST_POSTS, ST_BUSY_NS, ST_GAP_NS, ST_GAPS, ST_PAIRS, ST_GROUPS, N_ST };
#define GAP_NS 2000000L

struct pool {
    int n;
    pthread_t th[MAXT];
    targ args[MAXT];
    int cpus[MAXT];
    int32_t *ctl; const int8_t *xq; const float *dx; const int32_t *xs;
    const int32_t *ids, *task; float *y;
    int max_w, k, D;
    const layer_desc *layers; int n_layers;
    int max_k, max_n, max_f, max_e;
    /* the post in progress: its pairs (tasks), their groups by expert (post.c) */
    int ntask, layer, tm[MAXTASK], tr[MAXTASK], te[MAXTASK];
    int nrow, rows[MAXTASK];                      /* the posted rows with a pair */
    int ngroup, gexp[MAXTASK], gstart[MAXTASK + 1], gtask[MAXTASK];
    long gcost[MAXTASK + 1];                      /* cost of a row of groups < g, summed */
    int *gof;                                     /* [max_e] an expert's group while grouping, else -1 */
    float *gu;      /* [max_w * k, max_n] gate|up outputs */
    int8_t *aq; float *adx; int32_t *axs;   /* [max_w * k, max_f (/32, /16)] quantized acts */
    xset rowx, taskx;   /* gate|up's input per posted row, down's per pair */
    tscratch ts[MAXT];
    /* sync */
    int gen, quit;            /* gen: bumped by thread 0 per post (release) */
    int32_t req;              /* the post's REQ: DONE's value once its last unit is done */
    uint64_t claim[4];        /* a phase's units: gen << 32 | units << 16 | next (post.c) */
    int done[4];              /* a phase's units done */
    long t_open, t_done;      /* now_ns() as thread 0 opened the post / as the last DONE went out */
    long st[N_ST];            /* the clock's sums (atomic adds) */
};

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void nap(long idle) {
    struct timespec t = {0, idle > DOZE_NS ? DOZE_NAP_NS : NAP_NS};
    nanosleep(&t, 0);
}

/* Slots (and SIMD slack) of prepared values a row of K needs: the smallest slot is 16. */
#define NS_OF(K) ((size_t)(K) / 16 + CHUNK)

static int alloc_xset(xset *s, int n, int K) {
    size_t ns = NS_OF(K);
    s->x = malloc(sizeof *s->x * (size_t)n);
    s->xp = malloc((size_t)n * K); s->xi = malloc((size_t)n * K); s->ssum = malloc(4 * ns * n);
    s->xsum = malloc(4 * ns * n); s->dxs = malloc(4 * ns * n);
    if (!s->x || !s->xp || !s->xi || !s->ssum || !s->xsum || !s->dxs) return -1;
    for (int i = 0; i < n; i++)
        s->x[i] = (xprep){s->xp + (size_t)i * K, s->ssum + ns * i, s->xsum + ns * i, s->dxs + ns * i,
                          s->xi + (size_t)i * K};
    return 0;
}

static void free_xset(xset *s) { free(s->x); free(s->xp); free(s->xi); free(s->ssum); free(s->xsum); free(s->dxs); }

static int alloc_grpbuf(grpbuf *b, int K, int max_g) {
    size_t ns = NS_OF(K);
    b->rb = (rowbuf){malloc(4 * ns), malloc(ROW_PLANES(K))};
    b->codes = malloc(K); b->A = malloc(4 * ns); b->B = malloc(4 * ns); b->sum = malloc(4 * (size_t)max_g);
    b->lanes = malloc(4 * MAXLANES * (size_t)max_g);
    return b->rb.isum && b->rb.pl && b->codes && b->A && b->B && b->sum && b->lanes ? 0 : -1;
}

static void free_grpbuf(grpbuf *b) {
    free(b->rb.isum); free(b->rb.pl); free(b->codes); free(b->A); free(b->B); free(b->sum); free(b->lanes);
}

static int alloc_scratch(tscratch *s, int max_k, int max_tasks) {
    s->act = malloc(4 * (size_t)max_k);
    s->xv = malloc(sizeof *s->xv * (size_t)max_tasks); s->ov = malloc(sizeof *s->ov * (size_t)max_tasks);
    return alloc_grpbuf(&s->gb, max_k, max_tasks) == 0 && s->act && s->xv && s->ov ? 0 : -1;
}

static void free_scratch(tscratch *s) { free_grpbuf(&s->gb); free(s->act); free(s->xv); free(s->ov); }

#include "post.c"

static void *worker(void *arg) {
    targ *a = arg;
    pool *p = a->p;
    int id = a->id, seen_gen = 0;
    if (p->cpus[id] >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(p->cpus[id], &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    fp_defaults();
    int32_t last = __atomic_load_n(&p->ctl[DONE], __ATOMIC_ACQUIRE);
    long idle_since = now_ns();
    for (;;) {
        if (id == 0) {
            if (__atomic_load_n(&p->ctl[STOP], __ATOMIC_ACQUIRE) == 1) {
                __atomic_store_n(&p->quit, 1, __ATOMIC_RELAXED);
                __atomic_store_n(&p->gen, p->gen + 1, __ATOMIC_RELEASE);
                return 0;
            }
            int32_t req = __atomic_load_n(&p->ctl[REQ], __ATOMIC_ACQUIRE);
            if (req != last) {
                last = req;
                long t = now_ns(), since = t - __atomic_load_n(&p->t_done, __ATOMIC_ACQUIRE);
                if (since < GAP_NS) {
                    __atomic_add_fetch(&p->st[ST_GAP_NS], since, __ATOMIC_RELAXED);
                    __atomic_add_fetch(&p->st[ST_GAPS], 1, __ATOMIC_RELAXED);
                }
                p->t_open = t;                 /* published to the other threads with gen */
                if (read_post(p)) {            /* DONE comes from the thread that finishes its last unit */
                    int g = p->gen + 1;
                    open_post(p, g, req);
                    __atomic_store_n(&p->gen, g, __ATOMIC_RELEASE);
                    serve_post(p, 0, g);
                } else {
                    __atomic_store_n(&p->ctl[DONE], req, __ATOMIC_RELEASE);
                }
                idle_since = now_ns();
                continue;
            }
        } else {
            int g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
            if (g != seen_gen) {
                seen_gen = g;
                if (__atomic_load_n(&p->quit, __ATOMIC_RELAXED)) return 0;
                serve_post(p, id, g);
                idle_since = now_ns();
                continue;
            }
        }
        long idle = now_ns() - idle_since;
        if (idle > IDLE_NS) nap(idle);
        else for (int i = 0; i < 16; i++) cpu_relax();
    }
}

/* The largest shapes of the layers (scratch sizes), and the experts a layer may have. */
static void pool_sizes(pool *p) {
    p->max_k = 32; p->max_n = 2; p->max_f = 32; p->max_e = 1;
    for (int i = 0; i < p->n_layers; i++) {
        const layer_desc *L = &p->layers[i];
        if (!L->gate_up.N) continue;
        int ks[2] = {L->gate_up.K, L->down.K};
        for (int j = 0; j < 2; j++) p->max_k = ks[j] > p->max_k ? ks[j] : p->max_k;
        p->max_n = L->gate_up.N > p->max_n ? L->gate_up.N : p->max_n;
        p->max_f = L->down.K > p->max_f ? L->down.K : p->max_f;
        p->max_e = L->gate_up.E > p->max_e ? L->gate_up.E : p->max_e;
    }
}

static int alloc_buffers(pool *p) {
    long tasks = (long)p->max_w * p->k;
    p->gu = malloc(4 * tasks * p->max_n);
    p->aq = malloc(tasks * p->max_f); p->adx = malloc(4 * tasks * (p->max_f / 32));
    p->axs = malloc(4 * tasks * (p->max_f / 16));
    p->gof = malloc(sizeof *p->gof * (size_t)p->max_e);
    int ok = p->gu && p->aq && p->adx && p->axs && p->gof;
    ok = ok && alloc_xset(&p->rowx, p->max_w, p->D) == 0 && alloc_xset(&p->taskx, (int)tasks, p->max_f) == 0;
    for (int i = 0; ok && i < p->max_e; i++) p->gof[i] = -1;
    for (int i = 0; i < p->n; i++) ok = ok && alloc_scratch(&p->ts[i], p->max_k, (int)tasks) == 0;
    return ok ? 0 : -1;
}

static void free_pool(pool *p) {
    for (int i = 0; i < MAXT; i++) free_scratch(&p->ts[i]);
    free_xset(&p->rowx); free_xset(&p->taskx);
    free(p->gu); free(p->aq); free(p->adx); free(p->axs); free(p->gof); free(p);
}

/* The clock's sums into out[N_ST] (posts, busy ns, gap ns, gaps, pairs, groups). */
void aq_pool_stats(pool *p, long *out) {
    for (int i = 0; i < N_ST; i++) out[i] = p ? __atomic_load_n(&p->st[i], __ATOMIC_RELAXED) : 0;
}

/* Start n threads pinned to cpus (-1: not pinned) serving the mailbox. NULL on failure. */
pool *aq_pool_start(int n, const int *cpus, int32_t *ctl, const int8_t *xq, const float *dx, const int32_t *xs,
                    const int32_t *ids, const int32_t *task, float *y, int max_w, int k, int D,
                    const layer_desc *layers, int n_layers) {
    if (n < 1 || n > MAXT || max_w * k > MAXTASK) return 0;
    for (int i = 0; i < n_layers; i++)
        if (layers[i].gate_up.N && (layers[i].act < 0 || layers[i].act >= N_ACTS || !ACTS[layers[i].act])) return 0;
    pool *p = calloc(1, sizeof *p);
    if (!p) return 0;
    p->n = n; p->ctl = ctl; p->xq = xq; p->dx = dx; p->xs = xs; p->ids = ids; p->task = task; p->y = y;
    p->max_w = max_w; p->k = k; p->D = D; p->layers = layers; p->n_layers = n_layers;
    pool_sizes(p);
    int ok = alloc_buffers(p) == 0;
    __atomic_store_n(&ctl[STOP], 0, __ATOMIC_RELEASE);
    int started = 0;
    for (int i = 0; ok && i < n; i++) {
        p->cpus[i] = cpus ? cpus[i] : -1;
        p->args[i] = (targ){p, i};
        ok = pthread_create(&p->th[i], 0, worker, &p->args[i]) == 0;
        started += ok;
    }
    if (!ok) {
        __atomic_store_n(&ctl[STOP], 1, __ATOMIC_RELEASE);
        __atomic_store_n(&p->quit, 1, __ATOMIC_RELEASE);
        __atomic_store_n(&p->gen, 1, __ATOMIC_RELEASE);
        for (int i = 0; i < started; i++) pthread_join(p->th[i], 0);
        free_pool(p);
        return 0;
    }
    return p;
}

/* STOP = 1, join every thread, free; STOP back to 0 so the mailbox can serve a new pool. */
void aq_pool_stop(pool *p) {
    if (!p) return;
    __atomic_store_n(&p->ctl[STOP], 1, __ATOMIC_RELEASE);
    for (int i = 0; i < p->n; i++) pthread_join(p->th[i], 0);
    __atomic_store_n(&p->ctl[STOP], 0, __ATOMIC_RELEASE);
    free_pool(p);
}

/* One row through expert e of a layer, on the calling thread, pair by pair (aq_matvec):
 * y [down.N]. The reference the grouped pool is held to. */
int aq_expert_ffn(const layer_desc *L, int e, const int8_t *xq, const float *dx, const int32_t *xs, float *y) {
    int D = L->gate_up.K, F = L->gate_up.N / 2, K = D > F ? D : F;
    xset x = {0};
    grpbuf b = {0};
    float *gu = malloc(4 * (size_t)(2 * F)), *a = malloc(4 * (size_t)F);
    int8_t *aq = malloc(F);
    float *adx = malloc(4 * (size_t)(F / 32 + 1));
    int32_t *axs = malloc(4 * (size_t)(F / 16 + 1));
    int rc = alloc_xset(&x, 1, K) || alloc_grpbuf(&b, K, 1) || !gu || !a || !aq || !adx || !axs ? -2 : 0;
    unsigned csr = 0;
#if defined(__x86_64__)
    csr = _mm_getcsr();
    fp_defaults();
#endif
    if (!rc) {
        rc = aq_prep(L->gate_up.qtype, xq, dx, xs, D, x.x) || aq_matvec(&L->gate_up, e, x.x, 0, 2 * F, gu, &b.rb);
        if (!rc) rc = aq_act(L->act, gu, gu + F, F, a);
        if (!rc) {
            aq_quantize(a, F, aq, adx, axs);
            rc = aq_prep(L->down.qtype, aq, adx, axs, F, x.x) || aq_matvec(&L->down, e, x.x, 0, L->down.N, y, &b.rb);
        }
    }
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
    free_xset(&x); free_grpbuf(&b); free(gu); free(a); free(aq); free(adx); free(axs);
    return rc;
}

#include "probe.c"

/* The cpu the calling thread runs on now (-1 where unknown). */
int aq_current_cpu(void) { return sched_getcpu(); }
