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
#include "round_common.cuh"
#include "round_gemv.cuh"
#include "round_attn.cuh"

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
