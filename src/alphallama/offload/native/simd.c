/* AVX2 (and AVX-VNNI / AVX512-VNNI) slot dots, 8 slots (a chunk) per step: the same
 * exact integer sums as the scalar loops of experts.c, which take the tail; and the float
 * part of the whole chunks, 8 slot terms per vector, into the row's lanes (chunks_v).
 * Codes are unsigned bytes (nibble | top bits << 4), activations signed: u8 x s8 products
 * summed in 4s (dpbusd) or pairs (maddubs: |sum| <= 2 * 128 * 127, no saturation). */
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

static inline __m256i dot_u8s8(__m256i u, __m256i x) {   /* 8 int32 partial sums */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* acc + the 4-product sums of u8 u and s8 x per int32 lane (VNNI: one dpbusd, no saturation;
 * else pairs in int16: |sum| <= 2 * 128 * 127, exact). */
static inline __m256i dot_u8s8_acc(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

/* Eight vectors of partial sums (slot j's in r[j]) -> [sum r0, ..., sum r7]. */
static inline __m256i reduce8(const __m256i *r) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(r[4], r[5]), _mm256_hadd_epi32(r[6], r[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Four vectors each holding two 16-value slots (slot 2j in the low lane, 2j+1 high). */
static inline __m256i reduce8_pairs(const __m256i *r) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3]));
    return _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* A 32-value nibble slot's codes in storage order; HB: its 1 top bit from qh word h. */
static inline __m256i codes32(const uint8_t *B, uint32_t h, const int HB) {
    __m128i b = _mm_loadu_si128((const __m128i *)B), m = _mm_set1_epi8(15);
    __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
    if (HB) {   /* position p = 16 nib + 4 v + b: bit 8 b + 4 nib + v of h */
        __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                         _mm256_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3,
                                                          0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3));
        __m256i bit = _mm256_setr_epi8(1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8,
                                       16, 16, 16, 16, 32, 32, 32, 32, 64, 64, 64, 64,
                                       -128, -128, -128, -128);
        __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
        u = _mm256_or_si256(u, _mm256_and_si256(on, _mm256_set1_epi8(16)));
    }
    return u;
}

#define ROW_ISUMS32(NAME, SCALAR, HB, BIAS)                                                     \
    static void NAME(const uint8_t *qs, const uint8_t *qh, const int8_t *xp, const int32_t *ssum, \
                     const uint8_t *sh, int ns, int32_t *isum) {                                 \
        int s = 0;                                                                             \
        for (; s + 8 <= ns; s += 8) {                                                          \
            __m256i r[8];                                                                      \
            for (int j = 0; j < 8; j++)                                                        \
                r[j] = dot_u8s8(codes32(qs + 16 * (s + j), HB ? ld32(qh + 4 * (s + j)) : 0, HB),  \
                                _mm256_loadu_si256((const __m256i *)(xp + 32 * (s + j))));     \
            __m256i v = reduce8(r);                                                            \
            if (BIAS)                                                                          \
                v = _mm256_sub_epi32(v, _mm256_mullo_epi32(_mm256_set1_epi32(BIAS),           \
                                         _mm256_loadu_si256((const __m256i *)(ssum + s))));   \
            _mm256_storeu_si256((__m256i *)(isum + s), v);                                     \
        }                                                                                      \
        if (s < ns) SCALAR(qs + 16 * s, qh ? qh + 4 * s : qh, xp + 32 * s, ssum + s, sh, ns - s, isum + s); \
    }
ROW_ISUMS32(isums_q4k_v, isums_q4k, 0, 0)
ROW_ISUMS32(isums_q5k_v, isums_q5k, 1, 0)
ROW_ISUMS32(isums_q40_v, isums_q40, 0, 8)
ROW_ISUMS32(isums_q50_v, isums_q50, 1, 16)

/* Q6_K: slots of 16 (8 qs bytes, 2 top bits each at bit 8 b + 4 nib + 2 v of qh): the
 * unsigned codes of slots t, t+1 in one vector (slot t in the low lane). Position p = 8 nib + 4 v + b. */
static inline __m256i codes16x2(const uint8_t *qs, const uint8_t *qh) {
    const __m256i idx = _mm256_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3,
                                         0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    const __m256i b0 = _mm256_setr_epi8(1, 1, 1, 1, 4, 4, 4, 4, 16, 16, 16, 16, 64, 64, 64, 64,
                                        1, 1, 1, 1, 4, 4, 4, 4, 16, 16, 16, 16, 64, 64, 64, 64);
    const __m256i b1 = _mm256_add_epi8(b0, b0);
    const __m128i m = _mm_set1_epi8(15);
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    __m256i u = _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
    __m256i hv = _mm256_set_m128i(_mm_set1_epi32((int)ld32(qh + 4)), _mm_set1_epi32((int)ld32(qh)));
    __m256i hb = _mm256_shuffle_epi8(hv, idx);
    __m256i on0 = _mm256_cmpeq_epi8(_mm256_and_si256(hb, b0), b0);
    __m256i on1 = _mm256_cmpeq_epi8(_mm256_and_si256(hb, b1), b1);
    return _mm256_or_si256(u, _mm256_or_si256(_mm256_and_si256(on0, _mm256_set1_epi8(16)),
                                              _mm256_and_si256(on1, _mm256_set1_epi8(32))));
}

