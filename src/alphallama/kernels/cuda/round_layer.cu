// A persistent decode-layer kernel in the "No Bubbles" form: one CTA an SM walks its own
// queue of instructions; an instruction waits on a dependency counter (not a grid barrier),
// and a producer warp streams the weights (or KV) of the instructions ahead into a ring of
// shared-memory slots by bulk copies (cp.async.bulk, completing on mbarriers) while the
// consumer warps wait on inputs or compute. Built by kernels/cuda/nvrtc.py (NVRTC, sm_90).
// A probe (bench/gpu_round_probe.py): correct, and 2.3-2.6x slower than the PDL chain on the
// H200 (docs/decisions/round-kernel-probe.md); not used by the runtime.
//
// Instruction: NI int32 (the layout is kernels/cuda/schedule.py's F_* names).
// GEMV   Q4_K rows [rowbase, +nrows) of 1, 2 (gate|up pair) or 8 (routed experts) row
//        groups against int8 activations the consumers quantize themselves into shared
//        memory (qgemv_i8's lane order and q8 rule), optionally RMS-normalized first; the
//        dp4a sums in qgemv_i8's order for a 32-slot step (lane u: slots u, u+32, ...),
//        the lanes summed by a butterfly (xor 16, 8, 4, 2, 1).
// ROUTER F32 router rows against the normalized input; the last tile to arrive takes the
//        softmax top-k (renormalized) and signals.
// ATTN   one KV group x one split of keys: q/k RMS norm, RoPE (NeoX halves), the new K/V
//        into the cache (fp16), scores, partial softmax; the last split to arrive merges.

#define NS 5                 // slots in the ring
#define SLOT_BYTES 40960
#define ACT_BYTES 20480
#define NI 32
#define NCONS 256            // consumer threads (8 warps); warp 8 is the producer
#define HD 128               // head dim
#define CH 64                // keys a split (at most)
#define SPIN_LIMIT (1 << 22)
#define NEG_INF __int_as_float(0xff800000)

enum { OP_GEMV = 1, OP_ROUTER = 2, OP_ATTN = 3 };
enum { P_PLAIN = 0, P_NORM = 1, P_MULTI = 2, P_NORMF = 3 };
enum { E_STORE = 0, E_RES = 1, E_SILU = 2, E_MOE = 3 };
enum { M_ROWS = 0, M_EXPERT = 1, M_RANKS = 2 };
// common fields
enum { F_OP = 0, F_WAIT = 1, F_TARGET = 2, F_SIG = 3, F_SIGN = 4, F_ACT = 5, F_DUMP = 6, F_NORM_EPS = 7 };
// GEMV / ROUTER fields
enum { F_W = 8, F_NSLOTS = 9, F_ROW0 = 10, F_NROWS = 11, F_NGROUPS = 12, F_GSTRIDE = 13, F_MODE = 14,
       F_RPE = 15, F_RANK = 16, F_ROUTE = 17, F_RCTR = 18, F_RTARGET = 19, F_PRO = 20, F_SRC = 21,
       F_NORMW = 22, F_SSTRIDE = 23, F_EPI = 24, F_DST = 25, F_RES = 26, F_DOFF = 27, F_ARRIVE = 28,
       F_NTILES = 29, F_TOPK = 30, F_NEXP = 31 };
// ATTN fields
enum { A_QKV = 8, A_KC = 9, A_VC = 10, A_QOFF = 11, A_KOFF = 12, A_VOFF = 13, A_POS = 14, A_K0 = 15,
       A_K1 = 16, A_QN = 17, A_KN = 18, A_COS = 19, A_SIN = 20, A_PART = 21, A_SPLIT = 22, A_NSPLIT = 23,
       A_ARRIVE = 24, A_OUT = 25, A_OOFF = 26, A_HG = 27 };

typedef unsigned long long u64;

