"""Routed experts on int8 activations (dp4a), the MoE form of qgemv_i8:

    gate_up  program (pair, n block), pair = row * TOP_K + rank: expert e = experts[pair],
             its gate and up rows against the row's int8 input (+ e's bias) -> silu(g) * u
             (or swiglu_oai)                                                     [W, k, F]
    prepare  the activations [W * k, F] to int8 in the down weight's lane order
    down     program (pair, n block): one expert's rows against its pair's int8 act
             (+ e's bias), unweighted                                            [W, k, D]
    combine  moe.down_combine_kernel: y = fma(part_r, weight_r, y) in rank order; or the next
             norm does it (fused.add_rmsnorm's MoE parts, the same code)

Each (pair, n block) runs qgemv_i8's per-slot arithmetic (the same LOAD, lanes, dp4a
sums and per-lane FMA, one lane sum at the end) on a tile that is a function of the
weight only, so a row's bits depend on neither W nor its column, and not on the tier an
expert is read from (TABLE: bank slot or host planes, the same code on either).

CONTRACT (an expert store with CPU workers: kernels/moe/moe_q8.py) gives the expert
contract's bits (expert_q8.py), which the CPU workers compute too: the same lanes (NT =
contract_lanes, slot s in lane s mod NT), lane + t * dx in two roundings instead of the fma,
the lanes' pairwise tree instead of tl.sum, and the contract's act_c in fp32 (its exp and
correctly rounded division) instead of gated's; the interpreter gives the GPU's bits too.
A pair the CPU workers take (its tier, SKIP_TIER) is skipped.

The experts' types: the expert contract's (expert_q8_gpu.CODES) and MXFP4 (gpt-oss's), whose
codes become their doubled E2M1 levels through qgemv_i8_table's lookup (LANES 4: the `prmt`
asm on CUDA, selects under the interpreter; Q4_K's lane order, t = 2^(e-128) isum exact).
gpt-oss's experts also add a bias per expert to gate|up's sums ([E, 2F]) and to down's
([E, D]) before the activation and the rank sum (one fp32 add, as moe_f32), and take the
clamped swiglu_oai (ACT: activations/silu.gated, the formula the fp32 kernels call).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .expert_q8_gpu import CODES, act_c
from .moe_f32 import BD_COMBINE, NUM_WARPS, bank_args, check_bank, down_combine_kernel
from ..activations.silu import gated
from ..gemv.qgemv_i8 import lanes_i8, row_step_i8, step_slots
from ..gemv.qgemv_i8_table import i8_codes
from ..gemv.qmatvec_i8 import contract_step, lane_order, lane_tree, prepare_i8
from ..pdl import pdl_kwargs, pdl_start


# gate_up walks K once for its gate and up rows together (_rows2_i8: the same bits, twice
# the bytes in flight a program, a little faster at every W; docs/decisions/gemv-tiles.md)
GATE_UP_PAIRED = True
# weight rows a program of the experts' GEMVs takes (part of their float order, the same at
# every W). 16, not qgemv_i8's 4 for matrices of < 4096 rows: at 4 a 30B-A3B down ran 4,096
# one-step programs at W=1, and 16 is faster at every W (docs/decisions/gemv-tiles.md)
EXPERT_BN = 16
# the experts' types: the contract's and MXFP4 (the table lookup in 4-bit lanes of Q4_K's order).
# The other dense int8 forms (qgemv_i8_table.TABLE_CODES) would take the same lanes_i8 (the 2-bit
# ones with qgemv_i8's XV, their activation words a slot) but are not tested in moe_i8
EXPERT_TYPES = frozenset((*CODES, T.MXFP4))


@triton.jit
def _step(acc, lo, hi, s1, s2, xp_row, xsd_row, u, EVEN: tl.constexpr, n_slots: tl.constexpr, BITS: tl.constexpr,
          BIAS: tl.constexpr, HAS_MIN: tl.constexpr, DP4A: tl.constexpr, CONTRACT: tl.constexpr):
    """acc [NT, BN] + one step's slot terms, lane by lane: the expert contract's lane + t dx
    (two roundings) with CONTRACT, else qgemv_i8's fma."""
    if CONTRACT:
        return contract_step(acc, lo, hi, s1, s2, xp_row, xsd_row, u, EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A)
    return row_step_i8(acc, lo, hi, s1, s2, xp_row, xsd_row, u, EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A)


