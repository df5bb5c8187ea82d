"""The expert contract (expert_q8.py) in Triton: what a MoE layer over an expert store needs
around the experts' GEMVs, whose experts may sit in the VRAM bank, in pinned host RAM read in
place over PCIe, or be computed by the CPU workers (offload/native) where they sit.

    quantize  x rows -> xq / dx / xs into the mailbox (the CPU workers' input)
    post      every (row, rank) pair gets a tier: 0 bank, 1 host read in place, 2 CPU;
              if any pair is the CPU's: ids and tasks into the mailbox, then REQ last
    gate_up,  pairs of tier 0/1: moe_i8's kernels with CONTRACT (the contract's lanes, adds,
    down      tree and act_c, the activation in fp32), the CPU's pairs skipped
    combine   rows with a CPU pair wait for DONE == REQ; then the ranks in order,
              acc = acc + w_r * y_r, y_r from the device or from the mailbox

Every float operation is the contract's, in its order, compiled with
enable_fp_fusion=False and without tl.fma (the interpreter's fma rounds twice), so a
pair's bits are the same on the GPU, in the interpreter, in the CPU workers and in
the plain-torch reference, whichever tier computed it and whatever W is.
"""
from __future__ import annotations

import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from ..activations.act_ids import OAI_ALPHA, OAI_LIMIT

NUM_WARPS = 4
BD_COMBINE = 256
SPIN_LIMIT = 1 << 26   # polls before the combine gives up on the CPU (and flags the mailbox's ERR)

# qtype -> (BITS, HBITS, BIAS, HAS_MIN): field width, top bits in qh, code offset, min term
CODES: dict[T, tuple[int, int, int, bool]] = {
    T.Q4_K: (4, 0, 0, True), T.Q5_K: (4, 1, 0, True), T.Q6_K: (4, 2, 32, False),
    T.Q4_0: (4, 0, 8, False), T.Q5_0: (4, 1, 16, False), T.Q8_0: (8, 0, 128, False),   # Q8_0: load xors 0x80
    T.Q4_1: (4, 0, 0, True), T.Q5_1: (4, 1, 0, True)}   # their loads give B = -m
_OAI_ALPHA: tl.constexpr = tl.constexpr(OAI_ALPHA)
_OAI_LIMIT: tl.constexpr = tl.constexpr(OAI_LIMIT)


@triton.jit
def _rne(v):
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _exp_c(v):
    v = tl.minimum(tl.maximum(v, -87.0), 87.0)
    n = _rne(v * 1.4426950408889634)
    r = (v - n * 0.693359375) - n * -2.1219444005469057e-4
    p = r * 0.0 + 1.9841269841269841e-4          # 1/5040
    p = p * r + 1.3888888888888889e-3             # 1/720
    p = p * r + 8.333333333333333e-3              # 1/120
    p = p * r + 4.1666666666666664e-2             # 1/24
    p = p * r + 0.16666666666666666               # 1/6
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return p * scale


@triton.jit
def q8_scale(amax):
    """A 32-block's largest |value| -> (dx = amax / 127, the multiplier 127 / amax that
    rounds its values to q; 0 for a block of zeros): expert_q8.quantize_q8's rule, shared
    by every quantizer on the GPU so that they make the same bytes."""
    dx = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    safe = tl.where(amax > 0, amax, 1.0)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), safe), 0.0)
    return dx, inv


@triton.jit
def quantize_block(a):
    """a [R, 32] float32 -> (q int32 [R, 32], dx [R]) as expert_q8.quantize_q8."""
    dx, inv = q8_scale(tl.max(tl.abs(a), axis=1))                    # [R] each
    q = _rne(a * inv[:, None]).to(tl.int32)                           # [R, 32]
    return q, dx


@triton.jit
def act_c(g, u, ACT: tl.constexpr):
    """The contract's activation of gate g and up u [BN] (expert_q8.CONTRACT_ACTS): ACT 0 SiLU,
    2 swiglu_oai (its clamps as compare-selects, as the C workers and the reference)."""
    one = tl.full(g.shape, 1.0, tl.float32)
    if ACT == 2:
        g = tl.where(g > _OAI_LIMIT, _OAI_LIMIT, g)
        u = tl.where(u > _OAI_LIMIT, _OAI_LIMIT, tl.where(u < -_OAI_LIMIT, -_OAI_LIMIT, u)) + one
        z = g * _OAI_ALPHA
    else:
        tl.static_assert(ACT == 0, "the contract's activations are SiLU (0) and swiglu_oai (2)")
        z = g
    return (g * tl.math.div_rn(one, one + _exp_c(-z))) * u


