// The persistent layer kernel, second form ("stream"): the queues of round_layer.cu
// (kernels/cuda/schedule.py), but the GEMV tiles read their weights straight from global
// memory (ld.global.nc, 16 bytes a lane, DEPTH loads a lane in flight) with no shared-memory
// ring, no producer warp and no barrier a tile. A CTA takes its queue in runs: a run is the
// consecutive GEMV tiles of one stage (one activation id); the run's rows are dealt to the
// NW warps in batches of R rows (every load of a batch issued before the first use), and the
// CTA meets at three barriers a run (after the wait, after the prologue, before the signals),
// not a tile. The next run's first batches are prefetched into L2 (cp.async.bulk.prefetch)
// before the run-end barrier, so the wait and the prologue overlap DRAM traffic.
// Attention splits and router tiles: their K/V or router rows copied into a shared slot by
// the whole CTA, then round_layer.cu's code on warps 0-7.
// Row bits: lane u sums slots u, u + 32, ... by fma in slot order, lanes by a xor butterfly
// (qgemv_i8's NT = 32 order), as round_layer.cu. A probe (bench/gpu_round_probe.py).
#include "round_common.cuh"
#include "round_gemv.cuh"
#include "round_attn.cuh"

#define STREAM_SLOT 32768            // attention's K and V (2 x CH x HD x 2) or 4 router rows of 2048 floats
#define STREAM_SMEM (STREAM_SLOT + ACT_BYTES)
#define FL_PREFETCH_SHIFT 0          // flags bits 0-3: batches a warp prefetches into L2 (0: none)
#define FL_BARE 16                   // timing control: GEMV runs with no prologue and no barriers (garbage sums)

__device__ __forceinline__ int4 ld_stream(const void* p) {
    int4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
    if (bytes == 0 || ((unsigned long long)p & 15) || (bytes & 15)) return;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}

struct RunGeo {
    int ns, nr, ng, ranks, qs_row, sc_row, sd_row, nu, upb;
    const unsigned char *qs, *sc, *sd;
};
__device__ __forceinline__ RunGeo run_geo(const int* I0, int nt, const u64* P, int R) {
    RunGeo g;
    g.ns = I0[F_NSLOTS]; g.nr = I0[F_NROWS]; g.ng = I0[F_NGROUPS];
    g.ranks = I0[F_PRO] == P_MULTI ? 8 : 1;
    g.qs_row = g.ns * 16; g.sc_row = g.ns * 2; g.sd_row = (g.ns / 8) * 4;
    g.nu = nt * g.nr;
    g.upb = g.ng >= R ? 1 : R / g.ng;
    g.qs = (const unsigned char*)P[I0[F_W]];
    g.sc = (const unsigned char*)P[I0[F_W] + 1];
    g.sd = (const unsigned char*)P[I0[F_W] + 2];
    return g;
}

// L2 prefetch of warp `warp`'s first `nb` batches of the run (rows mode only: routed rows
// are not known before the routing); lane k takes row k of a batch
template <int NW, int R>
__device__ void prefetch_run(const int* I0, int nt, const u64* P, int nb, int warp, int lane) {
    if (nb <= 0 || I0[F_OP] != OP_GEMV || I0[F_MODE] != M_ROWS) return;
    RunGeo g = run_geo(I0, nt, P, R);
    for (int b = 0; b < nb; b++) {
        int u0 = (warp + b * NW) * g.upb;
        int k = lane;
        if (k >= g.upb * g.ng) continue;
        int unit = u0 + k / g.ng, gr = k % g.ng;
        if (unit >= g.nu) continue;
        const int* It = I0 + (unit / g.nr) * NI;
        long long row = (long long)group_row(It, gr, 0) + unit % g.nr;
        prefetch_l2(g.qs + row * g.qs_row, g.qs_row);
        prefetch_l2(g.sc + row * g.sc_row, g.sc_row);
        prefetch_l2(g.sd + row * g.sd_row, g.sd_row);
    }
}

