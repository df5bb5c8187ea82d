"""SiLU(gate) * up of the dense FFN (with the down GEMV's int8 activations in the same
launch), beside its plain-torch reference. One program per row and block."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemv.emit import Q8, q8_args
from ..gemv.qmatvec_i8 import emit_q8
from ..gemv.qgemv_mma import emit_q8k
from ..pdl import pdl_kwargs, pdl_start


@triton.jit
def _silu_mul_kernel(GU, OUT, F: tl.constexpr, BLOCK: tl.constexpr,
                     XP1=None, XS1=None, NQ: tl.constexpr = 0,
                     SLOT1: tl.constexpr = 32, V1: tl.constexpr = 4, BITS1: tl.constexpr = 4,
                     PDL: tl.constexpr = False, Q8K: tl.constexpr = False, XF=None, XK=None, DXK=None, XL=None):
    pdl_start(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    f = blk * BLOCK + tl.arange(0, BLOCK)
    mask = f < F
    g = tl.load(GU + row * 2 * F + f, mask=mask, other=0.0)
    u = tl.load(GU + row * 2 * F + F + f, mask=mask, other=0.0)
    a = (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty)
    tl.store(OUT + row * F + f, a, mask=mask)
    if NQ > 0:                       # the down GEMV's int8 activations (see _add_rmsnorm_kernel)
        emit_q8(a.to(tl.float32), blk * BLOCK, row.to(tl.int64), XP1, XS1, F, SLOT1, V1, BITS1, F % BLOCK != 0)
    if Q8K:                          # or prepare_q8k's (qgemv_mma_k / qgemv_q8k)
        emit_q8k(a.to(tl.float32), blk * BLOCK, row.to(tl.int64), XF, XK, DXK, XL, F, F % BLOCK != 0)


def silu_mul(gu: torch.Tensor, out_dtype: torch.dtype = torch.float32, pdl: bool = False) -> torch.Tensor:
    """gu: [W, 2F] (gate then up) -> silu(gate) * up [W, F] in out_dtype."""
    W, F2 = gu.shape
    F = F2 // 2
    out = torch.empty(W, F, device=gu.device, dtype=out_dtype)
    BLOCK = 1024
    _silu_mul_kernel[(W, triton.cdiv(F, BLOCK))](gu, out, F, BLOCK, **pdl_kwargs(pdl, gu.device))
    return out


def silu_mul_q8(gu: torch.Tensor, out_dtype: torch.dtype, orders: tuple,
                pdl: bool = False) -> tuple[torch.Tensor, dict[tuple, Q8]]:
    """silu_mul, and the int8 activations of its output in (at most) one lane order (or
    qgemv_mma.Q8K), in the same launch. -> (act [W, F], {order: (xp, xsd), or prepare_q8k's
    four tensors})."""
    W, F2 = gu.shape
    F = F2 // 2
    if F % 32 or len(orders) > 1:
        raise ValueError(f"silu_mul_q8 needs F % 32 == 0 and at most one lane order, got {F}, {orders}")
    out = torch.empty(W, F, device=gu.device, dtype=out_dtype)
    q8, args = q8_args(W, F, tuple(orders), gu.device)
    BLOCK = 1024
    _silu_mul_kernel[(W, triton.cdiv(F, BLOCK))](gu, out, F, BLOCK, enable_fp_fusion=False, **args,
                                                 **pdl_kwargs(pdl, gu.device))
    return out, q8


def silu_mul_ref(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u
