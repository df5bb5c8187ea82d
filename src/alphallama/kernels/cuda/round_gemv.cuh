// round_layer.cu's Q4_K slot geometry, the consumers' activation prologue (q8 in
// qgemv_i8's order), the GEMV tile and the router tile.
#pragma once
#include "round_common.cuh"

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

