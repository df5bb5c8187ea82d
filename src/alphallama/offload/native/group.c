/* One expert's rows times several activations, each weight row read and decoded once for
 * all of them: the CPU workers' misses grouped by expert (post.c hands each group of a
 * round's pairs that share an expert to aq_matvec_group). A miss is bound by RAM
 * bandwidth, so W rows using one expert cost one read of it, not W.
 *
 * Every (activation, row) gets the bits aq_matvec gives it: the slot sums are exact
 * integers (any order and any decoding give the same), and the float part is the same
 * sequence of operations on the same A, B and activation terms (chunk_scales_v /
 * slot_scales once per row instead of once per activation), each activation's terms
 * into its own nl lanes (experts.c's lane order) and their tree.
 *
 * What an extra activation costs is what a group saves, so the row is decoded into the
 * layout that makes a pair cheapest (SIMD builds): each chunk of 8 slots interleaved, vector
 * j holding bytes 4j..4j+3 of every slot, slot i in dword lane i; the activations are
 * interleaved alike once (aq_prep_group). A dpbusd per vector then adds every slot's
 * products into its own lane: a chunk's 8 sums without the horizontal reduction the
 * per-row slot dots (simd.c) pay. Slots past the last whole chunk stay in storage order.
 * Included by experts.c. */

/* Scratch for one decoded row: its codes [K], A and B [ns], the pairs' sums [G] and lanes
 * [G][MAXLANES], and a rowbuf (isum, pl). */
typedef struct { rowbuf rb; uint8_t *codes; float *A, *B, *sum, *lanes; } grpbuf;

/* Q8_0's and MXFP4's codes are signed (int8, E2M1 levels); the others unsigned, less a bias. */
static inline int signed_codes(int qtype) { return qtype == Q8_0 || qtype == MXFP4; }

/* Slot s's L codes in storage order: what the slot dots decode on the fly, written out. */
static void decode_slot(int qtype, const rowfmt *rf, const rowplanes *rp, int s, uint8_t *out) {
    const fmt_t *f = &rf->f;
    const uint8_t *b = rp->qs + (size_t)s * f->nbytes;
    if (qtype == Q8_0) { memcpy(out, b, 16); return; }
    uint32_t h = f->hbits ? ld32(rp->qh + 4 * s) : 0, m = (1u << f->hbits) - 1;
    int nb = f->nbytes;
    for (int p = 0; p < nb; p++) {
        int lo = b[p] & 15, hi = b[p] >> 4;
        if (qtype == MXFP4) {
            out[p] = (uint8_t)E2M1[lo];
            out[nb + p] = (uint8_t)E2M1[hi];
        } else {
            out[p] = (uint8_t)(lo | ((h >> rf->sh[p]) & m) << 4);
            out[nb + p] = (uint8_t)(hi | ((h >> rf->sh[nb + p]) & m) << 4);
        }
    }
}

/* GCC 12 with AVX512-VNNI (Zen 4 here) turns a signed x signed byte dot loop into vpdpbusd,
 * which reads one side as unsigned: wrong sums. This scalar dot (the tail slots; the whole
 * row in a build without AVX2) stays out of the vectorizer. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_VECTORIZE __attribute__((optimize("no-tree-vectorize")))
#else
#define NO_VECTORIZE
#endif

NO_VECTORIZE static int32_t dot_codes(const uint8_t *c, const int8_t *x, int L, int sgn) {
    int32_t acc = 0;
    if (sgn) for (int p = 0; p < L; p++) acc += (int32_t)(int8_t)c[p] * x[p];
    else for (int p = 0; p < L; p++) acc += (int32_t)c[p] * x[p];
    return acc;
}

#ifdef HAVE_SIMD_ISUMS
/* r[i]: slot i's 8 dwords -> r[j]: dword j of slots 0..7 (slots of 32 bytes). */
static inline void transpose8(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {   /* u[j]: dwords j (low lane), j + 4 (high) of slots 0..3; u[4 + j]: of 4..7 */
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* v[i]: the 4 dwords of slots 2i, 2i+1 -> v[j]: dword j of slots 0..7 (slots of 16 bytes). */
static inline void transpose4(__m256i *v) {
    __m256i a0 = _mm256_unpacklo_epi32(v[0], v[1]), a1 = _mm256_unpackhi_epi32(v[0], v[1]);
    __m256i a2 = _mm256_unpacklo_epi32(v[2], v[3]), a3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   /* lanes hold slots 0 2 4 6 1 3 5 7 */
    v[0] = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(a0, a2), order);
    v[1] = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(a0, a2), order);
    v[2] = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(a1, a3), order);
    v[3] = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(a1, a3), order);
}

/* A chunk's L / 4 vectors (storage order: a slot each, or two of 16) -> interleaved, stored. */
static inline void store_interleaved(__m256i *v, int L, uint8_t *out) {
    if (L == 32) transpose8(v);
    else transpose4(v);
    for (int j = 0; j < L / 4; j++) _mm256_storeu_si256((__m256i *)(out + 32 * j), v[j]);
}