// -- small helpers -------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void cons_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ void mbar_init(u64* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, unsigned parity) {
    unsigned ok = 0;
    while (!ok) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    }
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, u64* bar) {
    if (bytes == 0) return;
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ float warp_sum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 16));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 8));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 4));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ int warp_isum(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// spin until ctr[idx] >= target (one thread); a bound turns a schedule bug into an error, not a hang
__device__ void wait_counter(const unsigned* ctr, int idx, int target, int* err) {
    if (idx < 0) return;
    int n = 0;
    while ((int)ld_acquire(ctr + idx) < target) {
        if (++n > SPIN_LIMIT) { atomicExch(err, 1 + idx); return; }
        if ((n & 1023) == 0 && *(volatile int*)err) return;     // another wait gave up: drain, don't hang
    }
}
__device__ __forceinline__ void signal_counter(unsigned* ctr, int idx, int n) {
    __threadfence();
    atomicAdd(ctr + idx, (unsigned)n);
}

// -- Q4_K row-group geometry in a slot -------------------------------------------------
struct Geo { int qs_row, sc_row, sd_row, group; };
__device__ __forceinline__ Geo geo(int ns, int nrows) {
    Geo g; g.qs_row = ns * 16; g.sc_row = ns * 2; g.sd_row = (ns / 8) * 4;
    g.group = nrows * (g.qs_row + g.sc_row + g.sd_row);
    return g;
}
__device__ __forceinline__ int group_row(const int* I, int g, const int* ids) {
    int mode = I[F_MODE];
    if (mode == M_EXPERT) return ids[I[F_RANK]] * I[F_RPE] + I[F_ROW0] + g * I[F_GSTRIDE];
    if (mode == M_RANKS) return ids[g] * I[F_RPE] + I[F_ROW0];
    return I[F_ROW0] + g * I[F_GSTRIDE];
}

// -- the producer: copies for one instruction into slot `dst` ---------------------------------
__device__ void issue(const int* I, unsigned char* dst, u64* full, const u64* P, const unsigned* ctr, int* err) {
    int op = I[F_OP];
    if (op == OP_GEMV) {
        int ns = I[F_NSLOTS], nr = I[F_NROWS], ng = I[F_NGROUPS];
        Geo G = geo(ns, nr);
        int ids[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (I[F_MODE] != M_ROWS) {           // routed rows: the routing must be known first
            wait_counter(ctr, I[F_RCTR], I[F_RTARGET], err);
            const int* r = (const int*)P[I[F_ROUTE]];
            for (int k = 0; k < 8; k++) ids[k] = __ldcg(r + k);
        }
        mbar_expect_tx(full, (unsigned)(G.group * ng));
        const unsigned char* qs = (const unsigned char*)P[I[F_W]];
        const unsigned char* sc = (const unsigned char*)P[I[F_W] + 1];
        const unsigned char* sd = (const unsigned char*)P[I[F_W] + 2];
        for (int g = 0; g < ng; g++) {
            long long row = group_row(I, g, ids);
            unsigned char* d = dst + g * G.group;
            bulk_copy(d, qs + row * G.qs_row, nr * G.qs_row, full);
            bulk_copy(d + nr * G.qs_row, sc + row * G.sc_row, nr * G.sc_row, full);
            bulk_copy(d + nr * (G.qs_row + G.sc_row), sd + row * G.sd_row, nr * G.sd_row, full);
        }
    } else if (op == OP_ROUTER) {
        unsigned bytes = I[F_NROWS] * I[F_NSLOTS] * 4;         // F_NSLOTS holds K for the router
        mbar_expect_tx(full, bytes);
        bulk_copy(dst, (const unsigned char*)P[I[F_W]] + (long long)I[F_ROW0] * I[F_NSLOTS] * 4, bytes, full);
    } else {                                                  // ATTN: the split's old keys and values
        int k0 = I[A_K0], k1 = min(I[A_K1], I[A_POS]);
        unsigned bytes = k1 > k0 ? (unsigned)(k1 - k0) * HD * 2 : 0;
        mbar_expect_tx(full, 2 * bytes);
        bulk_copy(dst, (const unsigned char*)P[I[A_KC]] + (long long)k0 * HD * 2, bytes, full);
        bulk_copy(dst + CH * HD * 2, (const unsigned char*)P[I[A_VC]] + (long long)k0 * HD * 2, bytes, full);
    }
}

// -- activations: q8 of 32-value blocks, in qgemv_i8's lane order ---------------------------
// one thread, block b of src (times r * nw[k] when normalizing): its 8 code words (word e*4+v,
// byte j: the value k = 8j + 2v + e) and record (sum of q, bits of dx); qgemv_i8's q8 rule
__device__ void quant_block(const float* src, const float* nw, float r, int b, int* xw, int2* rec) {
    float a[32];
    const float4* s4 = (const float4*)(src + b * 32);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 v = __ldcg(s4 + i);
        a[4 * i] = v.x; a[4 * i + 1] = v.y; a[4 * i + 2] = v.z; a[4 * i + 3] = v.w;
    }
    if (nw) {
        const float4* w4 = (const float4*)(nw + b * 32);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 w = w4[i];
            a[4 * i] = __fmul_rn(__fmul_rn(a[4 * i], r), w.x);
            a[4 * i + 1] = __fmul_rn(__fmul_rn(a[4 * i + 1], r), w.y);
            a[4 * i + 2] = __fmul_rn(__fmul_rn(a[4 * i + 2], r), w.z);
            a[4 * i + 3] = __fmul_rn(__fmul_rn(a[4 * i + 3], r), w.w);
        }
    }
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(a[k]));
    float dx = __fdiv_rn(amax, 127.0f);
    float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    int xsum = 0;
    int w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < 32; k++) {
        int q = __float2int_rn(__fmul_rn(a[k], inv));
        xsum += q;
        int r8 = k & 7;
        w[(r8 & 1) * 4 + (r8 >> 1)] |= (q & 0xFF) << (8 * (k >> 3));
    }
    int4* d = (int4*)(xw + b * 8);
    d[0] = make_int4(w[0], w[1], w[2], w[3]);
    d[1] = make_int4(w[4], w[5], w[6], w[7]);
    rec[b] = make_int2(xsum, __float_as_int(dx));
}

