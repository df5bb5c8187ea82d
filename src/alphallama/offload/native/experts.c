/* The expert contract (kernels/expert_q8.py) in C: one routed expert's arithmetic, bit
 * for bit the plain-torch reference's. Integer slot dots are exact, so any order or SIMD
 * width gives the same sums; the float part is the contract's fixed sequence (built with
 * -ffp-contract=off -fno-fast-math: no fma, no reassociation): each slot's term, added
 * into the row's lane s % nl, then the lanes' pairwise tree (lane_add, lane_tree).
 *
 * Weights are read in place from the GPU "planes" layout (kernels/formats.py). A slot's
 * qs bytes are taken in storage order: position p < nbytes is the low nibble of byte p,
 * p >= nbytes the high nibble of byte p - nbytes (Q8_0: byte p). Byte j = 4v + b of a
 * slot is byte b of its word v and holds fields 2b, 2b+1 (Q8_0: field b), whose k in the
 * slot is slot_positions(V, P). Instead of moving codes into k order, the activations
 * are permuted once per matvec into storage order (xprep), so decoding is a mask and a
 * shift on contiguous bytes: loops the compiler vectorizes. MXFP4 (gpt-oss's experts) is
 * Q4_0's layout whose codes index the doubled E2M1 levels (E2M1 below: a table lookup,
 * then signed codes as Q8_0's), A = 2^(e - 128) built from e's bits.
 *
 * A weight may carry a bias per expert and row (qmat.bias [E, N] float32, gpt-oss's):
 * added to the row's sum, one float add; a layer's activation is an id (acts.c's ACTS, set
 * in pool.c's layer_desc). */
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };
#define QBLOCK 32
#define CHUNK 8       /* slots per SIMD step (simd.c, group.c) */
#define MAXL 32
#define MAXLANES 64   /* the most lanes a row has (contract_lanes) */
#define RNE_MAGIC 12582912.0f

/* One [E, N, K] expert tensor: plane bases and byte strides per expert and per row. */
typedef struct {
    const uint8_t *qs, *qh, *sc, *sd;
    int64_t qs_e, qs_r, qh_e, qh_r, sc_e, sc_r, sd_e, sd_r;
    int32_t qtype, N, K, E;   /* E: experts (1 for a 2-D weight) */
    /* raw != NULL: no planes; rows are the GGUF file's blocks (gguf_rows.c), row r of expert e
     * at raw + e raw_e + r raw_r, rows >= split at raw2 (gate|up from two file tensors) */
    const uint8_t *raw, *raw2;
    int64_t raw_e, raw_r;
    int32_t split;
    const float *bias;        /* [E, N] added to each row's sum, or NULL */
} qmat;

/* MXFP4's codes: the E2M1 (FP4) values doubled (gguf/quants_misc.e2m1_doubled) */
static const int8_t E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

typedef struct {
    int L;        /* values per slot */
    int nbytes;   /* qs bytes per slot */
    int hbits;    /* top bits per value in the qh word (0: no qh plane) */
    int bias;     /* code = q - bias */
    int kmin;     /* Q4_K / Q5_K / Q4_1 / Q5_1: value = A q - B */
} fmt_t;

static int fmt_of(int qtype, fmt_t *f) {
    switch (qtype) {
    case Q4_K: *f = (fmt_t){32, 16, 0, 0, 1}; return 0;
    case Q5_K: *f = (fmt_t){32, 16, 1, 0, 1}; return 0;
    case Q6_K: *f = (fmt_t){16, 8, 2, 32, 0}; return 0;
    case Q4_0: *f = (fmt_t){32, 16, 0, 8, 0}; return 0;
    case Q5_0: *f = (fmt_t){32, 16, 1, 16, 0}; return 0;
    case Q8_0: *f = (fmt_t){16, 16, 0, 0, 0}; return 0;
    case Q4_1: *f = (fmt_t){32, 16, 0, 0, 1}; return 0;
    case Q5_1: *f = (fmt_t){32, 16, 1, 0, 1}; return 0;
    case MXFP4: *f = (fmt_t){32, 16, 0, 0, 0}; return 0;   /* codes E2M1[q] (isums_mx) */
    default: return -1;
    }
}

/* k inside the slot of storage position p, and the qh bit of its top bits. */
static void slot_layout(const fmt_t *f, int p, int *k, int *hbit) {
    int V = f->nbytes / 4;
    if (f->L == 16 && f->nbytes == 16) {            /* Q8_0: byte p is field b of word v */
        int v = p / 4, b = p % 4;
        *k = (b / 2) * 8 + 2 * v + (b % 2);
        *hbit = 0;
        return;
    }
    int nib = p >= f->nbytes, j = p - nib * f->nbytes, v = j / 4, b = j % 4, i = 2 * b + nib;
    *k = (i / 2) * (2 * V) + 2 * v + (i % 2);
    *hbit = f->hbits * (i * V + v);
}