/* The codes of the 8 slots from slot s, interleaved, into out. */
static void decode8_v(int qtype, const rowplanes *rp, int s, uint8_t *out) {
    const uint8_t *qs = rp->qs, *qh = rp->qh;
    __m256i v[8];
    if (qtype == Q6_K) {
        for (int j = 0; j < 4; j++) v[j] = codes16x2(qs + 8 * (s + 2 * j), qh + 4 * (s + 2 * j));
        store_interleaved(v, 16, out);
        return;
    }
    if (qtype == Q8_0) {
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_si256((const __m256i *)(qs + 16 * (s + 2 * j)));
        store_interleaved(v, 16, out);
        return;
    }
    __m128i t = _mm_loadu_si128((const __m128i *)E2M1);
    __m256i lev = _mm256_set_m128i(t, t);
    int hb = qtype == Q5_K || qtype == Q5_1 || qtype == Q5_0;
    for (int j = 0; j < 8; j++) {
        if (qtype == MXFP4) v[j] = _mm256_shuffle_epi8(lev, codes32(qs + 16 * (s + j), 0, 0));
        else if (hb) v[j] = codes32(qs + 16 * (s + j), ld32(qh + 4 * (s + j)), 1);
        else v[j] = codes32(qs + 16 * (s + j), 0, 0);
    }
    store_interleaved(v, 32, out);
}

/* The integer sums of a chunk's 8 slots, interleaved codes c against interleaved x (before
 * the code bias), in two chains of dpbusd (exact integers: any order). L and sgn are
 * constants where pairs_chunks_v is expanded, so the loop unrolls into registers. */
static inline __attribute__((always_inline)) __m256i chunk_isums_v(const uint8_t *c, const int8_t *x, const int L,
                                                                  const int sgn) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (int j = 0; j < L / 4; j += 2) {
        __m256i u0 = _mm256_loadu_si256((const __m256i *)(c + 32 * j));
        __m256i u1 = _mm256_loadu_si256((const __m256i *)(c + 32 * j + 32));
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + 32 * j));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 32 * j + 32));
        if (sgn) {
            a0 = dot_u8s8_acc(a0, _mm256_abs_epi8(u0), _mm256_sign_epi8(x0, u0));
            a1 = dot_u8s8_acc(a1, _mm256_abs_epi8(u1), _mm256_sign_epi8(x1, u1));
        } else {
            a0 = dot_u8s8_acc(a0, u0, x0);
            a1 = dot_u8s8_acc(a1, u1, x1);
        }
    }
    return _mm256_add_epi32(a0, a1);
}

/* pairs_dot's whole chunks (slots [0, nc * CHUNK)): chunk c's 8 terms added to lanes
 * [8 (c % (nl / 8)), +8) of each activation's (lanes + g MAXLANES), chunks_of's order. */
static inline __attribute__((always_inline)) void pairs_chunks_v(const uint8_t *codes, const float *A, const float *B,
                                                                const xprep *const *x, int G, float *lanes, int nc,
                                                                int nl, const int L, const int sgn, int bias,
                                                                int kmin) {
    int vmask = nl / CHUNK - 1;   /* nl / 8 vectors of lanes: a power of 2 */
    for (int c = 0; c < nc; c++) {
        int s = c * CHUNK;
        float *acc = lanes + CHUNK * (c & vmask);
        __m256 a = _mm256_loadu_ps(A + s), b = _mm256_loadu_ps(B + s);
        for (int g = 0; g < G; g++) {
            __m256i is = chunk_isums_v(codes + (size_t)s * L, x[g]->xi + (size_t)s * L, L, sgn);
            if (bias)
                is = _mm256_sub_epi32(is, _mm256_mullo_epi32(_mm256_set1_epi32(bias),
                                                             _mm256_loadu_si256((const __m256i *)(x[g]->ssum + s))));
            float *l = acc + (size_t)g * MAXLANES;
            _mm256_storeu_ps(l, _mm256_add_ps(_mm256_loadu_ps(l), chunk_terms_v(kmin, a, b, is, x[g], s)));
        }
    }
}
#endif

/* aq_prep, then (SIMD builds) the interleaved copy of xp the grouped rows read: o->xi holds K bytes. */
int aq_prep_group(int qtype, const int8_t *xq, const float *dx, const int32_t *xs, int K, xprep *o) {
    if (aq_prep(qtype, xq, dx, xs, K, o)) return -1;
#ifdef HAVE_SIMD_ISUMS
    fmt_t f;
    fmt_of(qtype, &f);
    int L = f.L;
    for (int s = 0; s + CHUNK <= K / L; s += CHUNK) {
        __m256i v[8];
        for (int j = 0; j < L / 4; j++) v[j] = _mm256_loadu_si256((const __m256i *)(o->xp + s * L + 32 * j));
        store_interleaved(v, L, (uint8_t *)o->xi + s * L);
    }
#endif
    return 0;
}

