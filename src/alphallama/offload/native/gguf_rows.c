/* Rows read straight from a GGUF file's blocks (the store's mapped tier: the file's pages,
 * memory-mapped, page cache below RAM). A row is first re-laid into the planes layout
 * (kernels/formats: qs / qh / sc / sd, the bytes fmt.pack makes) in a per-thread scratch,
 * then computed by the same slot code as a host-tier row: the planes are the same bytes,
 * so the bits are (tests/offload/test_mapped.py holds aq_repack_row equal to fmt.pack).
 * The re-lay of a block is a fixed gather: where each planes nibble and top-bit field comes
 * from is worked out once per weight (relay_init, from code_loc's rules), and each block is
 * then copied by that table (relay_row): ~15x the per-value decoding it replaced. With AVX2
 * the same gather runs in vectors (relay_simd): every 16-byte run of qs and every slot's
 * top-bit word takes its bytes from one 32-byte window of the block, so it is byte shuffles
 * of the window's halves, then a nibble pick (qs) or a bit test and a movemask (qh).
 * Included by experts.c after fmt_of / slot_layout. */
#include <sys/mman.h>
#include <unistd.h>

/* GGUF block geometry: values and bytes of one block of the contract's formats. */
static int gguf_block(int qtype, int *qk, int *bytes) {
    switch (qtype) {
    case Q4_0: *qk = 32; *bytes = 18; return 0;
    case Q4_1: *qk = 32; *bytes = 20; return 0;
    case Q5_0: *qk = 32; *bytes = 22; return 0;
    case Q5_1: *qk = 32; *bytes = 24; return 0;
    case Q8_0: *qk = 32; *bytes = 34; return 0;
    case Q4_K: *qk = 256; *bytes = 144; return 0;
    case Q5_K: *qk = 256; *bytes = 176; return 0;
    case Q6_K: *qk = 256; *bytes = 210; return 0;
    case MXFP4: *qk = 32; *bytes = 17; return 0;
    default: return -1;
    }
}

/* Where value k of a block keeps its low bits (Q8_0: its int8 code, the whole byte) and its
 * top bits: byte index and shift in the block (*hwidth 0: none). */
static void code_loc(int qtype, int k, int *lo_byte, int *lo_shift, int *hi_byte, int *hi_shift, int *hwidth) {
    *hi_byte = *hi_shift = *hwidth = 0;
    switch (qtype) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
        int off = qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8;   /* the 16 code bytes */
        *lo_byte = off + k % 16; *lo_shift = k < 16 ? 0 : 4;
        if (qtype == Q5_0 || qtype == Q5_1) { *hi_byte = (qtype == Q5_0 ? 2 : 4) + k / 8; *hi_shift = k % 8; *hwidth = 1; }
        return;
    }
    case Q8_0: *lo_byte = 2 + k; *lo_shift = 0; return;
    case MXFP4: *lo_byte = 1 + k % 16; *lo_shift = k < 16 ? 0 : 4; return;   /* e, then Q4_0's nibbles */
    case Q4_K: case Q5_K: {   /* 4 runs of 32 bytes: run c's low nibbles are sub-block 2c, high 2c+1 */
        int w = k % 64;
        *lo_byte = (qtype == Q4_K ? 16 : 48) + (k / 64) * 32 + w % 32; *lo_shift = 4 * (w / 32);
        if (qtype == Q5_K) { *hi_byte = 16 + k % 32; *hi_shift = k / 32; *hwidth = 1; }
        return;
    }
    case Q6_K: {              /* halves of 128: ql 64 bytes (low / high nibbles), qh 32 bytes of 2-bit fields */
        int h = k / 128, w = k % 128;
        *lo_byte = h * 64 + w % 64; *lo_shift = 4 * (w / 64);
        *hi_byte = 128 + h * 32 + w % 32; *hi_shift = 2 * (w / 32); *hwidth = 2;
        return;
    }
    }
}

/* A block's re-lay as a gather: qs byte o of the block's slots is nibble (qa, sa) | nibble
 * (qb, sb) << 4 of the block (Q8_0: byte qa); value p of slot j's top-bit word comes from
 * (ha, hs), to bit hb[p]. */
typedef struct {
    int16_t base;              /* the window: block bytes [base, base + 32) */
    uint8_t ia[16], ib[16];    /* source byte - base of the low / high nibble of each output byte */
    uint8_t na[16], nb[16];    /* 0xff where that nibble is its source byte's high one */
} qs_run;

