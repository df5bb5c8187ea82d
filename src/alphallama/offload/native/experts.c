/* The expert contract (kernels/expert_q8.py) in C: one routed expert's arithmetic, bit
 * for bit the plain-torch reference's. Integer slot dots are exact, so any order or SIMD
 * width gives the same sums; the float part is the contract's fixed scalar sequence
 * (built with -ffp-contract=off -fno-fast-math: no fma, no reassociation).
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
 * added to the row's sum, one float add; a layer's activation is an id (ACTS below, set in
 * pool.c's layer_desc). */
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };
#define QBLOCK 32
#define CHUNK 8
#define MAXL 32
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

/* -- activations ------------------------------------------------------------------ */
static inline float rne(float v) { return (v + RNE_MAGIC) - RNE_MAGIC; }

void aq_quantize(const float *x, int K, int8_t *xq, float *dx, int32_t *xs) {
    for (int b = 0; b < K / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            float a = xb[i] < 0 ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
        }
        dx[b] = amax / 127.0f;
        float inv = amax > 0 ? 127.0f / amax : 0.0f;
        for (int i = 0; i < QBLOCK; i++) xq[b * QBLOCK + i] = (int8_t)(int32_t)rne(xb[i] * inv);
        for (int g = 0; g < QBLOCK / 16; g++) {
            int32_t s = 0;
            for (int i = 0; i < 16; i++) s += xq[b * QBLOCK + g * 16 + i];
            xs[b * 2 + g] = s;
        }
    }
}

#define LOG2E ((float)1.4426950408889634)
#define LN2_HI ((float)0.693359375)
#define LN2_LO ((float)-2.1219444005469057e-4)

static inline float exp_c1(float v) {
    v = v < -87.0f ? -87.0f : (v > 87.0f ? 87.0f : v);
    float n = rne(v * LOG2E);
    float r = (v - n * LN2_HI) - n * LN2_LO;
    float p = (float)(1.0 / 5040);
    p = p * r + (float)(1.0 / 720);
    p = p * r + (float)(1.0 / 120);
    p = p * r + (float)(1.0 / 24);
    p = p * r + (float)(1.0 / 6);
    p = p * r + (float)(1.0 / 2);
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

void aq_exp(const float *v, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = exp_c1(v[i]);
}

void aq_silu_mul(const float *g, const float *u, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = (g[i] * (1.0f / (1.0f + exp_c1(-g[i])))) * u[i];
}

#define OAI_ALPHA ((float)1.702)   /* gpt-oss's (kernels/activations/act_ids.py), rounded once */
#define OAI_LIMIT 7.0f

/* swiglu_oai: g clamped above at 7, u to [-7, 7] (compare-selects), g sigmoid(1.702 g) (u + 1). */
void aq_swiglu_oai(const float *g, const float *u, int n, float *out) {
    for (int i = 0; i < n; i++) {
        float gi = g[i] > OAI_LIMIT ? OAI_LIMIT : g[i];
        float ui = (u[i] > OAI_LIMIT ? OAI_LIMIT : (u[i] < -OAI_LIMIT ? -OAI_LIMIT : u[i])) + 1.0f;
        out[i] = (gi * (1.0f / (1.0f + exp_c1(-(gi * OAI_ALPHA))))) * ui;
    }
}

/* The contract's activations by id (act_ids.ACT_IDS; expert_q8.CONTRACT_ACTS). */
typedef void (*act_fn)(const float *, const float *, int, float *);
enum { ACT_SILU = 0, ACT_OAI = 2, N_ACTS = 3 };
static const act_fn ACTS[N_ACTS] = {[ACT_SILU] = aq_silu_mul, [ACT_OAI] = aq_swiglu_oai};

/* act(g, u) of n values into out; -1 for an id the contract has not. */
int aq_act(int act, const float *g, const float *u, int n, float *out) {
    if (act < 0 || act >= N_ACTS || !ACTS[act]) return -1;
    ACTS[act](g, u, n, out);
    return 0;
}

/* chunk_sum: CHUNK-term chunks summed pairwise, chunks added to acc in order (from +0). */
static inline float chunk_sum(float *t, int ns, float acc) {
    int nc = (ns + CHUNK - 1) / CHUNK;
    for (int s = ns; s < nc * CHUNK; s++) t[s] = 0.0f;
    for (int c = 0; c < nc; c++) {
        const float *q = t + c * CHUNK;
        acc = acc + (((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7])));
    }
    return acc;
}

