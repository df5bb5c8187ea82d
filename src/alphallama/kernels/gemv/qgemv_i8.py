"""qgemv_i8: the decode GEMV on int8 activations: x [W, K] @ w[N, K]^T -> [W, N] float32.

Why not qmatmul: its Q4_K GEMV spends ~6 instructions per weight (dequantize to fp32,
FMA) at 80 registers a thread, so it is bound by instruction issue, not by the weight
bytes, whatever its tile (docs/decisions/int8-decode-gemv.md). Here a weight costs about
one instruction: `w & 0x0F0F0F0F` (and `(w >> 4) & ...`) puts a qs word's codes in byte
lanes and one dp4a multiplies four of them with four int8 activations. Activations come
quantized (qmatvec_i8.prepare_i8: per 32 values one scale dx, bytes in the weight
format's lane order, and per slot the record (sum of its q, dx)). Per slot and x row:

    isum = sum of dp4a over the slot's words  [- BIAS * xsum]       (exact integer)
    t    = A * float(isum) [- B * float(xsum)]                       (A, B: the format's slot scales)
    acc[slot lane] = fma(t, dx, acc[slot lane])                      (slots of a lane in k order)

and once at the end the lanes of a row are summed (tl.sum over the slot axis). The
table formats (IQ4_NL, IQ4_XS, MXFP4) look their codes' levels up first, Q3_K, Q2_K and TQ
spread their 3- and 2-bit codes into 8-bit lanes (qgemv_i8_table.py), the codebook ones
sign their point bytes (qgemv_i8_grid.py). Unlike
qmatvec_i8 (the expert contract, which fixes one float order for GPU and CPU and pays
for it with layout shuffles through shared memory), the float order here is the
kernel's own: a function of the tile, which depends on the weight's (type, N, K) only.

Exact mode: every x row runs the same code on tensors of the same shapes (a named
accumulator per row, as in qmatmul), so a row's bits do not depend on W or its column.
Compiled with enable_fp_fusion=False; the one fusion wanted is written as tl.fma.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType

from ..moe.expert_q8 import QBLOCK, contract_lanes
from ..formats.format import PLANES
from ..moe.expert_q8_gpu import CODES
from .qgemv_i8_grid import grid_lanes
from .qgemv_i8_table import TABLE_CODES, has_dense_i8_form, i8_codes, table_lanes
from .qmatvec_i8 import lane_order, unpack_lanes, slot_terms_i8, prepare_i8
from ..pdl import pdl_kwargs, pdl_trigger, pdl_wait
from ..formats.qweight import QuantWeight, check_gemv_args

# x rows a program holds (not in the float order: a row's arithmetic is its own). 4, not 8:
# at 8 rows every dense tile needs nearly all registers, so one CTA fits an SM and wide
# rounds lack bytes in flight; at 4 two programs share a weight tile (the second reads it
# from L2) with twice the CTAs (docs/decisions/gemv-tiles.md)
MAX_BW = 4


@triton.jit
def row_step_i8(acc, lo, hi, s1, s2, xp_row, xsd_row, u, EVEN: tl.constexpr, n_slots: tl.constexpr,
              BITS: tl.constexpr, BIAS: tl.constexpr, HAS_MIN: tl.constexpr, DP4A: tl.constexpr):
    """acc [NT, BN] + one x row's terms of the NT slots u [NT] (padded slots: dx = 0)."""
    t, dx = slot_terms_i8(lo, hi, s1, s2, xp_row, xsd_row, u, EVEN, n_slots, BITS, BIAS, HAS_MIN, DP4A)
    return tl.fma(t, dx[:, None], acc)