typedef struct {
    int16_t base;
    uint8_t idx[32];           /* bit t of the word: source byte - base (0x80: no source, bit 0) */
    uint8_t bit[32];           /* the source byte's bit tested (0xff where there is none) */
} qh_word;

typedef struct {
    int qk, bb, spb, nq, hmask;
    uint8_t qa[256], sa[256], qb[256], sb[256];   /* nq output qs bytes a block */
    uint8_t ha[256], hs[256];                      /* the block's values, slot by slot, p in storage order */
    uint8_t hb[MAXL];
    int simd;                  /* every run and word fits its window: relay_simd may take whole blocks */
    int reach;                 /* the block bytes the windows read, from the block's start */
    qs_run run[16];            /* nq / 16 runs a block */
    qh_word word[16];          /* spb words a block (formats with top bits) */
} relay;

/* The window of a run whose sources span [lo, hi]: its start, or -1 where 32 bytes cannot hold them. */
static int window(const relay *t, int lo, int hi) {
    int base = t->bb >= 32 && lo > t->bb - 32 ? t->bb - 32 : lo;
    return hi - base < 32 ? base : -1;
}

/* The vector form of the tables (relay_init's last step). */
static void relay_vectors(relay *t, int hbits, int L, int whole) {
    t->simd = 1;
    t->reach = 0;
    for (int c = 0; c < t->nq / 16; c++) {
        qs_run *r = &t->run[c];
        int lo = 255, hi = 0;
        for (int i = 0; i < 16; i++) {
            int a = t->qa[16 * c + i], b = t->qb[16 * c + i];
            lo = a < lo ? a : lo; hi = a > hi ? a : hi;
            if (!whole) { lo = b < lo ? b : lo; hi = b > hi ? b : hi; }
        }
        int base = window(t, lo, hi);
        if (base < 0) { t->simd = 0; return; }
        r->base = (int16_t)base;
        t->reach = base + 32 > t->reach ? base + 32 : t->reach;
        for (int i = 0; i < 16; i++) {
            r->ia[i] = (uint8_t)(t->qa[16 * c + i] - base); r->na[i] = t->sa[16 * c + i] ? 0xff : 0;
            r->ib[i] = whole ? 0 : (uint8_t)(t->qb[16 * c + i] - base);
            r->nb[i] = !whole && t->sb[16 * c + i] ? 0xff : 0;
        }
    }
    if (!hbits) return;
    for (int j = 0; j < t->spb; j++) {
        qh_word *w = &t->word[j];
        const uint8_t *ha = t->ha + j * L, *hs = t->hs + j * L;
        int lo = 255, hi = 0;
        for (int p = 0; p < L; p++) { lo = ha[p] < lo ? ha[p] : lo; hi = ha[p] > hi ? ha[p] : hi; }
        int base = window(t, lo, hi);
        if (base < 0) { t->simd = 0; return; }
        w->base = (int16_t)base;
        t->reach = base + 32 > t->reach ? base + 32 : t->reach;
        memset(w->idx, 0x80, 32);
        memset(w->bit, 0xff, 32);
        for (int p = 0; p < L; p++)
            for (int u = 0; u < hbits; u++) {
                int bit = t->hb[p] + u;
                if (bit >= 32 || hs[p] + u > 7) { t->simd = 0; return; }
                w->idx[bit] = (uint8_t)(ha[p] - base);
                w->bit[bit] = (uint8_t)(1u << (hs[p] + u));
            }
    }
}

static int relay_init(int qtype, relay *t) {
    fmt_t f;
    if (fmt_of(qtype, &f) || gguf_block(qtype, &t->qk, &t->bb)) return -1;
    int perm[MAXL], hb[MAXL], lb, ls, hbyte, hsh, hw = 0;
    for (int p = 0; p < f.L; p++) { slot_layout(&f, p, &perm[p], &hb[p]); t->hb[p] = (uint8_t)hb[p]; }
    t->spb = t->qk / f.L;
    t->nq = t->spb * f.nbytes;
    for (int j = 0; j < t->spb; j++) {
        for (int p = 0; p < f.nbytes; p++) {
            int o = j * f.nbytes + p;
            code_loc(qtype, j * f.L + perm[p], &lb, &ls, &hbyte, &hsh, &hw);
            t->qa[o] = (uint8_t)lb; t->sa[o] = (uint8_t)ls;
            if (qtype != Q8_0) {
                code_loc(qtype, j * f.L + perm[p + f.nbytes], &lb, &ls, &hbyte, &hsh, &hw);
                t->qb[o] = (uint8_t)lb; t->sb[o] = (uint8_t)ls;
            }
        }
        for (int p = 0; p < f.L; p++) {
            code_loc(qtype, j * f.L + perm[p], &lb, &ls, &hbyte, &hsh, &hw);
            t->ha[j * f.L + p] = (uint8_t)hbyte; t->hs[j * f.L + p] = (uint8_t)hsh;
        }
    }
    t->hmask = (1 << f.hbits) - 1;
    relay_vectors(t, f.hbits, f.L, qtype == Q8_0);
    return 0;
}

