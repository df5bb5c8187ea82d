"""Routed experts on int8 activations (dp4a), the MoE form of qgemv_i8:

    gate_up  program (pair, n block), pair = row * TOP_K + rank: expert e = experts[pair],
             its gate and up rows against the row's int8 input -> silu(g) * u   [W, k, F]
    prepare  the activations [W * k, F] to int8 in the down weight's lane order
    down     program (pair, n block): one expert's rows against its pair's int8 act,
             unweighted                                                          [W, k, D]
    combine  moe.down_combine_kernel: y = fma(part_r, weight_r, y) in rank order; or the next
             norm does it (fused.add_rmsnorm's MoE parts, the same code)

Each (pair, n block) runs qgemv_i8's per-slot arithmetic (the same LOAD, lanes, dp4a
sums and per-lane FMA, one lane sum at the end) on a tile that is a function of the
weight only, so a row's bits depend on neither W nor its column, and not on the tier an
expert is read from (TABLE: bank slot or host planes, the same code on either).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expert_q8 import supports
from .expert_q8_gpu import CODES
from .moe_f32 import BD_COMBINE, NUM_WARPS, bank_args, check_bank, down_combine_kernel
from ..gemv.qgemv_i8 import row_step_i8, step_slots
from ..pdl import pdl_kwargs, pdl_start
from ..gemv.qmatvec_i8 import unpack_lanes, lane_order, prepare_i8


# gate_up walks K once for its gate and up rows together (_rows2_i8: the same bits, twice
# the bytes in flight a program, a little faster at every W; docs/decisions/gemv-tiles.md)
GATE_UP_PAIRED = True
# weight rows a program of the experts' GEMVs takes (part of their float order, the same at
# every W). 16, not qgemv_i8's 4 for matrices of < 4096 rows: at 4 a 30B-A3B down ran 4,096
# one-step programs at W=1, and 16 is faster at every W (docs/decisions/gemv-tiles.md)
EXPERT_BN = 16


@triton.jit
def _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, row, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
             V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr,
             BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr):
    """Weight rows `row` [1, BN] (int64, rows of the flattened planes) against one int8
    x row: [BN] float32, qgemv_i8's arithmetic."""
    EVEN: tl.constexpr = n_slots % NT == 0
    acc = tl.zeros([NT, BN], tl.float32)
    for s0 in range(0, n_slots, NT):
        words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)   # [NT, BN, V], [NT, BN] x3
        lo, hi = unpack_lanes(words, h, BITS, HBITS)
        acc = row_step_i8(acc, lo, hi, s1, s2, xp_row, xsd_row, s0 + tl.arange(0, NT), EVEN, n_slots, BITS, BIAS,
                        HAS_MIN, DP4A)
    return tl.sum(acc, axis=0)


@triton.jit
def _rows2_i8(xp_row, xsd_row, qs, qh, sc, sd, row_a, row_b, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
              V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr,
              BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr):
    """_rows_i8 of two row sets (gate's and up's) in one walk over K: each step asks for
    both sets' weights before either's arithmetic (twice the bytes in flight). Each set
    keeps its own accumulator and steps, so each gives _rows_i8's bits."""
    EVEN: tl.constexpr = n_slots % NT == 0
    acc_a = tl.zeros([NT, BN], tl.float32)
    acc_b = tl.zeros([NT, BN], tl.float32)
    for s0 in range(0, n_slots, NT):
        wa, ha, a1, a2 = LOAD(qs, qh, sc, sd, row_a, s0, one, n_slots, NT, V)   # [NT, BN, V], [NT, BN] x3
        wb, hb, b1, b2 = LOAD(qs, qh, sc, sd, row_b, s0, one, n_slots, NT, V)
        u = s0 + tl.arange(0, NT)
        lo, hi = unpack_lanes(wa, ha, BITS, HBITS)
        acc_a = row_step_i8(acc_a, lo, hi, a1, a2, xp_row, xsd_row, u, EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A)
        lo, hi = unpack_lanes(wb, hb, BITS, HBITS)
        acc_b = row_step_i8(acc_b, lo, hi, b1, b2, xp_row, xsd_row, u, EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A)
    return tl.sum(acc_a, axis=0), tl.sum(acc_b, axis=0)


