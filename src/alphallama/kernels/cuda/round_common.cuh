// round_layer.cu's constants, instruction fields and small device helpers (PTX wrappers,
// warp reductions, the dependency counters).
#pragma once

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