// sum of squares of src[0:K] over the consumers, the same order on every CTA -> 1/rms
__device__ float inv_rms(const float* src, int K, float eps, float* red, int tid) {
    float s = 0.0f;
    for (int k = tid; k < K; k += NCONS) { float v = __ldcg(src + k); s = __fmaf_rn(v, v, s); }
    s = warp_sum(s);
    if ((tid & 31) == 0) red[tid >> 5] = s;
    cons_sync();
    float t = 0.0f;
    for (int w = 0; w < 8; w++) t = __fadd_rn(t, red[w]);
    cons_sync();
    return rsqrtf(__fadd_rn(__fdiv_rn(t, (float)K), eps));
}

__device__ void prologue(const int* I, unsigned char* act, const u64* P, float* red, int tid) {
    int pro = I[F_PRO], K = I[F_OP] == OP_ROUTER ? I[F_NSLOTS] : I[F_NSLOTS] * 32;
    const float* src = (const float*)P[I[F_SRC]];
    float r = 1.0f;
    const float* nw = 0;
    if (pro == P_NORM || pro == P_NORMF) {
        r = inv_rms(src, K, __int_as_float(I[F_NORM_EPS]), red, tid);
        nw = (const float*)P[I[F_NORMW]];
    }
    if (pro == P_NORMF) {                                 // floats for the router
        float* h = (float*)act;
        for (int k = tid; k < K; k += NCONS) h[k] = __fmul_rn(__fmul_rn(__ldcg(src + k), r), nw[k]);
        return;
    }
    int ranks = pro == P_MULTI ? 8 : 1;
    int nb = K / 32;
    for (int i = tid; i < ranks * nb; i += NCONS) {
        int rk = i / nb, b = i % nb;
        quant_block(src + (long long)rk * I[F_SSTRIDE], nw, r, b, (int*)(act + rk * K),
                    (int2*)(act + ranks * K) + rk * nb);
    }
}

// the activations as prepared (xq bytes, then the records) for the checks
__device__ void dump_act(const int* I, const unsigned char* act, const u64* P, int tid) {
    int K = I[F_NSLOTS] * 32, ranks = I[F_PRO] == P_MULTI ? 8 : 1;
    int words = (ranks * K + ranks * I[F_NSLOTS] * 8) / 4;
    int* d = (int*)P[I[F_DUMP]];
    for (int i = tid; i < words; i += NCONS) d[i] = ((const int*)act)[i];
}