/* Q4_K / Q5_K's 12 scale bytes -> slot j's 6-bit scale | min << 8 (fmt_kquant._k_scales). */
static inline uint16_t kscale(const uint8_t *s12, int j) {
    const uint8_t *s = s12, *m = s12 + 4, *sm = s12 + 8;
    int sc = j < 4 ? s[j] & 63 : (sm[j - 4] & 15) | ((s[j - 4] >> 2) & 0x30);
    int mn = j < 4 ? m[j] & 63 : (sm[j - 4] >> 4) | ((m[j - 4] >> 2) & 0x30);
    return (uint16_t)(sc | mn << 8);
}

/* Bytes of one row's planes for K values: qs, qh (4 a slot), sc (<= 4 a slot), sd (<= 4 a slot). */
static inline size_t plane_bytes(const fmt_t *f, int K, size_t *qs, size_t *qh, size_t *sc) {
    int ns = K / f->L;
    *qs = (size_t)ns * f->nbytes;
    *qh = 4 * (size_t)ns;
    *sc = 4 * (size_t)ns;
    return *qs + *qh + *sc + 4 * (size_t)ns;
}

#if defined(__AVX2__)
#include <immintrin.h>

/* 16 bytes picked from the window w0 | w1 (idx 0..31). */
static inline __m128i pick16(__m128i w0, __m128i w1, __m128i idx) {
    __m128i upper = _mm_cmpgt_epi8(idx, _mm_set1_epi8(15));
    return _mm_blendv_epi8(_mm_shuffle_epi8(w0, idx), _mm_shuffle_epi8(w1, idx), upper);
}

/* The nibble of each byte that sel (0xff: the high one) names. */
static inline __m128i nibble16(__m128i v, __m128i sel) {
    const __m128i m4 = _mm_set1_epi8(15);
    return _mm_blendv_epi8(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4), sel);
}

/* Block b's qs bytes (nq) and its slots' top-bit words by the vector tables. */
static void relay_simd(const relay *t, int whole, int hbits, const uint8_t *b, uint8_t *q, uint8_t *qh) {
    for (int c = 0; c < t->nq / 16; c++) {
        const qs_run *r = &t->run[c];
        __m128i w0 = _mm_loadu_si128((const __m128i *)(b + r->base));
        __m128i w1 = _mm_loadu_si128((const __m128i *)(b + r->base + 16));
        __m128i lo = pick16(w0, w1, _mm_loadu_si128((const __m128i *)r->ia)), out;
        if (whole) out = lo;
        else {
            __m128i hi = pick16(w0, w1, _mm_loadu_si128((const __m128i *)r->ib));
            lo = nibble16(lo, _mm_loadu_si128((const __m128i *)r->na));
            hi = nibble16(hi, _mm_loadu_si128((const __m128i *)r->nb));
            out = _mm_or_si128(lo, _mm_slli_epi16(hi, 4));   /* hi <= 15 a byte: no carry into the next */
        }
        _mm_storeu_si128((__m128i *)(q + 16 * c), out);
    }
    if (!hbits) return;
    for (int j = 0; j < t->spb; j++) {
        const qh_word *w = &t->word[j];
        __m256i x = _mm256_loadu_si256((const __m256i *)(b + w->base));
        __m256i x0 = _mm256_permute2x128_si256(x, x, 0x00), x1 = _mm256_permute2x128_si256(x, x, 0x11);
        __m256i idx = _mm256_loadu_si256((const __m256i *)w->idx), bit = _mm256_loadu_si256((const __m256i *)w->bit);
        __m256i upper = _mm256_cmpgt_epi8(idx, _mm256_set1_epi8(15));   /* 0x80 < 0: x0's shuffle, a zero */
        __m256i v = _mm256_blendv_epi8(_mm256_shuffle_epi8(x0, idx), _mm256_shuffle_epi8(x1, idx), upper);
        uint32_t h = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit));
        memcpy(qh + 4 * (size_t)j, &h, 4);
    }
}
#define RELAY_SIMD 1
#else
#define RELAY_SIMD 0
static void relay_simd(const relay *t, int whole, int hbits, const uint8_t *b, uint8_t *q, uint8_t *qh) {
    (void)t; (void)whole; (void)hbits; (void)b; (void)q; (void)qh;
}
#endif

