"""Chunked prefill of a Gated DeltaNet layer: the conv over a prompt's rows, then the delta
rule a chunk of BT = 64 rows at a time in the WY (UT-transform) form.

Within a chunk, per value head, with G_t the cumulative log-decay from the chunk's start
(G_t = g_1 + .. + g_t), Gamma_t = exp(G_t), D[t, s] = exp(G_t - G_s) for s <= t (else 0)
and S0 the state before the chunk, the recurrence (step.py) unrolls to

    u_t = beta_t (v_t - Gamma_t S0^T k_t - sum_{s<t} D[t, s] (k_t . k_s) u_s)

a unit lower-triangular system (I + B) U = beta V - beta Gamma K S0, B[t, s] =
beta_t D[t, s] (k_t . k_s) for s < t. With A = (I + B)^-1 (forward substitution, row by
row: A's row t = e_t - sum_{s<t} B[t, s] A[s, :]) it reads U = A (beta V) - (A (beta Gamma
K)) S0 = U~ - W S0 (W: the WY factor), and then

    O  = (diag(Gamma) Q S0 + (D * Q K^T) U) / sqrt(dk)
    S' = Gamma_C S0 + (K * exp(G_C - G))^T U

Every exponent is <= 0 (decays only), so nothing overflows. The products are tl.dot at
float32 ("ieee": no TF32), so the result is the recurrence's to float32 rounding, not its
bits: prefill is not under the row contract (design.md §7: the prompt's last row goes
through the W = 1 step, step.py).

Three launches. The conv (T / 16, 2 hk + hv): a program per 16 rows and head, q and k
L2-normalised there. The WY factors (T / 64, hv): a program per chunk and head, every chunk at
once (nothing in them depends on the state): G, W and U~ into scratch rows. The state pass
(hv, dv / BV): a program walking the chunks of one head's state columns in order, dots only.
Dead rows of a last partial chunk load as zeros and are masked out of D.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from .common import DeltaNetShape, check_ring, conv_silu, gates, key_head, l2_normalize
from .step import BLOCK_V, DeltaNetWeights, _check, _gate_strides

CHUNK = 64         # rows of a chunk (BT)
CONV_ROWS = 16     # rows of a conv program
NUM_WARPS = 4


@triton.jit
def _conv_kernel(MIX, RING, CONVW, XC, pos, T, R, eps, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr, D_CONV: tl.constexpr):
    """Program (rows BR*i.., head h): h < hk a q head, < 2 hk a k head (both normalised),
    else a v head; XC [T, C] the conv output in the mix's channel order."""
    C: tl.constexpr = 2 * HK * DK + HV * DV
    t = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]       # [BR, 1]
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)[None, :]                             # [1, BLOCK]
    if h < 2 * HK:
        ch = h * DK + i
        mask = (i < DK) & (t < T)
    else:
        ch = 2 * HK * DK + (h - 2 * HK) * DV + i
        mask = (i < DV) & (t < T)
    x = conv_silu(MIX, RING, CONVW, pos + t, pos, R, C, ch, mask, D_CONV, False)     # [BR, BLOCK]
    if h < 2 * HK:
        x = l2_normalize(x, eps, 1)
    tl.store(XC + t * C + ch, x, mask=mask)


@triton.jit
def _rows(XC, rows, live, ch, C: tl.constexpr):
    """XC[rows, ch]: [BT, N] conv outputs (channels ch [N]), dead rows zero."""
    return tl.load(XC + rows[:, None] * C + ch[None, :], mask=live[:, None], other=0.0)


@triton.jit
def _decay(G, live, BT: tl.constexpr):
    """D [BT, BT] = exp(G_t - G_s) for live s <= t, else 0 (exponents <= 0)."""
    r = tl.arange(0, BT)
    keep = (r[:, None] >= r[None, :]) & live[:, None] & live[None, :]
    return tl.where(keep, tl.exp(tl.where(keep, G[:, None] - G[None, :], 0.0)), 0.0)