@triton.jit
def _lanes_total(acc, CONTRACT: tl.constexpr):
    if CONTRACT:
        return lane_tree(acc)
    return tl.sum(acc, axis=0)


@triton.jit
def _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, row, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
             V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr,
             BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr, LANES: tl.constexpr,
             CONTRACT: tl.constexpr = False):
    """Weight rows `row` [1, BN] (int64, rows of the flattened planes) against one int8
    x row: [BN] float32, qgemv_i8's arithmetic (LANES: its TABLE, qgemv_i8.lanes_i8), or
    with CONTRACT the expert contract's (expert_q8.py: its lanes, adds and tree)."""
    EVEN: tl.constexpr = n_slots % NT == 0
    acc = tl.zeros([NT, BN], tl.float32)
    for s0 in range(0, n_slots, NT):
        words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)   # [NT, BN, V], [NT, BN] x3
        lo, hi = lanes_i8(words, h, one, BITS, HBITS, LANES, DP4A)
        acc = _step(acc, lo, hi, s1, s2, xp_row, xsd_row, s0 + tl.arange(0, NT), EVEN, n_slots, BITS, BIAS,
                    HAS_MIN, DP4A, CONTRACT)
    return _lanes_total(acc, CONTRACT)


@triton.jit
def _rows2_i8(xp_row, xsd_row, qs, qh, sc, sd, row_a, row_b, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
              V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr,
              BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr, LANES: tl.constexpr,
              CONTRACT: tl.constexpr = False):
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
        lo, hi = lanes_i8(wa, ha, one, BITS, HBITS, LANES, DP4A)
        acc_a = _step(acc_a, lo, hi, a1, a2, xp_row, xsd_row, u, EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A, CONTRACT)
        lo, hi = lanes_i8(wb, hb, one, BITS, HBITS, LANES, DP4A)
        acc_b = _step(acc_b, lo, hi, b1, b2, xp_row, xsd_row, u, EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A, CONTRACT)
    return _lanes_total(acc_a, CONTRACT), _lanes_total(acc_b, CONTRACT)


@triton.jit
def _gate_up_pair(xp_row, xsd_row, qs, qh, sc, sd, row_g, F, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
                  V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                  HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr,
                  PAIRED: tl.constexpr, LANES: tl.constexpr, CONTRACT: tl.constexpr):
    """(gate rows row_g, up rows row_g + F) against one int8 x row: [BN] float32 each."""
    if PAIRED:
        g, u = _rows2_i8(xp_row, xsd_row, qs, qh, sc, sd, row_g, row_g + F, one, n_slots, LOAD, V, BITS, HBITS,
                         BIAS, HAS_MIN, BN, NT, DP4A, LANES, CONTRACT)
    else:
        g = _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, row_g, one, n_slots, LOAD, V, BITS, HBITS, BIAS, HAS_MIN,
                     BN, NT, DP4A, LANES, CONTRACT)
        u = _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, row_g + F, one, n_slots, LOAD, V, BITS, HBITS, BIAS,
                     HAS_MIN, BN, NT, DP4A, LANES, CONTRACT)
    return g, u


