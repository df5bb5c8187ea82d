"""qgemv_mma (spike): the decode GEMV's per-slot integer sums on the tensor cores through
inline PTX (mma.sync m16n8k32 s8.s8.s32), Q4_K only.

Triton's tl.dot path (session 20's first spike) held each int8 operand byte in a register
and went through shared memory every step. Here the operands are built where the mma wants
them: a tensor [T, 4 S] (T = the CTA's threads) whose row i is thread i's registers (Triton
lays such a tensor out one row a thread, rows in thread order: checked in the TTGIR), so
one inline-asm instance per 4 elements is one thread's share of one warp-wide mma.

Warp w of a program owns weight rows base + 16 w .. + 15; lane = 4 g + t. For slot s:
  a0 / a1 = qs word t of row g / g + 8, & 0x0F0F0F0F (the low nibbles: mma k-group t)
  a2 / a3 = the same words' high nibbles (k-group 4 + t)
  b0 / b1 = x column g's lo / hi activation word t (prepare_i8's lane order matches)
  c0..c3  = isum of (row g, column 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1), exact.
The float part is qgemv_i8's per-slot sequence on each element; each thread's element sums
its slots in k order in one fma chain (no cross-thread sum): a row's bits depend on neither
its column nor W by construction. x columns: 8 a program (the mma's N).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .expert_q8 import QBLOCK
from .qmatvec_i8 import prepare_i8
from .pdl import pdl_kwargs, pdl_trigger, pdl_wait
from .qweight import QuantWeight, check_gemv_args


@triton.jit
def _mma(a, b):
    """a, b [T, 4 S] int32 (b: b0, b1, -, - a slot) -> c [T, 4 S] int32, one mma a slot."""
    return tl.inline_asm_elementwise(
        "{ mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$12, $13, $14, $15}; }",
        "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [a, b, tl.zeros_like(a)], dtype=tl.int32, is_pure=True, pack=4)


@triton.jit
def _a_frag(qs, row_h, slot, t, n_slots: tl.constexpr):
    """[T, 4 S] int32: per slot (a0, a1, a2, a3). row_h [T, 1, 2]: rows g, g + 8; slot [1, S, 1]."""
    Tn: tl.constexpr = row_h.shape[0]
    S: tl.constexpr = slot.shape[1]
    w = tl.load(qs + row_h * (n_slots * 4) + slot * 4 + t[:, :, None])          # [T, S, 2(h)]
    a = tl.join(w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F)                          # [T, S, 2(h), 2(e)]
    return tl.reshape(tl.permute(a, (0, 1, 3, 2)), (Tn, 4 * S))                 # r = 2 e + h


@triton.jit
def _b_frag(xp, col_g, ok_g, slot, t, n_slots: tl.constexpr):
    """[T, 4 S] int32: per slot (b0, b1, 0, 0): x column g's lo and hi words t."""
    Tn: tl.constexpr = col_g.shape[0]
    S: tl.constexpr = slot.shape[1]
    e = tl.arange(0, 2)[None, None, :]
    xw = tl.load(xp + col_g[:, :, None] * (n_slots * 8) + slot * 8 + e * 4 + t[:, :, None],
                 mask=ok_g[:, :, None], other=0)                                  # [T, S, 2(e)]
    b = tl.join(xw, tl.zeros_like(xw))                                             # [T, S, 2(e), 2(z)]
    return tl.reshape(tl.permute(b, (0, 1, 3, 2)), (Tn, 4 * S))                   # r = 2 z + e


@triton.jit
def _by_row(v):
    """[T, S, 2] per row half h -> [T, S, 4] at c's registers r = 2 h + column bit."""
    Tn: tl.constexpr = v.shape[0]
    S: tl.constexpr = v.shape[1]
    return tl.reshape(tl.join(v, v), (Tn, S, 4))


@triton.jit
def _by_col(v):
    """[T, S, 2] per column bit -> [T, S, 4] at r = 2 h + column bit."""
    Tn: tl.constexpr = v.shape[0]
    S: tl.constexpr = v.shape[1]
    return tl.reshape(tl.permute(tl.join(v, v), (0, 1, 3, 2)), (Tn, S, 4))