@triton.jit
def _wy_kernel(XC, ALPHA, BETA, DTB, SSMA, GC, WYW, WYU, T, stride_ab,
               HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BT: tl.constexpr, TILED: tl.constexpr):
    """Program (chunk, value head j): G [BT], W = A (beta Gamma K) [BT, DK] and U~ = A (beta V)
    [BT, DV] into GC [T, HV], WYW [T, HV, DK], WYU [T, HV, DV]."""
    C: tl.constexpr = 2 * HK * DK + HV * DV
    j = tl.program_id(1)
    r = tl.arange(0, BT)
    rows = tl.program_id(0) * BT + r                             # [BT]
    live = rows < T
    dvi = tl.arange(0, DV)
    K = _rows(XC, rows, live, HK * DK + key_head(j, HK, HV, TILED) * DK + tl.arange(0, DK), C)   # [BT, DK]
    V = _rows(XC, rows, live, 2 * HK * DK + j * DV + dvi, C)                                 # [BT, DV]
    g, beta = gates(ALPHA, BETA, DTB, SSMA, rows, j, stride_ab, live)                   # [BT], dead rows 0
    G = tl.cumsum(g, 0)                                          # [BT]
    B = tl.where(r[:, None] > r[None, :],
                 beta[:, None] * tl.dot(K, tl.trans(K), input_precision="ieee") * _decay(G, live, BT), 0.0)
    A = tl.where(r[:, None] == r[None, :], 1.0, 0.0)             # [BT, BT] -> (I + B)^-1
    for i in range(1, BT):
        b_i = tl.sum(tl.where(r[:, None] == i, B, 0.0), 0)       # [BT] row i of B (zero from column i on)
        a_i = -tl.sum(b_i[:, None] * A, 0)                       # [BT] -sum_s B[i, s] A[s, :]
        A = tl.where(r[:, None] == i, a_i[None, :] + tl.where(r == i, 1.0, 0.0)[None, :], A)
    Wf = tl.dot(A, K * (beta * tl.exp(G))[:, None], input_precision="ieee")               # [BT, DK]
    Ut = tl.dot(A, V * beta[:, None], input_precision="ieee")                             # [BT, DV]
    tl.store(GC + rows * HV + j, G, mask=live)
    tl.store(WYW + (rows[:, None] * HV + j) * DK + tl.arange(0, DK)[None, :], Wf, mask=live[:, None])
    tl.store(WYU + (rows[:, None] * HV + j) * DV + dvi[None, :], Ut, mask=live[:, None])


@triton.jit
def _state_kernel(XC, GC, WYW, WYU, STATE, OUT, T, scale,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BV: tl.constexpr, BT: tl.constexpr, TILED: tl.constexpr):
    """Program (value head j, column block): the chunks in order from the state S [DK, BV]:
    U = U~ - W S, O = (Gamma Q S + (D * Q K^T) U) * scale, S = Gamma_C S + (K exp(G_C - G))^T U."""
    C: tl.constexpr = 2 * HK * DK + HV * DV
    j = tl.program_id(0)
    vi = tl.program_id(1) * BV + tl.arange(0, BV)                # [BV] state columns
    dki = tl.arange(0, DK)
    kh = key_head(j, HK, HV, TILED)
    r = tl.arange(0, BT)
    s_off = j * DK * DV + dki[:, None] * DV + vi[None, :]        # [DK, BV]
    S = tl.load(STATE + s_off)                                   # [DK, BV]
    c0 = 0
    while c0 < T:                                                # a while loop: the interpreter takes no run-time range()
        rows = c0 + r                                            # [BT]
        live = rows < T
        Q = _rows(XC, rows, live, kh * DK + dki, C)              # [BT, DK]
        K = _rows(XC, rows, live, HK * DK + kh * DK + dki, C)    # [BT, DK]
        G = tl.load(GC + rows * HV + j, mask=live, other=0.0)    # [BT]
        Wf = tl.load(WYW + (rows[:, None] * HV + j) * DK + dki[None, :], mask=live[:, None], other=0.0)   # [BT, DK]
        U = tl.load(WYU + (rows[:, None] * HV + j) * DV + vi[None, :], mask=live[:, None], other=0.0) \
            - tl.dot(Wf, S, input_precision="ieee")              # [BT, BV]
        M = tl.dot(Q, tl.trans(K), input_precision="ieee") * _decay(G, live, BT)          # [BT, BT]
        O = tl.dot(Q * tl.exp(G)[:, None], S, input_precision="ieee") + tl.dot(M, U, input_precision="ieee")
        tl.store(OUT + rows[:, None] * HV * DV + j * DV + vi[None, :], O * scale, mask=live[:, None])
        g_c = tl.sum(tl.where(r == tl.minimum(T - c0, BT) - 1, G, 0.0), 0)               # G of the last live row
        decay = tl.where(live, tl.exp(g_c - G), 0.0)             # [BT]
        S = S * tl.exp(g_c) + tl.dot(tl.trans(K * decay[:, None]), U, input_precision="ieee")  # [DK, BV]
        c0 += BT
    tl.store(STATE + s_off, S)


