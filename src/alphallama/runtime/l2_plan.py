"""Which latency-bound kernel of a layer asks L2 for which later GEMV's weights (kernels/l2.py).

A layer's kernels in decode order, and what each prefetch plan covers:

    norm (attn)  -> qkv GEMV        the norm asks for the qkv weight
    qkv_rope     -> ...             asks for the o weight (and a MoE layer's router)
    attention    -> o GEMV          asks for the first `head` bytes of the FFN's gate|up
    norm (ffn)   -> gate|up GEMV    asks for the next `tail` bytes of gate|up
    silu         -> down GEMV       asks for the first `head` bytes of down

Budgets are bytes, not fractions, because L2 is a fixed 50 MB whatever the model: a
small model's weights are asked for whole, a large one's first `head` + `tail` bytes.
A MoE layer (resident experts): the norm before its experts asks for the next layer's
qkv weight, and the routing kernel asks for the chosen experts' gate|up and down slices
as soon as it has chosen them (l2.expert_prefetch), no static plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..kernels.l2 import L2Prefetch


@dataclass
class LayerPrefetch:
    qkv: L2Prefetch | None = None        # issued by the norm before the qkv GEMV
    o: L2Prefetch | None = None          # by qkv_rope
    attn: L2Prefetch | None = None       # by the attention's split launch
    ffn: L2Prefetch | None = None        # by the norm before the FFN
    silu: L2Prefetch | None = None       # by the SiLU launch (dense, unfused)


def _planes(linear) -> list:
    return [p for w in linear.weights for p in w.planes.values()]


def _part(planes: list, nbytes: int, lo_bytes: int, hi_bytes: int) -> list:
    """[(planes, lo, hi)] for bytes [lo_bytes, hi_bytes) of a weight of nbytes, or []."""
    if nbytes <= 0 or lo_bytes >= min(hi_bytes, nbytes):
        return []
    return [(planes, lo_bytes / nbytes, min(hi_bytes, nbytes) / nbytes)]


def _plan(parts: list) -> L2Prefetch | None:
    plan = L2Prefetch(parts) if parts else None
    return plan if plan is not None and plan.table is not None else None


def layer_prefetch(layer, nxt, head: int, tail: int) -> LayerPrefetch:
    """The plans of one GPULayer (see the module's table; nxt: the next layer or None);
    head, tail: bytes."""
    whole = 1 << 62
    qkv = _plan(_part(_planes(layer.qkv), layer.qkv.nbytes, 0, whole))
    o_parts = _part(_planes(layer.o), layer.o.nbytes, 0, whole)
    if layer.moe is not None:
        o_parts += _part(list(layer.moe.router.planes.values()), layer.moe.router.nbytes, 0, whole)
        ahead = _part(_planes(nxt.qkv), nxt.qkv.nbytes, 0, whole) if nxt is not None else []
        return LayerPrefetch(qkv=qkv, o=_plan(o_parts), ffn=_plan(ahead))
    gu, dn = layer.gate_up, layer.down
    return LayerPrefetch(qkv=qkv, o=_plan(o_parts),
                         attn=_plan(_part(_planes(gu), gu.nbytes, 0, head)),
                         ffn=_plan(_part(_planes(gu), gu.nbytes, head, head + tail)),
                         silu=_plan(_part(_planes(dn), dn.nbytes, 0, head)))
