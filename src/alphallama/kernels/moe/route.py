"""MoE routing on the device: router logits [W, E] -> softmax, top-k, renormalise ->
(weights, expert ids) [W, k], one program a row (the same bits at every W).

gpt-oss: the router's bias [E] added to the logits first, and its gating (Variant.moe_gating
"softmax_weight"): the top k by logit, then the softmax over those k only."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...model.layers import GATINGS
from ..backend import use_triton
from ..pdl import pdl_kwargs, pdl_start

# warps of the route launch (softmax, top-k over E logits: one program a row; the softmax
# sums' layout follows them, the same at every W). 1 warp makes a faster decode round but
# broke the MoE prefill chunk's graph capture ("operation failed due to a previous error
# during capture", tests/runtime/test_gpu_prefill.py), not understood yet
# (docs/decisions/launch-cuts-kept.md), so 4
ROUTE_WARPS = 4


# -- router: softmax, top-k, renormalise ----------------------------------------------------
@triton.jit
def _route_kernel(logits, weights, experts, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False,
                  BIAS=None, HAS_BIAS: tl.constexpr = False, AFTER: tl.constexpr = False):
    """One program per row: route_row's choice stored by rank."""
    pdl_start(PDL)                   # reads the router GEMV's output, writes what the last round's experts read
    m = tl.program_id(0).to(tl.int64)
    w, ids = route_row(logits, m, E, TOP_K, BLOCK_E, BLOCK_K, NORM, BIAS, HAS_BIAS, AFTER)
    j = tl.arange(0, BLOCK_K)
    tl.store(weights + m * TOP_K + j, w, mask=j < TOP_K)
    tl.store(experts + m * TOP_K + j, ids, mask=j < TOP_K)


@triton.jit
def route_row(logits, m, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
              NORM: tl.constexpr, BIAS=None, HAS_BIAS: tl.constexpr = False, AFTER: tl.constexpr = False):
    """Row m's routing: softmax over its E logits, then TOP_K rounds of argmax (ties go
    to the lower expert id), the chosen weights renormalised to sum to 1 if NORM.
    HAS_BIAS: BIAS [E] added to the logits first. AFTER (gpt-oss's softmax_weight): the
    argmax rounds pick the logits themselves, and the softmax is over the k picked.
    -> (weights [BLOCK_K] fp32, expert ids [BLOCK_K] int32) by rank."""
    e = tl.arange(0, BLOCK_E)
    l = tl.load(logits + m * E + e, mask=e < E, other=-float("inf"))  # [BLOCK_E]
    if HAS_BIAS:
        l += tl.load(BIAS + e, mask=e < E, other=0.0)
    if AFTER:
        p = l                           # (padding lanes: -inf, never chosen)
        gone = -float("inf")            # a chosen lane's mark
    else:
        gone = -1.0
        p = tl.exp(l - tl.max(l, 0))
        p = p / tl.sum(p, 0)
        p = tl.where(e < E, p, -1.0)    # padding lanes are never chosen
    j = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for r in tl.static_range(TOP_K):
        # one reduction gives the value and its index (ties: the lower id), as argmax
        # and max did in two; the maximum is exact, so the bits are the same
        best_p, best = tl.max(p, 0, return_indices=True, return_indices_tie_break_left=True)
        w = tl.where(j == r, best_p, w)
        ids = tl.where(j == r, best, ids)
        p = tl.where(e == best, gone, p)
    if AFTER:                           # the softmax of the k logits (rank 0 holds their maximum)
        top = tl.where(j < TOP_K, w, -float("inf"))
        w = tl.exp(top - tl.max(top, 0))
        w = w / tl.sum(w, 0)
    if NORM:
        w = w / tl.sum(w, 0)
    return w, ids


def moe_route(logits: torch.Tensor, top_k: int, norm: bool,
              experts_out: torch.Tensor | None = None, pdl: bool = False, bias: torch.Tensor | None = None,
              after: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [W, E] fp32 -> (weights [W, k] fp32, expert ids [W, k] int32), by rank.
    experts_out: a contiguous int32 [W, k] to write the ids into (the expert store's
    record of the round's routing). pdl: launched with programmatic dependent launch.
    bias [E] fp32: added to the logits; after: the softmax over the k chosen logits
    (gpt-oss's gating), not over all E before choosing."""
    if not use_triton(logits):
        w, ids = moe_route_ref(logits, top_k, norm, bias, after)
        return w, (ids if experts_out is None else experts_out.copy_(ids))
    W, E = logits.shape
    logits = logits.contiguous()
    weights = torch.empty((W, top_k), dtype=torch.float32, device=logits.device)   # [W, k]
    experts = experts_out if experts_out is not None else \
        torch.empty((W, top_k), dtype=torch.int32, device=logits.device)          # [W, k]
    _route_kernel[(W,)](logits, weights, experts, E, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(E),
                        BLOCK_K=triton.next_power_of_2(top_k), NORM=norm, num_warps=ROUTE_WARPS,
                        **({} if bias is None and not after else {"BIAS": bias, "HAS_BIAS": bias is not None,
                                                                  "AFTER": after}),
                        **pdl_kwargs(pdl, logits.device))
    return weights, experts


def moe_route_ref(logits: torch.Tensor, top_k: int, norm: bool, bias: torch.Tensor | None = None,
                  after: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """layers.moe's routing in plain torch: (weights [W, k], expert ids [W, k] int32)."""
    logits = logits.float() if bias is None else logits.float() + bias.float()
    w, ids = GATINGS["softmax_weight" if after else "softmax"](logits, top_k)   # [W, k] each
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(torch.int32)