@triton.jit(do_not_specialize=["one"])
def _qgemv_mma_kernel(xp, xsd, out, qs, sc, sd, W, N, stride_out, one, n_slots: tl.constexpr,
                      WARPS: tl.constexpr, S: tl.constexpr, PDL: tl.constexpr = False):
    Tn: tl.constexpr = 32 * WARPS
    BN: tl.constexpr = 16 * WARPS
    n_cb = tl.cdiv(W, 8)
    base = (tl.program_id(0) // n_cb) * BN
    m0 = (tl.program_id(0) % n_cb) * 8
    i = tl.arange(0, Tn)[:, None]                                      # [T, 1]: the thread
    lane = i % 32
    g = lane // 4
    t = lane % 4
    r0 = base + (i // 32) * 16 + g                                     # [T, 1]: row g of the warp's 16
    row_h = tl.minimum(r0[:, :, None] + 8 * tl.arange(0, 2)[None, None, :], N - 1).to(tl.int64)   # [T, 1, 2]
    col_g = m0 + g                                                     # [T, 1]: b's column
    ok_g = col_g < W
    col_g = tl.minimum(col_g, W - 1).to(tl.int64)
    rr = tl.arange(0, 4)[None, :]                                      # [1, 4]: c's register
    col_c = m0 + 2 * t + rr % 2                                        # [T, 4]
    ok_c = col_c < W
    col_c = tl.minimum(col_c, W - 1).to(tl.int64)
    col_c2 = m0 + 2 * t + tl.arange(0, 2)[None, :]                     # [T, 2]
    ok_c2 = col_c2 < W
    col_c2 = tl.minimum(col_c2, W - 1).to(tl.int64)
    jj = tl.arange(0, S)[None, :, None]                                # [1, S, 1]
    acc = tl.zeros([Tn, 4], tl.float32)
    pdl_trigger(PDL)
    na = _a_frag(qs, row_h, jj, t, n_slots)
    pdl_wait(PDL)
    for s0 in range(0, n_slots, S):
        a = na
        na = _a_frag(qs, row_h, tl.minimum(s0 + S, n_slots - S) + jj, t, n_slots)
        b = _b_frag(xp, col_g, ok_g, s0 + jj, t, n_slots)
        isum = tl.reshape(_mma(a, b), (Tn, S, 4))                      # [T, S, 4]
        slot = s0 + jj                                                 # [1, S, 1]
        rh = row_h                                                     # [T, 1, 2]: rows g, g + 8
        sw = tl.load(sc + rh * n_slots + slot).to(tl.int32)            # [T, S, 2]: sc | m << 8
        d = tl.load(sd + rh * (n_slots // 4) + (slot // 8) * 2).to(tl.float32)
        dmin = tl.load(sd + rh * (n_slots // 4) + (slot // 8) * 2 + 1).to(tl.float32)
        sc_f = ((sw & 0xFF) | (one * 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0
        m_f = (((sw >> 8) & 0xFF) | (one * 0x4B000000)).to(tl.float32, bitcast=True) - 8388608.0
        s1 = _by_row(d * sc_f)                                         # [T, S, 4]
        s2 = _by_row(dmin * m_f)
        cc = col_c2[:, None, :]                                        # [T, 1, 2]: columns 2t, 2t + 1
        xsum = _by_col(tl.load(xsd + cc * (n_slots * 2) + slot * 2, mask=ok_c2[:, None, :], other=0))
        dx = _by_col(tl.load(xsd + cc * (n_slots * 2) + slot * 2 + 1, mask=ok_c2[:, None, :],
                             other=0).to(tl.float32, bitcast=True))
        tv = s1 * isum.to(tl.float32) - s2 * xsum.to(tl.float32)       # [T, S, 4]
        tv = tl.permute(tv, (0, 2, 1))                                  # [T, 4, S]
        dx = tl.permute(dx, (0, 2, 1))
        if S == 1:
            acc = tl.fma(tl.reshape(tv, (Tn, 4)), tl.reshape(dx, (Tn, 4)), acc)
        else:
            tl.static_assert(S == 2, "S: 1 or 2 slots a step")
            t0, t1 = tl.split(tv)
            d0, d1 = tl.split(dx)
            acc = tl.fma(t1, d1, tl.fma(t0, d0, acc))
    ptr = out + col_c * stride_out + (r0 + 8 * (rr // 2))
    tl.store(ptr, acc, mask=ok_c & ((r0 + 8 * (rr // 2)) < N))


def qgemv_mma(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None, warps: int = 4, S: int = 2,
              prepared: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = False) -> torch.Tensor:
    """Q4_K x [W, K] @ w^T -> [W, N] float32 (prepare_i8's activations). CUDA only (inline PTX)."""
    if w.qtype != T.Q4_K:
        raise ValueError("qgemv_mma (spike) is Q4_K only")
    W, N, out = check_gemv_args(x, w, out, "qgemv_mma", k_multiple=QBLOCK, out_col_slice=True)
    xp, xsd = prepared if prepared is not None else prepare_i8(x if x.stride(1) == 1 else x.contiguous(), w, pdl)
    qs, _, sc, sd = w.plane_args()
    grid = (triton.cdiv(N, 16 * warps) * triton.cdiv(W, 8),)
    _qgemv_mma_kernel[grid](xp, xsd, out, qs, sc, sd, W, N, out.stride(0), 1, n_slots=w.n_slots, WARPS=warps, S=S,
                            num_warps=warps, enable_fp_fusion=False, **pdl_kwargs(pdl, x.device))
    return out
