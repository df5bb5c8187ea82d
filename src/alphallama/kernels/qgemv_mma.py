"""qgemv_mma: the decode GEMV's integer part on the tensor cores (int8 mma), a spike.

Why: qgemv_i8 multiplies codes by int8 activations with dp4a, one instruction per 4
codes per x row. At W = 8 a Q4_K weight costs 2 dp4a a code, ~85% of the H200's integer
issue rate at the copy rate (NOTES, session 19), so a verify round cannot cost what a
W = 1 round does. Here the per-slot integer sums come from one batched int8 dot a step:

    A [NT, BN, KS] int8: the slots' codes (bytes of qgemv_i8's lo|hi lanes, k permuted)
    B [NT, KS, BW] int8: the same slots' activation bytes, in the matching k order
    isum = A @ B   [NT, BN, BW] int32 (exact: the same integers dp4a gives)

and the float part is qgemv_i8's per-slot sequence, column by column:

    t = A_s * float(isum) [- B_s * float(xsum)];  acc[slot lane] = fma(t, dx, acc[lane])

The sums are exact integers and every column's float ops are elementwise, so a row's
bits depend on neither its column nor W (BW columns, padded by the compiler for the
mma). The lanes' final sum is tl.sum over the slot axis here (layout-dependent: the
same for every W in this kernel, but not qgemv_i8's order). Not used by the engine yet:
bench/gpu_qgemv_mma.py times it against qgemv_i8 to decide whether it is built out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .expert_q8 import QBLOCK
from .expert_q8_gpu import CODES
from .qmatvec_i8 import _lanes, prepare_i8
from .pdl import pdl_kwargs, pdl_trigger, pdl_wait
from .qweight import QuantWeight, check_gemv_args
from .formats import slot_field


@triton.jit
def _code_bytes(lo, hi, BITS: tl.constexpr):
    """lo, hi [NT, BN, V] int32 (codes in byte lanes) -> A [NT, BN, KS] int8,
    k = (v * 2 + e) * 4 + j for byte j of word v of lo (e = 0) or hi (e = 1);
    8-bit codes (Q8_0's loads xor 0x80: unsigned, BIAS 128): k = v * 4 + j of lo, the
    sign restored (the mma multiplies s8 by s8; the kernel then skips the bias)."""
    NT: tl.constexpr = lo.shape[0]
    BN: tl.constexpr = lo.shape[1]
    V: tl.constexpr = lo.shape[2]
    sh = (tl.arange(0, 4) * 8)[None, None, None, :]                    # [1, 1, 1, 4]
    if BITS == 8:
        a = ((lo[:, :, :, None] >> sh) & 0xFF) ^ 0x80                  # [NT, BN, V, 4]
        return tl.reshape(a.to(tl.int8), (NT, BN, 4 * V))
    lh = tl.join(lo, hi)                                               # [NT, BN, V, 2]
    a = (lh[:, :, :, :, None] >> sh[:, :, :, None, :]) & 0xFF          # [NT, BN, V, 2, 4]
    return tl.reshape(a.to(tl.int8), (NT, BN, 8 * V))


@triton.jit
def _x_bytes(xb, m_row, m_ok, u, n_slots: tl.constexpr, V: tl.constexpr, BITS: tl.constexpr):
    """B [NT, KS, BW] int8: the activation bytes of slots u [NT] of x rows m_row [BW]
    in _code_bytes' k order (prepare_i8 lays a slot out as V lo words, then V hi words)."""
    NT: tl.constexpr = u.shape[0]
    BW: tl.constexpr = m_row.shape[0]
    j = tl.arange(0, 4)
    v = tl.arange(0, V)
    if BITS == 8:
        XSB: tl.constexpr = 4 * V                                      # bytes a slot
        k = (v[:, None] * 4 + j[None, :])                              # [V, 4]
        offs = (u[:, None, None, None] * XSB + k[None, :, :, None]
                + m_row[None, None, None, :].to(tl.int64) * (n_slots * XSB))   # [NT, V, 4, BW]
        b = tl.load(xb + offs, mask=m_ok[None, None, None, :], other=0)
        return tl.reshape(b, (NT, 4 * V, BW))
    XSB2: tl.constexpr = 8 * V
    e = tl.arange(0, 2)
    k = v[:, None, None] * 4 + e[None, :, None] * (4 * V) + j[None, None, :]      # [V, 2, 4]
    offs = (u[:, None, None, None, None] * XSB2 + k[None, :, :, :, None]
            + m_row[None, None, None, None, :].to(tl.int64) * (n_slots * XSB2))   # [NT, V, 2, 4, BW]
    b = tl.load(xb + offs, mask=m_ok[None, None, None, None, :], other=0)
    return tl.reshape(b, (NT, 8 * V, BW))


@triton.jit(do_not_specialize=["one"])
def _qgemv_mma_kernel(xb, xsd, out, qs, qh, sc, sd, W, N, stride_out, one, n_slots: tl.constexpr,
                      LOAD: tl.constexpr, V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr,
                      BIAS: tl.constexpr, HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr,
                      BW: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    tl.static_assert(n_slots % NT == 0, "qgemv_mma: whole steps only")
    XS: tl.constexpr = n_slots * 2
    LAST: tl.constexpr = (n_slots - 1) // NT * NT
    n_wt = tl.cdiv(W, BW)
    pid_n = tl.program_id(0) // n_wt
    m0 = (tl.program_id(0) % n_wt) * BW
    n_out = pid_n * BN + tl.arange(0, BN)                              # [BN]
    row = tl.minimum(n_out, N - 1).to(tl.int64)[None, :]               # [1, BN]
    m = m0 + tl.arange(0, BW)                                          # [BW]
    m_ok = m < W
    m_row = tl.minimum(m, W - 1)
    acc = tl.zeros([NT, BN, BW], tl.float32)
    pdl_trigger(PDL)
    if PREFETCH:
        nwords, nh, ns1, ns2 = LOAD(qs, qh, sc, sd, row, 0, one, n_slots, NT, V)
    pdl_wait(PDL)
    for s0 in range(0, n_slots, NT):
        if PREFETCH:
            words, h, s1, s2 = nwords, nh, ns1, ns2
            nwords, nh, ns1, ns2 = LOAD(qs, qh, sc, sd, row, tl.minimum(s0 + NT, LAST), one, n_slots, NT, V)
        else:
            words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)   # [NT, BN, V], [NT, BN] x3
        lo, hi = _lanes(words, h, BITS, HBITS)
        u = s0 + tl.arange(0, NT)                                      # [NT]
        a = _code_bytes(lo, hi, BITS)                                  # [NT, BN, KS]
        b = _x_bytes(xb, m_row, m_ok, u, n_slots, V, BITS)             # [NT, KS, BW]
        isum = tl.dot(a, b, out_dtype=tl.int32)                        # [NT, BN, BW] exact
        roff = m_row[None, :].to(tl.int64) * XS + u[:, None] * 2       # [NT, BW]
        xsum = tl.load(xsd + roff, mask=m_ok[None, :], other=0)        # [NT, BW] int32
        dx = tl.load(xsd + roff + 1, mask=m_ok[None, :], other=0).to(tl.float32, bitcast=True)
        if BIAS != 0 and BITS != 8:
            isum = isum - BIAS * xsum[:, None, :]
        t = s1[:, :, None] * isum.to(tl.float32)                       # A * isum
        if HAS_MIN:
            t = t - s2[:, :, None] * xsum.to(tl.float32)[:, None, :]   # - B * xsum
        acc = tl.fma(t, dx[:, None, :], acc)
    y = tl.sum(acc, axis=0)                                            # [BN, BW]
    ptr = out + m[None, :].to(tl.int64) * stride_out + n_out[:, None]
    tl.store(ptr, y, mask=(n_out < N)[:, None] & m_ok[None, :])


@dataclass(frozen=True)
class MmaTile:
    BN: int = 32            # weight rows per program
    NT: int = 16            # slots per step (the batch of the dot)
    num_warps: int = 4
    prefetch: int = 1
    max_bw: int = 16        # x rows (dot columns) per program


def qgemv_mma(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None, tile: MmaTile | None = None,
              prepared: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = False) -> torch.Tensor:
    """x [W, K] @ w^T -> [W, N] float32 on int8 activations (prepare_i8's), the per-slot
    integer sums on the tensor cores. Runs on CUDA or under the Triton interpreter."""
    if w.qtype not in CODES:
        raise ValueError(f"qgemv_mma has no integer form of {w.qtype.name}")
    t = tile or MmaTile()
    W, N, out = check_gemv_args(x, w, out, "qgemv_mma", k_multiple=QBLOCK, out_col_slice=True)
    NT = min(t.NT, triton.next_power_of_2(w.n_slots))
    if w.n_slots % NT:
        raise ValueError(f"qgemv_mma: {w.n_slots} slots are not whole {NT}-slot steps")
    xp, xsd = prepared if prepared is not None else prepare_i8(x if x.stride(1) == 1 else x.contiguous(), w, pdl)
    BW = min(t.max_bw, triton.next_power_of_2(W))
    bits, hbits, bias, has_min = CODES[w.qtype]
    grid = (triton.cdiv(N, t.BN) * triton.cdiv(W, BW),)
    _qgemv_mma_kernel[grid](xp.view(torch.int8), xsd, out, *w.plane_args(), W, N, out.stride(0), 1,
                            n_slots=w.n_slots, LOAD=w.fmt.triton_load, V=w.fmt.V, BITS=bits, HBITS=hbits,
                            BIAS=bias, HAS_MIN=has_min, BN=t.BN, NT=NT, BW=BW, PREFETCH=int(t.prefetch),
                            num_warps=t.num_warps, enable_fp_fusion=False, **pdl_kwargs(pdl, x.device))
    return out


@triton.jit
def _k_scales(sc, sd, row, s0, one, n_slots: tl.constexpr, NT: tl.constexpr):
    """Q4_K/Q5_K: d * sc and dmin * m per slot [NT, BN] (fmt_kquant._load_k_with_min's scales)."""
    s = slot_field(sc, row, s0, one, n_slots, NT).to(tl.int32)
    d = slot_field(sd, row, s0, one, n_slots, NT, 8, 2, 0).to(tl.float32)
    dmin = slot_field(sd, row, s0, one, n_slots, NT, 8, 2, 1).to(tl.float32)
    sc_f = ((s & 0xFF) | (one * 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0
    m_f = (((s >> 8) & 0xFF) | (one * 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0
    return d * sc_f, dmin * m_f


@triton.jit
def _w_bytes(qb, row, s0, n_slots: tl.constexpr, NT: tl.constexpr):
    """A [NT, BN, 32] int8 of Q4_K slots s0..: the 16 code bytes a slot-row loaded as
    int8 (one 16-byte load), nibbles split with int8 ops; k = 2 b + e (e: low/high nibble)."""
    BN: tl.constexpr = row.shape[1]
    u = (s0 + tl.arange(0, NT))[:, None, None]                          # [NT, 1, 1]
    offs = row[:, :, None] * (n_slots * 16) + u * 16 + tl.arange(0, 16)[None, None, :]   # [NT, BN, 16]
    b = tl.load(qb + offs)                                              # int8
    lo = b & 0x0F
    hi = (b >> 4) & 0x0F
    return tl.reshape(tl.join(lo, hi), (NT, BN, 32))


@triton.jit
def _x_rows(xb, m_row, m_ok, s0, n_slots: tl.constexpr, NT: tl.constexpr):
    """B [NT, 32, BW] int8: each x row's slot as two contiguous 16-byte runs (lo words,
    then hi words: byte 16 e + b), loaded [NT, BW, 2, 16] and put in k = 2 b + e order."""
    BW: tl.constexpr = m_row.shape[0]
    u = (s0 + tl.arange(0, NT))[:, None, None, None]                    # [NT, 1, 1, 1]
    e = tl.arange(0, 2)[None, None, :, None]
    b = tl.arange(0, 16)[None, None, None, :]
    offs = m_row[None, :, None, None].to(tl.int64) * (n_slots * 32) + u * 32 + e * 16 + b   # [NT, BW, 2, 16]
    x = tl.load(xb + offs, mask=m_ok[None, :, None, None], other=0)
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (NT, 32, BW))


@triton.jit(do_not_specialize=["one"])
def _qgemv_mma2_kernel(xb, xsd, out, qb, sc, sd, W, N, stride_out, one, n_slots: tl.constexpr,
                       BN: tl.constexpr, NT: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr = False):
    """Q4_K only (the spike's second form): weight and x bytes loaded as int8 vectors."""
    XS: tl.constexpr = n_slots * 2
    LAST: tl.constexpr = (n_slots - 1) // NT * NT
    n_wt = tl.cdiv(W, BW)
    pid_n = tl.program_id(0) // n_wt
    m0 = (tl.program_id(0) % n_wt) * BW
    n_out = pid_n * BN + tl.arange(0, BN)
    row = tl.minimum(n_out, N - 1).to(tl.int64)[None, :]               # [1, BN]
    m = m0 + tl.arange(0, BW)
    m_ok = m < W
    m_row = tl.minimum(m, W - 1)
    acc = tl.zeros([NT, BN, BW], tl.float32)
    pdl_trigger(PDL)
    na = _w_bytes(qb, row, 0, n_slots, NT)
    ns1, ns2 = _k_scales(sc, sd, row, 0, one, n_slots, NT)
    pdl_wait(PDL)
    for s0 in range(0, n_slots, NT):
        a, s1, s2 = na, ns1, ns2
        nxt = tl.minimum(s0 + NT, LAST)
        na = _w_bytes(qb, row, nxt, n_slots, NT)
        ns1, ns2 = _k_scales(sc, sd, row, nxt, one, n_slots, NT)
        b = _x_rows(xb, m_row, m_ok, s0, n_slots, NT)                   # [NT, 32, BW]
        isum = tl.dot(a, b, out_dtype=tl.int32)                        # [NT, BN, BW]
        u = s0 + tl.arange(0, NT)
        roff = m_row[None, :].to(tl.int64) * XS + u[:, None] * 2       # [NT, BW]
        xsum = tl.load(xsd + roff, mask=m_ok[None, :], other=0)
        dx = tl.load(xsd + roff + 1, mask=m_ok[None, :], other=0).to(tl.float32, bitcast=True)
        t = s1[:, :, None] * isum.to(tl.float32)
        t = t - s2[:, :, None] * xsum.to(tl.float32)[:, None, :]
        acc = tl.fma(t, dx[:, None, :], acc)
    y = tl.sum(acc, axis=0)                                            # [BN, BW]
    ptr = out + m[None, :].to(tl.int64) * stride_out + n_out[:, None]
    tl.store(ptr, y, mask=(n_out < N)[:, None] & m_ok[None, :])


def qgemv_mma2(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None, tile: MmaTile | None = None,
               prepared: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = False) -> torch.Tensor:
    """Q4_K, the second form (int8 vector loads of weights and x)."""
    from gguf.constants import GGMLQuantizationType as T
    if w.qtype != T.Q4_K:
        raise ValueError("qgemv_mma2 is Q4_K only")
    t = tile or MmaTile()
    W, N, out = check_gemv_args(x, w, out, "qgemv_mma2", k_multiple=QBLOCK, out_col_slice=True)
    NT = min(t.NT, triton.next_power_of_2(w.n_slots))
    xp, xsd = prepared if prepared is not None else prepare_i8(x if x.stride(1) == 1 else x.contiguous(), w, pdl)
    BW = min(t.max_bw, triton.next_power_of_2(W))
    qs, _, sc, sd = w.plane_args()
    grid = (triton.cdiv(N, t.BN) * triton.cdiv(W, BW),)
    _qgemv_mma2_kernel[grid](xp.view(torch.int8), xsd, out, qs.view(torch.int8), sc, sd, W, N, out.stride(0), 1,
                             n_slots=w.n_slots, BN=t.BN, NT=NT, BW=BW, num_warps=t.num_warps,
                             enable_fp_fusion=False, **pdl_kwargs(pdl, x.device))
    return out
