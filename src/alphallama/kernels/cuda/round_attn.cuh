// round_layer.cu's attention split: q/k norm, RoPE, the new K/V, partial softmax, the merge.
#pragma once
#include "round_common.cuh"

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