@triton.jit
def _gate_up_program(xp, xsd, out, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, F, one, pair, n_out,
                     TOP_K: tl.constexpr, TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr,
                     V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                     HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr,
                     PAIRED: tl.constexpr, LANES: tl.constexpr, ebias, HAS_EBIAS: tl.constexpr, ACT: tl.constexpr,
                     CONTRACT: tl.constexpr):
    XROW: tl.constexpr = n_slots * (2 * V if BITS == 4 else V)        # int32 words per packed x row
    n_in = tl.minimum(n_out, F - 1).to(tl.int64)[None, :]              # [1, BN]; past F: recomputed, not stored
    m = (pair // TOP_K).to(tl.int64)
    e = tl.load(experts + pair).to(tl.int64)
    xp_row = xp + m * XROW
    xsd_row = xsd + m * n_slots * 2
    if TABLE:
        slot = tl.load(table + e).to(tl.int64)
        if slot >= 0:
            g, u = _gate_up_pair(xp_row, xsd_row, bqs, bqh, bsc, bsd, slot * 2 * F + n_in, F, one, n_slots, LOAD, V,
                                 BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, PAIRED, LANES, CONTRACT)
        else:
            g, u = _gate_up_pair(xp_row, xsd_row, qs, qh, sc, sd, e * 2 * F + n_in, F, one, n_slots, LOAD, V,
                                 BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, PAIRED, LANES, CONTRACT)
    else:
        g, u = _gate_up_pair(xp_row, xsd_row, qs, qh, sc, sd, e * 2 * F + n_in, F, one, n_slots, LOAD, V,
                             BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, PAIRED, LANES, CONTRACT)
    if HAS_EBIAS:
        g += tl.load(ebias + e * 2 * F + n_out, mask=n_out < F, other=0.0)
        u += tl.load(ebias + e * 2 * F + F + n_out, mask=n_out < F, other=0.0)
    if CONTRACT:
        y = act_c(g, u, ACT)                                           # the contract's exp and division, fp32
    else:
        y = gated(g, u, ACT).to(out.dtype.element_ty)                   # silu(gate) * up (as silu_mul), or swiglu_oai
    tl.store(out + pair.to(tl.int64) * F + n_out, y, mask=n_out < F)


@triton.jit(do_not_specialize=["one"])
def _gate_up_i8_kernel(xp, xsd, out, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, F, one,
                       TOP_K: tl.constexpr, TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr,
                       V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                       HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr,
                       PDL: tl.constexpr = False, PAIRED: tl.constexpr = False, LANES: tl.constexpr = 0,
                       ebias=None, HAS_EBIAS: tl.constexpr = False, ACT: tl.constexpr = 0,
                       CONTRACT: tl.constexpr = False, tier=None, SKIP_TIER: tl.constexpr = -1):
    """Program (pair, n block). LANES: the codes' lanes (qgemv_i8.lanes_i8's TABLE); HAS_EBIAS:
    ebias [E, 2F] fp32 (gate's then up's) added to the sums; ACT: silu.gated's activation.
    CONTRACT: the expert contract's arithmetic (out fp32); SKIP_TIER >= 0: pairs whose
    tier [W k] is SKIP_TIER are another's (the CPU workers'): nothing is read or written."""
    pdl_start(PDL)                   # which weights to read comes from the routing: nothing to fetch before
    n_fb = tl.cdiv(F, BN)
    pair = tl.program_id(0) // n_fb
    n_out = (tl.program_id(0) % n_fb) * BN + tl.arange(0, BN)         # [BN]
    if SKIP_TIER >= 0:
        if tl.load(tier + pair) != SKIP_TIER:
            _gate_up_program(xp, xsd, out, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, F, one, pair, n_out,
                             TOP_K, TABLE, n_slots, LOAD, V, BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, PAIRED, LANES,
                             ebias, HAS_EBIAS, ACT, CONTRACT)
    else:
        _gate_up_program(xp, xsd, out, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, F, one, pair, n_out,
                         TOP_K, TABLE, n_slots, LOAD, V, BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, PAIRED, LANES,
                         ebias, HAS_EBIAS, ACT, CONTRACT)


@triton.jit
def _down_program(xp, xsd, part, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, N, one, pair, n_out,
                  TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr, V: tl.constexpr,
                  BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr,
                  BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr, LANES: tl.constexpr, ebias,
                  HAS_EBIAS: tl.constexpr, CONTRACT: tl.constexpr):
    XROW: tl.constexpr = n_slots * (2 * V if BITS == 4 else V)
    nn = tl.minimum(n_out, N - 1).to(tl.int64)[None, :]                # [1, BN]
    e = tl.load(experts + pair).to(tl.int64)
    xp_row = xp + pair * XROW
    xsd_row = xsd + pair * n_slots * 2
    if TABLE:
        slot = tl.load(table + e).to(tl.int64)
        if slot >= 0:
            y = _rows_i8(xp_row, xsd_row, bqs, bqh, bsc, bsd, slot * N + nn, one, n_slots, LOAD, V, BITS, HBITS,
                         BIAS, HAS_MIN, BN, NT, DP4A, LANES, CONTRACT)
        else:
            y = _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, e * N + nn, one, n_slots, LOAD, V, BITS, HBITS,
                         BIAS, HAS_MIN, BN, NT, DP4A, LANES, CONTRACT)
    else:
        y = _rows_i8(xp_row, xsd_row, qs, qh, sc, sd, e * N + nn, one, n_slots, LOAD, V, BITS, HBITS,
                     BIAS, HAS_MIN, BN, NT, DP4A, LANES, CONTRACT)
    if HAS_EBIAS:
        y += tl.load(ebias + e * N + n_out, mask=n_out < N, other=0.0)
    tl.store(part + pair * N + n_out, y, mask=n_out < N)


