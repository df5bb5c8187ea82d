"""The expert contract (expert_q8.py) in Triton: a MoE layer over an expert store whose
experts may sit in the VRAM bank, in pinned host RAM read in place over PCIe, or be
computed by the CPU workers (offload/native) where they sit.

    quantize  x rows -> xq / dx / xs on the device (and into the mailbox)
    post      every (row, rank) pair gets a tier: 0 bank, 1 host read in place, 2 CPU;
              if any pair is the CPU's: ids and tasks into the mailbox, then REQ last
    gate_up   pairs of tier 0/1: act(gate, up) (+ the expert's biases first), quantized
              -> aq / adx / axs
    down      pairs of tier 0/1: y [W, k, D] (+ the expert's down bias)
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

from .expert_q8 import CHUNK, QBLOCK, XS_GROUP
from ..formats.fmt_misc import E2M1_WORDS
from ..formats.fmt_triton import levels16_biased
from ..formats.qweight import QuantWeight
from ..activations.act_ids import OAI_ALPHA, OAI_LIMIT

NUM_WARPS = 4
BN_GATE = 32        # gate|up rows per program: a multiple of the 32-value activation block
BN_DOWN = 32
BD_COMBINE = 256
SPIN_LIMIT = 1 << 26   # polls before the combine gives up on the CPU (and flags the mailbox's ERR)

# qtype -> (BITS, HBITS, BIAS, HAS_MIN): field width, top bits in qh, code offset, min term
CODES: dict[T, tuple[int, int, int, bool]] = {
    T.Q4_K: (4, 0, 0, True), T.Q5_K: (4, 1, 0, True), T.Q6_K: (4, 2, 32, False),
    T.Q4_0: (4, 0, 8, False), T.Q5_0: (4, 1, 16, False), T.Q8_0: (8, 0, 128, False),   # Q8_0: load xors 0x80
    T.Q4_1: (4, 0, 0, True), T.Q5_1: (4, 1, 0, True)}   # their loads give B = -m
# the contract's formats whose codes are levels of a table: qtype -> (BITS, HBITS, BIAS, HAS_MIN, LEVELS),
# LEVELS the table's four words of level + 128 bytes (fmt_iq4.level_words), BIAS 128 takes the 128 off
LEVEL_CODES: dict[T, tuple[int, int, int, bool, tuple[int, int, int, int]]] = {
    T.MXFP4: (4, 0, 128, False, E2M1_WORDS)}   # the doubled E2M1 levels; A = 2^(e - 128), the load's


def contract_codes(qtype: T) -> tuple[int, int, int, bool, tuple]:
    """(BITS, HBITS, BIAS, HAS_MIN, LEVELS) of a contract format (LEVELS () : the codes are affine)."""
    return (*CODES[qtype], ()) if qtype in CODES else LEVEL_CODES[qtype]


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
def chunk_sums(acc, t, C: tl.constexpr):
    """acc [BN] + the C 8-slot chunks of t [BN, 8C], each summed pairwise
    ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)), added chunk after chunk."""
    BN: tl.constexpr = t.shape[0]
    a, b = tl.split(tl.reshape(t, (BN, 4 * C, 2)))
    a, b = tl.split(tl.reshape(a + b, (BN, 2 * C, 2)))
    a, b = tl.split(tl.reshape(a + b, (BN, C, 2)))
    c = a + b                                                          # [BN, C]
    if C == 1:
        acc = acc + tl.reshape(c, (BN,))
    elif C == 2:
        c0, c1 = tl.split(c)
        acc = (acc + c0) + c1
    elif C == 4:
        e, o = tl.split(tl.reshape(c, (BN, 2, 2)))                     # chunks (0, 2), (1, 3)
        c0, c2 = tl.split(e)
        c1, c3 = tl.split(o)
        acc = (((acc + c0) + c1) + c2) + c3
    else:
        tl.static_assert(C == 8, "CHUNKS_PER_STEP must be 1, 2, 4 or 8")
        e, o = tl.split(tl.reshape(c, (BN, 4, 2)))                     # chunks (0, 2, 4, 6), (1, 3, 5, 7)
        ee, eo = tl.split(tl.reshape(e, (BN, 2, 2)))                   # (0, 4), (2, 6)
        oe, oo = tl.split(tl.reshape(o, (BN, 2, 2)))                   # (1, 5), (3, 7)
        c0, c4 = tl.split(ee)
        c2, c6 = tl.split(eo)
        c1, c5 = tl.split(oe)
        c3, c7 = tl.split(oo)
        acc = (((((((acc + c0) + c1) + c2) + c3) + c4) + c5) + c6) + c7
    return acc


@triton.jit
def _codes(words, h, I: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
           LEVELS: tl.constexpr):
    """Field I of words [NT, BN, V] (plus its top bits from the slot's qh word h
    [NT, BN]; or its level of LEVELS) as the signed integer code: int32 [NT, BN, V]."""
    c = (words >> (BITS * I)) & ((1 << BITS) - 1)
    if HBITS > 0:
        v = tl.arange(0, words.shape[2])[None, None, :] * HBITS       # [1, 1, V]
        c = c | (((h[:, :, None] >> (4 * I + v)) & ((1 << HBITS) - 1)) << 4)
    if len(LEVELS) > 0:
        c = levels16_biased(c, LEVELS[0], LEVELS[1], LEVELS[2], LEVELS[3])   # level + 128
    return c - BIAS


@triton.jit
def _matvec(xq_row, dx_row, xs_row, qs, qh, sc, sd, row, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
            V: tl.constexpr, P: tl.constexpr, SLOT: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr,
            BIAS: tl.constexpr, HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, LEVELS: tl.constexpr):
    """Weight rows `row` [1, BN] (int64) times one quantized activation row: [BN] float32."""
    acc = tl.zeros([BN], tl.float32)
    koff = tl.arange(0, 2 * V)[None, None, :]                         # [1, 1, 2V]
    for s0 in range(0, n_slots, NT):
        words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)   # [NT, BN, V], [NT, BN] x3
        us = s0 + tl.arange(0, NT)                                    # [NT]
        u = us[:, None, None]                                         # [NT, 1, 1]
        isum = tl.zeros([NT, BN, V], tl.int32)
        for i in tl.static_range(0, P, 2):
            # fields i, i+1 of the V words are the slot's 2V consecutive k from i * V
            xv = tl.load(xq_row + u * SLOT + i * V + koff, mask=u < n_slots, other=0).to(tl.int32)  # [NT, 1, 2V]
            x_a, x_b = tl.split(tl.reshape(xv, (NT, 1, V, 2)))       # [NT, 1, V] each
            isum += _codes(words, h, i, BITS, HBITS, BIAS, LEVELS) * x_a
            isum += _codes(words, h, i + 1, BITS, HBITS, BIAS, LEVELS) * x_b
        t = s1 * tl.sum(isum, axis=2).to(tl.float32)                   # [NT, BN]: A * isum
        live = us < n_slots
        if HAS_MIN:
            xg = us * (SLOT // 16)
            xsum = tl.load(xs_row + xg, mask=live, other=0) + tl.load(xs_row + xg + 1, mask=live, other=0)  # [NT]
            t = t - s2 * xsum.to(tl.float32)[:, None]
        dxs = tl.load(dx_row + us * SLOT // 32, mask=live, other=0.0)  # [NT]
        t = tl.where(live[:, None], t * dxs[:, None], 0.0)
        # NT = 8 C slots: C contract chunks per step (more bytes in flight per program);
        # a chunk wholly past n_slots adds +0, an identity here (acc is never -0)
        acc = chunk_sums(acc, tl.trans(t), NT // 8)
    return acc


@triton.jit
def _act_c(g, u, ACT: tl.constexpr):
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


@triton.jit
def _act_quantize_store(g, u, aq_pair, adx_pair, axs_pair, n0, BN: tl.constexpr, ACT: tl.constexpr):
    a = _act_c(g, u, ACT)                                             # [BN]
    q, dx = quantize_block(tl.reshape(a, (BN // 32, 32)))             # [BN/32, 32], [BN/32]
    tl.store(aq_pair + n0 + tl.arange(0, BN), tl.reshape(q, (BN,)).to(tl.int8))
    tl.store(adx_pair + n0 // 32 + tl.arange(0, BN // 32), dx)
    tl.store(axs_pair + n0 // 16 + tl.arange(0, BN // 16), tl.sum(tl.reshape(q, (BN // 16, 16)), axis=1))


@triton.jit(do_not_specialize=["one"])
def q8_gate_up_kernel(xq, dx, xs, aq, adx, axs, experts, tier, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, F, one,
                    TOP_K: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr, V: tl.constexpr, P: tl.constexpr,
                    SLOT: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                    HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, LEVELS: tl.constexpr = (),
                    ebias=None, HAS_EBIAS: tl.constexpr = False, ACT: tl.constexpr = 0):
    """Program (pair, block of BN gate rows); pair = row * TOP_K + rank. HAS_EBIAS: ebias
    [E, 2F] fp32 (gate's then up's) added to the sums; ACT: _act_c's activation."""
    n_fb = F // BN
    pair = tl.program_id(0) // n_fb
    n0 = (tl.program_id(0) % n_fb) * BN
    if tl.load(tier + pair) != 2:
        K: tl.constexpr = n_slots * SLOT
        m = (pair // TOP_K).to(tl.int64)
        e = tl.load(experts + pair).to(tl.int64)
        slot = tl.load(table + e).to(tl.int64)
        n = (n0 + tl.arange(0, BN))[None, :]                          # [1, BN]
        xr, dr, sr = xq + m * K, dx + m * (K // 32), xs + m * (K // 16)
        if slot >= 0:
            g = _matvec(xr, dr, sr, bqs, bqh, bsc, bsd, slot * 2 * F + n, one, n_slots, LOAD, V, P, SLOT, BITS,
                        HBITS, BIAS, HAS_MIN, BN, NT, LEVELS)
            u = _matvec(xr, dr, sr, bqs, bqh, bsc, bsd, slot * 2 * F + F + n, one, n_slots, LOAD, V, P, SLOT, BITS,
                        HBITS, BIAS, HAS_MIN, BN, NT, LEVELS)
        else:
            g = _matvec(xr, dr, sr, qs, qh, sc, sd, e * 2 * F + n, one, n_slots, LOAD, V, P, SLOT, BITS,
                        HBITS, BIAS, HAS_MIN, BN, NT, LEVELS)
            u = _matvec(xr, dr, sr, qs, qh, sc, sd, e * 2 * F + F + n, one, n_slots, LOAD, V, P, SLOT, BITS,
                        HBITS, BIAS, HAS_MIN, BN, NT, LEVELS)
        if HAS_EBIAS:
            nb = n0 + tl.arange(0, BN)                                # [BN]
            g = g + tl.load(ebias + e * 2 * F + nb)
            u = u + tl.load(ebias + e * 2 * F + F + nb)
        p64 = pair.to(tl.int64)
        _act_quantize_store(g, u, aq + p64 * F, adx + p64 * (F // 32), axs + p64 * (F // 16), n0, BN, ACT)


@triton.jit(do_not_specialize=["one"])
def q8_down_kernel(aq, adx, axs, y, experts, tier, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, D, one,
                 n_slots: tl.constexpr, LOAD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, SLOT: tl.constexpr,
                 BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr,
                 BN: tl.constexpr, NT: tl.constexpr, LEVELS: tl.constexpr = (), ebias=None,
                 HAS_EBIAS: tl.constexpr = False):
    """Program (pair, block of BN output rows): y[pair] for pairs the GPU computes (+ its
    expert's row of ebias [E, D] with HAS_EBIAS)."""
    n_db = tl.cdiv(D, BN)
    pair = tl.program_id(0) // n_db
    n_out = (tl.program_id(0) % n_db) * BN + tl.arange(0, BN)         # [BN]
    if tl.load(tier + pair) != 2:
        F: tl.constexpr = n_slots * SLOT
        p64 = pair.to(tl.int64)
        e = tl.load(experts + pair).to(tl.int64)
        slot = tl.load(table + e).to(tl.int64)
        n = tl.minimum(n_out, D - 1)[None, :]                         # [1, BN]; past D: recomputed, not stored
        ar, dr, sr = aq + p64 * F, adx + p64 * (F // 32), axs + p64 * (F // 16)
        if slot >= 0:
            acc = _matvec(ar, dr, sr, bqs, bqh, bsc, bsd, slot * D + n, one, n_slots, LOAD, V, P, SLOT, BITS,
                          HBITS, BIAS, HAS_MIN, BN, NT, LEVELS)
        else:
            acc = _matvec(ar, dr, sr, qs, qh, sc, sd, e * D + n, one, n_slots, LOAD, V, P, SLOT, BITS,
                          HBITS, BIAS, HAS_MIN, BN, NT, LEVELS)
        if HAS_EBIAS:
            acc = acc + tl.load(ebias + e * D + n_out, mask=n_out < D, other=0.0)
        tl.store(y + p64 * D + n_out, acc, mask=n_out < D)


# -- activations in, tiers, the mailbox, and the ordered combine ---------------------------
@triton.jit
def q8_quantize_kernel(x, xq, dx, xs, mxq, mdx, mxs, stride_x, K: tl.constexpr, POST: tl.constexpr,
                       KP: tl.constexpr):
    """Program per row: the contract's q8 of x[row] into the device buffers (and the mailbox).
    KP: K's next power of two (gpt-oss's 2880: 4096), the blocks past K zeros, not stored."""
    m = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, KP)
    a = tl.load(x + m * stride_x + k, mask=k < K, other=0.0).to(tl.float32)   # [KP]
    q, d = quantize_block(tl.reshape(a, (KP // 32, 32)))             # [KP/32, 32], [KP/32]
    q8 = tl.reshape(q, (KP,)).to(tl.int8)
    s = tl.sum(tl.reshape(q, (KP // 16, 16)), axis=1)                 # [KP/16]
    b, g = tl.arange(0, KP // 32), tl.arange(0, KP // 16)
    tl.store(xq + m * K + k, q8, mask=k < K)
    tl.store(dx + m * (K // 32) + b, d, mask=b < K // 32)
    tl.store(xs + m * (K // 16) + g, s, mask=g < K // 16)
    if POST:
        tl.store(mxq + m * K + k, q8, mask=k < K)
        tl.store(mdx + m * (K // 32) + b, d, mask=b < K // 32)
        tl.store(mxs + m * (K // 16) + g, s, mask=g < K // 16)


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


CHUNKS_PER_STEP = 2   # C: contract chunks per step (no bit depends on it): the fastest resident, near the
                      # best over PCIe (docs/decisions/expert-contract.md)


def layout_args(w: QuantWeight, chunks: int | None = None) -> dict:
    """A weight's constexprs for _matvec."""
    bits, hbits, bias, has_min, levels = contract_codes(w.qtype)
    fmt = w.fmt
    if CHUNK != 8 or QBLOCK != 32 or XS_GROUP != 16:
        raise AssertionError("the kernels are written for CHUNK 8, QBLOCK 32, XS_GROUP 16")
    return dict(n_slots=w.n_slots, LOAD=fmt.triton_load, V=fmt.V, P=fmt.P, SLOT=fmt.slot, BITS=bits, HBITS=hbits,
                BIAS=bias, HAS_MIN=has_min, NT=CHUNK * (chunks or CHUNKS_PER_STEP),
                **({"LEVELS": levels} if levels else {}))