// a warp's batches of the run: R rows (whole units of ng rows) a batch, S slots a lane a row
template <int NW, int S, int R>
__device__ void gemv_rows(const int* I0, int nt, const unsigned char* act, const u64* P, const int* ids,
                          int warp, int lane, int* err) {
    RunGeo g = run_geo(I0, nt, P, R);
    if (g.ng > R || (g.ns + 31) / 32 > S) { if (lane == 0) atomicExch(err, 1 << 30); return; }
    const int K = g.ns * 32;
    const int M = 0x0F0F0F0F;
    for (int u0 = warp * g.upb; u0 < g.nu; u0 += NW * g.upb) {
        int rowi[R];
        bool ok[R];
        int rk[R];
#pragma unroll
        for (int k = 0; k < R; k++) {
            int unit = u0 + k / g.ng, gr = k % g.ng;
            ok[k] = k < g.upb * g.ng && unit < g.nu;
            const int* It = I0 + (ok[k] ? unit / g.nr : 0) * NI;
            rowi[k] = ok[k] ? group_row(It, gr, ids) + unit % g.nr : 0;
            rk[k] = g.ranks > 1 ? gr : 0;
        }
        int4 w[R][S];
        unsigned sv[R][S], dv[R][S];
#pragma unroll
        for (int k = 0; k < R; k++) {
#pragma unroll
            for (int t = 0; t < S; t++) {
                int u = lane + 32 * t;
                if (ok[k] && u < g.ns) {
                    long long row = rowi[k];
                    w[k][t] = ld_stream(g.qs + row * g.qs_row + u * 16);
                    sv[k][t] = __ldg((const unsigned short*)(g.sc + row * g.sc_row) + u);
                    dv[k][t] = __ldg((const unsigned*)(g.sd + row * g.sd_row) + (u >> 3));
                } else {
                    w[k][t] = make_int4(0, 0, 0, 0); sv[k][t] = 0; dv[k][t] = 0;
                }
            }
        }
        float y[R];
#pragma unroll
        for (int k = 0; k < R; k++) {
            const int4* xw = (const int4*)(act + rk[k] * K);
            const int2* rec = (const int2*)(act + g.ranks * K) + rk[k] * g.ns;
            float acc = 0.0f;
#pragma unroll
            for (int t = 0; t < S; t++) {
                int u = lane + 32 * t;
                if (ok[k] && u < g.ns) {
                    int4 x0 = xw[2 * u], x1 = xw[2 * u + 1];
                    int4 wv = w[k][t];
                    int isum = __dp4a(wv.x & M, x0.x, 0);
                    isum = __dp4a(wv.y & M, x0.y, isum);
                    isum = __dp4a(wv.z & M, x0.z, isum);
                    isum = __dp4a(wv.w & M, x0.w, isum);
                    isum = __dp4a((wv.x >> 4) & M, x1.x, isum);
                    isum = __dp4a((wv.y >> 4) & M, x1.y, isum);
                    isum = __dp4a((wv.z >> 4) & M, x1.z, isum);
                    isum = __dp4a((wv.w >> 4) & M, x1.w, isum);
                    unsigned s = sv[k][t], d = dv[k][t];
                    float s1 = __fmul_rn(h2f((unsigned short)(d & 0xFFFF)), (float)(s & 0xFF));
                    float s2 = __fmul_rn(h2f((unsigned short)(d >> 16)), (float)((s >> 8) & 0xFF));
                    int2 rc = rec[u];
                    float tt = __fsub_rn(__fmul_rn(s1, (float)isum), __fmul_rn(s2, (float)rc.x));
                    acc = __fmaf_rn(tt, __int_as_float(rc.y), acc);
                }
            }
            y[k] = ok[k] ? warp_sum(acc) : 0.0f;
        }
        if (lane == 0) {
#pragma unroll
            for (int k = 0; k < R; k++) {
                if (k % g.ng != 0 || !ok[k]) continue;
                int unit = u0 + k / g.ng;
                const int* It = I0 + (unit / g.nr) * NI;
                int r = unit % g.nr, epi = It[F_EPI], row = It[F_ROW0] + r;
                float* dst = (float*)P[It[F_DST]] + It[F_DOFF];
                if (epi == E_STORE) {
                    dst[row] = y[k];
                } else if (epi == E_RES) {
                    dst[row] = __fadd_rn(__ldcg((const float*)P[It[F_RES]] + row), y[k]);
                } else if (epi == E_SILU) {
                    float gg = y[k], uu = k + 1 < R ? y[k + 1 < R ? k + 1 : k] : 0.0f;
                    dst[row] = __fmul_rn(__fdiv_rn(gg, __fadd_rn(1.0f, expf(-gg))), uu);
                } else {                                  // E_MOE: the ranks' rows weighted, in rank order
                    const float* wt = (const float*)P[It[F_ROUTE]] + 8;
                    float a = 0.0f;
#pragma unroll
                    for (int kk = 0; kk < 8; kk++)
                        if (k + kk < R) a = __fadd_rn(a, __fmul_rn(__ldcg(wt + kk), y[k + kk < R ? k + kk : k]));
                    dst[row] = __fadd_rn(__ldcg((const float*)P[It[F_RES]] + row), a);
                }
            }
        }
    }
}