@triton.jit(do_not_specialize=["one"])
def _down_i8_kernel(xp, xsd, part, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, N, one,
                    TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr,
                    V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                    HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DP4A: tl.constexpr,
                    PDL: tl.constexpr = False, LANES: tl.constexpr = 0, ebias=None,
                    HAS_EBIAS: tl.constexpr = False, CONTRACT: tl.constexpr = False, tier=None,
                    SKIP_TIER: tl.constexpr = -1):
    """Program (pair, n block): the pair's unweighted part [BN] (+ its expert's row of
    ebias [E, N] with HAS_EBIAS). CONTRACT, SKIP_TIER: as _gate_up_i8_kernel's."""
    pdl_start(PDL)
    n_nb = tl.cdiv(N, BN)
    pair = (tl.program_id(0) // n_nb).to(tl.int64)
    n_out = (tl.program_id(0) % n_nb) * BN + tl.arange(0, BN)         # [BN]
    if SKIP_TIER >= 0:
        if tl.load(tier + pair) != SKIP_TIER:
            _down_program(xp, xsd, part, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, N, one, pair, n_out,
                          TABLE, n_slots, LOAD, V, BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, LANES, ebias, HAS_EBIAS,
                          CONTRACT)
    else:
        _down_program(xp, xsd, part, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, N, one, pair, n_out,
                      TABLE, n_slots, LOAD, V, BITS, HBITS, BIAS, HAS_MIN, BN, NT, DP4A, LANES, ebias, HAS_EBIAS,
                      CONTRACT)


def expert_consts(w, N: int, DP4A: bool) -> dict:
    """Constexprs of a [E, ., K] weight's kernels: its format, its tile (a function of the
    weight only; under the interpreter, whose reductions do not depend on the layout,
    BN is raised because it pays per program). LANES only where not the contract's (0)."""
    bits, hbits, bias, has_min, lanes = i8_codes(w.qtype)
    BN = EXPERT_BN if DP4A else min(1024, triton.next_power_of_2(N))
    return dict(n_slots=w.n_slots, LOAD=w.fmt.triton_load, V=w.fmt.V, BITS=bits, HBITS=hbits, BIAS=bias,
                HAS_MIN=has_min, BN=BN, NT=step_slots(w.expert(0)), DP4A=DP4A, **({"LANES": lanes} if lanes else {}))


def moe_i8_ok(gate_up, down) -> bool:
    """Both expert weights are of a type moe_i8 takes (EXPERT_TYPES)."""
    return gate_up.qtype in EXPERT_TYPES and down.qtype in EXPERT_TYPES


def _bias_args(bias: torch.Tensor | None, shape: tuple[int, int], what: str) -> dict:
    """An experts' bias [E, N] fp32 as the kernels' keywords (none: their defaults)."""
    if bias is None:
        return {}
    if tuple(bias.shape) != shape or bias.dtype != torch.float32:
        raise ValueError(f"{what} bias {bias.dtype} {tuple(bias.shape)} does not match the experts' {shape}")
    return {"ebias": bias.contiguous(), "HAS_EBIAS": True}


def moe_i8_order(gate_up) -> tuple[int, int, int]:
    """The lane order the layer's input must come in."""
    return lane_order(gate_up.expert(0))


def _skip_args(contract: bool, skip: tuple[torch.Tensor, int] | None) -> dict:
    """The kernels' CONTRACT and tier-skip keywords (none: their defaults)."""
    return ({"CONTRACT": True} if contract else {}) | ({"tier": skip[0], "SKIP_TIER": skip[1]} if skip else {})


def moe_gate_up_i8(q8: tuple[torch.Tensor, torch.Tensor], gate_up, experts: torch.Tensor, act_dtype: torch.dtype,
                   table: torch.Tensor | None = None, bank=None, pdl: bool = False,
                   paired: bool = GATE_UP_PAIRED, bias: torch.Tensor | None = None, act: int = 0,
                   contract: bool = False, skip: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """q8: the rows' int8 input in gate_up's lane order (moe_i8_order), gate_up [E, 2F, K],
    experts [W, k] int32 -> silu(gate) * up [W, k, F] in act_dtype. pdl: programmatic
    dependent launch (kernels/pdl.py). paired: gate and up rows walked together (the same bits).
    bias [E, 2F] fp32: added to gate's and up's sums (gpt-oss); act: activations.silu.ACT_IDS'
    id of the activation in silu's place. contract: the expert contract's arithmetic
    (expert_q8.py; act_dtype must be float32); skip (tier [W, k] int32, t): pairs of tier t
    are neither read nor written."""
    check_bank(gate_up, table, bank)
    if contract and act_dtype != torch.float32:
        raise ValueError(f"the expert contract's activations are float32, not {act_dtype}")
    xp, xsd = q8
    W, k = experts.shape
    F = gate_up.N // 2
    dev = experts.device
    out = torch.empty((W, k, F), dtype=act_dtype, device=dev)                   # [W, k, F]
    c = expert_consts(gate_up, F, dev.type == "cuda")
    extra = _bias_args(bias, (gate_up.shape[0], 2 * F), "gate|up") | ({"ACT": act} if act else {})
    _gate_up_i8_kernel[(W * k * triton.cdiv(F, c["BN"]),)](
        xp, xsd, out, experts.contiguous(), *bank_args(gate_up, table, bank), F, 1, TOP_K=k,
        TABLE=table is not None, num_warps=NUM_WARPS, enable_fp_fusion=False, PAIRED=paired, **c, **extra,
        **_skip_args(contract, skip), **pdl_kwargs(pdl, dev))
    return out


def moe_down_i8(act: torch.Tensor, down, experts: torch.Tensor, weights: torch.Tensor,
                table: torch.Tensor | None = None, bank=None, pdl: bool = False, combine: bool = True,
                bias: torch.Tensor | None = None, contract: bool = False,
                skip: tuple[torch.Tensor, int] | None = None) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """act [W, k, F] (quantized here, one launch), down [E, D, F] -> sum over ranks j of
    weights[:, j] * (q8(act[:, j]) @ down[experts[:, j]]^T): [W, D] float32.
    Two launches (down, then moe's combine). pdl: every launch with programmatic
    dependent launch (kernels/pdl.py). combine=False: no combine launch; returns (part [W, k, D], weights [W, k]) fp32 for the next norm
    to sum (fused.add_rmsnorm's MoE parts: the same bits). bias [E, D] fp32: expert e's added
    to its part before the weighting (gpt-oss). contract, skip: as moe_gate_up_i8's (a skipped
    pair's part is left unwritten)."""
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
    _down_i8_kernel[grid](*args, TABLE=table is not None, num_warps=NUM_WARPS, enable_fp_fusion=False, **c, **pk,
                          **_bias_args(bias, (down.shape[0], D), "down"), **_skip_args(contract, skip))
    if not combine:
        return part, weights.float().contiguous()
    out = torch.empty((W, D), dtype=torch.float32, device=dev)                 # [W, D]
    down_combine_kernel[(W * triton.cdiv(D, BD_COMBINE),)](
        part, weights.float().contiguous(), out, D, TOP_K=k, BD=BD_COMBINE, num_warps=2, enable_fp_fusion=False,
        **pk)
    return out