/* fp16 bits -> float, exact, integer-only (no subnormal float arithmetic). */
static inline float h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else {
        int sh = __builtin_clz(m) - 21;             /* leading 1 to bit 10 */
        m <<= sh;
        u = s | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ff) << 13);
    }
    float out;
    memcpy(&out, &u, 4);
    return out;
}

/* MXFP4's A: an E8M0 byte e -> 2^(e - 128) from its bits, as ggml (e < 2: the subnormals). */
static inline float e8m0_half(uint8_t e) {
    uint32_t u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float out;
    memcpy(&out, &u, 4);
    return out;
}

static inline uint16_t ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

#include "acts.c"

/* The contract's sum order, the GPU kernel's: a row of ns slot terms is summed in nl
 * lanes (a power of 2, at most MAXLANES). Slot s's term is added to lane s % nl, slots in
 * order, lanes from +0; then the lanes' tree over adjacent pairs, ((l0 + l1) + (l2 + l3)) + ... */
static inline int contract_lanes(int qtype, int ns) {
    int cap = qtype == Q6_K && ns >= 512 ? 64 : 32, nl = 1;
    while (nl < ns && nl < cap) nl *= 2;
    return nl;
}

static inline void lane_add(float *lanes, int nl, int s, float term) {
    lanes[s & (nl - 1)] = lanes[s & (nl - 1)] + term;
}

static inline float lane_tree(float *lanes, int nl) {
    for (int n = nl / 2; n >= 1; n /= 2)
        for (int i = 0; i < n; i++) lanes[i] = lanes[2 * i] + lanes[2 * i + 1];
    return lanes[0];
}

/* One activation row made ready for a weight format: permuted into storage order. */
typedef struct {
    int8_t *xp;      /* [K] */
    int32_t *ssum;   /* [ns] sum of xq over the slot (for the code bias) */
    float *xsum;     /* [ns] sum of xs groups of the slot (the contract's xsum, K-min) */
    float *dxs;      /* [ns] dx of the slot's block */
    int8_t *xi;      /* [K] xp with each chunk of 8 slots interleaved (group.c), or NULL */
} xprep;

int aq_prep(int qtype, const int8_t *xq, const float *dx, const int32_t *xs, int K, xprep *o) {
    fmt_t f;
    if (fmt_of(qtype, &f) || K % f.L || K % QBLOCK) return -1;
    int perm[MAXL], hb;
    for (int p = 0; p < f.L; p++) slot_layout(&f, p, &perm[p], &hb);
    for (int s = 0; s < K / f.L; s++) {
        int32_t sum = 0;
        for (int p = 0; p < f.L; p++) {
            o->xp[s * f.L + p] = xq[s * f.L + perm[p]];
            sum += xq[s * f.L + p];
        }
        o->ssum[s] = sum;
        int g0 = s * f.L / 16, ng = f.L / 16;
        int32_t xsum = 0;
        for (int g = 0; g < ng; g++) xsum += xs[g0 + g];
        o->xsum[s] = (float)xsum;
        o->dxs[s] = dx[s * f.L / QBLOCK];
    }
    return 0;
}

/* -- integer slot dots, one function per format (constants let loops vectorize) ------ */
/* Nibble formats: sum_p u_p xp_p with u the unsigned code (low nibble | top bits << 4). */
static inline int32_t dot_nib(const uint8_t *B, uint32_t h, const int8_t *x, const uint8_t *sh,
                              const int NB, const int HB) {
    int32_t acc = 0;
    for (int p = 0; p < NB; p++) {
        int32_t lo = B[p] & 15, hi = B[p] >> 4;
        if (HB) {
            lo |= ((h >> sh[p]) & ((1u << HB) - 1)) << 4;
            hi |= ((h >> sh[NB + p]) & ((1u << HB) - 1)) << 4;
        }
        acc += lo * x[p] + hi * x[NB + p];
    }
    return acc;
}

static inline int32_t dot_mx(const uint8_t *B, const int8_t *x) {   /* 16 bytes of nibbles, 32 values */
    int32_t acc = 0;
    for (int p = 0; p < 16; p++) acc += E2M1[B[p] & 15] * x[p] + E2M1[B[p] >> 4] * x[16 + p];
    return acc;
}

static inline int32_t dot_q8(const uint8_t *B, const int8_t *x) {
    int32_t acc = 0;
    for (int p = 0; p < 16; p++) acc += (int32_t)(int8_t)B[p] * x[p];
    return acc;
}

