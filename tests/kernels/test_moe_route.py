"""kernels/moe/moe_f32.py's router (softmax, top-k, renormalise) gives the bits of the kernel it
replaced (an argmax and a max per round, two reductions; now one reduction returning
both), kept here as the reference and launched at the same warp count (the softmax sums'
layout follows the warps), and breaks ties toward the lower expert id."""
from __future__ import annotations


import pytest
import torch


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from alphallama.kernels.moe.route import ROUTE_WARPS, moe_route, moe_route_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _route_v1_kernel(logits, weights, experts, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    """The replaced kernel, as it was (commit ef8fd6c)."""
    m = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    l = tl.load(logits + m * E + e, mask=e < E, other=-float("inf"))  # [BLOCK_E]
    p = tl.exp(l - tl.max(l, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e < E, p, -1.0)
    j = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for r in tl.static_range(TOP_K):
        best = tl.argmax(p, 0)
        w = tl.where(j == r, tl.max(p, 0), w)
        ids = tl.where(j == r, best, ids)
        p = tl.where(e == best, -1.0, p)
    if NORM:
        w = w / tl.sum(w, 0)
    tl.store(weights + m * TOP_K + j, w, mask=j < TOP_K)
    tl.store(experts + m * TOP_K + j, ids, mask=j < TOP_K)


def route_v1(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    W, E = logits.shape
    weights = torch.empty((W, top_k), dtype=torch.float32, device=logits.device)   # [W, k]
    experts = torch.empty((W, top_k), dtype=torch.int32, device=logits.device)     # [W, k]
    _route_v1_kernel[(W,)](logits.contiguous(), weights, experts, E, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(E),
                           BLOCK_K=triton.next_power_of_2(top_k), NORM=norm, num_warps=ROUTE_WARPS)
    return weights, experts


@pytest.mark.parametrize("E,k", [(128, 8), (60, 4), (8, 3)])
def test_route_bits_equal_the_replaced_kernel(E, k):
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(E)).to(DEV) * 3   # [W, E]
    logits[1, :E // 2] = 0.25       # a row of exact ties
    for norm in (True, False):
        w, ids = moe_route(logits, k, norm)
        w1, ids1 = route_v1(logits, k, norm)
        assert torch.equal(ids, ids1) and torch.equal(w, w1)
        w_ref, _ = moe_route_ref(logits.cpu(), k, norm)                      # plain torch: the right function
        torch.testing.assert_close(w.cpu(), w_ref, rtol=1e-5, atol=1e-7)


def test_route_ties_go_to_the_lower_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 1.0]], device=DEV)    # [1, E]
    w, ids = moe_route(logits, 4, True)
    assert ids.tolist() == [[1, 3, 4, 2]]
    assert w[0, 0] == w[0, 1] == w[0, 2] and w[0, 2] > w[0, 3]