// slots a lane a row -> the batch shape (DEPTH: 16-byte weight loads a lane in flight)
template <int NW, int DEPTH>
__device__ void gemv_run(const int* I0, int nt, const unsigned char* act, const u64* P, const int* ids,
                         int warp, int lane, int* err) {
    const int S = (I0[F_NSLOTS] + 31) / 32;
    if (S <= 1) gemv_rows<NW, 1, (DEPTH > 8 ? DEPTH : 8)>(I0, nt, act, P, ids, warp, lane, err);
    else if (S == 2) gemv_rows<NW, 2, (DEPTH / 2 > 2 ? DEPTH / 2 : 2)>(I0, nt, act, P, ids, warp, lane, err);
    else if (S <= 4) gemv_rows<NW, 4, (DEPTH / 4 > 2 ? DEPTH / 4 : 2)>(I0, nt, act, P, ids, warp, lane, err);
    else if (S <= 8) gemv_rows<NW, 8, (DEPTH / 8 > 1 ? DEPTH / 8 : 1)>(I0, nt, act, P, ids, warp, lane, err);
    else if (S <= 12) gemv_rows<NW, 12, 1>(I0, nt, act, P, ids, warp, lane, err);
    else if (lane == 0) atomicExch(err, 1 << 29);
}
template <int NW, int DEPTH>
__device__ void prefetch_any(const int* I0, int nt, const u64* P, int nb, int warp, int lane) {
    const int S = (I0[F_NSLOTS] + 31) / 32;
    if (S <= 1) prefetch_run<NW, (DEPTH > 8 ? DEPTH : 8)>(I0, nt, P, nb, warp, lane);
    else if (S == 2) prefetch_run<NW, (DEPTH / 2 > 2 ? DEPTH / 2 : 2)>(I0, nt, P, nb, warp, lane);
    else if (S <= 4) prefetch_run<NW, (DEPTH / 4 > 2 ? DEPTH / 4 : 2)>(I0, nt, P, nb, warp, lane);
    else if (S <= 8) prefetch_run<NW, (DEPTH / 8 > 1 ? DEPTH / 8 : 1)>(I0, nt, P, nb, warp, lane);
    else prefetch_run<NW, 1>(I0, nt, P, nb, warp, lane);
}

// the end of the run starting at i: consecutive GEMV tiles of one activation id, else one instruction
__device__ __forceinline__ int run_end(const int* instrs, int q0, int nq, int i) {
    const int* I = instrs + (long long)(q0 + i) * NI;
    int j = i + 1;
    if (I[F_OP] == OP_GEMV)
        while (j < nq && instrs[(long long)(q0 + j) * NI + F_OP] == OP_GEMV &&
               instrs[(long long)(q0 + j) * NI + F_ACT] == I[F_ACT]) j++;
    return j;
}

// whole CTA: bytes from global (16-byte multiples) into shared memory
template <int NT>
__device__ __forceinline__ void copy_in(unsigned char* dst, const unsigned char* src, unsigned bytes, int tid) {
    for (unsigned o = tid * 16; o < bytes; o += NT * 16) *(int4*)(dst + o) = __ldcg((const int4*)(src + o));
}

