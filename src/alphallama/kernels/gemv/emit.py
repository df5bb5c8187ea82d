"""What a producer kernel (a norm, the SiLU, the attention combine) emits for the GEMV
that reads its output: the int8 activations of up to two lane orders (qmatvec_i8) and
q8k_act.Q8K's q8_K activations, made in the producer's own launch."""
from __future__ import annotations

import torch

from .q8k_act import Q8K, new_q8k
from .qmatvec_i8 import new_q8

Q8 = tuple[torch.Tensor, torch.Tensor]          # int8 activations: (xp, xsd), qmatvec_i8.new_q8


def q8_args(W: int, K: int, orders: tuple, device) -> tuple[dict, dict]:
    """Buffers for up to two lane orders (and q8k_act.Q8K's q8_K activations, if among the
    orders) and the kernel arguments that name them."""
    lanes = tuple(o for o in orders if o != Q8K)
    if len(lanes) > 2:
        raise ValueError(f"at most two lane orders per producer, got {orders}")
    q8 = {o: new_q8(W, K, o, device) for o in lanes}
    args: dict = {"NQ": len(lanes)}
    for i, o in enumerate(lanes, 1):
        xp, xsd = q8[o]
        args.update({f"XP{i}": xp.view(torch.int8), f"XS{i}": xsd, f"SLOT{i}": o[0], f"V{i}": o[1], f"BITS{i}": o[2]})
    if Q8K in orders:
        if K % 256:
            raise ValueError(f"q8_K activations need K % 256 == 0, got {K}")
        q8[Q8K] = xf, xs, dxs, xl = new_q8k(W, K, device)
        args.update(Q8K=True, XF=xf.view(torch.int8), XK=xs, DXK=dxs, XL=xl.view(torch.int8))
    return q8, args
