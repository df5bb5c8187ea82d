"""SiLU(gate) * up of the dense FFN, GELU(gate) * up (GeGLU: gemma3; GELU's tanh form) or
gpt-oss's clamped SwiGLU, with the down GEMV's int8 activations in the same launch, beside
their plain-torch references. One program per row and block; the activation is a constexpr
(ACT, an id of ACT_IDS) of one kernel, so the SiLU launch is the code it always was.
`gated` is the one formula of each, which the MoE kernels (moe_f32, moe_gemm) call too.

The launches with int8 activations compile without FP fusion (their rounding to int8 is of
unfused values); GELU's plain launch does too, so its two launches give the same bits (the
GELU polynomial's multiply-adds fuse into FMAs in one and not the other otherwise: seen on
the H100). SiLU's formula has no multiply-add to fuse."""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .act_ids import ACT_IDS as ACT_IDS, OAI_ALPHA as _ALPHA, OAI_LIMIT as _LIMIT   # (ACT_IDS: re-exported)
from ..gemv.emit import Q8, q8_args
from ..gemv.qmatvec_i8 import emit_q8
from ..gemv.q8k_act import emit_q8k
from ..pdl import pdl_kwargs, pdl_start


SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
# ACT_IDS (act_ids.py): Variant.ffn_act -> the ACT constexpr of `gated`
OAI_ALPHA = tl.constexpr(_ALPHA)   # gpt-oss's swiglu_oai (llama.cpp's constants; model/layers.swiglu_oai)
OAI_LIMIT = tl.constexpr(_LIMIT)


@triton.jit
def gated(g, u, ACT: tl.constexpr):
    """The gated activation of gate g and up u (fp32, any shape), ACT an id of ACT_IDS.
    SiLU: g / (1 + exp(-g)) * u. GELU: gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3)))
    written as g / (1 + exp(-2 c (g + 0.044715 g^3))) (the same function; exp overflows to
    inf, not NaN), times u. swiglu_oai: g clamped above at 7, u to [-7, 7],
    g / (1 + exp(-1.702 g)) * (u + 1)."""
    if ACT == 2:
        g = tl.minimum(g, OAI_LIMIT)
        u = tl.minimum(tl.maximum(u, -OAI_LIMIT), OAI_LIMIT) + 1.0
        z = g * OAI_ALPHA
    elif ACT == 1:
        z = g * (1.0 + 0.044715 * g * g) * (2.0 * SQRT_2_OVER_PI)
    else:
        z = g
    return g / (1.0 + tl.exp(-z)) * u


