"""qgemv_q8k6: qgemv_q8k's rows tile for Q6_K, the narrow-W partner of qgemv_mma6. dp4a on
prepare_q8k6's activations (their row-order copy, in prepare_i8's Q6_K lane order), the same
integers (ai = sum over a super-block's 16 slots of sc (isum - 32 xsum)) and the same float
ops (y + (d dx) ai a super-block, the runs interleaved and added in qgemv_mma._tree), so
qgemv_mma6's bits.

Tile: [32 rows (lanes), R runs (warps), 8 slots, 2 words], a super-block in two halves of 8
slots; a thread one row's run: 192 bytes of codes a super-block (qs 128, qh 64), the folds
inside the thread, the activations one broadcast transaction a load. The codes as qgemv_i8
makes them (qmatvec_i8._lanes: low nibbles, the 2-bit highs moved above them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_kwargs, pdl_trigger, pdl_wait
from .qgemv_mma import mma_tile
from .qgemv_mma6 import prepare_q8k6, supports_mma6
from .qgemv_q8k import row_tile, rows_store
from .qmatvec_i8 import _dp4a
from .qweight import QuantWeight, check_gemv_args


@triton.jit
def _codes(w, h):
    """Q6_K words w [BN, R, 8, 2] and their slots' qh words h [BN, R, 8] -> the 6-bit codes in
    byte lanes (lo, hi) [BN, R, 8, 2], qmatvec_i8._lanes' rule."""
    v = tl.arange(0, 2)[None, None, None, :] * 2
    hh = h[:, :, :, None]
    lo = (w & 0x0F0F0F0F) | ((hh << (4 - v)) & 0x30303030)
    hi = ((w >> 4) & 0x0F0F0F0F) | ((hh >> v) & 0x30303030)
    return lo, hi


@triton.jit
def _dot2(a, b, c, DP4A: tl.constexpr):
    """c + the dp4a of a and b [BN, R, 8, 2] over their 2 words (in the thread)."""
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return _dp4a(a1, b1, _dp4a(a0, b0, c, DP4A), DP4A)


@triton.jit
def _half(ai, w, h, sc8, xl, xs, slot, DP4A: tl.constexpr):
    """ai [BN, R] + half a super-block's 8 slots (slot [1, R, 8]) of a column (xl, xs: its
    activation words and xsums), exact."""
    BN: tl.constexpr = w.shape[0]
    R: tl.constexpr = w.shape[1]
    lo, hi = _codes(w, h)
    # a slot's 4 activation words: lo v0, v1, then hi v0, v1 (prepare_i8's Q6_K order)
    xo = tl.broadcast_to(slot[:, :, :, None] * 4 + tl.arange(0, 2)[None, None, None, :], (BN, R, 8, 2))
    isum = _dot2(hi, tl.load(xl + xo + 2), _dot2(lo, tl.load(xl + xo), 0, DP4A), DP4A)   # [BN, R, 8]
    xsum = tl.load(xs + tl.broadcast_to(slot, (BN, R, 8)))
    return ai + tl.sum(sc8 * (isum - 32 * xsum), axis=2)


@triton.jit
def _col(y, w0, h0, w1, h1, sc0, sc1, d, xl, xs, dxs, col, s, one, n_slots: tl.constexpr, DP4A: tl.constexpr):
    BN: tl.constexpr = w0.shape[0]
    R: tl.constexpr = w0.shape[1]
    NSB: tl.constexpr = n_slots // 16
    run = tl.arange(0, R)[None, :, None]
    slot = (s * R + run) * 16 + tl.arange(0, 8)[None, None, :]          # [1, R, 8]: the first half
    x_row = xl + col * (n_slots * 4)
    x_s = xs + col * n_slots
    ai = tl.zeros([BN, R], tl.int32)
    ai = _half(ai, w0, h0, sc0, x_row, x_s, slot, DP4A)
    ai = _half(ai, w1, h1, sc1, x_row, x_s, slot + 8, DP4A)
    dx = tl.load(dxs + col * NSB + s * R + tl.broadcast_to(tl.arange(0, R)[None, :] * one, (BN, R)))   # [BN, R]
    return y + (d * dx) * ai.to(tl.float32)                             # qgemv_mma6's flush, op for op


