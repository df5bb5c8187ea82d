"""Routed experts (MoE FFN) on the device, in four launches after the router GEMV:

    route:   router logits [W, E] -> softmax, top-k, renormalise -> weights, expert ids [W, k]
    gate_up: for every (row, rank): silu(x @ gate[e]^T) * (x @ up[e]^T)   -> act [W, k, F]
    down:    for every (row, rank): act_j @ down[e_j]^T -> [W, k, D]; then for every row
             the sum over ranks j of weight_j * that, in rank order        -> [W, D]

gpt-oss's experts: a bias per expert on gate, up ([E, 2F]: gate|up's rows) and down ([E, D]),
added to each (row, rank) pair's sums before the activation and before the weighted sum, and
the activation a constexpr (activations/silu.gated: SiLU, or the clamped swiglu_oai).

Nothing leaves the device (expert ids are read by the kernels from a device tensor),
so the layer is captured in the round's CUDA graph like the dense FFN.

Expert store (offload/store.py): with a `table` [E] int32, expert e's weights are read
from slot table[e] of a VRAM bank shared by the layers, or, where table[e] < 0, from
the layer's host tier (pinned RAM, read in place over PCIe). Both branches run the same
code on tiles of the same shape, so an expert's contribution has the same bits
whichever tier it lives in; the table is a device tensor, so residency changes need
no new graph.

The GEMVs are qmatmul's (qmatmul.py): the same per-format load/field functions, the
same tile per weight (qmatmul.tile), explicit FMAs in k order into a [NT, BN, V]
accumulator, compiled with enable_fp_fusion=False. Each program serves one x row
(gate_up and down: one (row, rank) pair and a block of output rows; the down's
weighted sum over ranks: one row, in ascending rank), so a row's bits depend only on
that row: the same whatever W and its column. There is no weight-tile sharing
between rows (rows mostly pick different experts anyway).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...model.layers import ACTIVATIONS
from ..activations.silu import ACT_IDS, gated
from ..pdl import pdl_start
from ..gemv.qmatmul import ROWS_PER_THREAD, row_fma, tile
from ..backend import use_triton
from ..formats.qweight import QuantWeight

NUM_WARPS = 4
ACT_NAMES = {i: name for name, i in ACT_IDS.items()}   # the references' activations (model/layers.py)
MoEParts = tuple[torch.Tensor, torch.Tensor]    # (part [W, k, D] fp32, weights [W, k] fp32): moe_down_i8(combine=False)


# -- the GEMV of one x row against BN rows of one expert ------------------------------------
@triton.jit
def _acc_row(acc, x_row, qs, qh, sc, sd, row, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
             FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, NT: tl.constexpr):
    """acc [NT, BN, V] + the products of x_row [K] with weight rows `row` [1, BN] (int64,
    rows of the flattened [E * N, K] planes), walking K in qmatmul's order."""
    EVEN: tl.constexpr = n_slots % NT == 0
    PAIR: tl.constexpr = P > 1
    koff = tl.arange(0, 2 * V if PAIR else V)[None, None, :]  # [1, 1, 2V]
    for s0 in range(0, n_slots, NT):
        words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)
        u = (s0 + tl.arange(0, NT))[:, None, None]  # [NT, 1, 1]
        xmask = u < n_slots
        for i in tl.static_range(0, P, 2 if PAIR else 1):
            w_a = FIELD(words, h, s1, s2, i, one)  # [NT, BN, V] float32
            if PAIR:
                w_b = FIELD(words, h, s1, s2, i + 1, one)
            else:
                w_b = w_a
            xoff = u * (V * P) + i * V + koff  # [NT, 1, 2V]
            acc = row_fma(acc, w_a, w_b, x_row, xoff, xmask, PAIR, EVEN)
    return acc


# -- gate + up + SiLU for every selected expert ---------------------------------------------
@triton.jit
def _gate_up_rows(x_row, qs, qh, sc, sd, row_g, F, one, n_slots: tl.constexpr, LOAD: tl.constexpr,
                  FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr):
    """Gate rows `row_g` [1, BN] (int64) and the up rows F further: two [NT, BN, V] accumulators."""
    g = _acc_row(tl.zeros([NT, BN, V], tl.float32), x_row, qs, qh, sc, sd, row_g, one, n_slots,
                 LOAD, FIELD, V, P, NT)
    u = _acc_row(tl.zeros([NT, BN, V], tl.float32), x_row, qs, qh, sc, sd, row_g + F, one, n_slots,
                 LOAD, FIELD, V, P, NT)
    return g, u


