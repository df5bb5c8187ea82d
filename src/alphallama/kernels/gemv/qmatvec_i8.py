"""qmatvec_i8: x [W, K] @ w[N, K]^T -> [W, N] float32 under the expert contract
(expert_q8.py), with int8 activations and dp4a; and the pieces the int8 GEMVs share.

`w & 0x0F0F0F0F` puts 4 codes of a qs word in 4 byte lanes and one dp4a multiplies them
with 4 int8 activations into an int32; only the per-slot scale work is float.

    prepare  (one program per row and block of x): the contract's q8 of x (quantize_q8's
             rule), its bytes stored in each format's dp4a lane order (`lane_perm`),
             and per slot the record (sum of its q, dx of its 32-block)
    gemv     (one program per x row and BN weight rows): per step NT slots (NT the
             contract's lanes); per slot isum = sum_lanes dp4a(codes, x) - BIAS * xsum
             (exact), then the contract's float32 sequence t = A * isum [- B * xsum],
             lane = lane + t * dx (slot s in lane s mod NT), the lanes' pairwise tree

Integer sums are exact in any order; the float part follows the contract to the bit,
so a row equals expert_q8.matvec_q8 and its bits do not depend on W or its column. The
dense decode GEMV is qgemv_i8 (an fma a slot and tl.sum: faster, not the contract); the
contract's experts run moe_i8 with CONTRACT, on contract_step and lane_tree from here.
Compiled with enable_fp_fusion=False, without tl.fma (the contract has no fused ops).
Under TRITON_INTERPRET=1 (no inline asm) the same integers come from plain shifts and
multiplies (the DP4A constexpr).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe.expert_q8 import QBLOCK, contract_lanes
from ..moe.expert_q8_gpu import CODES, quantize_block
from ..formats.format import slot_positions
from .qgemv_i8_table import ACT_ORDER, i8_codes
from .tree import tree_sum
from ..pdl import pdl_kwargs, pdl_start
from ..formats.qweight import QuantWeight, check_gemv_args

MAX_BW = 16             # x rows per program (one named accumulator each below)
NUM_WARPS = 4
PREP_BLOCK = 256        # x values per prepare program (32 if K is not a multiple)


# -- activations: the contract's q8, in dp4a lane order -----------------------------------
def lane_perm(slot: int, V: int, bits: int) -> torch.Tensor:
    """Byte p of a slot's packed activations holds the q8 of k position perm[p]: int64 [slot].
    4-bit codes: word e V + v (e = 0: fields 0,2,4,6 of qs word v, i.e. w & 0x0F0F0F0F;
    e = 1: fields 1,3,5,7, (w >> 4) & 0x0F0F0F0F), byte j = field 2j + e: the lo and hi
    words are two V-word vectors, loaded like the V qs words. 8-bit: word v, byte j =
    field j of qs word v."""
    P = 32 // bits
    pos = slot_positions(V, P)                                        # [V, P]
    if bits == 8:
        return pos.flatten()
    e, v, j = torch.meshgrid(torch.arange(2), torch.arange(V), torch.arange(P // 2), indexing="ij")
    return pos[v, 2 * j + e].flatten()                                 # [(e, v, j)] = [slot]


@triton.jit
def emit_q8(a, k0, m, xp, xsd, K: tl.constexpr, SLOT: tl.constexpr, V: tl.constexpr, BITS: tl.constexpr,
            MASKED: tl.constexpr = False):
    """The contract's q8 of a [BQ] float32 (x[m, k0:k0+BQ], k0 a multiple of 32) -> xp
    (int8 [W, K]: the bytes in lane order) and xsd (int32 [W, K/SLOT, 2]: per slot (sum
    of q, bits of dx)). MASKED: k may run past K (a row's padding, where a must be 0);
    nothing is stored past it. Shared by the prepare kernel and the producers that fuse
    it (kernels/norm/rmsnorm.py)."""
    BQ: tl.constexpr = a.shape[0]
    k = k0 + tl.arange(0, BQ)                                          # [BQ]
    q, dx = quantize_block(tl.reshape(a, (BQ // 32, 32)))            # [BQ/32, 32] int32, [BQ/32]: QBLOCK
    q = tl.reshape(q, (BQ,))
    # the inverse of lane_perm: k = (j // 2) 2V + 2v + (j % 2) for field j of qs word v
    r = k % (2 * V)
    jh = (k % SLOT) // (2 * V)
    if BITS == 4:
        lane = ((r % 2) * V + r // 2) * 4 + jh                        # word e V + v, byte j // 2
    else:
        lane = (r // 2) * 4 + 2 * jh + r % 2                           # word v, byte j
    dest = (k // SLOT) * SLOT + lane                                   # [BQ]: the byte's lane position
    xsum = tl.sum(tl.reshape(q, (BQ // SLOT, SLOT)), axis=1)          # [BQ/SLOT]
    if SLOT == 16:
        dxs = tl.reshape(tl.join(dx, dx), (BQ // SLOT,))              # two slots per 32-block
    elif SLOT == 8:                                                    # four (the codebook formats' groups)
        d2 = tl.join(dx, dx)
        dxs = tl.reshape(tl.join(d2, d2), (BQ // SLOT,))
    else:
        dxs = dx
    rec = tl.join(xsum, dxs.to(tl.int32, bitcast=True))               # [BQ/SLOT, 2]
    s = k0 // SLOT + tl.arange(0, BQ // SLOT)                          # [BQ/SLOT]: the slots
    roff = m * (K // SLOT) * 2 + s[:, None] * 2 + tl.arange(0, 2)[None, :]
    if MASKED:
        tl.store(xp + m * K + dest, q.to(tl.int8), mask=k < K)
        tl.store(xsd + roff, rec, mask=(s < K // SLOT)[:, None])
    else:
        tl.store(xp + m * K + dest, q.to(tl.int8))
        tl.store(xsd + roff, rec)


@triton.jit
def _prepare_kernel(x, xp, xsd, stride_x, K: tl.constexpr, BQ: tl.constexpr, SLOT: tl.constexpr, V: tl.constexpr,
                    BITS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row m, block b of BQ values): q8 of x[m, block] -> xp (lane order), and
    per slot the int32 pair (sum of q, bits of dx)."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    k = b * BQ + tl.arange(0, BQ)                                     # [BQ]
    emit_q8(tl.load(x + m * stride_x + k).to(tl.float32), b * BQ, m, xp, xsd, K, SLOT, V, BITS)


# -- the GEMV ------------------------------------------------------------------------------
@triton.jit
def dp4a(a, b, c, DP4A: tl.constexpr):
    """c + sum over the 4 byte lanes of a (unsigned) times b (signed): int32."""
    if DP4A:
        out = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = c + ((a & 0xFF) * ((b << 24) >> 24)) + (((a >> 8) & 0xFF) * ((b << 16) >> 24)) \
            + (((a >> 16) & 0xFF) * ((b << 8) >> 24)) + (((a >> 24) & 0xFF) * (b >> 24))
    return out


@triton.jit
def _dot_words(a, b, c, DP4A: tl.constexpr):
    """c + the dp4a of a [NT, BN, V] with b [NT, 1, V] summed over V, as one chain of
    dp4a (the V words are in one thread: the splits are free): [NT, BN] int32."""
    V: tl.constexpr = a.shape[2]
    if V == 4:
        a02, a13 = tl.split(tl.reshape(a, (a.shape[0], a.shape[1], 2, 2)))
        b02, b13 = tl.split(tl.reshape(b, (b.shape[0], 1, 2, 2)))
        a0, a2 = tl.split(a02)
        a1, a3 = tl.split(a13)
        b0, b2 = tl.split(b02)
        b1, b3 = tl.split(b13)
        c = dp4a(a3, b3, dp4a(a2, b2, dp4a(a1, b1, dp4a(a0, b0, c, DP4A), DP4A), DP4A), DP4A)
    else:
        tl.static_assert(V == 2, "V is 2 or 4")
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        c = dp4a(a1, b1, dp4a(a0, b0, c, DP4A), DP4A)
    return c


@triton.jit
def unpack_lanes(words, h, BITS: tl.constexpr, HBITS: tl.constexpr):
    """words [NT, BN, V] (+ the slot's qh word h [NT, BN]) -> the codes in byte lanes:
    (lo, hi) [NT, BN, V] int32 (8-bit codes: (words, words))."""
    if BITS == 8:
        lo = words
        hi = words
    else:
        lo = words & 0x0F0F0F0F
        hi = (words >> 4) & 0x0F0F0F0F
        if HBITS > 0:
            # top bits of field i of word v sit at bit 4 i + HBITS v of h; byte j of lo is
            # field 2j (top bits at 8j + HBITS v), of hi field 2j + 1 (at 8j + 4 + HBITS v)
            HM: tl.constexpr = ((1 << HBITS) - 1) * 0x10101010
            v = tl.arange(0, words.shape[2])[None, None, :] * HBITS   # [1, 1, V]
            hh = h[:, :, None]                                         # [NT, BN, 1]
            lo = lo | ((hh << (4 - v)) & HM)
            hi = hi | ((hh >> v) & HM)
    return lo, hi


@triton.jit
def slot_terms_i8(lo, hi, s1, s2, xp_row, xsd_row, u, EVEN: tl.constexpr, n_slots: tl.constexpr,
                BITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr, DP4A: tl.constexpr):
    """One x row against NT slots u [NT] (codes lo/hi [NT, BN, V]): (t = A * isum
    [- B * xsum] [NT, BN], dx [NT]), the integer part exact. Shared with qgemv_i8."""
    V: tl.constexpr = lo.shape[2]
    XW: tl.constexpr = 2 * V if BITS == 4 else V                       # activation words per slot
    u3 = u[:, None, None]                                              # [NT, 1, 1]
    xoff = u3 * XW + tl.arange(0, V)[None, None, :]                    # [NT, 1, V]: the lo words
    roff = u[:, None] * 2 + tl.arange(0, 2)[None, :]                   # [NT, 2]
    if EVEN:
        x_lo = tl.load(xp_row + xoff)                                  # [NT, 1, V] int32
        rec = tl.load(xsd_row + roff)                                  # [NT, 2]
    else:
        x_lo = tl.load(xp_row + xoff, mask=u3 < n_slots, other=0)
        rec = tl.load(xsd_row + roff, mask=u[:, None] < n_slots, other=0)
    xsum, dxb = tl.split(rec)                                          # [NT] each
    x_hi = x_lo
    if BITS == 4:
        if EVEN:
            x_hi = tl.load(xp_row + xoff + V)                          # [NT, 1, V]: the hi words
        else:
            x_hi = tl.load(xp_row + xoff + V, mask=u3 < n_slots, other=0)
    return _slot_math(lo, hi, s1, s2, x_lo, x_hi, xsum, BITS, BIAS, HAS_MIN, DP4A), dxb.to(tl.float32, bitcast=True)


@triton.jit
def _slot_math(lo, hi, s1, s2, x_lo, x_hi, xsum, BITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr,
               DP4A: tl.constexpr):
    """t = A * isum [- B * xsum] [NT, BN] from the codes lo/hi [NT, BN, V], the activation
    words x_lo/x_hi [NT, 1, V] (x_hi unused for 8-bit codes) and xsum [NT]."""
    if BITS == 4:
        isum = _dot_words(hi, x_hi, _dot_words(lo, x_lo, 0, DP4A), DP4A)   # [NT, BN]
    else:
        isum = _dot_words(lo, x_lo, 0, DP4A)
    if BIAS != 0:
        isum = isum - BIAS * xsum[:, None]                             # codes c = q - BIAS
    t = s1 * isum.to(tl.float32)                                       # A * isum
    if HAS_MIN:
        t = t - s2 * xsum.to(tl.float32)[:, None]                      # - B * xsum
    return t


@triton.jit
def contract_step(acc, lo, hi, s1, s2, xp_row, xsd_row, u, EVEN: tl.constexpr, n_slots: tl.constexpr,
                  BITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr, DP4A: tl.constexpr):
    """acc [NT, BN] lanes + one x row's terms of the NT slots u [NT], slot s in lane s mod NT:
    lane + t dx, two roundings (no fma; padded slots: dx = 0, an identity)."""
    t, dx = slot_terms_i8(lo, hi, s1, s2, xp_row, xsd_row, u, EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A)
    return acc + t * dx[:, None]


@triton.jit
def lane_tree(acc):
    """acc [NT, BN] -> [BN]: the lanes' pairwise tree, adjacent pairs first (expert_q8.lane_sum)."""
    NT: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    return tl.reshape(tree_sum(tl.reshape(tl.permute(acc, (1, 0)), (BN, 1, NT)), NT), (BN,))


@triton.jit(do_not_specialize=["one"])
def _qmatvec_i8_kernel(xp, xsd, out, qs, qh, sc, sd, W, N, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
                       V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                       HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr):
    """Program (x row m, BN weight rows): the contract's sums of row m."""
    EVEN: tl.constexpr = n_slots % NT == 0
    XROW: tl.constexpr = n_slots * (2 * V if BITS == 4 else V)        # int32 words per packed x row
    n_nb = tl.cdiv(N, BN)
    m = (tl.program_id(0) // n_nb).to(tl.int64)
    n_out = (tl.program_id(0) % n_nb) * BN + tl.arange(0, BN)         # [BN]
    row = tl.minimum(n_out, N - 1).to(tl.int64)[None, :]               # [1, BN]; past N: recomputed, not stored
    acc = tl.zeros([NT, BN], tl.float32)
    for s0 in range(0, n_slots, NT):
        words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)   # [NT, BN, V], [NT, BN] x3
        lo, hi = unpack_lanes(words, h, BITS, HBITS)
        acc = contract_step(acc, lo, hi, s1, s2, xp + m * XROW, xsd + m * n_slots * 2, s0 + tl.arange(0, NT),
                            EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A)
    tl.store(out + m * N + n_out, lane_tree(acc), mask=n_out < N)


# -- host side -------------------------------------------------------------------------------
def lane_order(w: QuantWeight) -> tuple[int, int, int]:
    """(slot, V, bits): what the activations' byte order depends on (Q4_K, Q5_K, Q4_0,
    Q5_0 and the dense GEMV's IQ4_NL, IQ4_XS share one; Q6_K has its own; Q8_0 and the
    dense GEMV's Q3_K another: qgemv_i8_table.ACT_ORDER; the codebook formats' (8, 2, 8)
    a fourth, a record per group of 8: qgemv_i8_grid.py)."""
    return ACT_ORDER.get(w.qtype) or (w.fmt.slot, w.fmt.V, i8_codes(w.qtype)[0])


def new_q8(W: int, K: int, order: tuple[int, int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty q8 activations for `order`: (xp int32 [W, K/4], xsd int32 [W, K/slot, 2])."""
    return (torch.empty((W, K // 4), dtype=torch.int32, device=device),
            torch.empty((W, K // order[0], 2), dtype=torch.int32, device=device))


def prepare_i8(x: torch.Tensor, w: QuantWeight, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [W, K] -> (xp int32 [W, K/4]: the q8 bytes in w's lane order, xsd int32
    [W, n_slots, 2]: per slot (sum of q, bits of dx))."""
    W, K = x.shape
    slot, V, bits = order = lane_order(w)
    xp, xsd = new_q8(W, K, order, x.device)
    BQ = PREP_BLOCK if K % PREP_BLOCK == 0 else QBLOCK
    _prepare_kernel[(W, K // BQ)](x, xp.view(torch.int8), xsd, x.stride(0), K=K, BQ=BQ, SLOT=slot,
                                  V=V, BITS=bits, num_warps=NUM_WARPS, enable_fp_fusion=False,
                                  **pdl_kwargs(pdl, x.device))
    return xp, xsd


def qmatvec_i8(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None, BN: int = 16) -> torch.Tensor:
    """x [W, K] (any float dtype) @ w^T -> [W, N] float32 under the expert contract: row m
    equals expert_q8.matvec_q8 of quantize_q8(x[m]) bit for bit, whatever W, m and BN (the
    lanes are the contract's). The dense form of moe_i8's CONTRACT rows (tests, and a
    reference on the device). Runs on CUDA or under the Triton interpreter."""
    if w.qtype not in CODES:         # (the contract's level formats, MXFP4, are its experts' kernels' only)
        raise ValueError(f"qmatvec_i8 has no integer form of {w.qtype.name} "
                         f"(supported: {', '.join(t.name for t in CODES)})")
    if BN < 1 or BN & (BN - 1):
        raise ValueError(f"qmatvec_i8: BN must be a power of two, got {BN}")
    W, N, out = check_gemv_args(x, w, out, "qmatvec_i8", k_multiple=QBLOCK)   # K: the contract's q8 blocks
    x = x if x.stride(1) == 1 else x.contiguous()
    xp, xsd = prepare_i8(x, w)
    bits, hbits, bias, has_min = CODES[w.qtype]
    _qmatvec_i8_kernel[(triton.cdiv(N, BN) * W,)](
        xp, xsd, out, *w.plane_args(), W, N, 1, n_slots=w.n_slots, LOAD=w.fmt.triton_load, V=w.fmt.V, BITS=bits,
        HBITS=hbits, BIAS=bias, HAS_MIN=has_min, BN=BN, NT=contract_lanes(w.qtype, w.n_slots), DP4A=x.is_cuda,
        num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