@triton.jit
def _gate_up_pair(xp_row, xsd_row, qs, qh, sc, sd, row_g, F, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
                  V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                  HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr,
                  PAIRED: tl.constexpr):
    """(gate rows row_g, up rows row_g + F) against one int8 x row: [BN] float32 each."""
    if PAIRED:
        g, u = _rows2_i8(xp_row, xsd_row, qs, qh, sc, sd, row_g, row_g + F, one, n_slots, LOAD, V, BITS, HBITS,
                         BIAS, HAS_MIN, BN, NT, DP4A)
    else:
        g = _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, row_g, one, n_slots, LOAD, V, BITS, HBITS, BIAS, HAS_MIN,
                     BN, NT, DP4A)
        u = _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, row_g + F, one, n_slots, LOAD, V, BITS, HBITS, BIAS,
                     HAS_MIN, BN, NT, DP4A)
    return g, u


@triton.jit(do_not_specialize=["one"])
def _gate_up_i8_kernel(xp, xsd, out, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, F, one,
                       TOP_K: tl.constexpr, TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr,
                       V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                       HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr,
                       PDL: tl.constexpr = False, PAIRED: tl.constexpr = False):
    """Program (pair, n block)."""
    pdl_start(PDL)                   # which weights to read comes from the routing: nothing to fetch before
    XROW: tl.constexpr = n_slots * (2 * V if BITS == 4 else V)        # int32 words per packed x row
    n_fb = tl.cdiv(F, BN)
    pair = tl.program_id(0) // n_fb
    n_out = (tl.program_id(0) % n_fb) * BN + tl.arange(0, BN)         # [BN]
    n_in = tl.minimum(n_out, F - 1).to(tl.int64)[None, :]              # [1, BN]; past F: recomputed, not stored
    m = (pair // TOP_K).to(tl.int64)
    e = tl.load(experts + pair).to(tl.int64)
    xp_row = xp + m * XROW
    xsd_row = xsd + m * n_slots * 2
    if TABLE:
        slot = tl.load(table + e).to(tl.int64)
        if slot >= 0:
            g, u = _gate_up_pair(xp_row, xsd_row, bqs, bqh, bsc, bsd, slot * 2 * F + n_in, F, one, n_slots, LOAD, V,
                                 BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, PAIRED)
        else:
            g, u = _gate_up_pair(xp_row, xsd_row, qs, qh, sc, sd, e * 2 * F + n_in, F, one, n_slots, LOAD, V,
                                 BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, PAIRED)
    else:
        g, u = _gate_up_pair(xp_row, xsd_row, qs, qh, sc, sd, e * 2 * F + n_in, F, one, n_slots, LOAD, V,
                             BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, PAIRED)
    y = (g / (1.0 + tl.exp(-g)) * u).to(out.dtype.element_ty)          # silu(gate) * up, as fused.silu_mul
    tl.store(out + pair.to(tl.int64) * F + n_out, y, mask=n_out < F)


@triton.jit(do_not_specialize=["one"])
def _down_i8_kernel(xp, xsd, part, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, N, one,
                    TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr,
                    V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                    HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Program (pair, n block): the pair's unweighted part [BN]."""
    pdl_start(PDL)
    XROW: tl.constexpr = n_slots * (2 * V if BITS == 4 else V)
    n_nb = tl.cdiv(N, BN)
    pair = (tl.program_id(0) // n_nb).to(tl.int64)
    n_out = (tl.program_id(0) % n_nb) * BN + tl.arange(0, BN)         # [BN]
    nn = tl.minimum(n_out, N - 1).to(tl.int64)[None, :]                # [1, BN]
    e = tl.load(experts + pair).to(tl.int64)
    xp_row = xp + pair * XROW
    xsd_row = xsd + pair * n_slots * 2
    if TABLE:
        slot = tl.load(table + e).to(tl.int64)
        if slot >= 0:
            y = _rows_i8(xp_row, xsd_row, bqs, bqh, bsc, bsd, slot * N + nn, one, n_slots, LOAD, V, BITS, HBITS,
                         BIAS, HAS_MIN, BN, NT, DP4A)
        else:
            y = _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, e * N + nn, one, n_slots, LOAD, V, BITS, HBITS,
                         BIAS, HAS_MIN, BN, NT, DP4A)
    else:
        y = _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, e * N + nn, one, n_slots, LOAD, V, BITS, HBITS,
                     BIAS, HAS_MIN, BN, NT, DP4A)
    tl.store(part + pair * N + n_out, y, mask=n_out < N)


def expert_consts(w, N: int, DP4A: bool) -> dict:
    """Constexprs of a [E, ., K] weight's kernels: its format, its tile (a function of the
    weight only; under the interpreter, whose reductions do not depend on the layout,
    BN is raised because it pays per program)."""
    bits, hbits, bias, has_min = CODES[w.qtype]
    BN = EXPERT_BN if DP4A else min(128, triton.next_power_of_2(N))
    return dict(n_slots=w.n_slots, LOAD=w.fmt.triton_load, V=w.fmt.V, BITS=bits, HBITS=hbits, BIAS=bias,
                HAS_MIN=has_min, BN=BN, NT=step_slots(w.expert(0)), DP4A=DP4A)


def moe_i8_ok(gate_up, down) -> bool:
    """Both expert weights have an integer form (expert_q8.supports)."""
    return supports(gate_up) and supports(down)


def moe_i8_order(gate_up) -> tuple[int, int, int]:
    """The lane order the layer's input must come in."""
    return lane_order(gate_up.expert(0))


def moe_gate_up_i8(q8: tuple[torch.Tensor, torch.Tensor], gate_up, experts: torch.Tensor, act_dtype: torch.dtype,
                   table: torch.Tensor | None = None, bank=None, pdl: bool = False,
                   paired: bool = GATE_UP_PAIRED) -> torch.Tensor:
    """q8: the rows' int8 input in gate_up's lane order (moe_i8_order), gate_up [E, 2F, K],
    experts [W, k] int32 -> silu(gate) * up [W, k, F] in act_dtype. pdl: programmatic
    dependent launch (kernels/pdl.py). paired: gate and up rows walked together (the same bits)."""
    check_bank(gate_up, table, bank)
    xp, xsd = q8
    W, k = experts.shape
    F = gate_up.N // 2
    dev = experts.device
    act = torch.empty((W, k, F), dtype=act_dtype, device=dev)                   # [W, k, F]
    c = expert_consts(gate_up, F, dev.type == "cuda")
    _gate_up_i8_kernel[(W * k * triton.cdiv(F, c["BN"]),)](
        xp, xsd, act, experts.contiguous(), *bank_args(gate_up, table, bank), F, 1, TOP_K=k,
        TABLE=table is not None, num_warps=NUM_WARPS, enable_fp_fusion=False, PAIRED=paired, **c,
        **pdl_kwargs(pdl, dev))
    return act


def moe_down_i8(act: torch.Tensor, down, experts: torch.Tensor, weights: torch.Tensor,
                table: torch.Tensor | None = None, bank=None, pdl: bool = False, combine: bool = True
                ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """act [W, k, F] (quantized here, one launch), down [E, D, F] -> sum over ranks j of
    weights[:, j] * (q8(act[:, j]) @ down[experts[:, j]]^T): [W, D] float32.
    Two launches (down, then moe's combine). pdl: every launch with programmatic
    dependent launch (kernels/pdl.py). combine=False: no combine launch; returns (part [W, k, D], weights [W, k]) fp32 for the next norm
    to sum (fused.add_rmsnorm's MoE parts: the same bits)."""
    check_bank(down, table, bank)
    W, k, F = act.shape
    D = down.N
    dev = act.device
    aq, asd = prepare_i8(act.reshape(W * k, F), down.expert(0), pdl)           # [W k, F/4], [W k, F/slot, 2]
    pk = pdl_kwargs(pdl, dev)
    part = torch.empty((W, k, D), dtype=torch.float32, device=dev)             # [W, k, D]
    c = expert_consts(down, D, dev.type == "cuda")
    grid = (W * k * triton.cdiv(D, c["BN"]),)
    args = (aq, asd, part, experts.contiguous(), *bank_args(down, table, bank), D, 1)
    _down_i8_kernel[grid](*args, TABLE=table is not None, num_warps=NUM_WARPS, enable_fp_fusion=False, **c, **pk)
    if not combine:
        return part, weights.float().contiguous()
    out = torch.empty((W, D), dtype=torch.float32, device=dev)                 # [W, D]
    down_combine_kernel[(W * triton.cdiv(D, BD_COMBINE),)](
        part, weights.float().contiguous(), out, D, TOP_K=k, BD=BD_COMBINE, num_warps=2, enable_fp_fusion=False,
        **pk)
    return out
