/* One post (a MoE layer of a round) served by every thread of the pool. The round's CPU
 * pairs (row, rank) are grouped by expert, and each group's weight rows are read once for
 * all its pairs (group.c): an expert that W rows of a verify round (or W streams) use is
 * streamed from RAM once, not W times (RAM bandwidth is the tier's limit with every worker
 * on), and decoded once, each extra pair costing only its dot. Included by pool.c.
 *
 * Four phases; a phase's work reads what any thread made in the phase before.
 *   1. each posted row's activation prepared for gate|up's format (all its pairs read it);
 *   2. gate|up: every group's rows against its pairs' rows, in CHUNKS_PER_THREAD x threads
 *      pieces of equal cost;
 *   3. per pair: the activation of its gate|up outputs, quantized and prepared for down's
 *      format (down's input is the pair's own);
 *   4. down: every group's rows against its pairs' activations, all made in 3.
 * A phase's units (rows, pieces, pairs) are claimed one at a time, and a thread moves on when
 * the phase's units are all done, not when every thread has arrived: a thread the OS has
 * descheduled (a desktop's other work, a VM's neighbours) delays a post by the unit it
 * holds, not by the whole of its share as a fixed split with barriers did. The thread that
 * finishes the post's last unit writes DONE. A claim is tagged with the post's generation,
 * so a thread that wakes after its post ended claims nothing of the next one.
 * A pair's bits do not depend on its group or its thread: each (pair, row) is aq_matvec's. */

#define CHUNKS_PER_THREAD 4

/* A weight row of a group of G pairs costs ROW_COST + G pair dots: reading and decoding the
 * row, then one dot per pair (the split's unit; a group of one is a plain matvec row, about
 * 3 of them). Measured on one Zen 4 core, Q4_K rows of 2048: a row 0.09 us, a pair's dot 0.03. */
#define ROW_COST 2

/* Thread 0: the post's pairs, grouped by expert in order of first use (a group's pairs in
 * row, rank order), and the cost line the phases split. */
static void group_tasks(pool *p) {
    int n = 0, count[MAXTASK];
    for (int t = 0; t < p->ntask; t++) {
        int e = p->te[t];
        if (p->gof[e] < 0) { p->gof[e] = n; p->gexp[n] = e; count[n++] = 0; }
        count[p->gof[e]]++;
    }
    p->ngroup = n;
    p->gstart[0] = 0;
    p->gcost[0] = 0;
    for (int g = 0; g < n; g++) {
        p->gstart[g + 1] = p->gstart[g] + count[g];
        p->gcost[g + 1] = p->gcost[g] + ROW_COST + count[g];
        count[g] = p->gstart[g];                      /* now: where the group's next pair goes */
    }
    for (int t = 0; t < p->ntask; t++) p->gtask[count[p->gof[p->te[t]]]++] = t;
    for (int g = 0; g < n; g++) p->gof[p->gexp[g]] = -1;
}

/* Thread 0: read a post's tasks. Returns 0 if the post has none it can serve. */
static int read_post(pool *p) {
    int layer = __atomic_load_n(&p->ctl[LAYER], __ATOMIC_RELAXED);
    int rows = __atomic_load_n(&p->ctl[ROWS], __ATOMIC_RELAXED);
    p->ntask = p->nrow = 0;
    if (layer < 0 || layer >= p->n_layers || p->layers[layer].gate_up.N == 0 || rows < 0 || rows > p->max_w)
        return 0;
    p->layer = layer;
    for (int m = 0; m < rows; m++) {
        int had = p->ntask;
        for (int r = 0; r < p->k; r++) {
            int e = p->ids[m * p->k + r];
            if (p->task[m * p->k + r] == 1 && e >= 0 && e < p->layers[layer].gate_up.E && p->ntask < MAXTASK) {
                p->tm[p->ntask] = m; p->tr[p->ntask] = r; p->te[p->ntask] = e; p->ntask++;
            }
        }
        if (p->ntask > had) p->rows[p->nrow++] = m;
    }
    group_tasks(p);
    return p->ntask > 0;
}

/* Where cost c of a phase whose weight has N rows falls: group *g, row *r (the first row
 * starting at or after c; *g == ngroup at the end). Monotonic in c, so the threads'
 * ranges [pos(c_i), pos(c_i+1)) cover every row once. */
static void cost_pos(const pool *p, long N, long c, int *g, long *r) {
    int i = 0;
    while (i < p->ngroup && N * p->gcost[i + 1] <= c) i++;
    if (i == p->ngroup) { *g = i; *r = 0; return; }
    long w = p->gcost[i + 1] - p->gcost[i], row = (c - N * p->gcost[i] + w - 1) / w;
    *g = row < N ? i : i + 1;
    *r = row < N ? row : 0;
}

/* Rows [r0, r1) of group g's `which` weight (0 gate|up, 1 down) for all its pairs. */
static void run_group(pool *p, tscratch *s, int which, int g, long r0, long r1) {
    const layer_desc *L = &p->layers[p->layer];
    int G = p->gstart[g + 1] - p->gstart[g];
    for (int j = 0; j < G; j++) {
        int t = p->gtask[p->gstart[g] + j];
        s->xv[j] = which ? &p->taskx.x[t] : &p->rowx.x[p->tm[t]];
        s->ov[j] = which ? p->y + ((long)p->tm[t] * p->k + p->tr[t]) * p->D + r0 : p->gu + (long)t * p->max_n + r0;
    }
    aq_matvec_group(which ? &L->down : &L->gate_up, p->gexp[g], s->xv, G, (int)r0, (int)r1, s->ov, &s->gb);
}