@triton.jit(do_not_specialize=["one"])
def _q8k6_rows_kernel(xl, xs, dxs, out, qs, qh, sc, sd, W, N, stride_out, one, n_slots: tl.constexpr,
                      R: tl.constexpr, BW: tl.constexpr, DP4A: tl.constexpr, PDL: tl.constexpr = False):
    tl.static_assert(BW == 1 or BW == 2, "1 or 2 columns a program")
    NSB: tl.constexpr = n_slots // 16
    tl.static_assert(NSB % R == 0, "whole super-block runs")
    NR: tl.constexpr = NSB // R
    BN: tl.constexpr = 32
    rows, rows_ok, c0 = row_tile(W, N, BN, BW)
    run = tl.arange(0, R)[None, :, None]                               # [1, R, 1]
    j = tl.arange(0, 8)[None, None, :]                                 # [1, 1, 8]
    r3 = rows[:, None, None]
    q_at = qs + r3[:, :, :, None] * (n_slots * 2) + ((run * 16 + j) * 2)[:, :, :, None] \
        + tl.arange(0, 2)[None, None, None, :]                          # [BN, R, 8, 2]: step 0, first half
    h_at = qh + r3 * n_slots + run * 16 + j                            # [BN, R, 8]
    sc_at = sc + r3 * n_slots + run * 16 + j
    sd_at = sd + rows[:, None] * NSB + tl.arange(0, R)[None, :] * one  # [BN, R] (one: laid out as the sums)
    y0 = tl.zeros([BN, R], tl.float32)
    y1 = tl.zeros([BN, R], tl.float32)
    m0 = tl.minimum(c0, W - 1).to(tl.int64)
    m1 = tl.minimum(c0 + 1, W - 1).to(tl.int64)
    pdl_trigger(PDL)
    nw0 = tl.load(q_at)
    nw1 = tl.load(q_at + 16)
    nh0 = tl.load(h_at)
    nh1 = tl.load(h_at + 8)
    pdl_wait(PDL)
    for s in range(0, NR):
        w0, w1, h0, h1 = nw0, nw1, nh0, nh1
        nxt = tl.minimum(s + 1, NR - 1) * R
        nw0 = tl.load(q_at + nxt * 32)                                  # a super-block ahead (32 words a run's)
        nw1 = tl.load(q_at + nxt * 32 + 16)
        nh0 = tl.load(h_at + nxt * 16)
        nh1 = tl.load(h_at + nxt * 16 + 8)
        sc0 = tl.load(sc_at + s * (R * 16)).to(tl.int32)               # [BN, R, 8] (signed)
        sc1 = tl.load(sc_at + s * (R * 16) + 8).to(tl.int32)
        d = tl.load(sd_at + s * R).to(tl.float32)                      # [BN, R]
        y0 = _col(y0, w0, h0, w1, h1, sc0, sc1, d, xl, xs, dxs, m0, s, one, n_slots, DP4A)
        if BW > 1:
            y1 = _col(y1, w0, h0, w1, h1, sc0, sc1, d, xl, xs, dxs, m1, s, one, n_slots, DP4A)
    rows_store(out, y0, rows, rows_ok, m0, c0 < W, stride_out)
    if BW > 1:
        rows_store(out, y1, rows, rows_ok, m1, c0 + 1 < W, stride_out)


def qgemv_q8k6(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None,
               prepared: tuple[torch.Tensor, ...] | None = None, cols: int | None = None,
               pdl: bool = False) -> torch.Tensor:
    """Q6_K x [W, K] @ w^T -> [W, N] float32 with dp4a on prepare_q8k6's activations: the bits
    of qgemv_mma6 on the same weight (its runs: mma_tile). cols: x rows a program (1 or 2;
    default W up to 2), not in the float order."""
    if not supports_mma6(w):
        raise ValueError(f"qgemv_q8k6: Q6_K with N a multiple of 16, got {w.qtype.name} {w.N}x{w.K}")
    W, N, out = check_gemv_args(x, w, out, "qgemv_q8k6", k_multiple=256, out_col_slice=True)
    xf, xs, dxs, xl = prepared if prepared is not None else prepare_q8k6(x, w.n_slots, pdl)
    runs = mma_tile(w)[1]
    cols = cols or (1 if W == 1 else 2)
    p = w.planes
    _q8k6_rows_kernel[(triton.cdiv(N, 32) * triton.cdiv(W, cols),)](
        xl, xs, dxs, out, p["qs"], p["qh"], p["sc"], p["sd"], W, N, out.stride(0), 1, n_slots=w.n_slots,
        R=runs, BW=cols, DP4A=x.is_cuda, num_warps=runs, enable_fp_fusion=False, **pdl_kwargs(pdl, x.device))
    return out
