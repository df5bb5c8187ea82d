"""qmatmul: x [W, K] @ w[N, K]^T -> [W, N] float32, reading GGUF blocks directly.

Decode is bandwidth bound: the kernel streams each weight once, dequantizes it in
registers and does the products in fp32 on the CUDA cores (GEMV style). One program
owns BN output rows and walks all of K, NT slots (formats.py) per step, one slot per
thread; up to 8 rows of x share each dequantized tile, more rows take more programs.

Exact mode. A row of x must give the same bits whatever its position among the W
rows and whatever W is (speculative verify vs plain decode). So every x row runs the
same code on tensors of the same shapes and layouts: its products go into that row's
own [NT, BN, V] accumulator by explicit fused multiply-adds in k order, and the lanes
are summed once at the end. W only changes how many rows a program unrolls (BW) and
the grid; the tile (BN, NT, warps) depends on the weight's (type, N, K) alone. No
implicit mul+add fusion (it depends on the surrounding code) and no tl.dot (its
internal order is not ours to fix).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..backend import use_triton
from ..formats.qweight import QuantWeight, check_gemv_args

MAX_BW = 8              # x rows per program: one named accumulator each below (fewer
                        # with more weight rows per thread, to stay within 255 registers)
NUM_WARPS = 4
SLOTS_PER_STEP = 128    # NT: one slot per thread with 4 warps
ROWS_PER_THREAD = 2     # weight rows per thread: they share each x vector load


@triton.jit
def row_fma(acc, w_a, w_b, x_row, xoff, xmask, PAIR: tl.constexpr, EVEN: tl.constexpr):
    """acc [NT, BN, V] + the products of one x row with the dequantized fields w_a (and
    w_b, if PAIR) [NT, BN, V], as fused multiply-adds in that order. The activations
    of a field pair are one load [NT, 1, V, 2], split in registers."""
    if EVEN:
        xv = tl.load(x_row + xoff).to(tl.float32)  # [NT, 1, 2V] or [NT, 1, V]
    else:
        xv = tl.load(x_row + xoff, mask=xmask, other=0.0).to(tl.float32)
    if PAIR:
        # loaded flat so that the compiler sees 2V contiguous values (one vector load)
        x_a, x_b = tl.split(tl.reshape(xv, (xv.shape[0], 1, xv.shape[2] // 2, 2)))  # [NT, 1, V] each
        out = tl.fma(w_b, x_b, tl.fma(w_a, x_a, acc))
    else:
        out = tl.fma(w_a, xv, acc)
    return out


@triton.jit
def _store_row(out, acc, m, W, N, n_out):
    tl.store(out + m * N + n_out, tl.sum(tl.sum(acc, axis=2), axis=0), mask=(n_out < N) & (m < W))  # [BN]


@triton.jit(do_not_specialize=["one"])
def _qmatmul_kernel(x, out, qs, qh, sc, sd, W, N, stride_xw, one, n_slots: tl.constexpr,
                    LOAD: tl.constexpr, FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr,
                    BN: tl.constexpr, NT: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr = 0):
    # PDL (programmatic dependent launch; the launch sets launch_pdl): 0 off; 1 let the
    # next kernel launch now and wait for the previous one before any load; 2 the same,
    # but the first step's weights (which no earlier kernel writes) are asked for before
    # the wait, so their latency overlaps the previous kernel's tail.
    # n_slots is a compile-time constant: a model has a handful of distinct K, the
    # compiler folds the strides, and the interpreter (numpy >= 2.4) cannot loop to a
    # run-time bound. `one` is a run-time 1 (fmt_triton.slot_field says why).
    EVEN: tl.constexpr = n_slots % NT == 0
    n_wt = tl.cdiv(W, BW)
    pid_n = tl.program_id(0) // n_wt   # the x-row tiles of one weight block run side by side
    m0 = (tl.program_id(0) % n_wt) * BW
    n_out = pid_n * BN + tl.arange(0, BN)  # [BN]
    row = tl.minimum(n_out, N - 1).to(tl.int64)[None, :]  # [1, BN]; past N: recompute N-1, not stored
    # rows past W recompute row W-1 and are not stored
    x0 = x + tl.minimum(m0 + 0, W - 1).to(tl.int64) * stride_xw
    x1 = x + tl.minimum(m0 + 1, W - 1).to(tl.int64) * stride_xw
    x2 = x + tl.minimum(m0 + 2, W - 1).to(tl.int64) * stride_xw
    x3 = x + tl.minimum(m0 + 3, W - 1).to(tl.int64) * stride_xw
    x4 = x + tl.minimum(m0 + 4, W - 1).to(tl.int64) * stride_xw
    x5 = x + tl.minimum(m0 + 5, W - 1).to(tl.int64) * stride_xw
    x6 = x + tl.minimum(m0 + 6, W - 1).to(tl.int64) * stride_xw
    x7 = x + tl.minimum(m0 + 7, W - 1).to(tl.int64) * stride_xw
    # one accumulator per x row, [NT, BN, V]: every (slot lane, row, word) sums its
    # products in k order with fused multiply-adds; lanes are added up once at the end
    acc0 = tl.zeros([NT, BN, V], tl.float32)
    acc1 = tl.zeros([NT, BN, V], tl.float32)
    acc2 = tl.zeros([NT, BN, V], tl.float32)
    acc3 = tl.zeros([NT, BN, V], tl.float32)
    acc4 = tl.zeros([NT, BN, V], tl.float32)
    acc5 = tl.zeros([NT, BN, V], tl.float32)
    acc6 = tl.zeros([NT, BN, V], tl.float32)
    acc7 = tl.zeros([NT, BN, V], tl.float32)
    PAIR: tl.constexpr = P > 1
    # k offsets of a field pair (2m, 2m+1) of the V words: 2v and 2v+1, so 2V in a row
    koff = tl.arange(0, 2 * V if PAIR else V)[None, None, :]  # [1, 1, 2V]
    if PDL > 0:
        gdc_launch_dependents()
    if PDL == 2:
        pw, ph, p1, p2 = LOAD(qs, qh, sc, sd, row, 0, one, n_slots, NT, V)
    if PDL > 0:
        gdc_wait()
    for s0 in range(0, n_slots, NT):
        if PDL == 2:
            if s0 == 0:
                words, h, s1, s2 = pw, ph, p1, p2
            else:
                words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)
        else:
            words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)
        u = (s0 + tl.arange(0, NT))[:, None, None]  # [NT, 1, 1]
        xmask = u < n_slots
        for i in tl.static_range(0, P, 2 if PAIR else 1):
            w_a = FIELD(words, h, s1, s2, i, one)  # [NT, BN, V] float32: field i of each word
            if PAIR:
                w_b = FIELD(words, h, s1, s2, i + 1, one)
            else:
                w_b = w_a
            xoff = u * (V * P) + i * V + koff  # [NT, 1, 2V]: the pair's 2V consecutive k
            acc0 = row_fma(acc0, w_a, w_b, x0, xoff, xmask, PAIR, EVEN)
            if BW > 1:
                acc1 = row_fma(acc1, w_a, w_b, x1, xoff, xmask, PAIR, EVEN)
            if BW > 2:
                acc2 = row_fma(acc2, w_a, w_b, x2, xoff, xmask, PAIR, EVEN)
                acc3 = row_fma(acc3, w_a, w_b, x3, xoff, xmask, PAIR, EVEN)
            if BW > 4:
                acc4 = row_fma(acc4, w_a, w_b, x4, xoff, xmask, PAIR, EVEN)
                acc5 = row_fma(acc5, w_a, w_b, x5, xoff, xmask, PAIR, EVEN)
                acc6 = row_fma(acc6, w_a, w_b, x6, xoff, xmask, PAIR, EVEN)
                acc7 = row_fma(acc7, w_a, w_b, x7, xoff, xmask, PAIR, EVEN)
    _store_row(out, acc0, m0 + 0, W, N, n_out)
    if BW > 1:
        _store_row(out, acc1, m0 + 1, W, N, n_out)
    if BW > 2:
        _store_row(out, acc2, m0 + 2, W, N, n_out)
        _store_row(out, acc3, m0 + 3, W, N, n_out)
    if BW > 4:
        _store_row(out, acc4, m0 + 4, W, N, n_out)
        _store_row(out, acc5, m0 + 5, W, N, n_out)
        _store_row(out, acc6, m0 + 6, W, N, n_out)
        _store_row(out, acc7, m0 + 7, W, N, n_out)


def tile(w: QuantWeight, rows_per_thread: int = ROWS_PER_THREAD, slots_per_step: int = SLOTS_PER_STEP,
         num_warps: int = NUM_WARPS) -> tuple[int, int, int]:
    """(BN, NT, num_warps) for a weight: a function of its type and shape only, never of
    W, so that a row's summation order is the same in every call (exact mode). Short
    rows take fewer slots per step and spread the rows over the idle threads."""
    NT = min(slots_per_step, triton.next_power_of_2(w.n_slots))
    BN = rows_per_thread * max(1, 32 * num_warps // NT)
    return BN, NT, num_warps


def qmatmul(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None,
            rows_per_thread: int = ROWS_PER_THREAD, slots_per_step: int = SLOTS_PER_STEP,
            num_warps: int = NUM_WARPS, maxnreg: int | None = None, pdl: int = 0) -> torch.Tensor:
    """x [W, K] (bf16/fp16/fp32) @ w^T -> [W, N] float32 (into `out` if given, a
    contiguous [W, N] float32). A row's result is bit-identical for every W and
    position (Triton path). The last three are tuning knobs that change the bits: a
    weight must always be used with the same values (maxnreg, a register cap for
    occupancy, does not change them). Without CUDA or the Triton
    interpreter, falls back to `qmatmul_torch` (not position-invariant).

    Compiled with enable_fp_fusion=False: every multiply-add that should be fused is
    written as tl.fma, and nothing else is left for LLVM or ptxas to contract. Their
    implicit fusion depends on the surrounding code (rows of Q8_0 and Q6_K, whose tiles
    loop over K, changed bits between W=1 and W>=3 on the GPU)."""
    W, N, out = check_gemv_args(x, w, out, "qmatmul", triton_only=False)   # off Triton: qmatmul_torch
    if not use_triton(x):
        return out.copy_(qmatmul_torch(x, w))
    x = x if x.stride(1) == 1 else x.contiguous()
    BN, NT, num_warps = tile(w, rows_per_thread, slots_per_step, num_warps)
    if not x.is_cuda:       # the interpreter pays per program; a row's order is NT's, not BN's
        BN = max(BN, min(1024, triton.next_power_of_2(N)))
    BW = min(MAX_BW, 16 // rows_per_thread, triton.next_power_of_2(W))
    grid = (triton.cdiv(N, BN) * triton.cdiv(W, BW),)
    fmt = w.fmt
    _qmatmul_kernel[grid](x, out, *w.plane_args(), W, N, x.stride(0), 1, n_slots=w.n_slots,
                          LOAD=fmt.triton_load, FIELD=fmt.triton_field, V=fmt.V, P=fmt.P, BN=BN, NT=NT, BW=BW,
                          num_warps=num_warps, enable_fp_fusion=False, PDL=pdl if x.is_cuda else 0,
                          **({} if maxnreg is None else {"maxnreg": maxnreg}),
                          **({"launch_pdl": True} if pdl and x.is_cuda else {}))
    return out


def qmatmul_torch(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Plain-torch fallback: dequantize the planes, fp32 matmul. [W, N] float32."""
    return x.float() @ w.dequantize().T  # [W, N]


def qmatmul_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Reference of the same function in float64 (x as given, weights from the planes): [W, N]."""
    return x.double() @ w.dequantize().double().T  # [W, N]