/* One activation row made ready for a weight format: permuted into storage order. */
typedef struct {
    int8_t *xp;      /* [K] */
    int32_t *ssum;   /* [ns] sum of xq over the slot (for the code bias) */
    float *xsum;     /* [ns] sum of xs groups of the slot (the contract's xsum, K-min) */
    float *dxs;      /* [ns] dx of the slot's block */
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

/* One slot's term of the contract: (A isum [- B xsum]) dx. */
static inline float slot_term(int qtype, const uint8_t *sc, const uint8_t *sd, const int32_t *isum,
                              const xprep *x, int s) {
    switch (qtype) {
    case Q4_K: case Q5_K: {
        float d = h2f(ld16(sd + 4 * (s / 8))), dmin = h2f(ld16(sd + 4 * (s / 8) + 2));
        uint16_t v = ld16(sc + 2 * s);
        float A = d * (float)(v & 0xFF), B = dmin * (float)((v >> 8) & 0xFF);
        return ((A * (float)isum[s]) - (B * x->xsum[s])) * x->dxs[s];
    }
    case Q4_1: case Q5_1: {   /* sc: fp16 d, m per slot; A = d, B = -m */
        float A = h2f(ld16(sc + 4 * s)), B = -h2f(ld16(sc + 4 * s + 2));
        return ((A * (float)isum[s]) - (B * x->xsum[s])) * x->dxs[s];
    }
    case Q6_K: return ((h2f(ld16(sd + 2 * (s / 16))) * (float)(int8_t)sc[s]) * (float)isum[s]) * x->dxs[s];
    case Q8_0: return (h2f(ld16(sc + 2 * (s / 2))) * (float)isum[s]) * x->dxs[s];   /* two slots share d */
    case MXFP4: return (e8m0_half(sc[s]) * (float)isum[s]) * x->dxs[s];                /* sc: e, a byte a slot */
    default: return (h2f(ld16(sc + 2 * s)) * (float)isum[s]) * x->dxs[s];
    }
}

#include "simd.c"
#include "gguf_rows.c"

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

/* Scratch for one row: isum [ns], terms [ns rounded up to CHUNK], a mapped row's planes
 * (ROW_PLANES(K) bytes; unused for a weight with planes). */
typedef struct { int32_t *isum; float *t; uint8_t *pl; } rowbuf;
#define ROW_PLANES(K) (2 * (size_t)(K) + 64)

/* Rows [r0, r1) of expert e of w times the prepared activation: out[r - r0]. */
int aq_matvec(const qmat *w, int e, const xprep *x, int r0, int r1, float *out, rowbuf *rb) {
    fmt_t f;
    if (fmt_of(w->qtype, &f)) return -1;
    int ns = w->K / f.L;
    uint8_t sh[MAXL];
    for (int p = 0; p < f.L; p++) { int k, hb; slot_layout(&f, p, &k, &hb); sh[p] = (uint8_t)hb; }
    isums_fn fn = isums_of(w->qtype);
    size_t nqs, nqh, nsc;
    plane_bytes(&f, w->K, &nqs, &nqh, &nsc);
    for (int r = r0; r < r1; r++) {
        const uint8_t *qs, *qh, *sc, *sd;
        if (w->raw) {   /* the mapped tier: this row's blocks re-laid as planes first */
            uint8_t *p = rb->pl;
            if (!p || aq_repack_row(w->qtype, raw_row(w, e, r), w->K, p, p + nqs, p + nqs + nqh, p + nqs + nqh + nsc))
                return -1;
            qs = p; qh = p + nqs; sc = p + nqs + nqh; sd = p + nqs + nqh + nsc;
        } else {
            qs = w->qs + e * w->qs_e + r * w->qs_r;
            qh = w->qh ? w->qh + e * w->qh_e + r * w->qh_r : 0;
            sc = w->sc + e * w->sc_e + r * w->sc_r;
            sd = w->sd ? w->sd + e * w->sd_e + r * w->sd_r : 0;
        }
        fn(qs, qh, x->xp, x->ssum, sh, ns, rb->isum);
        float acc = 0.0f;
        int s0 = 0;
#ifdef HAVE_SIMD_ISUMS
        s0 = ns / CHUNK * CHUNK;
        acc = chunks_v(w->qtype, sc, sd, rb->isum, x, ns / CHUNK);
#endif
        for (int s = s0; s < ns; s++) rb->t[s - s0] = slot_term(w->qtype, sc, sd, rb->isum, x, s);
        acc = s0 < ns ? chunk_sum(rb->t, ns - s0, acc) : acc;
        out[r - r0] = w->bias ? acc + w->bias[(int64_t)e * w->N + r] : acc;
    }
    return 0;
}

int aq_slot_len(int qtype) {
    fmt_t f;
    return fmt_of(qtype, &f) ? -1 : f.L;
}