@triton.jit
def lanes_i8(words, h, one, BITS: tl.constexpr, HBITS: tl.constexpr, TABLE: tl.constexpr, DP4A: tl.constexpr):
    """A step's words [NT, BN, V] (and qh / group words h [NT, BN]) -> the (lo, hi) int32
    dp4a lanes of any format with an int8 form: TABLE 0 the contract's (unpack_lanes), 3 the
    codebook formats' signed points (qgemv_i8_grid.grid_lanes), else qgemv_i8_table.table_lanes
    (the IQ4s' and MXFP4's levels, the 2- and 3-bit codes). Shared by qgemv_i8 and moe_i8."""
    if TABLE == 3:                                                     # qgemv_i8_grid.TABLE_GRID
        lo = grid_lanes(words, h)                                      # h: the group words
        hi = lo
    elif TABLE:
        lo, hi = table_lanes(words, h, one, TABLE, DP4A, HBITS)
    else:
        lo, hi = unpack_lanes(words, h, BITS, HBITS)
    return lo, hi


@triton.jit
def _store(out, acc, m, W, N, n_out, stride_out, ADD: tl.constexpr = False):
    """Row m's sums into out (ADD: added to what out holds, one fp32 add: the residual
    stream's x + o(a), bit for bit what a later kernel adding them would make)."""
    ptr = out + m.to(tl.int64) * stride_out + n_out
    ok = (n_out < N) & (m < W)
    y = tl.sum(acc, axis=0)
    if ADD:
        y = tl.load(ptr, mask=ok, other=0.0) + y
    tl.store(ptr, y, mask=ok)


