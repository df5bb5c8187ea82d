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

typedef struct {
    int8_t *xp; int32_t *ssum; float *xsum, *dxs;   /* xprep storage, sized for the largest K */
    int32_t *isum; float *t; uint8_t *pl;          /* rowbuf storage */
    float *act;                                    /* [max_k] silu_mul output */
    int prepped;                                   /* task index whose activation xp holds, -1 none */
} tscratch;

typedef struct pool pool;
typedef struct { pool *p; int id; } targ;

struct pool {
    int n;
    pthread_t th[MAXT];
    targ args[MAXT];
    int cpus[MAXT];
    int32_t *ctl; const int8_t *xq; const float *dx; const int32_t *xs;
    const int32_t *ids, *task; float *y;
    int max_w, k, D;
    const layer_desc *layers; int n_layers;
    int max_k, max_n, max_f;
    /* the post in progress */
    int ntask, layer, tm[4096], tr[4096], te[4096];
    float *gu;      /* [max_w * k, max_n] gate|up outputs */
    int8_t *aq; float *adx; int32_t *axs;   /* [max_w * k, max_f (/32, /16)] quantized acts */
    tscratch ts[MAXT];
    /* sync */
    int gen, quit;            /* gen: bumped by thread 0 per post (release) */
    int bar_count, bar_sense;
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

static void barrier(pool *p, int *local_sense) {
    *local_sense = !*local_sense;
    if (__atomic_add_fetch(&p->bar_count, 1, __ATOMIC_ACQ_REL) == p->n) {
        __atomic_store_n(&p->bar_count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&p->bar_sense, *local_sense, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&p->bar_sense, __ATOMIC_ACQUIRE) != *local_sense) cpu_relax();
    }
}

static int alloc_scratch(tscratch *s, int max_k) {
    int ns = max_k / 16 + CHUNK;
    s->xp = malloc(max_k); s->ssum = malloc(4 * ns); s->xsum = malloc(4 * ns); s->dxs = malloc(4 * ns);
    s->isum = malloc(4 * ns); s->t = malloc(4 * ns); s->act = malloc(4 * (size_t)max_k);
    s->pl = malloc(ROW_PLANES(max_k));
    s->prepped = -1;
    return s->xp && s->ssum && s->xsum && s->dxs && s->isum && s->t && s->act && s->pl ? 0 : -1;
}

static void free_scratch(tscratch *s) {
    free(s->xp); free(s->ssum); free(s->xsum); free(s->dxs); free(s->isum); free(s->t); free(s->act); free(s->pl);
}

/* Rows [a, b) of the concatenation of every task's `which` matrix (rows tasks * N). */
static void run_rows(pool *p, tscratch *s, int which, long a, long b) {
    const layer_desc *L = &p->layers[p->layer];
    const qmat *w = which ? &L->down : &L->gate_up;
    long N = w->N;
    xprep x = {s->xp, s->ssum, s->xsum, s->dxs};
    rowbuf rb = {s->isum, s->t, s->pl};
    s->prepped = -1;
    for (long r = a; r < b;) {
        int t = (int)(r / N);
        long r0 = r % N, r1 = N < r0 + (b - r) ? N : r0 + (b - r);
        if (s->prepped != t) {
            int m = p->tm[t], f = L->gate_up.N / 2;
            if (which == 0)
                aq_prep(w->qtype, p->xq + (long)m * p->D, p->dx + (long)m * (p->D / 32),
                        p->xs + (long)m * (p->D / 16), w->K, &x);
            else
                aq_prep(w->qtype, p->aq + (long)t * p->max_f, p->adx + (long)t * (p->max_f / 32),
                        p->axs + (long)t * (p->max_f / 16), f, &x);
            s->prepped = t;
        }
        float *out = which ? p->y + ((long)p->tm[t] * p->k + p->tr[t]) * p->D + r0
                           : p->gu + (long)t * p->max_n + r0;
        aq_matvec(w, p->te[t], &x, (int)r0, (int)r1, out, &rb);
        r += r1 - r0;
    }
}

static void serve_post(pool *p, int id, int *sense) {
    tscratch *s = &p->ts[id];
    const layer_desc *L = &p->layers[p->layer];
    int F = L->gate_up.N / 2;
    long total = (long)p->ntask * L->gate_up.N;
    run_rows(p, s, 0, total * id / p->n, total * (id + 1) / p->n);
    barrier(p, sense);
    for (int t = id; t < p->ntask; t += p->n) {
        float *g = p->gu + (long)t * p->max_n;
        aq_act(L->act, g, g + F, F, s->act);
        aq_quantize(s->act, F, p->aq + (long)t * p->max_f, p->adx + (long)t * (p->max_f / 32),
                    p->axs + (long)t * (p->max_f / 16));
    }
    barrier(p, sense);
    total = (long)p->ntask * L->down.N;
    run_rows(p, s, 1, total * id / p->n, total * (id + 1) / p->n);
    barrier(p, sense);
}

/* Thread 0: read a post's tasks. Returns 0 if the post has none it can serve. */
static int read_post(pool *p, int32_t req) {
    int layer = __atomic_load_n(&p->ctl[LAYER], __ATOMIC_RELAXED);
    int rows = __atomic_load_n(&p->ctl[ROWS], __ATOMIC_RELAXED);
    p->ntask = 0;
    if (layer < 0 || layer >= p->n_layers || p->layers[layer].gate_up.N == 0 || rows < 0 || rows > p->max_w)
        return 0;
    p->layer = layer;
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < p->k; r++) {
            int e = p->ids[m * p->k + r];
            if (p->task[m * p->k + r] == 1 && e >= 0 && e < p->layers[layer].gate_up.E && p->ntask < 4096) {
                p->tm[p->ntask] = m; p->tr[p->ntask] = r; p->te[p->ntask] = e; p->ntask++;
            }
        }
    (void)req;
    return p->ntask > 0;
}

