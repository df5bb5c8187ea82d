"""q8_K activations for the tensor-core and dp4a GEMVs (qgemv_mma_k, qgemv_q8k): int8 with one
scale a 256-value super-block (llama.cpp's q8_K scales, expert_q8's rounding rule), laid out in
qgemv_mma's fragment order and again in row order, with xsum a 32-slot and dx a super-block.
emit_q8k is the one writer: the prepare launch here and the producers that fuse it (the norm,
SiLU and attention kernels) call it, so their bytes are the same."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe.expert_q8_gpu import quantize_block
from ..pdl import pdl_kwargs, pdl_start
from .mma_layout import COLS


@triton.jit
def emit_q8k(a, k0, m, xf, xs, dxs, xl, K: tl.constexpr, MASKED: tl.constexpr = False):
    """prepare_q8k's outputs for x[m, k0 : k0 + BQ] = a [BQ] float32 (k0 and BQ multiples of
    256): q8 with one scale a super-block (expert_q8's rounding rule), the bytes to their
    fragment-order places (prepare_i8's lane order inside a slot, the words in the module
    docstring's x order) and again in row order (xl: prepare_i8's words, for qgemv_q8k),
    xsum a slot, dx a super-block.
    MASKED: k may run past K (a is 0 there) and nothing is stored past it. The prepare
    launch and the producers that fuse it (kernels/norm/rmsnorm.py) share it: the same bits."""
    BQ: tl.constexpr = a.shape[0]
    NB: tl.constexpr = BQ // 256
    n_slots: tl.constexpr = K // 32
    STEPS: tl.constexpr = n_slots // 2
    q, dx = quantize_block(tl.reshape(a, (NB, 256)))                 # [NB, 256], [NB]
    q = tl.reshape(q, (BQ,))
    k = k0 + tl.arange(0, BQ)                                          # [BQ]
    kk = k % 32                                                        # within the slot: emit_q8's lane rule
    e = kk % 2                                                         # lo (0) or hi (1) word
    v = (kk % 8) // 2                                                  # word t of that half
    jh = kk // 8                                                       # its byte
    s = k // 32                                                        # the slot, its step and place in it
    word = (((m // 8) * STEPS + s // 2) * 32 + 4 * (m % 8) + v) * 4 + 2 * (s % 2) + e
    row_word = (m * n_slots + s) * 8 + e * 4 + v
    slots = k0 // 32 + tl.arange(0, BQ // 32)                          # [BQ/32]
    xsum = tl.sum(tl.reshape(q, (BQ // 32, 32)), axis=1)
    blocks = k0 // 256 + tl.arange(0, NB)
    if MASKED:
        tl.store(xf + word * 4 + jh, q.to(tl.int8), mask=k < K)
        tl.store(xl + row_word * 4 + jh, q.to(tl.int8), mask=k < K)
        tl.store(xs + m * n_slots + slots, xsum, mask=slots < n_slots)
        tl.store(dxs + m * (K // 256) + blocks, dx, mask=blocks < K // 256)
    else:
        tl.store(xf + word * 4 + jh, q.to(tl.int8))
        tl.store(xl + row_word * 4 + jh, q.to(tl.int8))
        tl.store(xs + m * n_slots + slots, xsum)
        tl.store(dxs + m * (K // 256) + blocks, dx)


@triton.jit
def _prepare_q8k_kernel(x, xf, xs, dxs, xl, stride_x, n_slots: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row m, super-block b): emit_q8k of x[m, 256 b : 256 b + 256]."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * 256
    a = tl.load(x + m * stride_x + k0 + tl.arange(0, 256)).to(tl.float32)
    emit_q8k(a, k0, m, xf, xs, dxs, xl, n_slots * 32)


Q8K = ("q8k", 32)       # prepare_q8k's activations among the orders a producer emits (Linear.orders)


def new_q8k(W: int, K: int, device) -> tuple[torch.Tensor, ...]:
    """Empty buffers for prepare_q8k's outputs, launch_prepare's shapes: (xf, xs, dxs, xl)."""
    return (torch.empty((triton.cdiv(W, COLS) * COLS * K // 4,), dtype=torch.int32, device=device),
            torch.empty((W, K // 32), dtype=torch.int32, device=device),
            torch.empty((W, K // 256), dtype=torch.float32, device=device),
            torch.empty((W, K // 4), dtype=torch.int32, device=device))


def prepare_q8k(x: torch.Tensor, n_slots: int, pdl: bool = False) -> tuple[torch.Tensor, ...]:
    """x [W, K] -> int8 activations with one scale a 256-value super-block (llama.cpp's q8_K
    scales), one launch: (fragment-order words for qgemv_mma_k [W/8 blocks, n_slots/2, 32, 2, 2]
    (the padding columns' words are left unwritten: their sums are never stored), xsum int32
    [W, n_slots] a 32-slot, dx float32 [W, K / 256], the same bytes in row order for
    qgemv_q8k: int32 [W, n_slots, 2 (lo, hi), 4])."""
    return launch_prepare(_prepare_q8k_kernel, x, n_slots, 32, "prepare_q8k", pdl, rows=True)


def launch_prepare(kernel, x: torch.Tensor, n_slots: int, slot: int, name: str,
                   pdl: bool, rows: bool = False) -> tuple[torch.Tensor, ...]:
    """One launch of a q8_K prepare kernel (program per row and super-block): (fragment-order
    words, a whole 8-column block's worth (the padding columns' left unwritten), xsum int32
    [W, n_slots], dx float32 [W, K / 256]) and with `rows` the words in row order [W, K / 4]."""
    W, K = x.shape
    if K != n_slots * slot or K % 256:
        raise ValueError(f"{name}: K = {K} must be {n_slots} slots of {slot} and whole super-blocks")
    x = x if x.stride(1) == 1 else x.contiguous()
    xf = torch.empty((triton.cdiv(W, COLS) * COLS * K // 4,), dtype=torch.int32, device=x.device)
    xs = torch.empty((W, n_slots), dtype=torch.int32, device=x.device)
    dxs = torch.empty((W, K // 256), dtype=torch.float32, device=x.device)
    xl = (torch.empty((W, K // 4), dtype=torch.int32, device=x.device),) if rows else ()
    kernel[(W, K // 256)](x, xf.view(torch.int8), xs, dxs, *(t.view(torch.int8) for t in xl), x.stride(0),
                          n_slots=n_slots, num_warps=4, enable_fp_fusion=False, **pdl_kwargs(pdl, x.device))
    return (xf, xs, dxs, *xl)