@triton.jit(do_not_specialize=["one"])
def _qgemv_i8_kernel(xp, xsd, out, qs, qh, sc, sd, W, N, stride_out, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
                     V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr, BIAS: tl.constexpr,
                     HAS_MIN: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, BW: tl.constexpr,
                     PREFETCH: tl.constexpr, DP4A: tl.constexpr, PDL: tl.constexpr = False,
                     ADD: tl.constexpr = False, SPLIT: tl.constexpr = 1, stride_split=0,
                     RUN_QS: tl.constexpr = 0, RUN_QH: tl.constexpr = 0, RUN_SC: tl.constexpr = 0,
                     RUN_SD: tl.constexpr = 0, TABLE: tl.constexpr = 0, XV: tl.constexpr = 0):
    """ADD: the sums are added to what `out` holds. SPLIT > 1: the slots are cut into
    SPLIT equal runs of whole steps (and whole blocks), one program each, and run s's sums
    go to out + s * stride_split (partials, for the consumer to add in run order). A run
    starts its planes RUN_* elements a run further on and its x rows its slots further on,
    then walks its slots as a whole row's are walked: the same loop, the same registers.
    TABLE > 0: the words become lanes as qgemv_i8_table.py says (IQ4's and MXFP4's levels, Q3_K's,
    Q2_K's and TQ's codes)
    or qgemv_i8_grid.py (3: signed points); XV: activation words a slot where not
    the format's (Q3_K: 4)."""
    EVEN: tl.constexpr = n_slots % NT == 0
    XROW: tl.constexpr = n_slots * (XV if XV else 2 * V if BITS == 4 else V)   # int32 words per packed x row
    XS: tl.constexpr = n_slots * 2
    SL: tl.constexpr = n_slots // SPLIT                                 # slots of a run (all of them: SPLIT 1)
    LAST: tl.constexpr = (SL - 1) // NT * NT
    n_wt = tl.cdiv(W, BW)
    pid = tl.program_id(0) // SPLIT
    pid_n = pid // n_wt
    m0 = (pid % n_wt) * BW
    if SPLIT > 1:
        run = (tl.program_id(0) % SPLIT).to(tl.int64)
        qs += run * RUN_QS
        qh += run * RUN_QH
        sc += run * RUN_SC
        sd += run * RUN_SD
        xp += run * (SL * (XROW // n_slots))
        xsd += run * (SL * 2)
        out += run * stride_split
    n_out = pid_n * BN + tl.arange(0, BN)                              # [BN]
    row = tl.minimum(n_out, N - 1).to(tl.int64)[None, :]               # [1, BN]; past N: recomputed, not stored
    # x rows past W recompute row W-1 and are not stored
    r0 = tl.minimum(m0 + 0, W - 1).to(tl.int64)
    r1 = tl.minimum(m0 + 1, W - 1).to(tl.int64)
    r2 = tl.minimum(m0 + 2, W - 1).to(tl.int64)
    r3 = tl.minimum(m0 + 3, W - 1).to(tl.int64)
    r4 = tl.minimum(m0 + 4, W - 1).to(tl.int64)
    r5 = tl.minimum(m0 + 5, W - 1).to(tl.int64)
    r6 = tl.minimum(m0 + 6, W - 1).to(tl.int64)
    r7 = tl.minimum(m0 + 7, W - 1).to(tl.int64)
    acc0 = tl.zeros([NT, BN], tl.float32)
    acc1 = tl.zeros([NT, BN], tl.float32)
    acc2 = tl.zeros([NT, BN], tl.float32)
    acc3 = tl.zeros([NT, BN], tl.float32)
    acc4 = tl.zeros([NT, BN], tl.float32)
    acc5 = tl.zeros([NT, BN], tl.float32)
    acc6 = tl.zeros([NT, BN], tl.float32)
    acc7 = tl.zeros([NT, BN], tl.float32)
    pdl_trigger(PDL)
    if PREFETCH:
        nwords, nh, ns1, ns2 = LOAD(qs, qh, sc, sd, row, 0, one, n_slots, NT, V)
    if PREFETCH >= 2:
        SECOND: tl.constexpr = NT if NT < LAST else LAST               # (one step only: LAST = 0, reloaded)
        mwords, mh, ms1, ms2 = LOAD(qs, qh, sc, sd, row, SECOND, one, n_slots, NT, V)
    pdl_wait(PDL)                    # the weights above are no earlier kernel's output; x is
    for s0 in range(0, SL, NT):
        if PREFETCH >= 2:
            # two steps' weights in flight behind this one's arithmetic
            words, h, s1, s2 = nwords, nh, ns1, ns2
            nwords, nh, ns1, ns2 = mwords, mh, ms1, ms2
            mwords, mh, ms1, ms2 = LOAD(qs, qh, sc, sd, row, tl.minimum(s0 + 2 * NT, LAST), one, n_slots, NT, V)
        elif PREFETCH:
            # the next step's weights are asked for before this step's arithmetic
            words, h, s1, s2 = nwords, nh, ns1, ns2
            nwords, nh, ns1, ns2 = LOAD(qs, qh, sc, sd, row, tl.minimum(s0 + NT, LAST), one, n_slots, NT, V)
        else:
            words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)   # [NT, BN, V], [NT, BN] x3
        lo, hi = lanes_i8(words, h, one, BITS, HBITS, TABLE, DP4A)
        u = s0 + tl.arange(0, NT)                                      # [NT]
        acc0 = row_step_i8(acc0, lo, hi, s1, s2, xp + r0 * XROW, xsd + r0 * XS, u, EVEN, n_slots, BITS, BIAS,
                         HAS_MIN, DP4A)
        if BW > 1:
            acc1 = row_step_i8(acc1, lo, hi, s1, s2, xp + r1 * XROW, xsd + r1 * XS, u, EVEN, n_slots, BITS, BIAS,
                             HAS_MIN, DP4A)
        if BW > 2:
            acc2 = row_step_i8(acc2, lo, hi, s1, s2, xp + r2 * XROW, xsd + r2 * XS, u, EVEN, n_slots, BITS, BIAS,
                             HAS_MIN, DP4A)
            acc3 = row_step_i8(acc3, lo, hi, s1, s2, xp + r3 * XROW, xsd + r3 * XS, u, EVEN, n_slots, BITS, BIAS,
                             HAS_MIN, DP4A)
        if BW > 4:
            acc4 = row_step_i8(acc4, lo, hi, s1, s2, xp + r4 * XROW, xsd + r4 * XS, u, EVEN, n_slots, BITS, BIAS,
                             HAS_MIN, DP4A)
            acc5 = row_step_i8(acc5, lo, hi, s1, s2, xp + r5 * XROW, xsd + r5 * XS, u, EVEN, n_slots, BITS, BIAS,
                             HAS_MIN, DP4A)
            acc6 = row_step_i8(acc6, lo, hi, s1, s2, xp + r6 * XROW, xsd + r6 * XS, u, EVEN, n_slots, BITS, BIAS,
                             HAS_MIN, DP4A)
            acc7 = row_step_i8(acc7, lo, hi, s1, s2, xp + r7 * XROW, xsd + r7 * XS, u, EVEN, n_slots, BITS, BIAS,
                             HAS_MIN, DP4A)
    _store(out, acc0, m0 + 0, W, N, n_out, stride_out, ADD)
    if BW > 1:
        _store(out, acc1, m0 + 1, W, N, n_out, stride_out, ADD)
    if BW > 2:
        _store(out, acc2, m0 + 2, W, N, n_out, stride_out, ADD)
        _store(out, acc3, m0 + 3, W, N, n_out, stride_out, ADD)
    if BW > 4:
        _store(out, acc4, m0 + 4, W, N, n_out, stride_out, ADD)
        _store(out, acc5, m0 + 5, W, N, n_out, stride_out, ADD)
        _store(out, acc6, m0 + 6, W, N, n_out, stride_out, ADD)
        _store(out, acc7, m0 + 7, W, N, n_out, stride_out, ADD)


@dataclass(frozen=True)
class GemvTile:
    """How the work is cut: part of a weight's float order (the lanes' partial sums and
    the layout of their final sum), so a function of the weight alone (gemv_tile). The
    x rows per program (BW, from W) only change how many rows share a weight tile, and
    the prefetch depth only when the loads are issued."""
    BN: int = 8             # weight rows per program
    NT: int = 32            # slots per step: one per lane of a warp
    num_warps: int = 4
    prefetch: int = 1       # steps of weights loaded ahead of the arithmetic (0, 1, 2): not part of the
                            # float order (the same sums in the same order), only of the bytes in flight.
                            # 1: a second step's registers take a CTA off each SM, which wide rounds pay
                            # for (docs/decisions/gemv-tiles.md)
    split: int = 1          # runs of whole steps the slots are cut into, one program each: partial sums
                            # [W, split, N] for the consumer to add in run order (part of the float order)


def step_slots(w: QuantWeight) -> int:
    """Slots a step of a looped tile: 64 for Q6_K rows of >= 512 slots (K >= 8192, e.g.
    ffn_down), else 32 (or the whole row where it is shorter). The experts' tile too."""
    return contract_lanes(w.qtype, w.n_slots)


def one_step_row(w: QuantWeight) -> bool:
    """A dense Q4_K weight whose rows of 4096 (128 slots) go in one step (gemv_tile): in
    matrices of 4096 < N < 16384 rows (a qkv) or of <= 2048 (the 30B-A3B's o)."""
    return (w.qtype == GGMLQuantizationType.Q4_K and w.n_slots == 128
            and (4096 < w.N < 16384 or w.N <= 2048))


def gemv_tile(w: QuantWeight) -> GemvTile:
    """A function of the weight only: the tile is part of a row's float order, and a W=1
    round must give the bits a verify round gives. So one tile per weight has to serve
    every W, and it is chosen for W = 1 and W = 8 together (docs/decisions/gemv-tiles.md).
    Many-row programs share each activation load among more weight rows (the W > 1 cost
    is the activations' loads); below ~4096 rows they would leave SMs idle.

    Q4_K rows of 4096 in a qkv-sized matrix or one of <= 2048 rows take one step a row
    (one_step_row): the program's whole rows are in flight before its PDL wait, while the
    kernel before it (a norm, the attention combine) still runs. It pays only there: the
    same form loses on an o of 4096 rows at W = 4-8, on a gate|up at W = 8 and on the
    K = 12288 downs at W = 1 (docs/decisions/one-step-q4k-rows.md)."""
    NT = step_slots(w)
    if w.N > 32768:                          # the output head
        return GemvTile(BN=16, NT=NT)
    if one_step_row(w):
        return GemvTile(BN=8 if w.N <= 2048 else 16, NT=w.n_slots, num_warps=4)
    if w.N >= 16384 or (NT == 64 and w.N >= 4096):      # Q6_K rows of >= 512 slots: 64 a step
        return GemvTile(BN=32, NT=NT, num_warps=8)
    if w.N >= 4096:
        return GemvTile(BN=16, NT=NT, num_warps=8)
    return GemvTile(BN=4, NT=NT)


SPLIT_MIN_K = 4096      # split_runs: rows at least this long ...
SPLIT_MAX_N = 4096      # ... in matrices of at most this many rows


def split_nt(w: QuantWeight, runs: int) -> int:
    """Slots a step in a split tile: the weight's own, or fewer where a run is shorter."""
    per_run = max(1, w.n_slots // runs)
    return min(gemv_tile(w).NT, 1 << (per_run.bit_length() - 1))


def split_runs(w: QuantWeight, min_k: int = SPLIT_MIN_K, max_n: int = SPLIT_MAX_N) -> int:
    """Runs to cut a weight's slots into where its consumer adds partial sums (Linear.parts,
    engine.gemv_split): 2 for rows of >= 4096 values in matrices of <= 4096 rows, whose row
    tiles alone are too few programs to fill the GPU's SMs; the qkv (6144 rows, or
    K = 2048) and the gate|up (24576 rows) lose (docs/decisions/split-runs.md). A one-step row
    (one_step_row: the 30B-A3B o) is not split. min_k / max_n: the thresholds."""
    if one_step_row(w):
        return 1
    return 2 if w.K >= min_k and w.N <= max_n and _whole_runs(w, 2, split_nt(w, 2)) else 1


def qgemv_i8(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None,
             tile: GemvTile | None = None, prepared: tuple[torch.Tensor, torch.Tensor] | None = None,
             pdl: bool = False, accumulate: bool = False, split: int = 1) -> torch.Tensor:
    """x [W, K] (any float dtype) @ w^T -> [W, N] float32 on int8 activations (quantized
    here unless `prepared` = prepare_i8(x, w) is given). `out` may be a column slice of
    a wider buffer (row stride free, unit column stride). Row m's bits do not depend on W
    or m. accumulate: out += x @ w^T (out given). split > 1 (or a tile's split): the
    partial sums of that many runs of the slots, [W, split, N] (GemvTile.split).
    Runs on CUDA or under the Triton interpreter."""
    if accumulate and out is None:
        raise ValueError("qgemv_i8(accumulate=True) adds into `out`: give it")
    _check_supported(w)
    t = tile or gemv_tile(w)
    if split > 1:
        t = GemvTile(t.BN, min(t.NT, split_nt(w, split)), t.num_warps, t.prefetch, split)
    if tile is None and not x.is_cuda:      # the interpreter pays per program (its bits are layout-free)
        t = GemvTile(BN=min(1024, triton.next_power_of_2(w.N)), NT=t.NT, num_warps=t.num_warps,
                     prefetch=t.prefetch, split=t.split)
    if t.split > 1:
        return _split_partials(x, w, out, t, prepared, pdl, accumulate)
    W, N, out = check_gemv_args(x, w, out, "qgemv_i8", k_multiple=QBLOCK, out_col_slice=True)
    _launch(x, w, out, out.stride(0), t, prepared, pdl, **({"ADD": True} if accumulate else {}))
    return out


def _split_partials(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None, t: GemvTile,
                    prepared: tuple[torch.Tensor, torch.Tensor] | None, pdl: bool, accumulate: bool) -> torch.Tensor:
    """A split tile's launch: -> partials [W, split, N] float32 (run s of row m at [m, s]),
    whose sum in run order is the row's x @ w^T."""
    if accumulate:
        raise ValueError("qgemv_i8: a split tile gives partial sums; it cannot add into `out`")
    if not _whole_runs(w, t.split, t.NT):
        raise ValueError(f"qgemv_i8: split {t.split} needs the {w.n_slots} slots in runs of whole {t.NT}-slot steps "
                         f"and whole {w.qtype.name} blocks")
    W, N = x.shape[0], w.N
    if out is None:
        out = torch.empty((W, t.split, N), dtype=torch.float32, device=x.device)      # [W, split, N]
    elif out.shape != (W, t.split, N) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"qgemv_i8: out must be a contiguous float32 [{W}, {t.split}, {N}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    # x and w checked as for any GEMV, run 0's columns standing for [W, N] (no spare buffer)
    check_gemv_args(x, w, out[:, 0], "qgemv_i8", k_multiple=QBLOCK, out_col_slice=True)
    # elements a run (a codebook's table, in qh's place, is the same for every run)
    runs = {f"RUN_{n.upper()}": 0 if p is w.table else p.shape[-1] // t.split
            for n, p in zip(PLANES, w.plane_args())}
    _launch(x, w, out, t.split * N, t, prepared, pdl, SPLIT=t.split, stride_split=N, **runs)
    return out


def _whole_runs(w: QuantWeight, runs: int, NT: int) -> bool:
    """Can w's slots be cut into `runs` equal runs of whole NT-slot steps and whole blocks?
    (Then every plane's row, a fixed number of elements a slot or a block, splits into
    `runs` equal parts, one a run.)"""
    per_run, per_block = w.n_slots // runs, w.fmt.block_size // w.fmt.slot
    return w.n_slots % runs == 0 and per_run % NT == 0 and per_run % per_block == 0


def _check_supported(w: QuantWeight) -> None:
    if not has_dense_i8_form(w.qtype):
        raise ValueError(f"qgemv_i8 has no integer form of {w.qtype.name} "
                         f"(supported: {', '.join(t.name for t in (*CODES, *TABLE_CODES))})")


def _launch(x: torch.Tensor, w: QuantWeight, out: torch.Tensor, stride_out: int, t: GemvTile,
            prepared: tuple[torch.Tensor, torch.Tensor] | None, pdl: bool, **epilogue) -> None:
    """One _qgemv_i8_kernel launch over x's W rows and w's N rows (x quantized here
    unless `prepared`); epilogue: ADD, or SPLIT and stride_split (the kernel's keywords)."""
    W = x.shape[0]
    xp, xsd = prepared if prepared is not None else prepare_i8(x if x.stride(1) == 1 else x.contiguous(), w, pdl)
    BW = min(MAX_BW, triton.next_power_of_2(W))
    bits, hbits, bias, has_min, table = i8_codes(w.qtype)
    _, xv, xbits = lane_order(w)
    extra = {"TABLE": table, "XV": 2 * xv if xbits == 4 else xv} if table else {}   # (the others: their defaults)
    grid = (triton.cdiv(w.N, t.BN) * triton.cdiv(W, BW) * t.split,)
    _qgemv_i8_kernel[grid](xp, xsd, out, *w.plane_args(), W, w.N, stride_out, 1, n_slots=w.n_slots,
                           LOAD=w.fmt.triton_load, V=w.fmt.V, BITS=bits, HBITS=hbits, BIAS=bias, HAS_MIN=has_min,
                           BN=t.BN, NT=t.NT, BW=BW, PREFETCH=int(t.prefetch), DP4A=x.is_cuda,
                           num_warps=t.num_warps, enable_fp_fusion=False, **epilogue, **extra,
                           **pdl_kwargs(pdl, x.device))