// -- GEMV: a warp a row, lane u the slots u, u+32, ... (qgemv_i8's NT = 32 order) ---------------
__device__ float row_dot(const unsigned char* grp, int r, int nr, int ns, const unsigned char* act, int ranks,
                         int rank, int lane) {
    Geo G = geo(ns, nr);
    const int4* qs = (const int4*)(grp + r * G.qs_row);
    const unsigned short* sc = (const unsigned short*)(grp + nr * G.qs_row + r * G.sc_row);
    const unsigned* sd = (const unsigned*)(grp + nr * (G.qs_row + G.sc_row) + r * G.sd_row);
    const int K = ns * 32;
    const int4* xw = (const int4*)(act + rank * K);
    const int2* rec = (const int2*)(act + ranks * K) + rank * ns;
    const int M = 0x0F0F0F0F;
    const int steps = (ns + 31) / 32;
    float acc = 0.0f;
    for (int j0 = 0; j0 < steps; j0 += 4) {
        float tt[4], dd[4];
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {           // the slots' terms: independent, in flight together
            int u = lane + 32 * (j0 + jj);
            tt[jj] = 0.0f; dd[jj] = 0.0f;
            if (j0 + jj < steps && u < ns) {
                int4 w = qs[u];
                int4 x0 = xw[2 * u], x1 = xw[2 * u + 1];
                int isum = __dp4a(w.x & M, x0.x, 0);
                isum = __dp4a(w.y & M, x0.y, isum);
                isum = __dp4a(w.z & M, x0.z, isum);
                isum = __dp4a(w.w & M, x0.w, isum);
                isum = __dp4a((w.x >> 4) & M, x1.x, isum);
                isum = __dp4a((w.y >> 4) & M, x1.y, isum);
                isum = __dp4a((w.z >> 4) & M, x1.z, isum);
                isum = __dp4a((w.w >> 4) & M, x1.w, isum);
                unsigned sv = sc[u], dv = sd[u >> 3];
                float s1 = __fmul_rn(h2f((unsigned short)(dv & 0xFFFF)), (float)(sv & 0xFF));
                float s2 = __fmul_rn(h2f((unsigned short)(dv >> 16)), (float)((sv >> 8) & 0xFF));
                int2 rc = rec[u];
                tt[jj] = __fsub_rn(__fmul_rn(s1, (float)isum), __fmul_rn(s2, (float)rc.x));
                dd[jj] = __int_as_float(rc.y);
            }
        }
#pragma unroll
        for (int jj = 0; jj < 4; jj++)              // acc over the lane's slots in slot order
            if (j0 + jj < steps && lane + 32 * (j0 + jj) < ns) acc = __fmaf_rn(tt[jj], dd[jj], acc);
    }
    return warp_sum(acc);
}

__device__ void gemv(const int* I, const unsigned char* slot, const unsigned char* act, const u64* P,
                     float* ybuf, int tid) {
    int ns = I[F_NSLOTS], nr = I[F_NROWS], ng = I[F_NGROUPS];
    int ranks = I[F_PRO] == P_MULTI ? 8 : 1;
    Geo G = geo(ns, nr);
    int lane = tid & 31, warp = tid >> 5;
    for (int rr = warp; rr < nr * ng; rr += 8) {
        int g = rr / nr, r = rr % nr;
        float y = row_dot(slot + g * G.group, r, nr, ns, act, ranks, ranks > 1 ? g : 0, lane);
        if (lane == 0) ybuf[rr] = y;
    }
    cons_sync();
    int epi = I[F_EPI], row0 = I[F_ROW0];
    float* dst = (float*)P[I[F_DST]] + I[F_DOFF];
    if (tid < nr) {
        if (epi == E_STORE) {
            dst[row0 + tid] = ybuf[tid];
        } else if (epi == E_RES) {
            const float* res = (const float*)P[I[F_RES]];
            dst[row0 + tid] = __fadd_rn(__ldcg(res + row0 + tid), ybuf[tid]);
        } else if (epi == E_SILU) {                  // groups: gate rows, up rows
            float g = ybuf[tid], u = ybuf[nr + tid];
            dst[row0 + tid] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
        } else {                                     // E_MOE: the ranks' rows weighted, in rank order
            const float* wt = (const float*)P[I[F_ROUTE]] + 8;
            const float* res = (const float*)P[I[F_RES]];
            float acc = 0.0f;
            for (int k = 0; k < 8; k++) acc = __fadd_rn(acc, __fmul_rn(__ldcg(wt + k), ybuf[k * nr + tid]));
            dst[row0 + tid] = __fadd_rn(__ldcg(res + row0 + tid), acc);
        }
    }
}