static void *worker(void *arg) {
    targ *a = arg;
    pool *p = a->p;
    int id = a->id, sense = 0, seen_gen = 0;
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
                if (read_post(p, req)) {
                    __atomic_store_n(&p->gen, p->gen + 1, __ATOMIC_RELEASE);
                    serve_post(p, 0, &sense);
                }
                __atomic_store_n(&p->ctl[DONE], req, __ATOMIC_RELEASE);
                idle_since = now_ns();
                continue;
            }
        } else {
            int g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
            if (g != seen_gen) {
                seen_gen = g;
                if (__atomic_load_n(&p->quit, __ATOMIC_RELAXED)) return 0;
                serve_post(p, id, &sense);
                idle_since = now_ns();
                continue;
            }
        }
        long idle = now_ns() - idle_since;
        if (idle > IDLE_NS) nap(idle);
        else for (int i = 0; i < 16; i++) cpu_relax();
    }
}

/* Start n threads pinned to cpus (-1: not pinned) serving the mailbox. NULL on failure. */
pool *aq_pool_start(int n, const int *cpus, int32_t *ctl, const int8_t *xq, const float *dx, const int32_t *xs,
                    const int32_t *ids, const int32_t *task, float *y, int max_w, int k, int D,
                    const layer_desc *layers, int n_layers) {
    if (n < 1 || n > MAXT || max_w * k > 4096) return 0;
    for (int i = 0; i < n_layers; i++)
        if (layers[i].gate_up.N && (layers[i].act < 0 || layers[i].act >= N_ACTS || !ACTS[layers[i].act])) return 0;
    pool *p = calloc(1, sizeof *p);
    if (!p) return 0;
    p->n = n; p->ctl = ctl; p->xq = xq; p->dx = dx; p->xs = xs; p->ids = ids; p->task = task; p->y = y;
    p->max_w = max_w; p->k = k; p->D = D; p->layers = layers; p->n_layers = n_layers;
    p->max_k = 32; p->max_n = 2; p->max_f = 32;
    for (int i = 0; i < n_layers; i++) {
        const layer_desc *L = &layers[i];
        if (!L->gate_up.N) continue;
        int ks[2] = {L->gate_up.K, L->down.K};
        for (int j = 0; j < 2; j++) p->max_k = ks[j] > p->max_k ? ks[j] : p->max_k;
        p->max_n = L->gate_up.N > p->max_n ? L->gate_up.N : p->max_n;
        p->max_f = L->down.K > p->max_f ? L->down.K : p->max_f;
    }
    long tasks = (long)max_w * k;
    p->gu = malloc(4 * tasks * p->max_n);
    p->aq = malloc(tasks * p->max_f); p->adx = malloc(4 * tasks * (p->max_f / 32));
    p->axs = malloc(4 * tasks * (p->max_f / 16));
    int ok = p->gu && p->aq && p->adx && p->axs;
    for (int i = 0; i < n; i++) ok = ok && alloc_scratch(&p->ts[i], p->max_k) == 0;
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
        /* fall through to free */
        p->n = started;
        for (int i = 0; i < MAXT; i++) free_scratch(&p->ts[i]);
        free(p->gu); free(p->aq); free(p->adx); free(p->axs); free(p);
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
    for (int i = 0; i < p->n; i++) free_scratch(&p->ts[i]);
    free(p->gu); free(p->aq); free(p->adx); free(p->axs); free(p);
}

/* One row through expert e of a layer, on the calling thread: y [down.N]. */
int aq_expert_ffn(const layer_desc *L, int e, const int8_t *xq, const float *dx, const int32_t *xs, float *y) {
    int D = L->gate_up.K, F = L->gate_up.N / 2, K = D > F ? D : F;
    tscratch s;
    float *gu = malloc(4 * (size_t)(2 * F)), *a = malloc(4 * (size_t)F);
    int8_t *aq = malloc(F);
    float *adx = malloc(4 * (size_t)(F / 32 + 1));
    int32_t *axs = malloc(4 * (size_t)(F / 16 + 1));
    int rc = alloc_scratch(&s, K) || !gu || !a || !aq || !adx || !axs ? -2 : 0;
    unsigned csr = 0;
#if defined(__x86_64__)
    csr = _mm_getcsr();
    fp_defaults();
#endif
    if (!rc) {
        xprep x = {s.xp, s.ssum, s.xsum, s.dxs};
        rowbuf rb = {s.isum, s.t, s.pl};
        rc = aq_prep(L->gate_up.qtype, xq, dx, xs, D, &x) || aq_matvec(&L->gate_up, e, &x, 0, 2 * F, gu, &rb);
        if (!rc) rc = aq_act(L->act, gu, gu + F, F, a);
        if (!rc) {
            aq_quantize(a, F, aq, adx, axs);
            rc = aq_prep(L->down.qtype, aq, adx, axs, F, &x) || aq_matvec(&L->down, e, &x, 0, L->down.N, y, &rb);
        }
    }
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
    free_scratch(&s); free(gu); free(a); free(aq); free(adx); free(axs);
    return rc;
}

#include "probe.c"

/* The cpu the calling thread runs on now (-1 where unknown). */
int aq_current_cpu(void) { return sched_getcpu(); }