@triton.jit
def _silu_mul_kernel(GU, OUT, F: tl.constexpr, BLOCK: tl.constexpr,
                     XP1=None, XS1=None, NQ: tl.constexpr = 0,
                     SLOT1: tl.constexpr = 32, V1: tl.constexpr = 4, BITS1: tl.constexpr = 4,
                     PDL: tl.constexpr = False, Q8K: tl.constexpr = False, XF=None, XK=None, DXK=None, XL=None,
                     ACT: tl.constexpr = 0):
    """ACT: `gated`'s activation (0 SiLU, 1 GELU, 2 swiglu_oai)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    f = blk * BLOCK + tl.arange(0, BLOCK)
    mask = f < F
    g = tl.load(GU + row * 2 * F + f, mask=mask, other=0.0)
    u = tl.load(GU + row * 2 * F + F + f, mask=mask, other=0.0)
    a = gated(g, u, ACT).to(OUT.dtype.element_ty)
    tl.store(OUT + row * F + f, a, mask=mask)
    if NQ > 0:                       # the down GEMV's int8 activations (see _add_rmsnorm_kernel)
        emit_q8(a.to(tl.float32), blk * BLOCK, row.to(tl.int64), XP1, XS1, F, SLOT1, V1, BITS1, F % BLOCK != 0)
    if Q8K:                          # or prepare_q8k's (qgemv_mma_k / qgemv_q8k)
        emit_q8k(a.to(tl.float32), blk * BLOCK, row.to(tl.int64), XF, XK, DXK, XL, F, F % BLOCK != 0)


def _plain(gu: torch.Tensor, out_dtype: torch.dtype, pdl: bool, act: int) -> torch.Tensor:
    W, F2 = gu.shape
    F = F2 // 2
    out = torch.empty(W, F, device=gu.device, dtype=out_dtype)
    BLOCK = 1024
    extra = {"ACT": act, "enable_fp_fusion": False} if act else {}     # the q8 launch's bits (see above)
    _silu_mul_kernel[(W, triton.cdiv(F, BLOCK))](gu, out, F, BLOCK, **extra, **pdl_kwargs(pdl, gu.device))
    return out


def _with_q8(gu: torch.Tensor, out_dtype: torch.dtype, orders: tuple, pdl: bool,
             act: int) -> tuple[torch.Tensor, dict[tuple, Q8]]:
    W, F2 = gu.shape
    F = F2 // 2
    if F % 32 or len(orders) > 1:
        raise ValueError(f"the gated activation's q8 output needs F % 32 == 0 and at most one lane order, "
                         f"got {F}, {orders}")
    out = torch.empty(W, F, device=gu.device, dtype=out_dtype)
    q8, args = q8_args(W, F, tuple(orders), gu.device)
    BLOCK = 1024
    extra = {"ACT": act} if act else {}
    _silu_mul_kernel[(W, triton.cdiv(F, BLOCK))](gu, out, F, BLOCK, enable_fp_fusion=False, **args, **extra,
                                                 **pdl_kwargs(pdl, gu.device))
    return out, q8


def silu_mul(gu: torch.Tensor, out_dtype: torch.dtype = torch.float32, pdl: bool = False) -> torch.Tensor:
    """gu: [W, 2F] (gate then up) -> silu(gate) * up [W, F] in out_dtype."""
    return _plain(gu, out_dtype, pdl, 0)


def silu_mul_q8(gu: torch.Tensor, out_dtype: torch.dtype, orders: tuple,
                pdl: bool = False) -> tuple[torch.Tensor, dict[tuple, Q8]]:
    """silu_mul, and the int8 activations of its output in (at most) one lane order (or
    q8k_act.Q8K), in the same launch. -> (act [W, F], {order: (xp, xsd), or prepare_q8k's
    four tensors})."""
    return _with_q8(gu, out_dtype, orders, pdl, 0)


def gelu_mul(gu: torch.Tensor, out_dtype: torch.dtype = torch.float32, pdl: bool = False) -> torch.Tensor:
    """gu: [W, 2F] (gate then up) -> gelu_tanh(gate) * up [W, F] in out_dtype (GeGLU)."""
    return _plain(gu, out_dtype, pdl, 1)


def gelu_mul_q8(gu: torch.Tensor, out_dtype: torch.dtype, orders: tuple,
                pdl: bool = False) -> tuple[torch.Tensor, dict[tuple, Q8]]:
    """gelu_mul with the down GEMV's int8 activations, as silu_mul_q8."""
    return _with_q8(gu, out_dtype, orders, pdl, 1)


def swiglu_oai_mul(gu: torch.Tensor, out_dtype: torch.dtype = torch.float32, pdl: bool = False) -> torch.Tensor:
    """gu: [W, 2F] (gate then up) -> swiglu_oai(gate, up) [W, F] in out_dtype (gpt-oss)."""
    return _plain(gu, out_dtype, pdl, 2)


def swiglu_oai_mul_q8(gu: torch.Tensor, out_dtype: torch.dtype, orders: tuple,
                      pdl: bool = False) -> tuple[torch.Tensor, dict[tuple, Q8]]:
    """swiglu_oai_mul with the down GEMV's int8 activations, as silu_mul_q8."""
    return _with_q8(gu, out_dtype, orders, pdl, 2)


@dataclass(frozen=True)
class GatedAct:
    """A gated activation's two launches: plain, and with the down GEMV's activations."""
    plain: Callable[..., torch.Tensor]
    q8: Callable[..., tuple]


# Variant.ffn_act -> its launches (the GPU runtime runs these two)
GATED = {"silu": GatedAct(silu_mul, silu_mul_q8), "gelu": GatedAct(gelu_mul, gelu_mul_q8),
         "swiglu_oai": GatedAct(swiglu_oai_mul, swiglu_oai_mul_q8)}


def silu_mul_ref(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def gelu_mul_ref(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.gelu(g, approximate="tanh") * u