// -- ROUTER: F32 rows against the normalized floats; the last tile takes top-k ------------------
__device__ void router(const int* I, const unsigned char* slot, const unsigned char* act, const u64* P,
                       unsigned* ctr, int* flag, int tid) {
    int K = I[F_NSLOTS], nr = I[F_NROWS], lane = tid & 31, warp = tid >> 5;
    const float* h = (const float*)act;
    float* logits = (float*)P[I[F_DST]];
    for (int r = warp; r < nr; r += 8) {
        const float4* w = (const float4*)(slot + (long long)r * K * 4);
        float acc = 0.0f;
        for (int k4 = lane; k4 < K / 4; k4 += 32) {
            float4 v = w[k4];
            acc = __fmaf_rn(v.x, h[4 * k4], acc);
            acc = __fmaf_rn(v.y, h[4 * k4 + 1], acc);
            acc = __fmaf_rn(v.z, h[4 * k4 + 2], acc);
            acc = __fmaf_rn(v.w, h[4 * k4 + 3], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) logits[I[F_ROW0] + r] = acc;
    }
    cons_sync();
    if (tid == 0) {
        __threadfence();
        unsigned old = atomicAdd(ctr + I[F_ARRIVE], 1u);
        *flag = old == (unsigned)(I[F_NTILES] - 1);
        __threadfence();
    }
    cons_sync();
    if (!*flag || warp != 0) return;
    // warp 0: softmax top-k over E = 32 * EPL experts, renormalized over the k taken
    const int E = I[F_NEXP], topk = I[F_TOPK];
    float v[4];
    for (int i = 0; i < 4; i++) v[i] = (lane + 32 * i) < E ? __ldcg(logits + lane + 32 * i) : NEG_INF;
    float mx = warp_max(fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3])));
    int* route = (int*)P[I[F_ROUTE]];
    float num[8], tot = 0.0f;
    int id[8];
    for (int k = 0; k < topk; k++) {
        float bv = NEG_INF; int bi = 1 << 30;
        for (int i = 0; i < 4; i++) if (v[i] > bv) { bv = v[i]; bi = lane + 32 * i; }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if ((bi & 31) == lane) v[bi >> 5] = NEG_INF;
        id[k] = bi;
        num[k] = expf(__fsub_rn(bv, mx));
        tot = __fadd_rn(tot, num[k]);
    }
    if (lane == 0) {
        for (int k = 0; k < topk; k++) {
            route[k] = id[k];
            ((float*)route)[8 + k] = __fdiv_rn(num[k], tot);
        }
        signal_counter(ctr, I[F_SIG], 1);
    }
}

// -- ATTN: one KV group's HG heads over one split of keys --------------------------------------
__device__ void head_norm_rope(float* x, const float* nw, const float* cs, const float* sn, float eps, int lane) {
    // x [HD] in shared memory: RMS norm (weight nw), then RoPE on the halves (i, i + HD/2)
    float s = 0.0f;
    for (int d = lane; d < HD; d += 32) s = __fmaf_rn(x[d], x[d], s);
    s = warp_sum(s);
    float r = rsqrtf(__fadd_rn(__fdiv_rn(s, (float)HD), eps));
    float a[4];
    for (int j = 0; j < 4; j++) a[j] = __fmul_rn(__fmul_rn(x[lane + 32 * j], r), nw[lane + 32 * j]);
    __syncwarp();
    for (int j = 0; j < 2; j++) {
        int i = lane + 32 * j;                       // i < HD/2: pairs (a[j], a[j + 2])
        float x1 = a[j], x2 = a[j + 2], c = cs[i], sv = sn[i];
        x[i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sv));
        x[i + HD / 2] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sv));
    }
    __syncwarp();
}