/* Piece u of `parts` (by cost) of every group's rows of the `which` weight. */
static void run_piece(pool *p, tscratch *s, int which, int u, int parts) {
    const layer_desc *L = &p->layers[p->layer];
    long N = which ? L->down.N : L->gate_up.N, total = N * p->gcost[p->ngroup], r, r1;
    int g, g1;
    cost_pos(p, N, total * u / parts, &g, &r);
    cost_pos(p, N, total * (u + 1) / parts, &g1, &r1);
    for (; g < g1 || (g == g1 && r < r1); g++, r = 0) run_group(p, s, which, g, r, g < g1 ? N : r1);
}

/* Phase 3 for pair t: act(gate, up), quantized, prepared for down. */
static void pair_act(pool *p, tscratch *s, int t) {
    const layer_desc *L = &p->layers[p->layer];
    int F = L->gate_up.N / 2;
    float *g = p->gu + (long)t * p->max_n;
    int8_t *aq = p->aq + (long)t * p->max_f;
    float *adx = p->adx + (long)t * (p->max_f / 32);
    int32_t *axs = p->axs + (long)t * (p->max_f / 16);
    aq_act(L->act, g, g + F, F, s->act);
    aq_quantize(s->act, F, aq, adx, axs);
    aq_prep_group(L->down.qtype, aq, adx, axs, F, &p->taskx.x[t]);
}

/* Thread 0, before publishing generation g: the post's four phases, none claimed or done. */
static void open_post(pool *p, int g, int32_t req) {
    int pieces = CHUNKS_PER_THREAD * p->n;
    int units[4] = {p->nrow, pieces, p->ntask, pieces};
    p->req = req;
    for (int k = 0; k < 4; k++) {
        __atomic_store_n(&p->claim[k], (uint64_t)(uint32_t)g << 32 | (uint64_t)units[k] << 16, __ATOMIC_RELAXED);
        __atomic_store_n(&p->done[k], 0, __ATOMIC_RELAXED);
    }
}

/* A unit of phase k of post g (its index, and the phase's units in *units), or -1: none left
 * or the post is over. */
static int take(pool *p, int k, int g, int *units) {
    uint64_t v = __atomic_load_n(&p->claim[k], __ATOMIC_ACQUIRE);
    for (;;) {
        int next = (int)(v & 0xffff), n = (int)(v >> 16 & 0xffff);
        if ((int)(v >> 32) != g || next >= n) return -1;
        if (__atomic_compare_exchange_n(&p->claim[k], &v, v + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *units = n;
            return next;
        }
    }
}

/* A unit of phase k done; the post's last one publishes DONE (every unit's outputs with it). */
static void finish(pool *p, int k, int units) {
    if (__atomic_add_fetch(&p->done[k], 1, __ATOMIC_ACQ_REL) == units && k == 3) {
        long t = now_ns();                     /* the clock (pool.c) before DONE: the next REQ sees it */
        __atomic_add_fetch(&p->st[ST_BUSY_NS], t - p->t_open, __ATOMIC_RELAXED);
        __atomic_add_fetch(&p->st[ST_POSTS], 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&p->st[ST_PAIRS], p->ntask, __ATOMIC_RELAXED);
        __atomic_add_fetch(&p->st[ST_GROUPS], p->ngroup, __ATOMIC_RELAXED);
        __atomic_store_n(&p->t_done, t, __ATOMIC_RELEASE);
        __atomic_store_n(&p->ctl[DONE], p->req, __ATOMIC_RELEASE);
    }
}

/* Wait until phase k of post g is done: 1, or 0 if the post is over (a newer one is out). */
static int phase_done(pool *p, int k, int g) {
    for (;;) {
        uint64_t v = __atomic_load_n(&p->claim[k], __ATOMIC_ACQUIRE);
        if ((int)(v >> 32) != g) return 0;
        if (__atomic_load_n(&p->done[k], __ATOMIC_ACQUIRE) >= (int)(v >> 16 & 0xffff)) return 1;
        if (__atomic_load_n(&p->gen, __ATOMIC_ACQUIRE) != g) return 0;
        cpu_relax();
    }
}

static void serve_post(pool *p, int id, int g) {
    tscratch *s = &p->ts[id];
    int u, n;
    while ((u = take(p, 0, g, &n)) >= 0) {
        const layer_desc *L = &p->layers[p->layer];
        int m = p->rows[u];
        aq_prep_group(L->gate_up.qtype, p->xq + (long)m * p->D, p->dx + (long)m * (p->D / 32),
                p->xs + (long)m * (p->D / 16), L->gate_up.K, &p->rowx.x[m]);
        finish(p, 0, n);
    }
    if (!phase_done(p, 0, g)) return;
    while ((u = take(p, 1, g, &n)) >= 0) { run_piece(p, s, 0, u, n); finish(p, 1, n); }
    if (!phase_done(p, 1, g)) return;
    while ((u = take(p, 2, g, &n)) >= 0) { pair_act(p, s, u); finish(p, 2, n); }
    if (!phase_done(p, 2, g)) return;
    while ((u = take(p, 3, g, &n)) >= 0) { run_piece(p, s, 1, u, n); finish(p, 3, n); }
}