#define ROW_ISUMS(NAME, L, NB, HB, BIAS)                                                     \
    static void NAME(const uint8_t *qs, const uint8_t *qh, const int8_t *xp, const int32_t *ssum, \
                     const uint8_t *sh, int ns, int32_t *isum) {                                \
        for (int s = 0; s < ns; s++) {                                                        \
            uint32_t h = HB ? ld32(qh + 4 * s) : 0;                                           \
            isum[s] = dot_nib(qs + s * NB, h, xp + s * L, sh, NB, HB) - BIAS * ssum[s];       \
        }                                                                                     \
    }
ROW_ISUMS(isums_q4k, 32, 16, 0, 0)
ROW_ISUMS(isums_q5k, 32, 16, 1, 0)
ROW_ISUMS(isums_q6k, 16, 8, 2, 32)
ROW_ISUMS(isums_q40, 32, 16, 0, 8)
ROW_ISUMS(isums_q50, 32, 16, 1, 16)

static void isums_q80(const uint8_t *qs, const uint8_t *qh, const int8_t *xp, const int32_t *ssum,
                      const uint8_t *sh, int ns, int32_t *isum) {
    (void)qh; (void)ssum; (void)sh;
    for (int s = 0; s < ns; s++) isum[s] = dot_q8(qs + 16 * s, xp + 16 * s);
}

static void isums_mx(const uint8_t *qs, const uint8_t *qh, const int8_t *xp, const int32_t *ssum,
                     const uint8_t *sh, int ns, int32_t *isum) {
    (void)qh; (void)ssum; (void)sh;
    for (int s = 0; s < ns; s++) isum[s] = dot_mx(qs + 16 * s, xp + 32 * s);
}

/* The contract's slot scales, read once per weight row: A, and B for the formats with a
 * min (has_min: value = A q - B). */
static inline int has_min(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q4_1 || qtype == Q5_1; }

static inline void slot_scales(int qtype, const uint8_t *sc, const uint8_t *sd, int s, float *A, float *B) {
    *B = 0.0f;
    switch (qtype) {
    case Q4_K: case Q5_K: {
        float d = h2f(ld16(sd + 4 * (s / 8))), dmin = h2f(ld16(sd + 4 * (s / 8) + 2));
        uint16_t v = ld16(sc + 2 * s);
        *A = d * (float)(v & 0xFF);
        *B = dmin * (float)((v >> 8) & 0xFF);
        return;
    }
    case Q4_1: case Q5_1: *A = h2f(ld16(sc + 4 * s)); *B = -h2f(ld16(sc + 4 * s + 2)); return;   /* d, m */
    case Q6_K: *A = h2f(ld16(sd + 2 * (s / 16))) * (float)(int8_t)sc[s]; return;
    case Q8_0: *A = h2f(ld16(sc + 2 * (s / 2))); return;   /* two slots share d */
    case MXFP4: *A = e8m0_half(sc[s]); return;              /* sc: e, a byte a slot */
    default: *A = h2f(ld16(sc + 2 * s)); return;
    }
}

/* One slot's term of the contract: (A isum [- B xsum]) dx. Two forms, not one with B = 0:
 * A isum - 0 turns a -0 into +0. */
static inline float slot_term(int kmin, float A, float B, int32_t isum, float xsum, float dx) {
    return kmin ? ((A * (float)isum) - (B * xsum)) * dx : (A * (float)isum) * dx;
}

#include "simd.c"
#include "gguf_rows.c"

/* A row's sum from its lanes: lane_tree, 8 lanes a vector where the build has them. */
static inline float row_sum(float *lanes, int nl) {
#ifdef HAVE_SIMD_ISUMS
    if (nl >= CHUNK) return lane_tree_v(lanes, nl);
#endif
    return lane_tree(lanes, nl);
}

typedef void (*isums_fn)(const uint8_t *, const uint8_t *, const int8_t *, const int32_t *,
                         const uint8_t *, int, int32_t *);

#ifdef HAVE_SIMD_ISUMS
#define ISUMS(NAME) NAME##_v
#else
#define ISUMS(NAME) NAME
#endif
/* A format's slot dots (Q4_1 / Q5_1: unsigned codes without bias, as Q4_K / Q5_K's). */
static isums_fn isums_of(int qtype) {
    switch (qtype) {
    case Q4_K: case Q4_1: return ISUMS(isums_q4k);
    case Q5_K: case Q5_1: return ISUMS(isums_q5k);
    case Q6_K: return ISUMS(isums_q6k);
    case Q4_0: return ISUMS(isums_q40);
    case Q5_0: return ISUMS(isums_q50);
    case MXFP4: return ISUMS(isums_mx);
    default: return ISUMS(isums_q80);
    }
}
#undef ISUMS