static void isums_q6k_v(const uint8_t *qs, const uint8_t *qh, const int8_t *xp, const int32_t *ssum,
                        const uint8_t *sh, int ns, int32_t *isum) {
    int s = 0;
    for (; s + 8 <= ns; s += 8) {
        __m256i r[4];
        for (int j = 0; j < 4; j++) {
            int t = s + 2 * j;
            r[j] = dot_u8s8(codes16x2(qs + 8 * t, qh + 4 * t), _mm256_loadu_si256((const __m256i *)(xp + 16 * t)));
        }
        __m256i bias = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(ssum + s)), 5);   /* 32 sum x */
        _mm256_storeu_si256((__m256i *)(isum + s), _mm256_sub_epi32(reduce8_pairs(r), bias));
    }
    if (s < ns) isums_q6k(qs + 8 * s, qh + 4 * s, xp + 16 * s, ssum + s, sh, ns - s, isum + s);
}

/* Q8_0: signed codes: |c| times x with c's sign (exact: |c| <= 128, |x| <= 127). */
static void isums_q80_v(const uint8_t *qs, const uint8_t *qh, const int8_t *xp, const int32_t *ssum,
                        const uint8_t *sh, int ns, int32_t *isum) {
    int s = 0;
    for (; s + 8 <= ns; s += 8) {
        __m256i r[4];
        for (int j = 0; j < 4; j++) {
            __m256i c = _mm256_loadu_si256((const __m256i *)(qs + 16 * (s + 2 * j)));
            __m256i x = _mm256_loadu_si256((const __m256i *)(xp + 16 * (s + 2 * j)));
            r[j] = dot_u8s8(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c));
        }
        _mm256_storeu_si256((__m256i *)(isum + s), reduce8_pairs(r));
    }
    if (s < ns) isums_q80(qs + 16 * s, qh, xp + 16 * s, ssum + s, sh, ns - s, isum + s);
}

/* MXFP4: the nibbles (codes32's storage order) looked up in E2M1 (pshufb, the table in
 * both lanes), then Q8_0's signed product: |c| <= 12. */
static void isums_mx_v(const uint8_t *qs, const uint8_t *qh, const int8_t *xp, const int32_t *ssum,
                       const uint8_t *sh, int ns, int32_t *isum) {
    const __m128i t = _mm_loadu_si128((const __m128i *)E2M1);
    const __m256i lev = _mm256_set_m128i(t, t);
    int s = 0;
    for (; s + 8 <= ns; s += 8) {
        __m256i r[8];
        for (int j = 0; j < 8; j++) {
            __m256i c = _mm256_shuffle_epi8(lev, codes32(qs + 16 * (s + j), 0, 0));
            __m256i x = _mm256_loadu_si256((const __m256i *)(xp + 32 * (s + j)));
            r[j] = dot_u8s8(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c));
        }
        _mm256_storeu_si256((__m256i *)(isum + s), reduce8(r));
    }
    if (s < ns) isums_mx(qs + 16 * s, qh, xp + 32 * s, ssum + s, sh, ns - s, isum + s);
}

/* MXFP4's A of 8 slots: e8m0_half of 8 scale bytes (e < 2: 0x00200000 << e). */
static inline __m256 e8m0_half8(const uint8_t *e8) {
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e8));
    __m256i nrm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(nrm, sub, small));
}

/* A and B (has_min formats; else 0) of the 8 slots of chunk c: slot_scales' operations per lane. */
static inline __attribute__((always_inline)) void chunk_scales_v(int qtype, const uint8_t *sc, const uint8_t *sd,
                                                                int c, __m256 *A, __m256 *B) {
    int s = c * CHUNK;
    *B = _mm256_setzero_ps();
    if (qtype == Q4_K || qtype == Q5_K) {   /* a chunk is one super-block */
        __m128i v = _mm_loadu_si128((const __m128i *)(sc + 2 * s));
        __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_and_si128(v, _mm_set1_epi16(0xFF))));
        __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_srli_epi16(v, 8)));
        *A = _mm256_mul_ps(_mm256_set1_ps(h2f(ld16(sd + 4 * c))), scf);
        *B = _mm256_mul_ps(_mm256_set1_ps(h2f(ld16(sd + 4 * c + 2))), mf);
    } else if (qtype == Q4_1 || qtype == Q5_1) {   /* the scalar scales, gathered */
        float a[CHUNK], b[CHUNK];
        for (int j = 0; j < CHUNK; j++) slot_scales(qtype, sc, sd, s + j, &a[j], &b[j]);
        *A = _mm256_loadu_ps(a);
        *B = _mm256_loadu_ps(b);
    } else if (qtype == Q6_K) {
        *A = _mm256_mul_ps(_mm256_set1_ps(h2f(ld16(sd + 2 * (s / 16)))),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + s)))));
    } else if (qtype == MXFP4) {
        *A = e8m0_half8(sc + s);
    } else if (qtype == Q8_0) {   /* 4 d's, each for two slots */
        *A = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + s)))),
                                      _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    } else {
        *A = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 2 * s)));
    }
}