def chunk_delta_rule(xc: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, w: DeltaNetWeights,
                     state: torch.Tensor, shape: DeltaNetShape, block_v: int = BLOCK_V) -> torch.Tensor:
    """The delta rule over T rows of conv output xc [T, C] (q, k normalised), from and into
    state [Hv, dk, dv]: the WY launch, then the state pass. -> out [T, Hv, dv]."""
    T = xc.shape[0]
    dev, hv = xc.device, shape.hv
    gc = torch.empty(T, hv, device=dev)                                          # [T, Hv]
    wyw = torch.empty(T, hv, shape.dk, device=dev)                               # [T, Hv, dk]
    wyu = torch.empty(T, hv, shape.dv, device=dev)                               # [T, Hv, dv]
    _wy_kernel[(triton.cdiv(T, CHUNK), hv)](xc, alpha, beta, w.dt_bias, w.ssm_a, gc, wyw, wyu, T,
                                            _gate_strides(alpha, beta), shape.hk, hv, shape.dk, shape.dv, CHUNK,
                                            shape.tiled, num_warps=NUM_WARPS)
    out = torch.empty(T, hv, shape.dv, device=dev)
    _state_kernel[(hv, shape.dv // block_v)](xc, gc, wyw, wyu, state, out, T, shape.dk ** -0.5, shape.hk, hv,
                                             shape.dk, shape.dv, block_v, CHUNK, shape.tiled, num_warps=NUM_WARPS)
    return out


def deltanet_prefill(mix: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, w: DeltaNetWeights,
                     ring: torch.Tensor, state: torch.Tensor, pos: int, shape: DeltaNetShape, *,
                     block_v: int = BLOCK_V, rule: Callable | None = None) -> torch.Tensor:
    """T prompt rows of one layer at positions pos..pos+T-1 (any T), from the conv ring and
    the state before them (the step kernel's layouts): state updated in place, the last
    d_conv - 1 mix rows written into the ring. -> out [T, Hv, dv]. rule: the delta rule over
    the conv output (chunk_delta_rule's signature; fla_rule.fla_delta_rule), ours by default."""
    _check(shape, w, state, block_v)
    T, C = mix.shape
    check_ring(ring, shape, 1)
    if C != shape.channels or alpha.shape != (T, shape.hv) or beta.shape != alpha.shape or \
            not mix.is_contiguous() or not ring.is_contiguous():
        raise ValueError(f"mix [T, {shape.channels}], alpha, beta [T, {shape.hv}], got {tuple(mix.shape)}, "
                         f"{tuple(alpha.shape)}, {tuple(beta.shape)}")
    R = ring.shape[0]
    xc = torch.empty_like(mix)                                                   # [T, C]
    _conv_kernel[(triton.cdiv(T, CONV_ROWS), 2 * shape.hk + shape.hv)](
        mix, ring, w.conv_w, xc, pos, T, R, shape.eps, shape.hk, shape.hv, shape.dk, shape.dv,
        max(shape.dk, shape.dv), CONV_ROWS, shape.d_conv, num_warps=NUM_WARPS)
    out = (rule or chunk_delta_rule)(xc, alpha, beta, w, state, shape, block_v)
    first = max(0, T - (shape.d_conv - 1))                                       # the rows the conv state keeps
    ring[(torch.arange(pos + first, pos + T) % R).to(ring.device)] = mix[first:]
    return out