/* Scratch for one row: isum [ns], a mapped row's planes (ROW_PLANES(K) bytes; unused for a
 * weight with planes). */
typedef struct { int32_t *isum; uint8_t *pl; } rowbuf;
#define ROW_PLANES(K) (2 * (size_t)(K) + 64)

/* What every row of a weight shares: its format, slots and lanes a row, qh shifts, slot dots, plane sizes. */
typedef struct { fmt_t f; int ns, nl; uint8_t sh[MAXL]; isums_fn fn; size_t nqs, nqh, nsc;
                 relay rl; /* a mapped weight's: its GGUF blocks' re-lay (gguf_rows.c) */ } rowfmt;

static int row_fmt(const qmat *w, rowfmt *rf) {
    if (fmt_of(w->qtype, &rf->f)) return -1;
    rf->ns = w->K / rf->f.L;
    rf->nl = contract_lanes(w->qtype, rf->ns);
    for (int p = 0; p < rf->f.L; p++) { int k, hb; slot_layout(&rf->f, p, &k, &hb); rf->sh[p] = (uint8_t)hb; }
    rf->fn = isums_of(w->qtype);
    plane_bytes(&rf->f, w->K, &rf->nqs, &rf->nqh, &rf->nsc);
    return w->raw ? relay_init(w->qtype, &rf->rl) : 0;
}

/* One row's planes: where they sit (host tier), or re-laid into pl from the file's blocks (mapped tier). */
typedef struct { const uint8_t *qs, *qh, *sc, *sd; } rowplanes;

static inline __attribute__((always_inline)) int row_planes(const qmat *w, const rowfmt *rf, int e, int r,
                                                           uint8_t *pl, rowplanes *o) {
    if (w->raw) {
        size_t a = rf->nqs, b = a + rf->nqh, c = b + rf->nsc;
        if (!pl || relay_row(&rf->rl, w->qtype, raw_row(w, e, r), w->K, pl, pl + a, pl + b, pl + c)) return -1;
        *o = (rowplanes){pl, pl + a, pl + b, pl + c};
        return 0;
    }
    o->qs = w->qs + e * w->qs_e + r * w->qs_r;
    o->qh = w->qh ? w->qh + e * w->qh_e + r * w->qh_r : 0;
    o->sc = w->sc + e * w->sc_e + r * w->sc_r;
    o->sd = w->sd ? w->sd + e * w->sd_e + r * w->sd_r : 0;
    return 0;
}

/* A row's sum plus its bias (the expert's, row r), where the weight has one. */
static inline float with_bias(const qmat *w, int e, int r, float acc) {
    return w->bias ? acc + w->bias[(int64_t)e * w->N + r] : acc;
}

/* One row times one prepared activation, decoding as it goes (without the bias). It and
 * row_planes are expanded into each row loop (as the one loop before them was): a call a row
 * costs a short row (down's K = 768) a few %. */
static inline __attribute__((always_inline)) float row_dot(const qmat *w, const rowfmt *rf, const rowplanes *rp,
                                                           const xprep *x, rowbuf *rb) {
    int ns = rf->ns, nl = rf->nl, s = 0, kmin = has_min(w->qtype);
    float lanes[MAXLANES];
    rf->fn(rp->qs, rp->qh, x->xp, x->ssum, rf->sh, ns, rb->isum);
#ifdef HAVE_SIMD_ISUMS
    s = ns / CHUNK * CHUNK;
    chunks_v(w->qtype, rp->sc, rp->sd, rb->isum, x, s / CHUNK, nl, lanes);   /* sets the nl lanes */
#else
    for (int j = 0; j < nl; j++) lanes[j] = 0.0f;
#endif
    for (; s < ns; s++) {
        float A, B;
        slot_scales(w->qtype, rp->sc, rp->sd, s, &A, &B);
        lane_add(lanes, nl, s, slot_term(kmin, A, B, rb->isum[s], x->xsum[s], x->dxs[s]));
    }
    return row_sum(lanes, nl);
}

/* Rows [r0, r1) of expert e of w times the prepared activation: out[r - r0]. */
int aq_matvec(const qmat *w, int e, const xprep *x, int r0, int r1, float *out, rowbuf *rb) {
    rowfmt rf;
    if (row_fmt(w, &rf)) return -1;
    for (int r = r0; r < r1; r++) {
        rowplanes rp;
        if (row_planes(w, &rf, e, r, rb->pl, &rp)) return -1;
        out[r - r0] = with_bias(w, e, r, row_dot(w, &rf, &rp, x, rb));
    }
    return 0;
}

#include "group.c"

int aq_slot_len(int qtype) {
    fmt_t f;
    return fmt_of(qtype, &f) ? -1 : f.L;
}
