"""Grouped expert GEMMs for MoE prefill chunks, dequantizing weight tiles on the fly.

A prefill chunk of T rows sends T * k (row, rank) pairs to E experts. Here the pairs
are sorted by expert into blocks of BM (each expert's run padded to a multiple of BM)
entirely on the device (moe_align: no host sync, so the layer can be issued ahead or
captured), and one launch per weight multiplies every block by its expert: a program
takes a block of BM pairs and BN weight rows, and at each step dequantizes NT slots of
its BN rows (the formats' own Triton decoders, formats.py, put in k order by
qgemm.slot_values) into a [BK, BN] tile for a tensor-core `tl.dot` with the block's
[BM, BK] activations. The weight is read once per block of an expert (at T 512 on the
30B-A3B shape, ~32 pairs an expert: about once), never written out as bf16.

gate|up ([E, 2F, D]) is GATED: gate rows n and up rows F + n in two accumulators,
silu(gate) * up stored per padded slot. down ([E, D, F]) reads those rows in place and
stores each real pair's row at the pair's index; the k ranks of a row are then summed
in rank order (moe_prefill): every value written once, no atomics: deterministic.

gpt-oss: BIAS rows per expert ([E, 2F] gate|up's, [E, D] down's) added to the block's sums,
and the activation a constexpr (activations/silu.gated: SiLU or swiglu_oai).

Not row-invariant (the block a pair lands in and its padding depend on the chunk):
prefill only, like qgemm (gpu_model.py says what that means for exact mode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activations.silu import gated
from ..formats.dequant import slot_values
from ..formats.qweight import QuantWeight


# (BN, warps, stages): the fastest of the tiles tried (docs/decisions/prefill-tensor-cores.md)
TILE = (64, 4, 3)


def block_rows(pairs: int, experts: int) -> int:
    """BM: about the mean pairs per expert, 16..64 (the padding is up to BM - 1 an expert)."""
    return max(16, min(64, triton.next_power_of_2(max(1, pairs // max(1, experts)))))


def moe_align(experts: torch.Tensor, E: int, BM: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [T, k] (int) -> (slot_pair [MB * BM] int32: the pair (row * k + rank) in each
    padded slot, T * k where none; block_expert [MB] int32; total [1] int32: padded slots
    in use). Blocks past total are not used. MB = cdiv(T * k, BM) + E bounds the blocks
    whatever the routing, so every shape is known without reading the counts."""
    P = experts.numel()
    dev = experts.device
    flat = experts.reshape(-1).long()                                        # [P]
    sorted_e, order = torch.sort(flat, stable=True)                          # [P] each
    bounds = torch.searchsorted(sorted_e, torch.arange(E + 1, device=dev))   # [E + 1] (bincount would sync)
    first, counts = bounds[:-1], bounds[1:] - bounds[:-1]                    # [E] first sorted pair, pairs
    padded = (counts + BM - 1) // BM * BM                                    # [E]
    ends = torch.cumsum(padded, 0)                                           # [E] padded run ends
    slot = ends[sorted_e] - padded[sorted_e] + torch.arange(P, device=dev) - first[sorted_e]  # [P]
    MB = -(-P // BM) + E
    slot_pair = torch.full((MB * BM,), P, dtype=torch.int32, device=dev)     # [MB * BM]
    slot_pair[slot] = order.to(torch.int32)
    starts = torch.arange(MB, device=dev) * BM                               # [MB]
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=E - 1).to(torch.int32)  # [MB]
    return slot_pair, block_expert, ends[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["one"])
def _moe_gemm_kernel(a, out, slot_pair, block_expert, total, qs, qh, sc, sd, n_pairs, N_OUT, N_W, K, stride_a,
                     one, TOP_K: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr,
                     n_slots: tl.constexpr, LOAD: tl.constexpr, FIELD: tl.constexpr, V: tl.constexpr,
                     P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr,
                     BIAS=None, HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0):
    """Program (block b, n block): out rows of the block's BM padded slots, columns n.
    GATHER: activations are a's rows pair // TOP_K (gate|up), else its rows b * BM..
    (down, reading gate|up's output) and the rows are stored at their pairs. GATED:
    weight rows e * N_W + n (gate) and + N_OUT (up), silu(gate) * up stored (ACT: silu.gated's).
    HAS_BIAS: BIAS [E, N_W] fp32, expert e's row added to the sums (gate's n, up's N_OUT + n)."""
    b = tl.program_id(0)
    if b * BM < tl.load(total):
        e = tl.load(block_expert + b).to(tl.int64)
        m = b * BM + tl.arange(0, BM)                                        # [BM] padded slots
        pair = tl.load(slot_pair + m)                                        # [BM]
        real = pair < n_pairs
        if GATHER:
            arow = (pair // TOP_K).to(tl.int64)
        else:
            arow = m.to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)                         # [BN]
        wrow = (e * N_W + tl.minimum(n, N_OUT - 1))[None, :]                 # [1, BN]; past N_OUT: not stored
        SLOT: tl.constexpr = V * P
        BK: tl.constexpr = NT * SLOT
        acc = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        dt = a.dtype.element_ty
        for s0 in range(0, n_slots, NT):
            k = s0 * SLOT + tl.arange(0, BK)                                 # [BK]
            x = tl.load(a + arow[:, None] * stride_a + k[None, :], mask=real[:, None] & (k < K)[None, :],
                        other=0.0)                                           # [BM, BK]
            words, h, s1, s2 = LOAD(qs, qh, sc, sd, wrow, s0, one, n_slots, NT, V)
            w = slot_values(words, h, s1, s2, FIELD, V, P, one)              # [NT, BN, SLOT]
            w = tl.reshape(tl.permute(w, (0, 2, 1)), (BK, BN)).to(dt)       # [BK, BN]
            acc = tl.dot(x, w, acc, input_precision=PREC)
            if GATED:
                words, h, s1, s2 = LOAD(qs, qh, sc, sd, wrow + N_OUT, s0, one, n_slots, NT, V)
                w = slot_values(words, h, s1, s2, FIELD, V, P, one)
                w = tl.reshape(tl.permute(w, (0, 2, 1)), (BK, BN)).to(dt)
                acc_u = tl.dot(x, w, acc_u, input_precision=PREC)
        cols = (n < N_OUT)[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + e * N_W + n, mask=n < N_OUT, other=0.0)[None, :]
            if GATED:
                acc_u += tl.load(BIAS + e * N_W + N_OUT + n, mask=n < N_OUT, other=0.0)[None, :]
        if GATED:
            y = gated(acc, acc_u, ACT)                                       # silu(gate) * up, as fused.silu_mul
            tl.store(out + m.to(tl.int64)[:, None] * N_OUT + n[None, :], y.to(out.dtype.element_ty), mask=cols)
        else:
            tl.store(out + pair.to(tl.int64)[:, None] * N_OUT + n[None, :], acc.to(out.dtype.element_ty),
                     mask=real[:, None] & cols)


