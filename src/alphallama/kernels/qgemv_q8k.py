"""qgemv_q8k: the narrow-W partner of qgemv_mma_k. dp4a on the same q8_K activations
(prepare_q8k's fragment-order words, xsum a slot, dx a super-block), giving the same bits.

Why: exact mode needs a row's bits not to depend on the round's width. qgemv_mma_k makes a
W = 8 round cost ~1.3x a W = 1 round, but at W = 1 it is slower than dp4a (H200,
gpu_qgemv_mma-20261201-183426.json: gate_up 22 against 17 us). Two kernels can share one
float order if everything before the float part is an exact integer: qgemv_mma_k folds a
super-block's 8 slots into ai = sum sc_s isum_s and am = sum m_s xsum_s (int32, any order),
then y += (d dx) ai - (dmin dx) am once a super-block, in k order within each run of K, and
the runs are added in one written-out pairwise tree (_tree). This kernel computes the same
integers with dp4a (its sums over words and slots are integer, so their order is free),
then the same float expressions in the same order: the mma for wide rounds, dp4a for
narrow ones, one set of bits (checked bit for bit against qgemv_mma_k in the tests).

Tile: BN rows x R runs (R = the weight's mma_tile runs: part of the float order) x the 8
slots of a super-block, 16 bytes of qs a (row, run, slot) element; BW columns a program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_kwargs, pdl_trigger, pdl_wait
from .qgemv_mma import COLS, _tree, mma_tile, prepare_q8k, supports_mma
from .qmatvec_i8 import _dp4a
from .qweight import QuantWeight, check_gemv_args


@triton.jit
def _q8k_dp4a_kernel(xf, xs, dxs, out, qs, sc, sd, W, N, stride_out, n_slots: tl.constexpr, BN: tl.constexpr,
                     R: tl.constexpr, BW: tl.constexpr, DP4A: tl.constexpr, PDL: tl.constexpr = False):
    NSB: tl.constexpr = n_slots // 8
    tl.static_assert(NSB % R == 0, "whole super-block runs")
    NR: tl.constexpr = NSB // R                                        # super-blocks a run
    STEPS: tl.constexpr = n_slots // 2
    n_wb = tl.cdiv(W, BW)
    rows = (tl.program_id(0) // n_wb) * BN + tl.arange(0, BN)          # [BN]
    rows_ok = rows < N
    rows = tl.minimum(rows, N - 1).to(tl.int64)
    cols = (tl.program_id(0) % n_wb) * BW + tl.arange(0, BW)           # [BW]
    cols_ok = cols < W
    cols = tl.minimum(cols, W - 1).to(tl.int64)
    r4 = rows[:, None, None, None, None]                               # [BN, 1, 1, 1, 1]
    c4 = cols[None, :, None, None, None]                               # [1, BW, 1, 1, 1]
    run = tl.arange(0, R)[None, None, :, None, None]                   # [1, 1, R, 1, 1]
    sl = tl.arange(0, 8)[None, None, None, :, None]                    # [1, 1, 1, 8, 1]: slot in the super-block
    t4 = tl.arange(0, 4)[None, None, None, None, :]                    # [1, 1, 1, 1, 4]: word
    slot0 = run * NR * 8 + sl                                          # the run's first super-block's slots
    q_at = qs + r4 * (n_slots * 4) + slot0 * 4 + t4                    # [BN, 1, R, 8, 4]
    # prepare_q8k's words: column c's lo | hi word t of slot s at lane 4 (c % 8) + t, step s // 2
    x_at = xf + ((((c4 // 8) * STEPS + slot0 // 2) * 32 + 4 * (c4 % 8) + t4) * 2 + slot0 % 2) * 2   # [1, BW, R, 8, 4]
    s3 = tl.reshape(slot0, (1, R, 8))
    sc_at = sc + rows[:, None, None] * n_slots + s3                    # [BN, R, 8]
    xs_at = xs + cols[:, None, None] * n_slots + s3                    # [BW, R, 8]
    sb0 = tl.arange(0, R)[None, :] * NR                                # [1, R]
    y = tl.zeros([BN, BW, R], tl.float32)
    pdl_trigger(PDL)
    pdl_wait(PDL)
    for s in range(0, NR):
        w = tl.load(q_at + s * 32)                                     # [BN, 1, R, 8, 4]
        xl = tl.load(x_at + s * 512, mask=cols_ok[None, :, None, None, None], other=0)   # [1, BW, R, 8, 4]
        xh = tl.load(x_at + s * 512 + 1, mask=cols_ok[None, :, None, None, None], other=0)
        isum = tl.sum(_dp4a(w & 0x0F0F0F0F, xl, 0, DP4A) + _dp4a((w >> 4) & 0x0F0F0F0F, xh, 0, DP4A), axis=4)
        raw = tl.load(sc_at + s * 8).to(tl.int32)                      # [BN, R, 8]: sc | m << 8
        xsum = tl.load(xs_at + s * 8, mask=cols_ok[:, None, None], other=0)   # [BW, R, 8]
        ai = tl.sum((raw & 0xFF)[:, None, :, :] * isum, axis=3)        # [BN, BW, R] int32, exact
        am = tl.sum(((raw >> 8) & 0xFF)[:, None, :, :] * xsum[None, :, :, :], axis=3)
        sb = sb0 + s                                                   # [1, R]
        d = tl.load(sd + rows[:, None] * (NSB * 2) + sb * 2).to(tl.float32)      # [BN, R]
        dmin = tl.load(sd + rows[:, None] * (NSB * 2) + sb * 2 + 1).to(tl.float32)
        dx = tl.load(dxs + cols[:, None] * NSB + sb, mask=cols_ok[:, None], other=0.0)   # [BW, R]
        # qgemv_mma_k's _flush, op for op
        t = (d[:, None, :] * dx[None, :, :]) * ai.to(tl.float32) - (dmin[:, None, :] * dx[None, :, :]) * am.to(tl.float32)
        y = y + t
    yr = _tree(y, R)                                                   # [BN, BW]
    tl.store(out + cols[None, :] * stride_out + rows[:, None], yr, mask=rows_ok[:, None] & cols_ok[None, :])


def qgemv_q8k(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None,
              prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, rows: int = 16,
              cols: int = 1, warps: int = 4, pdl: bool = False) -> torch.Tensor:
    """Q4_K x [W, K] @ w^T -> [W, N] float32 with dp4a on prepare_q8k's activations: the bits
    of qgemv_mma_k on the same weight (its runs: mma_tile). rows, cols: the tile (BN, BW)."""
    if not supports_mma(w):
        raise ValueError(f"qgemv_q8k: Q4_K with N a multiple of 16, got {w.qtype.name} {w.N}x{w.K}")
    W, N, out = check_gemv_args(x, w, out, "qgemv_q8k", k_multiple=256, out_col_slice=True)
    xf, xs, dxs = prepared if prepared is not None else prepare_q8k(x, w.n_slots, pdl)
    assert xf.numel() >= triton.cdiv(W, COLS) * COLS * w.K // 4
    runs = mma_tile(w)[1]
    grid = (triton.cdiv(N, rows) * triton.cdiv(W, cols),)
    _q8k_dp4a_kernel[grid](xf, xs, dxs, out, w.planes["qs"], w.planes["sc"], w.planes["sd"], W, N, out.stride(0),
                           n_slots=w.n_slots, BN=rows, R=runs, BW=cols, DP4A=x.is_cuda, num_warps=warps,
                           enable_fp_fusion=False, **pdl_kwargs(pdl, x.device))
    return out
