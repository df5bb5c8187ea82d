"""qgemv_mma: the decode/verify GEMV on int8 activations with tensor cores:
x [W, K] @ w[N, K]^T -> [W, N] float32, the same arithmetic as qgemv_i8 but with the
per-slot integer dots done by int8 MMA over a fixed tile of WP x rows.

Why: qgemv_i8's dp4a does a weight's work once per x row, so a W=8 round's GEMVs cost
~3x a W=1 round's (bench/results/gpu_decode_arms-*): verify rounds, the point of
speculative decoding, pay almost per token. Here the weights' codes of NT slots are
unpacked once into an int8 tile [NT, BN, SLOT] and one batched int8 dot against the
activations [NT, SLOT, WP] gives every (slot, weight row, x row) integer sum at once;
the tensor cores do W = 1..WP for the price of one.

Per slot and x row (as qgemv_i8):

    isum = exact int8 dot of the slot's codes and q8(x)   [- BIAS * xsum]
    t    = A * float(isum) [- B * float(xsum)]              (A, B: the format's slot scales)
    acc  = acc + sum over the step's NT slots of t * dx     (one tl.sum per step)

Exact mode: the x tile is WP rows whatever W (rows past W are masked to 0 and not
stored), so every program of every W runs the same code on tensors of the same shapes
and layouts; a row's float operations, the per-step reduction included, do not depend on
W or on the row's column. W is not specialized on (do_not_specialize).
Compiled with enable_fp_fusion=False.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .expert_q8 import QBLOCK, supports
from .expert_q8_gpu import CODES
from .pdl import pdl_kwargs, pdl_trigger, pdl_wait
from .qmatvec_i8 import _lanes, prepare_i8
from .qweight import QuantWeight

WP = 16                 # x rows per program: the MMA's N; fixed, so a row's bits do not depend on W


@triton.jit
def _bytes(words, SHIFT: tl.constexpr):
    """int32 words [NT, BN, V] holding 4 byte-lane codes each -> int8 [NT, BN, 4V]
    (byte j of word v at 4v + j), minus SHIFT (Q8_0's codes are stored + 128)."""
    b0 = words & 0xFF
    b1 = (words >> 8) & 0xFF
    b2 = (words >> 16) & 0xFF
    b3 = (words >> 24) & 0xFF
    z = tl.join(tl.join(b0, b2), tl.join(b1, b3))                     # [NT, BN, V, 2, 2]: [.., q, p] = byte 2q + p
    z = tl.reshape(z, (words.shape[0], words.shape[1], 4 * words.shape[2]))
    return (z - SHIFT).to(tl.int8)


@triton.jit
def _codes_i8(lo, hi, BITS: tl.constexpr, SHIFT: tl.constexpr):
    """The slot's codes as the MMA's A tile: [NT, BN, SLOT] int8. 4-bit formats: lo and
    hi word lanes interleave, k index (4v + j) * 2 + e; 8-bit: 4v + j."""
    if BITS == 8:
        a = _bytes(lo, SHIFT)
    else:
        a = tl.join(_bytes(lo, SHIFT), _bytes(hi, SHIFT))              # [NT, BN, 4V, 2]
        a = tl.reshape(a, (lo.shape[0], lo.shape[1], 8 * lo.shape[2]))
    return a


@triton.constexpr_function
def _pad(n):
    return max(n, 32)


@triton.jit(do_not_specialize=["W", "N", "one"])
def _qgemv_mma_kernel(xp, xsd, out, qs, qh, sc, sd, W, N, stride_out, one, n_slots: tl.constexpr,
                      LOAD: tl.constexpr, V: tl.constexpr, BITS: tl.constexpr, HBITS: tl.constexpr,
                      BIAS: tl.constexpr, HAS_MIN: tl.constexpr, SLOT: tl.constexpr, BN: tl.constexpr,
                      NT: tl.constexpr, WP: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    K: tl.constexpr = n_slots * SLOT
    SHIFT: tl.constexpr = 128 if BITS == 8 else 0
    EBIAS: tl.constexpr = BIAS - SHIFT                                 # codes c - SHIFT = q - EBIAS
    KD: tl.constexpr = _pad(SLOT)                                      # the dot's K: int8 MMA takes 32
    LAST: tl.constexpr = (n_slots - 1) // NT * NT
    n_wt = tl.cdiv(W, WP)
    pid_n = tl.program_id(0) // n_wt
    m0 = (tl.program_id(0) % n_wt) * WP
    n_out = pid_n * BN + tl.arange(0, BN)                              # [BN]
    row = tl.minimum(n_out, N - 1).to(tl.int64)[None, :]               # [1, BN]; past N: recomputed, not stored
    c = m0 + tl.arange(0, WP)                                          # [WP]: x rows
    cm = c < W
    c64 = c.to(tl.int64)
    # k index of the A tile -> the activation byte in the slot's lane order (qmatvec_i8.lane_perm)
    kk = tl.arange(0, KD)                                              # [KD]
    if BITS == 8:
        xo = kk
    else:
        xo = (kk % 2) * (4 * V) + kk // 2
    km = kk < SLOT
    acc = tl.zeros([BN, WP], tl.float32)
    pdl_trigger(PDL)
    if PREFETCH:
        nwords, nh, ns1, ns2 = LOAD(qs, qh, sc, sd, row, 0, one, n_slots, NT, V)
    pdl_wait(PDL)                    # the weights above are no earlier kernel's output; x is
    for s0 in range(0, n_slots, NT):
        if PREFETCH:
            words, h, s1, s2 = nwords, nh, ns1, ns2
            nwords, nh, ns1, ns2 = LOAD(qs, qh, sc, sd, row, tl.minimum(s0 + NT, LAST), one, n_slots, NT, V)
        else:
            words, h, s1, s2 = LOAD(qs, qh, sc, sd, row, s0, one, n_slots, NT, V)   # [NT, BN, V], [NT, BN] x3
        lo, hi = _lanes(words, h, BITS, HBITS)
        a = _codes_i8(lo, hi, BITS, SHIFT)                             # [NT, BN, SLOT] int8
        if KD > SLOT:
            a = tl.join(a, tl.zeros_like(a))                           # [NT, BN, SLOT, 2]: zero codes past SLOT
            a = tl.reshape(tl.permute(a, (0, 1, 3, 2)), (a.shape[0], a.shape[1], KD))
        u = s0 + tl.arange(0, NT)                                      # [NT]
        um = u < n_slots
        xb = tl.load(xp + c64[None, None, :] * K + (u * SLOT)[:, None, None] + xo[None, :, None],
                     mask=um[:, None, None] & km[None, :, None] & cm[None, None, :], other=0)   # [NT, KD, WP]
        isum = tl.dot(a, xb, out_dtype=tl.int32)                       # [NT, BN, WP] exact
        roff = c64[None, :] * (n_slots * 2) + u[:, None] * 2           # [NT, WP]
        xsum = tl.load(xsd + roff, mask=um[:, None] & cm[None, :], other=0)
        dx = tl.load(xsd + roff + 1, mask=um[:, None] & cm[None, :], other=0).to(tl.float32, bitcast=True)
        if EBIAS != 0:
            isum = isum - EBIAS * xsum[:, None, :]
        t = s1[:, :, None] * isum.to(tl.float32)                       # A * isum
        if HAS_MIN:
            t = t - s2[:, :, None] * xsum.to(tl.float32)[:, None, :]    # - B * xsum
        acc = acc + tl.sum(t * dx[:, None, :], axis=0)                 # [BN, WP]
    tl.store(out + c64[None, :] * stride_out + n_out[:, None], acc, mask=(n_out < N)[:, None] & cm[None, :])


@dataclass(frozen=True)
class MmaTile:
    """How the work is cut; with WP fixed, a function of the weight alone (mma_tile)."""
    BN: int = 32            # weight rows per program (the MMA's M)
    NT: int = 8             # slots per step (the batch of the dot)
    num_warps: int = 4
    prefetch: bool = True


def mma_tile(w: QuantWeight) -> MmaTile:
    """A function of the weight only. 16-value slots (Q6_K) take 16 a step so a step
    reads a whole super-block as 32-value ones do with 8."""
    NT = 16 if w.fmt.slot == 16 else 8
    return MmaTile(BN=32, NT=min(NT, triton.next_power_of_2(w.n_slots)))


def qgemv_mma(x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None,
              tile: MmaTile | None = None, prepared: tuple[torch.Tensor, torch.Tensor] | None = None,
              pdl: bool = False) -> torch.Tensor:
    """x [W, K] (any float dtype) @ w^T -> [W, N] float32 on int8 activations (quantized
    here unless `prepared` = prepare_i8(x, w) is given: the same activations as
    qgemv_i8's). `out` may be a column slice of a wider buffer (unit column stride). Row
    m's bits do not depend on W or m. Runs on CUDA (sm_80+) or under the Triton interpreter."""
    if not supports(w):
        raise ValueError(f"qgemv_mma has no integer form of {w.qtype.name} "
                         f"(supported: {', '.join(t.name for t in CODES)})")
    if len(w.shape) != 2:
        raise ValueError(f"qgemv_mma takes a 2-D weight; use w.expert(e) for {w.shape}")
    if x.dim() != 2 or x.shape[1] != w.K or w.K % QBLOCK:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {w.shape} (K a multiple of {QBLOCK})")
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("qgemv_mma runs on CUDA or under TRITON_INTERPRET=1")
    W, N = x.shape[0], w.N
    if out is None:
        out = torch.empty((W, N), dtype=torch.float32, device=x.device)   # [W, N]
    elif out.shape != (W, N) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{W}, {N}] with unit column stride, got {out.dtype} {tuple(out.shape)}")
    xp, xsd = prepared if prepared is not None else prepare_i8(x if x.stride(1) == 1 else x.contiguous(), w, pdl)
    t = tile or mma_tile(w)
    bits, hbits, bias, has_min = CODES[w.qtype]
    grid = (triton.cdiv(N, t.BN) * triton.cdiv(W, WP),)
    _qgemv_mma_kernel[grid](xp.view(torch.int8), xsd, out, *w.plane_args(), W, N, out.stride(0), 1,
                            n_slots=w.n_slots, LOAD=w.fmt.triton_load, V=w.fmt.V, BITS=bits, HBITS=hbits,
                            BIAS=bias, HAS_MIN=has_min, SLOT=w.fmt.slot, BN=t.BN, NT=t.NT, WP=WP,
                            PREFETCH=t.prefetch, num_warps=t.num_warps, enable_fp_fusion=False,
                            **pdl_kwargs(pdl, x.device))
    return out
