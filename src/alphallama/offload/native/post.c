/* One post (a MoE layer of a round) served by every thread of the pool. The round's CPU
 * pairs (row, rank) are grouped by expert, and each group's weight rows are read once for
 * all its pairs (group.c): an expert that W rows of a verify round (or W streams) use is
 * streamed from RAM once, not W times (RAM bandwidth is the tier's limit with every worker
 * on), and decoded once, each extra pair costing only its dot. Included by pool.c.
 *
 * Four phases, a barrier after each: a thread's work in one phase reads what any thread
 * made in the phase before.
 *   1. each posted row's activation prepared for gate|up's format (all its pairs read it);
 *   2. gate|up: every group's rows against its pairs' rows, split across threads by cost;
 *   3. per pair: the activation of its gate|up outputs, quantized and prepared for down's
 *      format (down's input is the pair's own);
 *   4. down: every group's rows against its pairs' activations, all made in 3.
 * A pair's bits do not depend on its group or its thread: each (pair, row) is aq_matvec's. */

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

/* This thread's share (by cost) of every group's rows of the `which` weight. */
static void run_groups(pool *p, tscratch *s, int which, int id) {
    const layer_desc *L = &p->layers[p->layer];
    long N = which ? L->down.N : L->gate_up.N, total = N * p->gcost[p->ngroup], r, r1;
    int g, g1;
    cost_pos(p, N, total * id / p->n, &g, &r);
    cost_pos(p, N, total * (id + 1) / p->n, &g1, &r1);
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

static void serve_post(pool *p, int id, int *sense) {
    tscratch *s = &p->ts[id];
    const layer_desc *L = &p->layers[p->layer];
    for (int i = id; i < p->nrow; i += p->n) {
        int m = p->rows[i];
        aq_prep_group(L->gate_up.qtype, p->xq + (long)m * p->D, p->dx + (long)m * (p->D / 32),
                p->xs + (long)m * (p->D / 16), L->gate_up.K, &p->rowx.x[m]);
    }
    barrier(p, sense);
    run_groups(p, s, 0, id);
    barrier(p, sense);
    for (int t = id; t < p->ntask; t += p->n) pair_act(p, s, t);
    barrier(p, sense);
    run_groups(p, s, 1, id);
    barrier(p, sense);
}