template <int NW, int DEPTH>
__device__ void stream_body(const int* __restrict__ instrs, const int* __restrict__ qstart, unsigned* ctr,
                            int* err, const u64* __restrict__ P, unsigned long long flags) {
    constexpr int NT = NW * 32;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float red[8];
    __shared__ int flag;
    __shared__ int ids[8];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int q0 = qstart[blockIdx.x], nq = qstart[blockIdx.x + 1] - q0;
    const int npf = (int)((flags >> FL_PREFETCH_SHIFT) & 15);
    const bool bare = (flags & FL_BARE) != 0;
    unsigned char* slot = smem;
    unsigned char* act = smem + STREAM_SLOT;
    int last_act = -1;
    int i = 0, j = nq > 0 ? run_end(instrs, q0, nq, 0) : 0;
    if (nq > 0) prefetch_any<NW, DEPTH>(instrs + (long long)q0 * NI, j, P, npf, warp, lane);
    while (i < nq) {
        const int* I = instrs + (long long)(q0 + i) * NI;
        const int op = I[F_OP];
        const bool routed = op == OP_GEMV && I[F_MODE] != M_ROWS;
        if (tid == 0) {
            wait_counter(ctr, I[F_WAIT], I[F_TARGET], err);
            if (routed) wait_counter(ctr, I[F_RCTR], I[F_RTARGET], err);
        }
        if (routed) {
            __syncthreads();
            if (tid < 8) ids[tid] = __ldcg((const int*)P[I[F_ROUTE]] + tid);
        }
        if ((op == OP_GEMV && !bare) || op == OP_ROUTER) {
            if (I[F_ACT] != last_act) {
                __syncthreads();                         // the wait seen by all
                if (tid < NCONS) {
                    prologue(I, act, P, red, tid);
                    cons_sync();
                    if (I[F_DUMP] >= 0) dump_act(I, act, P, tid);
                }
                last_act = I[F_ACT];
            }
        }
        if (op == OP_GEMV) {
            if (!bare) __syncthreads();
            gemv_run<NW, DEPTH>(I, j - i, act, P, ids, warp, lane, err);
        } else if (op == OP_ROUTER) {
            copy_in<NT>(slot, (const unsigned char*)P[I[F_W]] + (long long)I[F_ROW0] * I[F_NSLOTS] * 4,
                        I[F_NROWS] * I[F_NSLOTS] * 4, tid);
            __syncthreads();
            if (tid < NCONS) router(I, slot, act, P, ctr, &flag, tid);
        } else {                                         // ATTN: the split's old keys and values
            int k0 = I[A_K0], k1 = min(I[A_K1], I[A_POS]);
            unsigned bytes = k1 > k0 ? (unsigned)(k1 - k0) * HD * 2 : 0;
            __syncthreads();
            copy_in<NT>(slot, (const unsigned char*)P[I[A_KC]] + (long long)k0 * HD * 2, bytes, tid);
            copy_in<NT>(slot + CH * HD * 2, (const unsigned char*)P[I[A_VC]] + (long long)k0 * HD * 2, bytes, tid);
            __syncthreads();
            if (tid < NCONS) attention(I, slot, act, P, ctr, &flag, tid);
            last_act = -1;                               // the scratch overwrote the activations
        }
        // the next run's first batches into L2 before this run's barrier
        const int nj = j < nq ? run_end(instrs, q0, nq, j) : j;
        if (j < nq) prefetch_any<NW, DEPTH>(instrs + (long long)(q0 + j) * NI, nj - j, P, npf, warp, lane);
        if (!bare || op != OP_GEMV) __syncthreads();
        if (tid == 0 && op == OP_GEMV) {
            for (int k = i; k < j; k++) {
                const int* Ik = instrs + (long long)(q0 + k) * NI;
                if (Ik[F_SIG] >= 0 && Ik[F_SIGN] > 0) signal_counter(ctr, Ik[F_SIG], Ik[F_SIGN]);
            }
        }
        i = j;
        j = nj;
    }
}

extern "C" __global__ void __launch_bounds__(512, 1)
round_stream_w16d8(const int* instrs, const int* qstart, unsigned* ctr, int* err, const u64* P,
                   unsigned long long flags) {
    stream_body<16, 8>(instrs, qstart, ctr, err, P, flags);
}
extern "C" __global__ void __launch_bounds__(512, 1)
round_stream_w16d16(const int* instrs, const int* qstart, unsigned* ctr, int* err, const u64* P,
                    unsigned long long flags) {
    stream_body<16, 16>(instrs, qstart, ctr, err, P, flags);
}
extern "C" __global__ void __launch_bounds__(256, 2)
round_stream_w8d8(const int* instrs, const int* qstart, unsigned* ctr, int* err, const u64* P,
                  unsigned long long flags) {
    stream_body<8, 8>(instrs, qstart, ctr, err, P, flags);
}
