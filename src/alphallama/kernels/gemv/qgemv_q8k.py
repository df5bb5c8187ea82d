"""qgemv_q8k: the narrow-W partner of qgemv_mma_k. dp4a on the same q8_K activations
(prepare_q8k's row-order words, xsum a slot, dx a super-block), giving the same bits.

Why: exact mode needs a row's bits not to depend on the round's width. qgemv_mma_k makes a
W = 8 round cost ~1.3x a W = 1 round, but at W = 1 it is slower than dp4a
(docs/decisions/exact-mode-kernel-family.md). Two kernels can share one
float order if everything before the float part is an exact integer: qgemv_mma_k folds a
super-block's 8 slots into ai = sum sc_s isum_s and am = sum m_s xsum_s (int32, any order),
then y += (d dx) ai - (dmin dx) am once a super-block, in k order within each run of K, and
the runs are added in one written-out pairwise tree (tree_sum). This kernel computes the same
integers with dp4a (its sums over words and slots are integer, so their order is free),
then the same float expressions in the same order: the mma for wide rounds, dp4a for
narrow ones, one set of bits (checked bit for bit against qgemv_mma_k in the tests).

Tile (qgemv_i8's shapes): [S, BN, V] words a step, S = R runs x the 8 slots of one
super-block each (R = the weight's mma_tile runs: part of the float order), 16 bytes of qs
a (slot, row); BW <= 4 columns a program, a named accumulator [R, BN] each. At W = 1 it
stays a little slower than qgemv_i8 (docs/decisions/exact-mode-kernel-family.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_kwargs, pdl_trigger, pdl_wait
from .q8k_act import prepare_q8k
from .qgemv_mma import mma_tile, supports_mma
from .tree import tree_sum
from .qmatvec_i8 import dp4a
from ..formats.qweight import QuantWeight, check_gemv_args


@triton.jit
def _dot4(a, b, c, DP4A: tl.constexpr):
    """c + the dp4a of a and b [S, BN, 4] (the same shape and layout) over their 4 words,
    one chain in the thread: [S, BN] int32."""
    S: tl.constexpr = a.shape[0]
    BN: tl.constexpr = a.shape[1]
    a02, a13 = tl.split(tl.reshape(a, (S, BN, 2, 2)))
    b02, b13 = tl.split(tl.reshape(b, (S, BN, 2, 2)))
    a0, a2 = tl.split(a02)
    a1, a3 = tl.split(a13)
    b0, b2 = tl.split(b02)
    b1, b3 = tl.split(b13)
    return dp4a(a3, b3, dp4a(a2, b2, dp4a(a1, b1, dp4a(a0, b0, c, DP4A), DP4A), DP4A), DP4A)


@triton.jit
def _col_step(y, lo, hi, raw, d, dmin, xl, xs, dxs, col, ok, s, one, n_slots: tl.constexpr, R: tl.constexpr,
              DP4A: tl.constexpr):
    """Column col's super-block s of every run into y [R, BN]: the isums by dp4a (lo/hi
    [S, BN, V] codes, S = R runs x 8 slots), folded in integers, then qgemv_mma_k's _flush."""
    S: tl.constexpr = R * 8
    BN: tl.constexpr = lo.shape[1]
    NSB: tl.constexpr = n_slots // 8
    i = tl.arange(0, S)                                                # [S]: run i // 8, slot i % 8
    slot = s * S + i                                                   # runs interleave: step s is super-blocks s R ..
    # prepare_q8k's row-order words (prepare_i8's: a slot's 4 lo words, then its 4 hi words),
    # addressed as qgemv_i8 does (a row pointer, small offsets: the loads stay 16-byte vectors)
    x_row = xl + col * (n_slots * 8)
    xo = slot[:, None, None] * 8 + tl.arange(0, 4)[None, None, :]      # [S, 1, V]
    # the x words loaded as a [S, BN, V] tile (each thread its rows' copy of its slot's words,
    # the same addresses): a [S, 1, V] load is 128 elements for 128+ threads, so the compiler
    # gives it a one-word-a-thread layout and moves the weights to it every step
    xp = tl.broadcast_to(x_row + xo, (S, BN, 4))
    isum = _dot4(hi, tl.load(xp + 4), _dot4(lo, tl.load(xp), 0, DP4A), DP4A)   # [S, BN]
    xsum = tl.load(xs + col * n_slots + slot * one)                    # [S] (one: no vector across slots)
    ai = tl.sum(tl.reshape((raw & 0xFF) * isum, (R, 8, BN)), axis=1)   # [R, BN]: any order, integers
    am = tl.sum(tl.reshape(((raw >> 8) & 0xFF) * xsum[:, None], (R, 8, BN)), axis=1)
    dx = tl.load(dxs + col * NSB + s * R + tl.arange(0, R) * one)      # [R]
    dx = tl.where(ok, dx, 0.0)[:, None]                                # [R, 1]
    t = (d * dx) * ai.to(tl.float32) - (dmin * dx) * am.to(tl.float32)     # qgemv_mma_k's _flush, op for op
    return y + t


