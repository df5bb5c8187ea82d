"""The fused MoE kernels (kernels/moe/moe_f32.py) against their plain-torch references, their
row invariance, and the GPU runtime on a tiny qwen3moe against the reference model."""
from __future__ import annotations


import pytest
import torch


from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from alphallama.gguf.quants import QUANTS  # noqa: E402
from alphallama.kernels.moe.moe_f32 import moe_down, moe_down_ref, moe_gate_up, moe_gate_up_ref
from alphallama.kernels.moe.route import moe_route, moe_route_ref
from alphallama.kernels.formats.qweight import QuantWeight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QTYPES = [T.Q4_K, T.Q6_K, T.Q8_0]


def expert_weight(qtype: T, shape: tuple[int, int, int], seed: int) -> QuantWeight:
    """Random GGUF bits for an [E, N, K] tensor, every fp16 scale a small finite value."""
    g = torch.Generator().manual_seed(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    nb = shape[0] * shape[1] * shape[2] // block
    blocks = torch.randint(0, 256, (nb, size), dtype=torch.uint8, generator=g)  # [nb, size]
    for off in QUANTS[qtype].f16_fields:
        scale = (torch.rand(nb, generator=g) * 2 - 1) * 2e-3  # [nb]
        blocks[:, off:off + 2] = scale.to(torch.float16).reshape(nb, 1).view(torch.uint8)
    return QuantWeight.from_raw(blocks, qtype, shape, DEV)


def routed(W: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [W, k], experts [W, k] int32) from random router logits."""
    logits = torch.randn(W, E, generator=torch.Generator().manual_seed(seed)).to(DEV)
    return moe_route(logits, k, True)


def test_route_matches_reference():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)).to(DEV)  # [W, E]
    for norm in (True, False):
        w, ids = moe_route(logits, 3, norm)
        w_ref, ids_ref = moe_route_ref(logits.cpu(), 3, norm)
        assert torch.equal(ids.cpu(), ids_ref)
        torch.testing.assert_close(w.cpu(), w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_gate_up_matches_reference(qtype):
    E, F, K, W, k = 4, 24, 256, 3, 2           # F not a multiple of the tile: masked rows
    gu = expert_weight(qtype, (E, 2 * F, K), seed=1)
    x = torch.randn(W, K, generator=torch.Generator().manual_seed(2)).to(DEV)
    _, experts = routed(W, E, k, seed=3)
    out = moe_gate_up(x, gu, experts)
    ref = moe_gate_up_ref(x.cpu(), QuantWeight(gu.qtype, gu.shape, {n: p.cpu() for n, p in gu.planes.items()}),
                          experts.cpu())
    assert out.shape == (W, k, F)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_down_matches_reference(qtype):
    E, D, F, W, k = 4, 20, 256, 3, 3
    down = expert_weight(qtype, (E, D, F), seed=4)
    act = torch.randn(W, k, F, generator=torch.Generator().manual_seed(5)).to(DEV)
    weights, experts = routed(W, E, k, seed=6)
    out = moe_down(act, down, experts, weights)
    cpu = QuantWeight(down.qtype, down.shape, {n: p.cpu() for n, p in down.planes.items()})
    ref = moe_down_ref(act.cpu(), cpu, experts.cpu(), weights.cpu())
    assert out.shape == (W, D)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_kernels_are_row_invariant():
    """Each row's bits are the same in a round of 4 as alone (any column). The down's
    rotation test and its bits against the kernel it replaced: tests/kernels/test_moe_down.py."""
    E, F, D, W, k = 4, 16, 256, 4, 2
    gu = expert_weight(T.Q4_K, (E, 2 * F, D), seed=7)
    down = expert_weight(T.Q6_K, (E, D, 256), seed=8)
    x = torch.randn(W, D, generator=torch.Generator().manual_seed(9)).to(DEV)
    act = torch.randn(W, k, 256, generator=torch.Generator().manual_seed(10)).to(DEV)
    weights, experts = routed(W, E, k, seed=11)
    a, d = moe_gate_up(x, gu, experts), moe_down(act, down, experts, weights)
    for i in (0, 3):
        assert torch.equal(moe_gate_up(x[i:i + 1], gu, experts[i:i + 1]), a[i:i + 1])
        assert torch.equal(moe_down(act[i:i + 1], down, experts[i:i + 1], weights[i:i + 1]), d[i:i + 1])

# The whole GPU runtime on a tiny qwen3moe: tests/runtime/test_gpu_model.py (shared with the dense models).