def _launch(a: torch.Tensor, w: QuantWeight, out: torch.Tensor, align: tuple, n_pairs: int, top_k: int,
            gather: bool, gated: bool, BM: int, BN: int, warps: int, stages: int,
            bias: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    slot_pair, block_expert, total = align
    E, N_W, K = w.shape
    n_out = N_W // 2 if gated else N_W
    fmt = w.fmt
    NT = max(1, 64 // fmt.slot)                                              # BK = 64 values a step
    if not a.is_cuda:       # the interpreter pays per program; its dot is numpy's, one order per row
        BN = min(1024, triton.next_power_of_2(n_out))
    grid = (block_expert.shape[0], triton.cdiv(n_out, BN))
    planes = tuple(p if p is w.table else p.reshape(E * N_W, p.shape[-1])
                   for p in w.plane_args())  # the experts' rows one after another (a codebook as it is)
    extra = {"num_stages": stages} if a.is_cuda else {}
    if bias is not None or act:
        extra |= {"BIAS": bias, "HAS_BIAS": bias is not None, "ACT": act}
    _moe_gemm_kernel[grid](a, out, slot_pair, block_expert, total, *planes, n_pairs, n_out, N_W, K, a.stride(0), 1,
                           TOP_K=top_k, GATHER=gather, GATED=gated, n_slots=w.n_slots,
                           PREC="ieee" if a.dtype == torch.float32 else "tf32",   # fp32 in (CPU tests): no tf32
                           LOAD=fmt.triton_load,
                           FIELD=fmt.triton_field, V=fmt.V, P=fmt.P, BM=BM, BN=BN, NT=NT, num_warps=warps,
                           **extra)
    return out


def moe_prefill(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: QuantWeight,
                down: QuantWeight, tile: tuple = TILE, biases: tuple | None = None, act: int = 0) -> torch.Tensor:
    """The routed rows (weights, experts [T, k]) of h [T, D] through resident experts
    (gate_up [E, 2F, D], down [E, D, F]) -> [T, D] float32. Two GEMM launches and a
    handful of small ones, no host sync. h's dtype is the tensor cores' input (bf16 on
    the GPU). tile: (BN, warps, stages). biases: the experts' (gate|up [E, 2F], down [E, D])
    fp32 (gpt-oss); act: activations.silu.ACT_IDS' id in SiLU's place."""
    T, k = experts.shape
    E, F2, D = gate_up.shape
    if down.shape != (E, D, F2 // 2) or h.shape != (T, D):
        raise ValueError(f"moe_prefill: h {tuple(h.shape)}, gate_up {gate_up.shape}, down {down.shape} do not agree")
    BN, warps, stages = tile
    P = T * k
    BM = block_rows(P, E)
    align = moe_align(experts, E, BM)
    if not h.is_cuda:
        h = h.float()   # the interpreter's bf16 tl.dot is not faithful (garbage, seen under Triton 3.6)
    h = h.contiguous()
    hidden = torch.empty(align[0].shape[0], F2 // 2, dtype=h.dtype, device=h.device)  # [MB * BM, F]
    gu_bias, down_bias = biases if biases is not None else (None, None)
    _launch(h, gate_up, hidden, align, P, k, True, True, BM, BN, warps, stages, gu_bias, act)
    y = torch.empty(P, D, dtype=torch.float32, device=h.device)              # [P, D]
    _launch(hidden, down, y, align, P, k, False, False, BM, BN, warps, stages, down_bias)
    return (y.view(T, k, D) * weights[:, :, None]).sum(1)                   # [T, D]