@triton.jit(do_not_specialize=["one"])
def _gate_up_kernel(x, out, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, F, stride_xw, one,
                    TOP_K: tl.constexpr, TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr,
                    FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr,
                    BIAS=None, HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0):
    """Program (pair, n block): pair = row * TOP_K + rank. The weight is gate|up fused
    along N, [E, 2F, K]: gate rows e * 2F + n, up rows e * 2F + F + n. With TABLE, the
    planes b* are the bank [S, 2F, K] and expert e sits in slot table[e] (>= 0) or in
    the host planes (< 0): one branch or the other, the same arithmetic. HAS_BIAS: BIAS
    [E, 2F] fp32 (gate's then up's) added to the sums; ACT: silu.gated's activation."""
    n_fb = tl.cdiv(F, BN)
    pair = tl.program_id(0) // n_fb
    n_out = (tl.program_id(0) % n_fb) * BN + tl.arange(0, BN)  # [BN]
    e = tl.load(experts + pair).to(tl.int64)
    x_row = x + (pair // TOP_K).to(tl.int64) * stride_xw
    n_in = tl.minimum(n_out, F - 1)[None, :]  # [1, BN]; past F: recompute F-1, not stored
    if TABLE:
        slot = tl.load(table + e).to(tl.int64)
        if slot >= 0:
            g, u = _gate_up_rows(x_row, bqs, bqh, bsc, bsd, slot * 2 * F + n_in, F, one, n_slots, LOAD, FIELD,
                                 V, P, BN, NT)
        else:
            g, u = _gate_up_rows(x_row, qs, qh, sc, sd, e * 2 * F + n_in, F, one, n_slots, LOAD, FIELD,
                                 V, P, BN, NT)
    else:
        g, u = _gate_up_rows(x_row, qs, qh, sc, sd, e * 2 * F + n_in, F, one, n_slots, LOAD, FIELD, V, P, BN, NT)
    g = tl.sum(tl.sum(g, axis=2), axis=0)  # [BN]
    u = tl.sum(tl.sum(u, axis=2), axis=0)
    if HAS_BIAS:
        g += tl.load(BIAS + e * 2 * F + n_out, mask=n_out < F, other=0.0)
        u += tl.load(BIAS + e * 2 * F + F + n_out, mask=n_out < F, other=0.0)
    y = gated(g, u, ACT)                   # silu(gate) * up (as silu_mul), or swiglu_oai
    tl.store(out + pair.to(tl.int64) * F + n_out, y.to(out.dtype.element_ty), mask=n_out < F)


def check_bank(w: QuantWeight, table: torch.Tensor | None, bank: QuantWeight | None) -> None:
    if (table is None) != (bank is None):
        raise ValueError("an expert table needs its bank and a bank its table")
    if bank is not None and (bank.qtype != w.qtype or bank.shape[1:] != w.shape[1:]
                             or table.dtype != torch.int32 or table.shape != (w.shape[0],)):
        raise ValueError(f"bank {bank.qtype.name} {bank.shape} / table {tuple(table.shape)} do not match "
                         f"the experts {w.qtype.name} {w.shape}")


def bank_args(w: QuantWeight, table: torch.Tensor | None, bank: QuantWeight | None) -> tuple:
    """(table, host planes, bank planes) kernel arguments; without a table the bank
    arguments are stand-ins that are never read."""
    if table is None:
        return (w.planes["qs"], *w.plane_args(), *w.plane_args())
    return (table.contiguous(), *w.plane_args(), *bank.plane_args())


def _resolve(w: QuantWeight, table: torch.Tensor | None, bank: QuantWeight | None) -> QuantWeight:
    """The [E, N, K] weights the table points at, gathered (plain-torch paths)."""
    if table is None:
        return w
    t = table.long().cpu()
    planes = {n: torch.where((t >= 0).view(-1, *[1] * (p.dim() - 1)).to(p.device),
                             bank.planes[n][t.clamp(min=0).to(bank.device)].to(p.device), p)
              for n, p in w.planes.items()}
    return QuantWeight(w.qtype, w.shape, planes)


def moe_gate_up(x: torch.Tensor, gate_up: QuantWeight, experts: torch.Tensor,
                out_dtype: torch.dtype = torch.float32, rows_per_thread: int = ROWS_PER_THREAD,
                table: torch.Tensor | None = None, bank: QuantWeight | None = None,
                bias: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    """x [W, K] (bf16/fp32), gate_up [E, 2F, K] (gate rows then up rows per expert),
    experts [W, k] int32 -> silu(x @ gate[e]^T) * (x @ up[e]^T) [W, k, F] in out_dtype.
    rows_per_thread is part of the summation order (qmatmul.tile). With table [E] int32
    and bank [S, 2F, K]: expert e is read from bank slot table[e] when >= 0, else from
    gate_up (the host tier). bias [E, 2F] fp32: added to gate's and up's sums (gpt-oss);
    act: activations.silu.ACT_IDS' id of the activation in silu's place."""
    if len(gate_up.shape) != 3 or gate_up.N % 2 or x.shape[1] != gate_up.K:
        raise ValueError(f"x {tuple(x.shape)} does not match a fused gate|up weight {gate_up.shape}")
    check_bank(gate_up, table, bank)
    W, k = experts.shape
    F = gate_up.N // 2
    if bias is not None and tuple(bias.shape) != (gate_up.shape[0], 2 * F):
        raise ValueError(f"gate|up bias {tuple(bias.shape)} does not match the experts {gate_up.shape}")
    if not use_triton(x):
        return moe_gate_up_ref(x, _resolve(gate_up, table, bank), experts, bias, act).to(out_dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    experts = experts.contiguous()
    out = torch.empty((W, k, F), dtype=out_dtype, device=x.device)  # [W, k, F]
    BN, NT, num_warps = tile(gate_up, rows_per_thread, num_warps=NUM_WARPS)
    fmt = gate_up.fmt
    extra = {} if bias is None and not act else {"BIAS": bias, "HAS_BIAS": bias is not None, "ACT": act}
    _gate_up_kernel[(W * k * triton.cdiv(F, BN),)](
        x, out, experts, *bank_args(gate_up, table, bank), F, x.stride(0), 1, TOP_K=k, TABLE=table is not None,
        n_slots=gate_up.n_slots, LOAD=fmt.triton_load, FIELD=fmt.triton_field, V=fmt.V, P=fmt.P, BN=BN, NT=NT,
        num_warps=num_warps, enable_fp_fusion=False, **extra)
    return out


def moe_gate_up_ref(x: torch.Tensor, gate_up: QuantWeight, experts: torch.Tensor,
                    bias: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    """Plain torch, fp32 from the planes: [W, k, F] (float64 where x is; on x's device)."""
    gu = gate_up.dequantize().to(x.device, x.dtype if x.dtype == torch.float64 else torch.float32)   # [E, 2F, K]
    F = gu.shape[1] // 2
    ids = experts.long().to(x.device)
    w = gu[ids]                                              # [W, k, 2F, K]
    y = torch.einsum("wk,wjnk->wjn", x.to(w.dtype), w)       # [W, k, 2F]
    if bias is not None:
        y = y + bias.to(x.device, y.dtype)[ids]              # [W, k, 2F]
    return ACTIVATIONS[ACT_NAMES[act]](y[..., :F], y[..., F:])


# -- down projection + weighted sum over the selected experts -------------------------------
BD_COMBINE = 256        # output values per program of the rank sum


@triton.jit(do_not_specialize=["one"])
def _down_part_kernel(act, part, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, N, one,
                      TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr, FIELD: tl.constexpr,
                      V: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr,
                      BIAS=None, HAS_BIAS: tl.constexpr = False):
    """Program (pair, n block), pair = row * TOP_K + rank: one expert's GEMV of BN
    output rows, reduced to [BN] (+ the expert's bias row, BIAS [E, N], with HAS_BIAS) and
    stored unweighted. The ranks of a row run side by side (W * TOP_K * N / BN programs);
    the weighted sum is down_combine_kernel's."""
    n_nb = tl.cdiv(N, BN)
    pair = (tl.program_id(0) // n_nb).to(tl.int64)
    n_out = (tl.program_id(0) % n_nb) * BN + tl.arange(0, BN)  # [BN]
    nn = tl.minimum(n_out, N - 1)[None, :]   # [1, BN]; past N: recompute N-1, not stored
    K: tl.constexpr = n_slots * V * P
    e = tl.load(experts + pair).to(tl.int64)
    a_row = act + pair * K
    if TABLE:
        slot = tl.load(table + e).to(tl.int64)
        if slot >= 0:
            acc = _acc_row(tl.zeros([NT, BN, V], tl.float32), a_row, bqs, bqh, bsc, bsd, slot * N + nn, one,
                           n_slots, LOAD, FIELD, V, P, NT)
        else:
            acc = _acc_row(tl.zeros([NT, BN, V], tl.float32), a_row, qs, qh, sc, sd, e * N + nn, one,
                           n_slots, LOAD, FIELD, V, P, NT)
    else:
        acc = _acc_row(tl.zeros([NT, BN, V], tl.float32), a_row, qs, qh, sc, sd, e * N + nn, one,
                       n_slots, LOAD, FIELD, V, P, NT)
    y = tl.sum(tl.sum(acc, axis=2), axis=0)                                       # [BN]
    if HAS_BIAS:
        y += tl.load(BIAS + e * N + n_out, mask=n_out < N, other=0.0)
    tl.store(part + pair * N + n_out, y, mask=n_out < N)


@triton.jit
def combine_block(part, weights, m, n, N, TOP_K: tl.constexpr):
    """Row m's outputs n [BLOCK]: y = 0, then y = fma(part_r, weight_r, y) for the ranks
    in ascending order: the sum's order is fixed (and does not depend on which tier each
    expert's weights came from)."""
    y = tl.zeros(n.shape, tl.float32)                                  # [BLOCK]
    for r in tl.static_range(TOP_K):
        wr = tl.load(weights + m * TOP_K + r)
        v = tl.load(part + (m * TOP_K + r) * N + n, mask=n < N, other=0.0)          # [BLOCK]
        y = tl.fma(v, wr, y)
    return y


@triton.jit
def down_combine_kernel(part, weights, out, N, TOP_K: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, block of BD): the row's ranks summed (combine_block)."""
    pdl_start(PDL)
    n_db = tl.cdiv(N, BD)
    m = (tl.program_id(0) // n_db).to(tl.int64)
    n = (tl.program_id(0) % n_db) * BD + tl.arange(0, BD)  # [BD]
    tl.store(out + m * N + n, combine_block(part, weights, m, n, N, TOP_K), mask=n < N)


def moe_down(act: torch.Tensor, down: QuantWeight, experts: torch.Tensor, weights: torch.Tensor,
             rows_per_thread: int = ROWS_PER_THREAD, table: torch.Tensor | None = None,
             bank: QuantWeight | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """act [W, k, F] (bf16/fp32), down [E, D, F], experts [W, k] int32, weights [W, k]
    fp32 -> sum_j weights[:, j] * (act[:, j] @ down[experts[:, j]]^T): [W, D] fp32.
    table/bank: as moe_gate_up. Two launches: every (row, rank, n block) GEMV in
    parallel into a [W, k, D] fp32 buffer, then the weighted sum over the ranks.
    bias [E, D] fp32: expert e's added to its GEMV before the weighting (gpt-oss)."""
    W, k, F = act.shape
    if len(down.shape) != 3 or down.K != F or experts.shape != (W, k) or weights.shape != (W, k):
        raise ValueError(f"act {tuple(act.shape)}, experts {tuple(experts.shape)}, weights "
                         f"{tuple(weights.shape)} do not match the down weight {down.shape}")
    check_bank(down, table, bank)
    if bias is not None and tuple(bias.shape) != (down.shape[0], down.N):
        raise ValueError(f"down bias {tuple(bias.shape)} does not match the experts {down.shape}")
    if not use_triton(act):
        return moe_down_ref(act, _resolve(down, table, bank), experts, weights, bias)
    D = down.N
    part = torch.empty((W, k, D), dtype=torch.float32, device=act.device)  # [W, k, D]
    out = torch.empty((W, D), dtype=torch.float32, device=act.device)      # [W, D]
    BN, NT, num_warps = tile(down, rows_per_thread, num_warps=NUM_WARPS)
    fmt = down.fmt
    _down_part_kernel[(W * k * triton.cdiv(D, BN),)](
        act.contiguous(), part, experts.contiguous(), *bank_args(down, table, bank), D, 1,
        TABLE=table is not None, n_slots=down.n_slots, LOAD=fmt.triton_load, FIELD=fmt.triton_field, V=fmt.V,
        P=fmt.P, BN=BN, NT=NT, num_warps=num_warps, enable_fp_fusion=False,
        **({} if bias is None else {"BIAS": bias, "HAS_BIAS": True}))
    down_combine_kernel[(W * triton.cdiv(D, BD_COMBINE),)](
        part, weights.float().contiguous(), out, D, TOP_K=k, BD=BD_COMBINE, num_warps=2, enable_fp_fusion=False)
    return out


def moe_down_ref(act: torch.Tensor, down: QuantWeight, experts: torch.Tensor, weights: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, fp32 from the planes: [W, D] (float64 where act is; on act's device)."""
    dt, dev = torch.float64 if act.dtype == torch.float64 else torch.float32, act.device
    ids = experts.long().to(dev)
    w = down.dequantize().to(dev, dt)[ids]                   # [W, k, D, F]
    y = torch.einsum("wjf,wjdf->wjd", act.to(dt), w)         # [W, k, D]
    if bias is not None:
        y = y + bias.to(dev, dt)[ids]                        # [W, k, D]
    return (y * weights.to(dev, dt)[..., None]).sum(1)

