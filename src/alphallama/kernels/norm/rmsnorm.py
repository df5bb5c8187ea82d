"""RMSNorm kernels of the decode round (the residual add, the int8 activations of the
next GEMV, the MoE router's logits), each beside its plain-torch reference.

One program per row: a row's arithmetic never depends on the other rows or the width,
which is what exact mode needs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemv.emit import Q8, q8_args
from ..gemv.qmatvec_i8 import emit_q8
from ..gemv.q8k_act import emit_q8k
from ..moe.moe_f32 import MoEParts, combine_block
from ..pdl import pdl_kwargs, pdl_start, pdl_trigger, pdl_wait


# -- residual add + RMSNorm -------------------------------------------------------------
# Warps of a norm program (one per row) for rows of >= 2048 values; 4 below. The layout
# of the row's sum of squares follows them, so they are part of the row's float order:
# one value for every W. 16: the fastest of 4 / 8 / 16 on rows of 2048 and 4096 values
# (docs/decisions/launch-cuts-kept.md)
NORM_WARPS = 16


def _norm_warps(D: int) -> int:
    return NORM_WARPS if D >= 2048 else 4


@triton.jit
def _add_rmsnorm_kernel(X, Y, Wt, H, D: tl.constexpr, BLOCK: tl.constexpr, eps, HAS_Y: tl.constexpr,
                        XP1=None, XS1=None, XP2=None, XS2=None, NQ: tl.constexpr = 0,
                        SLOT1: tl.constexpr = 32, V1: tl.constexpr = 4, BITS1: tl.constexpr = 4,
                        SLOT2: tl.constexpr = 32, V2: tl.constexpr = 4, BITS2: tl.constexpr = 4,
                        PDL: tl.constexpr = False, PART=None, PW=None, TOP_K: tl.constexpr = 0,
                        Q8K: tl.constexpr = False, XF=None, XK=None, DXK=None, XL=None):
    """TOP_K > 0: y is the MoE ranks' sum, made here from PART [W, TOP_K, D] and PW
    [W, TOP_K] by moe's combine code (the same fma chain: y's bits are the combine
    kernel's), instead of loaded from Y. Q8K: prepare_q8k's activations of h too."""
    pdl_start(PDL)
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(X + row * D + d, mask=mask, other=0.0)
    if TOP_K > 0:
        x += combine_block(PART, PW, row.to(tl.int64), d, D, TOP_K)
        tl.store(X + row * D + d, x, mask=mask)
    elif HAS_Y:
        x += tl.load(Y + row * D + d, mask=mask, other=0.0)
        tl.store(X + row * D + d, x, mask=mask)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    h = (x * r * tl.load(Wt + d, mask=mask, other=0.0)).to(H.dtype.element_ty)
    tl.store(H + row * D + d, h, mask=mask)
    # the int8 activations of the next GEMVs, from the values just stored (what a separate
    # prepare launch would read back): up to two lane orders
    if NQ > 0:
        emit_q8(h.to(tl.float32), 0, row.to(tl.int64), XP1, XS1, D, SLOT1, V1, BITS1, BLOCK != D)
    if NQ > 1:
        emit_q8(h.to(tl.float32), 0, row.to(tl.int64), XP2, XS2, D, SLOT2, V2, BITS2, BLOCK != D)
    if Q8K:
        emit_q8k(h.to(tl.float32), 0, row.to(tl.int64), XF, XK, DXK, XL, D, BLOCK != D)


def _y_args(x: torch.Tensor, y: "torch.Tensor | MoEParts | None") -> tuple[torch.Tensor, dict]:
    """(Y argument, the kernel's y keywords) for y a tensor, MoE parts or None."""
    if isinstance(y, tuple):
        part, weights = y
        W, D = x.shape
        if part.shape[0] != W or part.shape[2] != D or weights.shape != part.shape[:2] or \
                part.dtype != torch.float32 or weights.dtype != torch.float32:
            raise ValueError(f"MoE parts [W, k, D] and weights [W, k] fp32 for x {tuple(x.shape)}, got "
                             f"{tuple(part.shape)} {part.dtype}, {tuple(weights.shape)} {weights.dtype}")
        return x, {"HAS_Y": True, "PART": part.contiguous(), "PW": weights.contiguous(), "TOP_K": part.shape[1]}
    return (y if y is not None else x), {"HAS_Y": y is not None}


def add_rmsnorm(x: torch.Tensor, y: "torch.Tensor | MoEParts | None", w: torch.Tensor, eps: float,
                out_dtype: torch.dtype = torch.float32, pdl: bool = False) -> torch.Tensor:
    """x += y (in place, when y is given); returns rmsnorm(x) * w in out_dtype (bf16 on
    the GPU: the quantized GEMV reads half the activation bytes). x, y: [W, D] fp32; or
    y = (part [W, k, D], weights [W, k]): the MoE ranks' sum made here (moe's combine,
    the same bits), one launch fewer."""
    W, D = x.shape
    out = torch.empty(W, D, device=x.device, dtype=out_dtype)
    Y, ya = _y_args(x, y)
    _add_rmsnorm_kernel[(W,)](x, Y, w, out, D, triton.next_power_of_2(D), eps, num_warps=_norm_warps(D), **ya,
                              **pdl_kwargs(pdl, x.device))
    return out


def add_rmsnorm_q8(x: torch.Tensor, y: "torch.Tensor | MoEParts | None", w: torch.Tensor, eps: float,
                   out_dtype: torch.dtype, orders: tuple, pdl: bool = False) -> tuple[torch.Tensor, dict[tuple, Q8]]:
    """add_rmsnorm, and in the same launch the int8 activations of its output for each
    lane order in `orders` (at most two; qmatvec_i8.lane_order; and q8k_act.Q8K): bit for
    bit what prepare_i8 (prepare_q8k) would make of the returned tensor.
    -> (h [W, D], {order: (xp, xsd) (Q8K: prepare_q8k's four tensors)})."""
    W, D = x.shape
    if D % 32:
        raise ValueError(f"int8 activations need D % 32 == 0, got {D}")
    out = torch.empty(W, D, device=x.device, dtype=out_dtype)
    q8, args = q8_args(W, D, tuple(orders), x.device)
    Y, ya = _y_args(x, y)
    _add_rmsnorm_kernel[(W,)](x, Y, w, out, D, triton.next_power_of_2(D), eps, enable_fp_fusion=False,
                              num_warps=_norm_warps(D), **ya, **args, **pdl_kwargs(pdl, x.device))
    return out, q8


def add_rmsnorm_ref(x, y, w, eps):
    x = x + y if y is not None else x
    return x, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# -- RMSNorm + the MoE router --------------------------------------------------------------
ROUTER_ROWS = 8        # router rows (experts) a program of _norm_router_kernel takes


@triton.jit
def _norm_router_kernel(X, Wt, H, R, LOGITS, E, eps, D: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr,
                        XP1=None, XS1=None, XP2=None, XS2=None, NQ: tl.constexpr = 0,
                        SLOT1: tl.constexpr = 32, V1: tl.constexpr = 4, BITS1: tl.constexpr = 4,
                        SLOT2: tl.constexpr = 32, V2: tl.constexpr = 4, BITS2: tl.constexpr = 4,
                        PDL: tl.constexpr = False, PART=None, PW=None, TOP_K: tl.constexpr = 0, XOUT=None):
    """Program (row, expert block): rmsnorm(x) * w, and the router logits of RB experts
    from it. Every program of a row normalizes it (the same code: the same bits); the
    block-0 program stores h and its int8 activations. The router rows are loaded before
    the PDL wait (weights: no kernel's output). TOP_K > 0: x is X plus the parts PART
    [W, TOP_K, D] with weights PW [W, TOP_K] (moe's combine code, as _add_rmsnorm_kernel),
    stored by the block-0 program into XOUT (not X: the row's other programs still read it)."""
    pdl_trigger(PDL)
    e = tl.program_id(1) * RB + tl.arange(0, RB)                       # [RB]
    d = tl.arange(0, BLOCK)
    mask = d < D
    rw = tl.load(R + e[:, None] * D + d[None, :], mask=(e < E)[:, None] & mask[None, :], other=0.0)   # [RB, BLOCK]
    pdl_wait(PDL)
    row = tl.program_id(0)
    x = tl.load(X + row * D + d, mask=mask, other=0.0)
    if TOP_K > 0:
        x += combine_block(PART, PW, row.to(tl.int64), d, D, TOP_K)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    h = (x * r * tl.load(Wt + d, mask=mask, other=0.0)).to(H.dtype.element_ty)
    if tl.program_id(1) == 0:
        if TOP_K > 0:
            tl.store(XOUT + row * D + d, x, mask=mask)
        tl.store(H + row * D + d, h, mask=mask)
        if NQ > 0:
            emit_q8(h.to(tl.float32), 0, row.to(tl.int64), XP1, XS1, D, SLOT1, V1, BITS1, BLOCK != D)
        if NQ > 1:
            emit_q8(h.to(tl.float32), 0, row.to(tl.int64), XP2, XS2, D, SLOT2, V2, BITS2, BLOCK != D)
    logit = tl.sum(rw.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)   # [RB]
    tl.store(LOGITS + row * E + e, logit, mask=e < E)


def rmsnorm_router_q8(x: torch.Tensor, w: torch.Tensor, router: torch.Tensor, eps: float, out_dtype: torch.dtype,
                      orders: tuple, pdl: bool = False, parts: MoEParts | None = None,
                      x_out: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[tuple, Q8], torch.Tensor]:
    """rmsnorm(x) * w in out_dtype, its int8 activations (up to two lane orders, as
    add_rmsnorm_q8) and the MoE router's logits h @ router^T in one launch.
    x [W, D] fp32 (the residual, already holding the layer's attention output: read only),
    router [E, D] (a float dtype) -> (h [W, D], {order: q8}, logits [W, E] fp32).
    parts = (part [W, k, D], weights [W, k]): the residual is x + their sum (add_rmsnorm's
    MoE-ranks add, the same bits), written to x_out [W, D] fp32 (x stays as it was)."""
    W, D = x.shape
    E = router.shape[0]
    if D % 32 or router.shape[1] != D or not router.is_contiguous():
        raise ValueError(f"rmsnorm_router_q8 needs D % 32 == 0 and a contiguous router [E, {D}], "
                         f"got D={D}, router {tuple(router.shape)}")
    if (parts is None) != (x_out is None) or (x_out is not None and (
            x_out.shape != x.shape or x_out.dtype != torch.float32 or not x_out.is_contiguous())):
        raise ValueError(f"rmsnorm_router_q8: parts and x_out come together, x_out a contiguous float32 "
                         f"{tuple(x.shape)}")
    h = torch.empty(W, D, device=x.device, dtype=out_dtype)                   # [W, D]
    logits = torch.empty(W, E, device=x.device, dtype=torch.float32)          # [W, E]
    q8, args = q8_args(W, D, tuple(orders), x.device)
    if parts is not None:
        _, ya = _y_args(x, parts)
        args.update(PART=ya["PART"], PW=ya["PW"], TOP_K=ya["TOP_K"], XOUT=x_out)
    _norm_router_kernel[(W, triton.cdiv(E, ROUTER_ROWS))](
        x, w, h, router, logits, E, eps, D, triton.next_power_of_2(D), ROUTER_ROWS, enable_fp_fusion=False,
        num_warps=_norm_warps(D), **args, **pdl_kwargs(pdl, x.device))
    return h, q8, logits