__device__ void attention(const int* I, unsigned char* slot, unsigned char* scratch, const u64* P,
                          unsigned* ctr, int* flag, int tid) {
    const int HG = I[A_HG], pos = I[A_POS], k0 = I[A_K0], k1 = I[A_K1];
    const int lane = tid & 31, warp = tid >> 5, nk = k1 - k0;
    const float eps = __int_as_float(I[F_NORM_EPS]);
    float* q = (float*)scratch;                       // [HG][HD]
    float* kn = q + 8 * HD;                           // the new key, value [HD] each
    float* vn = kn + HD;
    float* sc = vn + HD;                              // [HG][CH] scores, then exp
    float* ml = sc + 8 * CH;                          // [HG][2]
    const float* qkv = (const float*)P[I[A_QKV]];
    const float* cs = (const float*)P[I[A_COS]];
    const float* sn = (const float*)P[I[A_SIN]];
    for (int i = tid; i < HG * HD; i += NCONS) q[i] = __ldcg(qkv + I[A_QOFF] + i);
    const bool has_new = k1 == pos + 1;
    if (has_new && tid < HD) { kn[tid] = __ldcg(qkv + I[A_KOFF] + tid); vn[tid] = __ldcg(qkv + I[A_VOFF] + tid); }
    cons_sync();
    if (warp < HG) head_norm_rope(q + warp * HD, (const float*)P[I[A_QN]], cs, sn, eps, lane);
    cons_sync();
    unsigned short* ks = (unsigned short*)slot;                 // [nk][HD]: the old keys, then the new one
    unsigned short* vs = (unsigned short*)(slot + CH * HD * 2);
    if (has_new) {                                              // into the cache and beside the old ones
        if (warp == 0) {
            head_norm_rope(kn, (const float*)P[I[A_KN]], cs, sn, eps, lane);
            unsigned short* kc = (unsigned short*)P[I[A_KC]] + (long long)pos * HD;
            for (int d = lane; d < HD; d += 32) { unsigned short hv = f2h(kn[d]); kc[d] = hv; ks[(pos - k0) * HD + d] = hv; }
        } else if (warp == 1) {
            unsigned short* vc = (unsigned short*)P[I[A_VC]] + (long long)pos * HD;
            for (int d = lane; d < HD; d += 32) { unsigned short hv = f2h(vn[d]); vc[d] = hv; vs[(pos - k0) * HD + d] = hv; }
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // before the slot's next bulk copy
        cons_sync();
    }
    // scores: a thread a (head, key), the dims walked from a lane-rotated start (no bank conflicts)
    const float scale = rsqrtf((float)HD);
    const unsigned* k2 = (const unsigned*)slot;
    for (int p = tid; p < HG * CH; p += NCONS) {
        int h = p / CH, t = p % CH;
        if (t < nk) {
            const float* qh = q + h * HD;
            float acc = 0.0f;
#pragma unroll 8
            for (int j = 0; j < HD / 2; j++) {
                int d2 = (j + lane) & (HD / 2 - 1);
                unsigned kk = k2[t * (HD / 2) + d2];
                acc = __fmaf_rn(qh[2 * d2], h2f((unsigned short)(kk & 0xFFFF)), acc);
                acc = __fmaf_rn(qh[2 * d2 + 1], h2f((unsigned short)(kk >> 16)), acc);
            }
            sc[h * CH + t] = __fmul_rn(acc, scale);
        }
    }
    cons_sync();
    if (warp < HG) {
        float a = lane < nk ? sc[warp * CH + lane] : NEG_INF;
        float b = lane + 32 < nk ? sc[warp * CH + lane + 32] : NEG_INF;
        float m = warp_max(fmaxf(a, b));
        float ea = lane < nk ? expf(__fsub_rn(a, m)) : 0.0f;
        float eb = lane + 32 < nk ? expf(__fsub_rn(b, m)) : 0.0f;
        float l = warp_sum(__fadd_rn(ea, eb));
        if (lane < nk) sc[warp * CH + lane] = ea;
        if (lane + 32 < nk) sc[warp * CH + lane + 32] = eb;
        if (lane == 0) { ml[2 * warp] = m; ml[2 * warp + 1] = l; }
    }
    cons_sync();
    // partial [HG][4 + HD]: m, l, -, -, acc
    float* part = (float*)P[I[A_PART]] + (long long)I[A_SPLIT] * HG * (4 + HD);
    for (int i = tid; i < HG * HD; i += NCONS) {
        int h = i / HD, d = i % HD;
        float acc = 0.0f;
        for (int t = 0; t < nk; t++) {
            acc = __fmaf_rn(sc[h * CH + t], h2f(vs[t * HD + d]), acc);
        }
        part[h * (4 + HD) + 4 + d] = acc;
        if (d == 0) { part[h * (4 + HD)] = ml[2 * h]; part[h * (4 + HD) + 1] = ml[2 * h + 1]; }
    }
    cons_sync();
    if (tid == 0) {
        __threadfence();
        unsigned old = atomicAdd(ctr + I[A_ARRIVE], 1u);
        *flag = old == (unsigned)(I[A_NSPLIT] - 1);
        __threadfence();
    }
    cons_sync();
    if (!*flag) return;
    // the last split merges the group's splits in split order
    const float* p0 = (const float*)P[I[A_PART]];
    float* out = (float*)P[I[A_OUT]] + I[A_OOFF];
    const int S = I[A_NSPLIT];
    for (int i = tid; i < HG * HD; i += NCONS) {
        int h = i / HD, d = i % HD;
        float M = NEG_INF;
        for (int j = 0; j < S; j++) M = fmaxf(M, __ldcg(p0 + (j * HG + h) * (4 + HD)));
        float L = 0.0f, o = 0.0f;
        for (int j = 0; j < S; j++) {
            const float* pj = p0 + (j * HG + h) * (4 + HD);
            float e = expf(__fsub_rn(__ldcg(pj), M));
            L = __fmaf_rn(__ldcg(pj + 1), e, L);
            o = __fmaf_rn(__ldcg(pj + 4 + d), e, o);
        }
        out[i] = __fdiv_rn(o, L);
    }
    cons_sync();
    if (tid == 0) signal_counter(ctr, I[F_SIG], 1);
}

// -- the kernel --------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(288, 1)
round_layer(const int* __restrict__ instrs, const int* __restrict__ qstart, unsigned* ctr, int* err,
            const u64* __restrict__ P) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 full[NS], empty[NS];
    __shared__ float ybuf[64];
    __shared__ float red[8];
    __shared__ int flag;
    const int tid = threadIdx.x;
    const int q0 = qstart[blockIdx.x], nq = qstart[blockIdx.x + 1] - q0;
    if (tid == 0) {
        for (int s = 0; s < NS; s++) { mbar_init(&full[s], 1); mbar_init(&empty[s], 1); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    unsigned char* act = smem + NS * SLOT_BYTES;
    if (tid >= NCONS) {                                  // the producer warp
        if (tid == NCONS) {
            for (int i = 0; i < nq; i++) {
                int s = i % NS;
                if (i >= NS) mbar_wait(&empty[s], ((i / NS) & 1) ^ 1);
                issue(instrs + (long long)(q0 + i) * NI, smem + s * SLOT_BYTES, &full[s], P, ctr, err);
            }
        }
        return;
    }
    int last_act = -1, seen_ctr = -1, seen_target = 0, seen_route = -1;
    for (int i = 0; i < nq; i++) {
        const int* I = instrs + (long long)(q0 + i) * NI;
        const int s = i % NS, op = I[F_OP];
        unsigned char* slot = smem + s * SLOT_BYTES;
        // a wait this CTA has already seen satisfied is skipped, barrier and all (uniform)
        const bool need = I[F_WAIT] >= 0 && !(I[F_WAIT] == seen_ctr && I[F_TARGET] <= seen_target);
        const bool route = op == OP_GEMV && I[F_EPI] == E_MOE && I[F_RCTR] != seen_route;
        if (need || route) {
            if (tid == 0) {
                if (need) wait_counter(ctr, I[F_WAIT], I[F_TARGET], err);
                if (route) wait_counter(ctr, I[F_RCTR], I[F_RTARGET], err);
            }
            cons_sync();
            if (need) { seen_ctr = I[F_WAIT]; seen_target = I[F_TARGET]; }
            if (route) seen_route = I[F_RCTR];
        }
        if (op != OP_ATTN && I[F_ACT] != last_act) {
            prologue(I, act, P, red, tid);
            cons_sync();
            if (I[F_DUMP] >= 0) { dump_act(I, act, P, tid); }
            last_act = I[F_ACT];
        }
        mbar_wait(&full[s], (i / NS) & 1);
        if (op == OP_GEMV) {
            gemv(I, slot, act, P, ybuf, tid);
        } else if (op == OP_ROUTER) {
            router(I, slot, act, P, ctr, &flag, tid);
        } else {
            attention(I, slot, act, P, ctr, &flag, tid);
            last_act = -1;                               // the scratch overwrote the activations
        }
        cons_sync();
        if (tid == 0) {
            mbar_arrive(&empty[s]);
            if (op == OP_GEMV && I[F_SIG] >= 0 && I[F_SIGN] > 0) signal_counter(ctr, I[F_SIG], I[F_SIGN]);
        }
    }
}