/* One GGUF row of K values -> its planes at qs, qh, sc, sd (the layout fmt.pack makes), by
 * the format's relay (relay_init): in vectors where the block's windows lie inside the row. */
static int relay_row(const relay *t, int qtype, const uint8_t *row, int K, uint8_t *qs, uint8_t *qh, uint8_t *sc,
                     uint8_t *sd) {
    fmt_t f;
    if (fmt_of(qtype, &f) || K % t->qk) return -1;
    size_t row_bytes = (size_t)(K / t->qk) * t->bb;
    for (int blk = 0; blk < K / t->qk; blk++) {
        const uint8_t *b = row + (size_t)blk * t->bb;
        uint8_t *q = qs + (size_t)blk * t->nq;
        int vec = RELAY_SIMD && t->simd && (size_t)blk * t->bb + t->reach <= row_bytes;
        if (vec)
            relay_simd(t, qtype == Q8_0, f.hbits, b, q, qh + 4 * (size_t)blk * t->spb);
        else if (qtype == Q8_0)
            for (int o = 0; o < t->nq; o++) q[o] = b[t->qa[o]];
        else
            for (int o = 0; o < t->nq; o++)
                q[o] = (uint8_t)(((b[t->qa[o]] >> t->sa[o]) & 15) | ((b[t->qb[o]] >> t->sb[o]) & 15) << 4);
        for (int j = 0; j < t->spb; j++) {
            int s = blk * t->spb + j;
            if (f.hbits && !vec) {
                uint32_t h = 0;
                const uint8_t *ha = t->ha + j * f.L, *hs = t->hs + j * f.L;
                for (int p = 0; p < f.L; p++) h |= (uint32_t)((b[ha[p]] >> hs[p]) & t->hmask) << t->hb[p];
                memcpy(qh + 4 * (size_t)s, &h, 4);
            }
            switch (qtype) {
            case Q4_K: case Q5_K: { uint16_t v = kscale(b + 4, j); memcpy(sc + 2 * (size_t)s, &v, 2); break; }
            case Q6_K: sc[s] = b[192 + j]; break;
            case Q4_1: case Q5_1: memcpy(sc + 4 * (size_t)s, b, 4); break;
            case Q8_0: if (j == 0) memcpy(sc + 2 * (size_t)blk, b, 2); break;
            case MXFP4: sc[s] = b[0]; break;                       /* the E8M0 byte */
            default: memcpy(sc + 2 * (size_t)s, b, 2); break;
            }
        }
        if (qtype == Q4_K || qtype == Q5_K) memcpy(sd + 4 * (size_t)blk, b, 4);
        if (qtype == Q6_K) memcpy(sd + 2 * (size_t)blk, b + 208, 2);
    }
    return 0;
}

int aq_repack_row(int qtype, const uint8_t *row, int K, uint8_t *qs, uint8_t *qh, uint8_t *sc, uint8_t *sd) {
    relay t;
    return relay_init(qtype, &t) ? -1 : relay_row(&t, qtype, row, K, qs, qh, sc, sd);
}

/* Row r of expert e of a mapped weight (rows >= split from raw2: gate|up fused from two tensors). */
static inline const uint8_t *raw_row(const qmat *w, int e, int r) {
    return r < w->split ? w->raw + e * w->raw_e + r * w->raw_r : w->raw2 + e * w->raw_e + (r - w->split) * w->raw_r;
}

/* Hint the kernel to read [p, p + n) ahead (the mapped tier's read-ahead); 0 on success. */
int aq_willneed(const void *p, size_t n) {
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(page - 1);
    return madvise((void *)a, n + ((uintptr_t)p - a), MADV_WILLNEED);
}

/* 1 where this build re-lays qtype's blocks in vectors (relay_simd), else 0; -1: no such format. */
int aq_relay_vectorized(int qtype) {
    relay t;
    return relay_init(qtype, &t) ? -1 : RELAY_SIMD && t.simd;
}
