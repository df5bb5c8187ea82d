"""MoE routing on the device: router logits [W, E] -> softmax, top-k, renormalise ->
(weights, expert ids) [W, k], one program a row (the same bits at every W)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
                  BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    """One program per row: route_row's choice stored by rank."""
    pdl_start(PDL)                   # reads the router GEMV's output, writes what the last round's experts read
    m = tl.program_id(0).to(tl.int64)
    w, ids = route_row(logits, m, E, TOP_K, BLOCK_E, BLOCK_K, NORM)
    j = tl.arange(0, BLOCK_K)
    tl.store(weights + m * TOP_K + j, w, mask=j < TOP_K)
    tl.store(experts + m * TOP_K + j, ids, mask=j < TOP_K)


@triton.jit
def route_row(logits, m, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
              NORM: tl.constexpr):
    """Row m's routing: softmax over its E logits, then TOP_K rounds of argmax (ties go
    to the lower expert id), the chosen weights renormalised to sum to 1 if NORM.
    -> (weights [BLOCK_K] fp32, expert ids [BLOCK_K] int32) by rank."""
    e = tl.arange(0, BLOCK_E)
    l = tl.load(logits + m * E + e, mask=e < E, other=-float("inf"))  # [BLOCK_E]
    p = tl.exp(l - tl.max(l, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e < E, p, -1.0)        # padding lanes are never chosen
    j = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for r in tl.static_range(TOP_K):
        # one reduction gives the value and its index (ties: the lower id), as argmax
        # and max did in two; the maximum is exact, so the bits are the same
        best_p, best = tl.max(p, 0, return_indices=True, return_indices_tie_break_left=True)
        w = tl.where(j == r, best_p, w)
        ids = tl.where(j == r, best, ids)
        p = tl.where(e == best, -1.0, p)
    if NORM:
        w = w / tl.sum(w, 0)
    return w, ids


def moe_route(logits: torch.Tensor, top_k: int, norm: bool,
              experts_out: torch.Tensor | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [W, E] fp32 -> (weights [W, k] fp32, expert ids [W, k] int32), by rank.
    experts_out: a contiguous int32 [W, k] to write the ids into (the expert store's
    record of the round's routing). pdl: launched with programmatic dependent launch."""
    if not use_triton(logits):
        w, ids = moe_route_ref(logits, top_k, norm)
        return w, (ids if experts_out is None else experts_out.copy_(ids))
    W, E = logits.shape
    logits = logits.contiguous()
    weights = torch.empty((W, top_k), dtype=torch.float32, device=logits.device)   # [W, k]
    experts = experts_out if experts_out is not None else \
        torch.empty((W, top_k), dtype=torch.int32, device=logits.device)          # [W, k]
    _route_kernel[(W,)](logits, weights, experts, E, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(E),
                        BLOCK_K=triton.next_power_of_2(top_k), NORM=norm, num_warps=ROUTE_WARPS,
                        **pdl_kwargs(pdl, logits.device))
    return weights, experts


def moe_route_ref(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers.moe's routing in plain torch: (weights [W, k], expert ids [W, k] int32)."""
    w, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)  # [W, k] each
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(torch.int32)