# -- activations in, tiers, the mailbox, and the ordered combine ---------------------------
@triton.jit
def q8_quantize_kernel(x, xq, dx, xs, stride_x, K: tl.constexpr, KP: tl.constexpr):
    """Program per row: the contract's q8 of x[row] (into the mailbox: the CPU workers' input).
    KP: K's next power of two (gpt-oss's 2880: 4096), the blocks past K zeros, not stored."""
    m = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, KP)
    a = tl.load(x + m * stride_x + k, mask=k < K, other=0.0).to(tl.float32)   # [KP]
    q, d = quantize_block(tl.reshape(a, (KP // 32, 32)))             # [KP/32, 32], [KP/32]
    s = tl.sum(tl.reshape(q, (KP // 16, 16)), axis=1)                 # [KP/16]
    b, g = tl.arange(0, KP // 32), tl.arange(0, KP // 16)
    tl.store(xq + m * K + k, tl.reshape(q, (KP,)).to(tl.int8), mask=k < K)
    tl.store(dx + m * (K // 32) + b, d, mask=b < K // 32)
    tl.store(xs + m * (K // 16) + g, s, mask=g < K // 16)


@triton.jit
def _st_release_sys(ptr, val):
    return tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [ptr, val], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ld_acquire_sys(ptr):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def q8_post_kernel(experts, table, tier, share, seq, mids, mtask, ctl, n_pairs, layer, W,
                 BP: tl.constexpr, POST: tl.constexpr, GPU: tl.constexpr, REQ: tl.constexpr, LAYER: tl.constexpr,
                 ROWS: tl.constexpr):
    """One program: each pair's tier; of the n host pairs (table -1) the first
    (n * share + 128) >> 8 (share in 0..256) go to the CPU, the rest are read over
    PCIe; a pair of a mapped expert (table -2: in the GGUF file's mapping, offload/mapped.py)
    is always the CPU's. If the CPU got any: ids and tasks into the mailbox, then REQ =
    ++seq, last. REQ, LAYER, ROWS: the control words' indices (offload/mailbox.py)."""
    p = tl.arange(0, BP)
    live = p < n_pairs
    e = tl.load(experts + p, mask=live, other=0)
    slot = tl.load(table + e, mask=live, other=0)
    host = live & (slot == -1)
    n_host = tl.sum(host.to(tl.int32), axis=0)
    limit = (n_host * tl.load(share) + 128) >> 8
    rank = tl.cumsum(host.to(tl.int32), axis=0) - 1
    cpu = ((host & (rank < limit)) | (live & (slot < -1))) & POST
    t = tl.where(slot >= 0, 0, tl.where(cpu, 2, 1))
    tl.store(tier + p, t, mask=live)
    if POST:
        n_cpu = tl.sum(cpu.to(tl.int32), axis=0)
        if n_cpu > 0:
            tl.store(mids + p, e, mask=live)
            tl.store(mtask + p, cpu.to(tl.int32), mask=live)
            s = tl.load(seq) + 1
            tl.store(seq, s)
            tl.store(ctl + LAYER, layer)
            tl.store(ctl + ROWS, W)
            tl.debug_barrier()
            if GPU:
                _st_release_sys(ctl + REQ + tl.zeros([1], tl.int32), tl.full([1], s, tl.int32))
            else:
                tl.store(ctl + REQ, s)


@triton.jit
def q8_combine_kernel(y, ycpu, weights, tier, out, seq, ctl, D, TOP_K: tl.constexpr, BD: tl.constexpr,
                    WAIT: tl.constexpr, LIMIT: tl.constexpr, DONE: tl.constexpr, ERR: tl.constexpr):
    """Program (row, block of BD): wait for the CPU if the row has a CPU pair, then
    acc = acc + w_r * y_r over the ranks in order. DONE, ERR: control word indices."""
    n_db = tl.cdiv(D, BD)
    m = (tl.program_id(0) // n_db).to(tl.int64)
    n = (tl.program_id(0) % n_db) * BD + tl.arange(0, BD)             # [BD]
    r = tl.arange(0, TOP_K)
    if WAIT:
        if tl.max(tl.load(tier + m * TOP_K + r), axis=0) == 2:
            s = tl.load(seq)
            flag = tl.zeros([1], tl.int32) + ctl + DONE
            done = tl.max(_ld_acquire_sys(flag), axis=0)
            i = 0
            while (done != s) & (i < LIMIT):
                done = tl.max(_ld_acquire_sys(flag), axis=0)
                i += 1
            if done != s:
                tl.store(ctl + ERR, 1)
    acc = tl.zeros([BD], tl.float32)
    for k in tl.static_range(TOP_K):
        w = tl.load(weights + m * TOP_K + k)
        off = (m * TOP_K + k) * D + n
        if tl.load(tier + m * TOP_K + k) == 2:
            v = tl.load(ycpu + off, mask=n < D, other=0.0, volatile=True)
        else:
            v = tl.load(y + off, mask=n < D, other=0.0)
        acc = acc + w * v
    tl.store(out + m * D + n, acc, mask=n < D)