/* The row's codes into buf (interleaved whole chunks, then storage order): where they are. */
static const uint8_t *decode_row(int qtype, const rowfmt *rf, const rowplanes *rp, uint8_t *buf) {
    int L = rf->f.L, s = 0;
#ifdef HAVE_SIMD_ISUMS
    for (; s + CHUNK <= rf->ns; s += CHUNK) decode8_v(qtype, rp, s, buf + (size_t)s * L);
#else
    if (qtype == Q8_0) return rp->qs;   /* already its codes, in storage order */
#endif
    for (; s < rf->ns; s++) decode_slot(qtype, rf, rp, s, buf + (size_t)s * L);
    return buf;
}

/* Every slot's A and B (row_dot's: chunk_scales_v for the whole chunks, slot_scales for the rest). */
static void row_scales(int qtype, const rowfmt *rf, const rowplanes *rp, float *A, float *B) {
    int s = 0;
#ifdef HAVE_SIMD_ISUMS
    for (; s + CHUNK <= rf->ns; s += CHUNK) {
        __m256 a, b;
        chunk_scales_v(qtype, rp->sc, rp->sd, s / CHUNK, &a, &b);
        _mm256_storeu_ps(A + s, a);
        _mm256_storeu_ps(B + s, b);
    }
#endif
    for (; s < rf->ns; s++) slot_scales(qtype, rp->sc, rp->sd, s, &A[s], &B[s]);
}

/* G activations against a decoded row: row_dot's sums (without the bias), term for term,
 * into sum[g], activation g's lanes at lanes + g MAXLANES. Chunk by chunk, the pairs inner:
 * their lanes are independent chains the core overlaps, and a chunk's codes and scales stay
 * in registers / L1 across them. */
static void pairs_dot(int qtype, const rowfmt *rf, const uint8_t *codes, const float *A, const float *B,
                      const xprep *const *x, int G, float *sum, float *lanes) {
    int L = rf->f.L, ns = rf->ns, nl = rf->nl, bias = rf->f.bias, kmin = has_min(qtype), sgn = signed_codes(qtype);
    int s = 0;
    for (int g = 0; g < G; g++)
        for (int j = 0; j < nl; j++) lanes[(size_t)g * MAXLANES + j] = 0.0f;
#ifdef HAVE_SIMD_ISUMS
    int nc = ns / CHUNK;   /* one expansion per code width and sign: constants for the unrolled loops */
    if (L == 32 && sgn) pairs_chunks_v(codes, A, B, x, G, lanes, nc, nl, 32, 1, bias, kmin);
    else if (L == 32) pairs_chunks_v(codes, A, B, x, G, lanes, nc, nl, 32, 0, bias, kmin);
    else if (sgn) pairs_chunks_v(codes, A, B, x, G, lanes, nc, nl, 16, 1, bias, kmin);
    else pairs_chunks_v(codes, A, B, x, G, lanes, nc, nl, 16, 0, bias, kmin);
    s = nc * CHUNK;
#endif
    for (int g = 0; g < G; g++) {
        float *l = lanes + (size_t)g * MAXLANES;
        for (int j = s; j < ns; j++) {
            int32_t is = dot_codes(codes + (size_t)j * L, x[g]->xp + (size_t)j * L, L, sgn) - bias * x[g]->ssum[j];
            lane_add(l, nl, j, slot_term(kmin, A[j], B[j], is, x[g]->xsum[j], x[g]->dxs[j]));
        }
        sum[g] = row_sum(l, nl);
    }
}

/* Rows [r0, r1) of expert e of w times the G activations x[g] (prepared by aq_prep_group):
 * out[g][r - r0]. G == 1 decodes as it goes (row_dot: nothing to share, no store and reload). */
int aq_matvec_group(const qmat *w, int e, const xprep *const *x, int G, int r0, int r1, float *const *out,
                    grpbuf *gb) {
    rowfmt rf;
    if (row_fmt(w, &rf)) return -1;
    for (int r = r0; r < r1; r++) {
        rowplanes rp;
        if (row_planes(w, &rf, e, r, gb->rb.pl, &rp)) return -1;
        if (G == 1) {
            out[0][r - r0] = with_bias(w, e, r, row_dot(w, &rf, &rp, x[0], &gb->rb));
            continue;
        }
        const uint8_t *codes = decode_row(w->qtype, &rf, &rp, gb->codes);
        row_scales(w->qtype, &rf, &rp, gb->A, gb->B);
        pairs_dot(w->qtype, &rf, codes, gb->A, gb->B, x, G, gb->sum, gb->lanes);
        for (int g = 0; g < G; g++) out[g][r - r0] = with_bias(w, e, r, gb->sum[g]);
    }
    return 0;
}