/* slot_term of the 8 slots from slot s (their integer sums in isum): the same per-lane IEEE
 * operations. */
static inline __m256 chunk_terms_v(int kmin, __m256 A, __m256 B, __m256i isum, const xprep *x, int s) {
    __m256 is = _mm256_cvtepi32_ps(isum);   /* exact: < 2**24 */
    __m256 dx = _mm256_loadu_ps(x->dxs + s), t = _mm256_mul_ps(A, is);
    if (kmin) t = _mm256_sub_ps(t, _mm256_mul_ps(B, _mm256_loadu_ps(x->xsum + s)));
    return _mm256_mul_ps(t, dx);
}

/* The nc whole chunks of a row into its nl lanes (contract_lanes; nl >= 8 where a row has a
 * chunk), stored over lanes[0, max(nl, 8)): chunk c's 8 terms are added to vector accumulator
 * c % NV, slot 8c + j to lane 8 (c % NV) + j, which is lane (8c + j) % nl where nl == 8 NV. A
 * row of fewer lanes (nl < 8 NV: at most 16 slots) has at most nl / 8 chunks, each alone in
 * accumulator c. qtype and NV are constants where this is expanded: no format tests in the
 * loop, the accumulators in registers. */
static inline __attribute__((always_inline)) void chunks_of(const int qtype, const int NV, const uint8_t *sc,
                                                           const uint8_t *sd, const int32_t *isum, const xprep *x,
                                                           int nc, int nl, float *lanes) {
    __m256 acc[MAXLANES / CHUNK];
    for (int k = 0; k < NV; k++) acc[k] = _mm256_setzero_ps();
    for (int c0 = 0; c0 < nc; c0 += NV)
        for (int k = 0; k < NV && c0 + k < nc; k++) {
            int c = c0 + k;
            __m256 A, B;
            chunk_scales_v(qtype, sc, sd, c, &A, &B);
            __m256i is = _mm256_loadu_si256((const __m256i *)(isum + c * CHUNK));
            acc[k] = _mm256_add_ps(acc[k], chunk_terms_v(has_min(qtype), A, B, is, x, c * CHUNK));
        }
    for (int k = 0; k < NV && CHUNK * k < nl; k++) _mm256_storeu_ps(lanes + CHUNK * k, acc[k]);
}

static inline __attribute__((always_inline)) void chunks_v(int qtype, const uint8_t *sc, const uint8_t *sd,
                                                          const int32_t *isum, const xprep *x, int nc, int nl,
                                                          float *lanes) {
    switch (qtype) {   /* formats with the same scales share an expansion; only Q6_K has 64 lanes */
    case Q4_K: case Q5_K: chunks_of(Q4_K, 4, sc, sd, isum, x, nc, nl, lanes); return;
    case Q4_1: case Q5_1: chunks_of(Q4_1, 4, sc, sd, isum, x, nc, nl, lanes); return;
    case Q6_K:
        if (nl == 64) chunks_of(Q6_K, 8, sc, sd, isum, x, nc, nl, lanes);
        else chunks_of(Q6_K, 4, sc, sd, isum, x, nc, nl, lanes);
        return;
    case Q8_0: chunks_of(Q8_0, 4, sc, sd, isum, x, nc, nl, lanes); return;
    case MXFP4: chunks_of(MXFP4, 4, sc, sd, isum, x, nc, nl, lanes); return;
    default: chunks_of(Q4_0, 4, sc, sd, isum, x, nc, nl, lanes); return;
    }
}

/* The 8-lane trees ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of the vectors
 * l[8k, 8k + 8), k < 4, as [r0, r1, r2, r3] (of n = 1 or 2 vectors: k mod n, repeated).
 * hadd adds adjacent pairs: levels 1 and 2 of four vectors at once; level 3, the halves. */
static inline __m128 tree4_v(const float *l, int n) {
    __m256 v[4];
    for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(l + CHUNK * (k & (n - 1)));
    __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

/* lane_tree of nl >= 8 lanes, the same adds: each vector's 8-lane tree r_k, then the r_k's
 * tree, r0 + r1 (n = 2), (r0 + r1) + (r2 + r3) (n = 4), or that of 8. */
static inline float lane_tree_v(const float *lanes, int nl) {
    int n = nl / CHUNK;
    __m128 r = tree4_v(lanes, n < 4 ? n : 4);
    if (n == 1) return _mm_cvtss_f32(r);
    __m128 s = _mm_hadd_ps(r, n == 8 ? tree4_v(lanes + 32, 4) : r);   /* [r0 + r1, r2 + r3, (n = 8:) r4 + r5, ...] */
    if (n == 2) return _mm_cvtss_f32(s);
    if (n == 8) s = _mm_hadd_ps(s, s);                                 /* [(r0 + r1) + (r2 + r3), (r4 + r5) + ...] */
    return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_movehdup_ps(s));
}
#define HAVE_SIMD_ISUMS 1
#endif