@triton.jit(do_not_specialize=["one"])
def _q8k_dp4a_kernel(xl, xs, dxs, out, qs, sc, sd, W, N, stride_out, one, n_slots: tl.constexpr, BN: tl.constexpr,
                     R: tl.constexpr, BW: tl.constexpr, DP4A: tl.constexpr, PDL: tl.constexpr = False):
    """A program: BN rows x BW columns; a step: super-block s of each of the R runs (S = 8 R
    slots, 16 bytes of qs a (slot, row)), the next step's weights loaded ahead. `one` is a
    run-time 1 in the scales' slot strides (fmt_triton.slot_field's reason: no vector load
    across slots, which would move the scales between threads through shared memory)."""
    tl.static_assert(BW == 1 or BW == 2 or BW == 4, "1, 2 or 4 columns a program")
    NSB: tl.constexpr = n_slots // 8
    tl.static_assert(NSB % R == 0, "whole super-block runs")
    NR: tl.constexpr = NSB // R                                        # super-blocks a run
    S: tl.constexpr = R * 8
    n_wb = tl.cdiv(W, BW)                                              # programs walk the columns innermost
    rows = (tl.program_id(0) // n_wb) * BN + tl.arange(0, BN)          # [BN]
    rows_ok = rows < N
    rows = tl.minimum(rows, N - 1).to(tl.int64)                        # past N: recomputed, not stored
    c0 = (tl.program_id(0) % n_wb) * BW
    i = tl.arange(0, S)
    slot0 = i                                                          # [S]: step 0's slots (run i // 8)
    q_at = qs + rows[None, :, None] * (n_slots * 4) + slot0[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]
    sc_at = sc + rows[None, :] * n_slots + slot0[:, None] * one        # [S, BN]
    sb0 = tl.arange(0, R)[:, None]                                     # [R, 1]
    y0 = tl.zeros([R, BN], tl.float32)
    y1 = tl.zeros([R, BN], tl.float32)
    y2 = tl.zeros([R, BN], tl.float32)
    y3 = tl.zeros([R, BN], tl.float32)
    m0 = tl.minimum(c0, W - 1).to(tl.int64)
    m1 = tl.minimum(c0 + 1, W - 1).to(tl.int64)
    m2 = tl.minimum(c0 + 2, W - 1).to(tl.int64)
    m3 = tl.minimum(c0 + 3, W - 1).to(tl.int64)
    pdl_trigger(PDL)
    nw = tl.load(q_at)                                                 # [S, BN, V]
    pdl_wait(PDL)
    for s in range(0, NR):
        w = nw
        nw = tl.load(q_at + tl.minimum(s + 1, NR - 1) * (S * 4))       # a step ahead
        raw = tl.load(sc_at + s * S).to(tl.int32)                      # [S, BN]: sc | m << 8
        sd_at = sd + rows[None, :] * (NSB * 2) + (s * R + sb0) * (2 * one)     # [R, BN]
        d = tl.load(sd_at).to(tl.float32)
        dmin = tl.load(sd_at + 1).to(tl.float32)
        lo = w & 0x0F0F0F0F
        hi = (w >> 4) & 0x0F0F0F0F
        y0 = _col_step(y0, lo, hi, raw, d, dmin, xl, xs, dxs, m0, c0 < W, s, one, n_slots, R, DP4A)
        if BW > 1:
            y1 = _col_step(y1, lo, hi, raw, d, dmin, xl, xs, dxs, m1, c0 + 1 < W, s, one, n_slots, R, DP4A)
        if BW > 2:
            y2 = _col_step(y2, lo, hi, raw, d, dmin, xl, xs, dxs, m2, c0 + 2 < W, s, one, n_slots, R, DP4A)
            y3 = _col_step(y3, lo, hi, raw, d, dmin, xl, xs, dxs, m3, c0 + 3 < W, s, one, n_slots, R, DP4A)
    _store_col(out, y0, rows, rows_ok, m0, c0 < W, stride_out)
    if BW > 1:
        _store_col(out, y1, rows, rows_ok, m1, c0 + 1 < W, stride_out)
    if BW > 2:
        _store_col(out, y2, rows, rows_ok, m2, c0 + 2 < W, stride_out)
        _store_col(out, y3, rows, rows_ok, m3, c0 + 3 < W, stride_out)


@triton.jit
def _store_col(out, y, rows, rows_ok, col, ok, stride_out):
    """A column's sums y [R, BN] (runs first): the runs added in tree_sum's order, stored."""
    R: tl.constexpr = y.shape[0]
    BN: tl.constexpr = y.shape[1]
    yr = tl.reshape(tree_sum(tl.reshape(tl.permute(y, (1, 0)), (BN, 1, R)), R), (BN,))
    tl.store(out + col * stride_out + rows, yr, mask=rows_ok & ok)


def q8k_tile(w: QuantWeight, W: int) -> tuple[int, int]:
    """(rows, warps) a program, neither in the float order (the runs are: mma_tile), so free
    to follow W: 8 rows x 8 warps at W = 1 up to 8192 rows, 8 x 2 otherwise, near each
    shape's best in a sweep of tiles with qgemv_mma_k's bits
    (docs/decisions/exact-mode-kernel-family.md)."""
    return (8, 8) if W == 1 and w.N <= 8192 else (8, 2)


def qgemv_q8k(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None,
              prepared: tuple[torch.Tensor, ...] | None = None, rows: int | None = None,
              cols: int | None = None, warps: int = 4, pdl: bool = False) -> torch.Tensor:
    """Q4_K x [W, K] @ w^T -> [W, N] float32 with dp4a on prepare_q8k's activations: the bits
    of qgemv_mma_k on the same weight (its runs: mma_tile). rows x cols a program (cols: W up
    to 4), neither in the float order (rows None: q8k_tile's rows and warps)."""
    if not supports_mma(w):
        raise ValueError(f"qgemv_q8k: Q4_K with N a multiple of 16, got {w.qtype.name} {w.N}x{w.K}")
    W, N, out = check_gemv_args(x, w, out, "qgemv_q8k", k_multiple=256, out_col_slice=True)
    xf, xs, dxs, xl = prepared if prepared is not None else prepare_q8k(x, w.n_slots, pdl)
    runs = mma_tile(w)[1]
    if rows is None:
        rows, warps = q8k_tile(w, W)
        if not x.is_cuda:           # the interpreter pays per program (the tile is not in the float order)
            rows = min(1024, triton.next_power_of_2(N))
    cols = cols or (1 if W == 1 else 2 if W == 2 else 4)
    grid = (triton.cdiv(N, rows) * triton.cdiv(W, cols),)
    _q8k_dp4a_kernel[grid](xl, xs, dxs, out, w.planes["qs"], w.planes["sc"], w.planes["sd"], W, N, out.stride(0), 1,
                           n_slots=w.n_slots, BN=rows, R=runs, BW=cols, DP4A=x.is_cuda, num_warps=warps,
                           enable_fp_fusion=False, **pdl_kwargs(pdl, x.device))
    return out
