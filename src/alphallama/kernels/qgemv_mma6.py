"""qgemv_mma6: qgemv_mma_k's design for Q6_K (the 8B shape's downs in half the layers and
its output head): one mma.sync m16n8k16 (s8) a 16-value slot, activations with one scale a
256-value super-block (prepare_q8k6), a super-block's slots folded in exact int32 sums and
its float work done once. Built for timing with qgemv_mma_k (engine.gemv_mma), untimed.

Fragments (m16n8k16, lane = 4g + t): a0 / a1 = the 4 codes at k = 4t .. 4t + 3 of the slot
for rows g / g + 8, b0 = column g's 4 activation bytes at the same k, c0..c3 as in m16n8k32.
A lane's 4 codes are 2 bytes of low nibbles and 1 byte of 2-bit highs, so the weights are
re-laid (mma6_planes) without duplicating a byte: per 16-row group, per 8-slot chunk, per
lane, three 16-byte words of 4:
    LO_g  word i: low nibbles of slots 2i (bits 0-15) and 2i + 1 (16-31), row g
    LO_g8 the same for row g + 8
    HI    word i: highs of (row g, slot 2i), (g + 8, 2i), (g, 2i + 1), (g + 8, 2i + 1), a byte each
(48 bytes a lane a chunk = the chunk's 16 rows x 8 slots x 12 bytes / 32 lanes). The asm
block spreads nibbles and highs into the code bytes (q = lo | hi << 4, 0..63) and issues
the two slots' mma. The activations likewise (prepare_q8k6): per lane, XA word i = column
g's bytes k = 4t .. 4t + 3 of slot 2i, XB of slot 2i + 1. Q6_K's value is d sc (q - 32):
the fold is ai += sc * (isum - 32 xsum), the flush y += (d dx) * ai.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .formats import torch_fields, torch_high
from .expert_q8_gpu import _quantize_block
from .qgemv_mma import _store_runs, _warp_place, launch_prepare, launch_q8k_gemv, q8k_store
from .qmatvec_i8 import _dp4a
from .pdl import pdl_start, pdl_trigger, pdl_wait
from .qweight import QuantWeight


def _slot_asm(e: int) -> str:
    """PTX for slot parity e of an element: its two code words (rows g, g + 8) and the mma.
    Registers: $0-$7 the outputs (slot 0's c0-c3, slot 1's), $8 LO_g, $9 LO_g8, $10 HI,
    $11 XA, $12 XB."""
    lo_sh, x = 16 * e, f"${11 + e}"
    out = [f"${4 * e + r}" for r in range(4)]
    word = []
    for h, lo in ((0, "$8"), (1, "$9")):
        word.append(
            f"shr.u32 n, {lo}, {lo_sh};\n and.b32 n, n, 0xFFFF;\n"
            "shl.b32 t, n, 8;\n or.b32 n, n, t;\n and.b32 n, n, 0x00FF00FF;\n"
            "shl.b32 t, n, 4;\n or.b32 n, n, t;\n and.b32 n, n, 0x0F0F0F0F;\n"
            f"shr.u32 hh, $10, {16 * e + 8 * h};\n and.b32 hh, hh, 0xFF;\n"
            "shl.b32 t, hh, 12;\n or.b32 hh, hh, t;\n and.b32 hh, hh, 0x000F000F;\n"
            "shl.b32 t, hh, 6;\n or.b32 hh, hh, t;\n and.b32 hh, hh, 0x03030303;\n"
            f"shl.b32 hh, hh, 4;\n or.b32 a{h}, n, hh;\n")
    zero = "".join(f"mov.b32 {o}, 0;\n" for o in out)
    return ("".join(word) + zero
            + f"mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {{{', '.join(out)}}}, {{a0, a1}}, {{{x}}}, "
            f"{{{', '.join(out)}}};\n")


_ASM = tl.constexpr("{ .reg .b32 n, hh, t, a0, a1;\n" + _slot_asm(0) + _slot_asm(1) + "}")


@triton.jit
def _mma6(lo_g, lo_g8, hi, xa, xb):
    """[T, 4] int32 each (element i: slots 2i, 2i + 1) -> 8 [T, 4] int32: slot 2i's c0..c3,
    then slot 2i + 1's."""
    return tl.inline_asm_elementwise(
        _ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r", [lo_g, lo_g8, hi, xa, xb],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True, pack=1)


@triton.jit
def _code_word(lo, hi):
    """The asm's code bytes with tensor ops: lo (4 nibbles in bits 0-15), hi (4 two-bit
    fields in bits 0-7) -> int32, byte j = nibble j | high j << 4."""
    n = lo & 0xFFFF
    n = (n | (n << 8)) & 0x00FF00FF
    n = (n | (n << 4)) & 0x0F0F0F0F
    h = hi & 0xFF
    h = (h | (h << 12)) & 0x000F000F
    h = (h | (h << 6)) & 0x03030303
    return n | (h << 4)


@triton.jit
def _emulated_slot(lo_g, lo_g8, hi, x, e: tl.constexpr, WARPS: tl.constexpr):
    """One slot parity of _mma6 with tensor ops across the threads' rows: (c0, c1, c2, c3)."""
    Tn: tl.constexpr = 32 * WARPS
    a_g = _code_word(lo_g >> (16 * e), hi >> (16 * e))                 # [T, 4]: row g's k-group t
    a_g8 = _code_word(lo_g8 >> (16 * e), hi >> (16 * e + 8))
    a = tl.reshape(tl.join(a_g, a_g8), (WARPS, 8, 4, 4, 2))             # [W, g, t, i, h]
    a = tl.reshape(tl.permute(a, (0, 3, 4, 1, 2)), (WARPS, 4, 16, 4))  # [W, i, row 8h + g, k-group t]
    b = tl.permute(tl.reshape(x, (WARPS, 8, 4, 4)), (0, 3, 1, 2))      # [W, i, column g, k-group t]
    isum = tl.sum(_dp4a(a[:, :, :, None, :], b[:, :, None, :, :], 0, False), axis=4)   # [W, i, 16, 8]
    c = tl.reshape(isum, (WARPS, 4, 2, 8, 4, 2))                       # [W, i, h, g, t, cb]
    c = tl.reshape(tl.permute(c, (0, 3, 4, 1, 2, 5)), (Tn, 4, 2, 2))   # [T, i, h, cb]
    c_cb0, c_cb1 = tl.split(c)                                         # [T, i, h] each
    c0, c2 = tl.split(c_cb0)
    c1, c3 = tl.split(c_cb1)
    return c0, c1, c2, c3


@triton.jit
def _mma6_emulated(lo_g, lo_g8, hi, xa, xb, WARPS: tl.constexpr):
    """_mma6 under the interpreter."""
    e0, e1, e2, e3 = _emulated_slot(lo_g, lo_g8, hi, xa, 0, WARPS)
    o0, o1, o2, o3 = _emulated_slot(lo_g, lo_g8, hi, xb, 1, WARPS)
    return e0, e1, e2, e3, o0, o1, o2, o3


@triton.jit
def _fold6(ai, c_e, c_o, sc_e, sc_o, xs_e, xs_o):
    """ai [T] + sum over the chunk's slot pairs of sc * (isum - 32 xsum) (exact int32)."""
    v = sc_e * (c_e - 32 * xs_e) + sc_o * (c_o - 32 * xs_o)            # [T, 4]
    return ai + tl.sum(v, axis=1)


@triton.jit
def _q6_kernel(xf, xs, dxs, out, qf, sc, sd, W, N, stride_out, n_slots: tl.constexpr,
               WARPS: tl.constexpr, EMULATE: tl.constexpr, KW: tl.constexpr = 1, PDL: tl.constexpr = False):
    """KW: warps a row group, each a run of whole super-blocks (qgemv_mma_k's runs)."""
    Tn: tl.constexpr = 32 * WARPS
    NCH: tl.constexpr = n_slots // 8                                   # 8-slot chunks (2 a super-block)
    tl.static_assert(WARPS % KW == 0 and (NCH // 2) % KW == 0, "whole row groups and whole super-block runs")
    NR: tl.constexpr = NCH // 2 // KW                                  # super-blocks a run
    cb, lane, g, t, grp, row_ok, run = _warp_place(W, N, WARPS, KW)
    e4 = tl.arange(0, 4)[None, :]
    qrow = qf + (grp * NCH * 32 + lane) * 12 + e4                      # [T, 4]: chunk 0's LO_g
    xrow = xf + (cb * NCH * 32 + lane) * 8 + e4                        # [T, 4]: chunk 0's XA
    r_lo = grp * 16 + g                                                # [T, 1]
    r_hi = r_lo + 8
    c0 = tl.minimum(cb * 8 + 2 * t, W - 1).to(tl.int64)                # [T, 1]: columns 2t, 2t + 1
    c1 = tl.minimum(cb * 8 + 2 * t + 1, W - 1).to(tl.int64)
    ok0 = cb * 8 + 2 * t < W
    ok1 = cb * 8 + 2 * t + 1 < W
    se = 2 * e4                                                        # [1, 4]: a chunk's even slots
    y0 = tl.zeros([Tn, 1], tl.float32)
    y1 = tl.zeros([Tn, 1], tl.float32)
    y2 = tl.zeros([Tn, 1], tl.float32)
    y3 = tl.zeros([Tn, 1], tl.float32)
    sb0 = run                                                          # [T, 1]: runs interleave (qgemv_mma_k's)
    pdl_trigger(PDL)
    q0 = qrow + sb0 * (2 * 32 * 12)
    nq = (tl.load(q0), tl.load(q0 + 4), tl.load(q0 + 8))
    pdl_wait(PDL)
    for s in range(0, NR):
        sb = sb0 + s * KW
        nsb = sb0 + tl.minimum(s + 1, NR - 1) * KW                     # the run's next super-block
        dx0 = tl.load(dxs + c0 * (NCH // 2) + sb)                      # [T, 1]
        dx1 = tl.load(dxs + c1 * (NCH // 2) + sb)
        d_lo = tl.load(sd + r_lo * (NCH // 2) + sb).to(tl.float32)
        d_hi = tl.load(sd + r_hi * (NCH // 2) + sb).to(tl.float32)
        a0 = tl.zeros([Tn], tl.int32)
        a1 = tl.zeros([Tn], tl.int32)
        a2 = tl.zeros([Tn], tl.int32)
        a3 = tl.zeros([Tn], tl.int32)
        for h in tl.static_range(2):
            ch = sb * 2 + h
            lo_g, lo_g8, hi = nq
            if h == 0:
                nxt = (sb * 2 + 1) * (32 * 12)                         # this super-block's second chunk
            else:
                nxt = (nsb * 2) * (32 * 12)                            # the run's next super-block
            nq = (tl.load(qrow + nxt), tl.load(qrow + nxt + 4), tl.load(qrow + nxt + 8))   # a chunk ahead
            xa = tl.load(xrow + ch * (32 * 8))
            xb = tl.load(xrow + ch * (32 * 8) + 4)
            if EMULATE:
                ce0, ce1, ce2, ce3, co0, co1, co2, co3 = _mma6_emulated(lo_g, lo_g8, hi, xa, xb, WARPS)
            else:
                ce0, ce1, ce2, ce3, co0, co1, co2, co3 = _mma6(lo_g, lo_g8, hi, xa, xb)
            s0 = ch * 8 + se                                           # [1, 4]: slots 2i
            sg_e = tl.load(sc + r_lo * n_slots + s0).to(tl.int32)      # [T, 4]
            sg_o = tl.load(sc + r_lo * n_slots + s0 + 1).to(tl.int32)
            sh_e = tl.load(sc + r_hi * n_slots + s0).to(tl.int32)
            sh_o = tl.load(sc + r_hi * n_slots + s0 + 1).to(tl.int32)
            x0e = tl.load(xs + c0 * n_slots + s0, mask=ok0, other=0)   # [T, 4]
            x0o = tl.load(xs + c0 * n_slots + s0 + 1, mask=ok0, other=0)
            x1e = tl.load(xs + c1 * n_slots + s0, mask=ok1, other=0)
            x1o = tl.load(xs + c1 * n_slots + s0 + 1, mask=ok1, other=0)
            a0 = _fold6(a0, ce0, co0, sg_e, sg_o, x0e, x0o)            # (row g, column 2t)
            a1 = _fold6(a1, ce1, co1, sg_e, sg_o, x1e, x1o)            # (g, 2t + 1)
            a2 = _fold6(a2, ce2, co2, sh_e, sh_o, x0e, x0o)            # (g + 8, 2t)
            a3 = _fold6(a3, ce3, co3, sh_e, sh_o, x1e, x1o)            # (g + 8, 2t + 1)
        y0 = y0 + (d_lo * dx0) * a0.to(tl.float32)[:, None]
        y1 = y1 + (d_lo * dx1) * a1.to(tl.float32)[:, None]
        y2 = y2 + (d_hi * dx0) * a2.to(tl.float32)[:, None]
        y3 = y3 + (d_hi * dx1) * a3.to(tl.float32)[:, None]
    _store_runs(out, tl.join(y0, y1).reshape(Tn, 2), tl.join(y2, y3).reshape(Tn, 2), W, N, stride_out, WARPS, KW)


def supports_mma6(w: QuantWeight) -> bool:
    return w.qtype == T.Q6_K and w.N % 16 == 0


def mma6_planes(w: QuantWeight) -> torch.Tensor:
    """Q6_K codes re-laid for the m16n8k16 fragments: int32 [N/16, n_slots/8, 32 lanes, 3, 4]
    (LO_g, LO_g8, HI; see the module docstring). The same bytes as qs + qh."""
    if not supports_mma6(w):
        raise ValueError(f"qgemv_mma6: Q6_K with N a multiple of 16, got {w.qtype.name} {w.N}x{w.K}")
    p, N, ns = w.planes, w.N, w.n_slots
    q = torch_fields(p["qs"], 4, 2) | (torch_high(p["qh"], 2, 2, 8) << 4)   # [N, ns, 16] codes in k order
    q = q.reshape(N // 16, 2, 8, ns // 8, 4, 2, 4, 4)                  # [G, h, g, chunk, i, parity, t, j]
    sh = torch.arange(4, device=q.device, dtype=torch.int32)
    lo = ((q & 15) << (4 * sh)).sum(-1, dtype=torch.int32)             # [G, h, g, chunk, i, parity, t]: 16 bits
    hi = ((q >> 4) << (2 * sh)).sum(-1, dtype=torch.int32)             # 8 bits
    lo = lo[..., 0, :] | (lo[..., 1, :] << 16)                         # [G, h, g, chunk, i, t]: slots 2i, 2i + 1
    hi = hi[:, 0, :, :, :, 0] | (hi[:, 1, :, :, :, 0] << 8) | (hi[:, 0, :, :, :, 1] << 16) | (hi[:, 1, :, :, :, 1] << 24)
    lo = lo.permute(0, 3, 2, 5, 1, 4)                                   # [G, chunk, g, t, h, i]
    hi = hi.permute(0, 2, 1, 4, 3)[:, :, :, :, None, :]                # [G, chunk, g, t, 1, i]
    return torch.cat([lo, hi], dim=4).contiguous()                     # [G, chunk, g, t, 3, 4]


@triton.jit
def emit_q8k6(a, k0, m, xf, xs, dxs, xl, K: tl.constexpr, MASKED: tl.constexpr = False):
    """prepare_q8k6's outputs for x[m, k0 : k0 + BQ] = a [BQ] float32 (k0 and BQ multiples of
    256): q8 with one scale a super-block (expert_q8's rounding rule), the bytes in natural k
    order to their fragment places and again in row order in prepare_i8's Q6_K lane order
    (xl, for qgemv_q8k6), xsum a 16-slot, dx a super-block. MASKED: k may run past K (a is 0
    there), nothing stored past it. The prepare launch and the fused producers share it."""
    BQ: tl.constexpr = a.shape[0]
    NB: tl.constexpr = BQ // 256
    n_slots: tl.constexpr = K // 16
    NCH: tl.constexpr = n_slots // 8
    q, dx = _quantize_block(tl.reshape(a, (NB, 256)))                 # [NB, 256], [NB]
    q = tl.reshape(q, (BQ,))
    k = k0 + tl.arange(0, BQ)
    s = k // 16                                                        # the slot
    kk = k % 16
    word = (((m // 8) * NCH + s // 8) * 32 + 4 * (m % 8) + kk // 4) * 8 + ((s % 8) % 2) * 4 + (s % 8) // 2
    r = kk % 4                                                         # emit_q8's lane rule (slot 16, V 2, 4 bits)
    lane = ((r % 2) * 2 + r // 2) * 4 + kk // 4                        # word e V + v, byte j // 2
    q8k_store(q, dx, k0, m, word * 4 + kk % 4, m * K + s * 16 + lane, xf, xs, dxs, xl, K, 16, MASKED)


@triton.jit
def _prepare_q8k6_kernel(x, xf, xs, dxs, xl, stride_x, n_slots: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row m, super-block b): emit_q8k6 of x[m, 256 b : 256 b + 256]."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * 256
    emit_q8k6(tl.load(x + m * stride_x + k0 + tl.arange(0, 256)).to(tl.float32), k0, m, xf, xs, dxs, xl, n_slots * 16)


Q8K6 = ("q8k", 16)      # prepare_q8k6's activations among the orders a producer emits (Linear.orders)


def prepare_q8k6(x: torch.Tensor, n_slots: int, pdl: bool = False) -> tuple[torch.Tensor, ...]:
    """x [W, K] -> (fragment words [W/8 blocks, n_slots/8, 32 lanes, 2 (XA, XB), 4], xsum int32
    [W, n_slots] a 16-value slot, dx float32 [W, K / 256], the bytes again in row order in
    prepare_i8's Q6_K lane order: int32 [W, K / 4]); padding columns unwritten."""
    return launch_prepare(_prepare_q8k6_kernel, x, n_slots, 16, "prepare_q8k6", pdl, rows=True)


def qgemv_mma6(x: torch.Tensor, w: QuantWeight, planes: torch.Tensor | None = None, out: torch.Tensor | None = None,
               prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, warps: int | None = None,
               runs: int | None = None, pdl: bool = False) -> torch.Tensor:
    """Q6_K x [W, K] @ w^T -> [W, N] float32 on prepare_q8k6's activations, the isums on the
    tensor cores (emulated under the interpreter). runs: as qgemv_mma_k's."""
    return launch_q8k_gemv(_q6_kernel, "qgemv_mma6", x, w, out, planes, prepared, mma6_planes, prepare_q8k6,
                           warps, runs, pdl)
